// quantfuse::quantize_per_token on CUDA, one dispatcher trip: the operand rules of
// compile_backend/ops/quantize_per_token.py mirrored, then the kernel (quantize_per_token_kernels.cu).
// An activation whose elements are not adjacent along K is copied to a dense one first (a row
// pitch of 0, from expand, is read as it is).  Inputs the kernel does not take (CPU or meta
// tensors, sizes beyond 32-bit indexing) and malformed ones run the reference, which logs the
// reason or raises naming the argument.
#include <ATen/ATen.h>
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/library.h>

#include <string>
#include <tuple>

#include "common/check.h"
#include "common/launch_dtype.h"
#include "common/reference.h"
#include "quantize_per_token/quantize_per_token.h"

namespace quantfuse {
namespace {

using Result = std::tuple<at::Tensor, at::Tensor, at::Tensor>;
using Ref = Result(const at::Tensor&, at::ScalarType, bool, c10::string_view);

// Why the kernel does not take these arguments ("" when it does).
std::string quantize_reason(const at::Tensor& x, at::ScalarType qdtype, bool symmetric) {
  if (!x.is_cuda()) return "x is not a CUDA tensor";
  const auto dt = x.scalar_type();
  if ((dt != at::kHalf && dt != at::kBFloat16 && dt != at::kFloat) || x.dim() != 2 || x.size(1) == 0)
    return "x is not a 2-D float16, bfloat16 or float32 tensor with K >= 1";
  if (qdtype != at::kChar && qdtype != at::kFloat8_e4m3fn) return "qdtype is not int8 or float8_e4m3fn";
  if (!symmetric && qdtype != at::kChar) return "asymmetric quantization to float8_e4m3fn";
  constexpr int64_t kLimit = int64_t(1) << 31;
  if (x.size(0) >= kLimit || x.size(1) >= kLimit) return "sizes exceed 32-bit indexing";
  return "";
}

Result quantize_per_token_cuda(const at::Tensor& x_in, at::ScalarType qdtype, bool symmetric) {
  const std::string reason = quantize_reason(x_in, qdtype, symmetric);
  if (!reason.empty())
    return reference_op<Ref>("quantfuse::_quantize_per_token_reference").call(x_in, qdtype, symmetric, reason);
  const c10::cuda::CUDAGuard guard(x_in.device());
  const int64_t M = x_in.size(0), K = x_in.size(1);
  const at::Tensor x = K == 1 || x_in.stride(1) == 1 ? x_in : at::empty(x_in.sizes(), x_in.options()).copy_(x_in);
  at::Tensor q = at::empty({M, K}, x.options().dtype(qdtype));
  at::Tensor scale = at::empty({M, 1}, x.options().dtype(at::kFloat));
  at::Tensor zero_point = at::empty({M, 1}, x.options().dtype(at::kFloat));
  quantize_per_token::Params p;
  p.x = x.data_ptr();
  p.q = q.data_ptr();
  p.scale = scale.data_ptr<float>();
  p.zero_point = zero_point.data_ptr<float>();
  p.M = M;
  p.K = K;
  p.ldx = M == 1 ? 0 : x.stride(0);
  p.dtype = launch_dtype(x, "quantize_per_token", "x");
  p.fp8 = qdtype == at::kFloat8_e4m3fn;
  p.symmetric = symmetric;
  p.stream = at::cuda::getCurrentCUDAStream(x.device().index()).stream();
  int err = 0;
  const int status = quantize_per_token::launch(p, &err);
  QF_CHECK(status != kUnsupported, "quantfuse quantize_per_token: unsupported operands");
  QF_CHECK(status == kOk, "quantfuse quantize_per_token: launch failed: %s",
           cudaGetErrorString(static_cast<cudaError_t>(err)));
  return {q, scale, zero_point};
}

}  // namespace
}  // namespace quantfuse

TORCH_LIBRARY_IMPL(quantfuse, CUDA, m) { m.impl("quantize_per_token", &quantfuse::quantize_per_token_cuda); }
