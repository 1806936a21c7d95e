// quantfuse W8A16: the kernels' torch-facing entry points (w8a16_gemm_torch.h) and the private
// ops tests and benchmarks reach them through (_w8a16_decode_cuda, _w8a16_prefill_cuda).  The
// public op quantfuse::w8a16_gemm is defined in Python (compile_backend/ops/w8a16_gemm.py); its CUDA
// dispatch is w8a16_gemm_dispatch.cpp.
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/all.h>

#include <cstdint>
#include <optional>

#include "common/check.h"
#include "common/pdl.h"
#include "common/launch_dtype.h"
#include "common/device_attribute.h"
#include "w8a16_gemm/w8a16_gemm.h"
#include "w8a16_gemm/w8a16_gemm_torch.h"

namespace quantfuse {
namespace {

using w8a16::Dt;

// The decode kernel's token slices serve up to this M when called directly (tests, benchmarks);
// the dispatch's own threshold is kDecodeMaxM in w8a16_gemm_dispatch.cpp.
constexpr int64_t kDecodeKernelMaxM = 256;

bool aligned16(const void* p) { return reinterpret_cast<uintptr_t>(p) % 16 == 0; }

// The checks every entry point makes (the dispatch has made them already; private ops called
// directly get an error instead of a wrong result).
w8a16::Params params(const at::Tensor& x, const at::Tensor& w_q, const at::Tensor& w_scale,
                     const std::optional<at::Tensor>& bias, const at::Tensor& y) {
  QF_CHECK(x.is_cuda() && w_q.device() == x.device() && w_scale.device() == x.device() &&
               (!bias.has_value() || bias->device() == x.device()),
           "quantfuse w8a16: operands must be CUDA tensors on one device");
  QF_CHECK(x.dim() == 2 && w_q.dim() == 2 && w_q.scalar_type() == at::kChar && w_q.size(1) == x.size(1),
           "quantfuse w8a16: expected x [M, K] and int8 w_q [N, K]");
  const int64_t N = w_q.size(0);
  QF_CHECK(w_scale.is_contiguous() && (w_scale.numel() == 1 || w_scale.numel() == N) &&
               (w_scale.scalar_type() == at::kFloat || w_scale.scalar_type() == x.scalar_type()),
           "quantfuse w8a16: 'w_scale' must be contiguous, 1 or N = %lld elements, float32 or x's dtype",
           (long long)N);
  QF_CHECK(!bias.has_value() || (bias->is_contiguous() && bias->numel() == N && bias->scalar_type() == x.scalar_type()),
           "quantfuse w8a16: 'bias' must be contiguous [N] in x's dtype");
  w8a16::Params p;
  p.x = x.data_ptr();
  p.w = static_cast<const int8_t*>(w_q.data_ptr());
  p.scale = w_scale.data_ptr();
  p.bias = bias.has_value() ? bias->data_ptr() : nullptr;
  p.y = y.data_ptr();
  p.M = x.size(0);
  p.N = N;
  p.K = x.size(1);
  p.ldx = x.stride(0);
  p.ldw = w_q.stride(0);
  p.ldy = y.stride(0);
  p.dtype = launch_dtype(x, "w8a16", "x");
  p.scale_f32 = w_scale.scalar_type() == at::kFloat;
  p.scale_per_channel = w_scale.numel() != 1 || N == 1;
  p.stream = at::cuda::getCurrentCUDAStream(x.device().index()).stream();
  return p;
}

void check_status(int status, int cuda_error, const char* what) {
  QF_CHECK(status != w8a16::kUnsupported, "quantfuse w8a16: %s: unsupported operands", what);
  QF_CHECK(status == w8a16::kOk, "quantfuse w8a16: %s launch failed: %s", what,
           cudaGetErrorString(static_cast<cudaError_t>(cuda_error)));
}

}  // namespace

at::Tensor w8a16_decode_cuda(const at::Tensor& x, const at::Tensor& w_q, const at::Tensor& w_scale,
                             const std::optional<at::Tensor>& bias, int64_t splits, int64_t warps, int64_t batch,
                             int64_t pdl) {
  const c10::cuda::CUDAGuard guard(x.device());
  at::Tensor y = at::empty({x.size(0), w_q.size(0)}, x.options());
  w8a16::Params p = params(x, w_q, w_scale, bias, y);
  p.pdl = pdl_for(pdl, x.device().index());
  const int64_t esize = x.element_size();
  const int64_t max_m = p.dtype == Dt::kF32 ? w8a16::kMaxM : kDecodeKernelMaxM;
  QF_CHECK(p.M >= 1 && p.M <= max_m, "quantfuse w8a16 decode: M = %lld; expected 1..%lld", (long long)p.M,
           (long long)max_m);
  QF_CHECK(p.K % 16 == 0 && x.stride(1) == 1 && w_q.stride(1) == 1 && (p.ldx * esize) % 16 == 0 && p.ldw % 16 == 0 &&
               aligned16(p.x) && aligned16(p.w),
           "quantfuse w8a16 decode: K %% 16, unit column strides and 16-byte aligned rows of x and w_q required");
  QF_CHECK(p.N < (int64_t(1) << 31) && p.K < (int64_t(1) << 31), "quantfuse w8a16 decode: N, K must be < 2^31");
  if (p.N == 0) return y;
  const int dev = x.device().index();
  const auto* props = at::cuda::getDeviceProperties(dev);
  const auto c = w8a16::choose_config(p.M, p.N, p.K, sm_count(dev, props->multiProcessorCount), props->major >= 9,
                                      static_cast<int>(splits), static_cast<int>(warps), static_cast<int>(batch));
  int err = 0;
  check_status(w8a16::launch_decode(p, c, &err), err, "decode");
  return y;
}

at::Tensor w8a16_prefill_cuda(const at::Tensor& x, const at::Tensor& w_q, const at::Tensor& w_scale,
                              const std::optional<at::Tensor>& bias) {
  const c10::cuda::CUDAGuard guard(x.device());
  // int8 values are exact in every float type.  The cast kernel takes a dense, 16-byte aligned
  // weight of a multiple of 16 elements; anything else goes through torch's cast.
  at::Tensor w_dt;
  if (w_q.is_contiguous() && w_q.numel() % 16 == 0 && aligned16(w_q.data_ptr())) {
    w_dt = at::empty(w_q.sizes(), x.options());
    int err = 0;
    const auto stream = at::cuda::getCurrentCUDAStream(x.device().index()).stream();
    check_status(w8a16::launch_cast(static_cast<const int8_t*>(w_q.data_ptr()), w_dt.data_ptr(), w_q.numel(),
                                    launch_dtype(x, "w8a16", "x"), stream, &err),
                 err, "weight cast");
  } else {
    w_dt = w_q.to(x.scalar_type());
  }
  const at::Tensor wt = w_dt.t();
  const at::Tensor acc = x.scalar_type() == at::kFloat ? at::mm(x, wt) : at::mm(x, wt, at::kFloat);
  at::Tensor y = at::empty({x.size(0), w_q.size(0)}, x.options());
  const w8a16::Params p = params(x, w_q, w_scale, bias, y);
  int err = 0;
  check_status(w8a16::launch_epilogue(acc.contiguous().data_ptr<float>(), p, &err), err, "epilogue");
  return y;
}

}  // namespace quantfuse

TORCH_LIBRARY_FRAGMENT(quantfuse, m) {
  m.def("_w8a16_decode_cuda(Tensor x, Tensor w_q, Tensor w_scale, Tensor? bias=None, int splits=-1, "
        "int warps=-1, int batch=-1, int pdl=-1) -> Tensor");
  m.def("_w8a16_prefill_cuda(Tensor x, Tensor w_q, Tensor w_scale, Tensor? bias=None) -> Tensor");
}

TORCH_LIBRARY_IMPL(quantfuse, CUDA, m) {
  m.impl("_w8a16_decode_cuda", &quantfuse::w8a16_decode_cuda);
  m.impl("_w8a16_prefill_cuda", &quantfuse::w8a16_prefill_cuda);
}
