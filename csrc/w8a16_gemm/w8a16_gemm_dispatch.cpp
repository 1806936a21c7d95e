// quantfuse::w8a16_gemm on CUDA, one dispatcher trip: the operand rules of compile_backend/ops/w8a16_gemm.py
// (_check_w8a16) mirrored, then the kernel chosen by M and K:
//
// * K % 16 == 0 and 1 <= M <= kDecodeMaxM (float16 / bfloat16; slices of 16 tokens) or
//   M <= 16 (float32): the weight-streaming decode kernel (w8a16_gemm_decode.cuh: tensor cores
//   for float16 / bfloat16, CUDA cores for float32);
// * otherwise: w_q converted to x's dtype (exact; a cast kernel), cuBLAS with a float32 result,
//   and the epilogue kernel (scale, bias, one rounding).
//
// Operands in another layout than the kernels read (strided or misaligned x, a non-contiguous
// or misaligned weight, a strided scale or bias) are copied to it first.  Inputs no kernel takes
// (CPU or mixed devices, pre-sm_80 GPUs, sizes beyond 32-bit indexing) and malformed inputs run
// the reference, which logs the reason or raises naming the argument.
#include <ATen/ATen.h>
#include <ATen/cuda/CUDAContext.h>
#include <torch/library.h>

#include <cstdint>
#include <optional>
#include <string>

#include "common/reference.h"
#include "w8a16_gemm/w8a16_gemm.h"
#include "w8a16_gemm/w8a16_gemm_torch.h"

namespace quantfuse {
namespace {

// H100 (benchmarks/bench_w8a16.py): the decode kernel's token slices read the weight from DRAM
// once per row tile, so it stays ahead of the cast + cuBLAS path (5 bytes moved per weight) up to
// here: 26 vs 34 µs at M = 64 on 4096 x 4096, 84 vs 133 on 14336 x 4096; 52 vs 40 at M = 128.
constexpr int64_t kDecodeMaxM = 64;
constexpr int64_t kLimit = int64_t(1) << 31;

bool aligned16(const at::Tensor& t) { return reinterpret_cast<uintptr_t>(t.data_ptr()) % 16 == 0; }

// Why no kernel takes these operands ("" when one does).
std::string w8a16_reason(const at::Tensor& x, const at::Tensor& w_q, const at::Tensor& w_scale,
                         const std::optional<at::Tensor>& bias) {
  if (!x.is_cuda()) return "x is not a CUDA tensor";
  const c10::Device dev = x.device();
  if (w_q.device() != dev || w_scale.device() != dev || (bias.has_value() && bias->device() != dev))
    return "operands are not all on the device of x";
  const auto dt = x.scalar_type();
  if ((dt != at::kHalf && dt != at::kBFloat16 && dt != at::kFloat) || x.dim() != 2)
    return "x is not a 2-D float16, bfloat16 or float32 tensor";
  if (w_q.scalar_type() != at::kChar || w_q.dim() != 2 || w_q.size(1) != x.size(1))
    return "w_q is not a 2-D int8 tensor [N, K] matching x";
  const int64_t N = w_q.size(0), K = w_q.size(1), M = x.size(0);
  if (w_scale.scalar_type() != at::kFloat && w_scale.scalar_type() != dt) return "w_scale is not float32 or x's dtype";
  if (w_scale.dim() > 1 || (w_scale.numel() != 1 && w_scale.numel() != N)) return "w_scale has neither 1 nor N elements";
  if (bias.has_value() && (bias->dim() != 1 || bias->size(0) != N || bias->scalar_type() != dt))
    return "bias is not [N] in x's dtype";
  const auto* props = at::cuda::getDeviceProperties(dev.index());
  if (props->major < 8) return "GPU older than sm_80 (no bf16 mma.sync)";
  if (N >= kLimit || K >= kLimit || M >= kLimit) return "sizes exceed 32-bit indexing";
  return "";
}

// `t` as the decode kernel reads it: unit column stride, 16-byte aligned rows; else a fresh
// dense copy (with K % 16 == 0 its rows are 16-byte aligned).  Not .contiguous(): a contiguous
// view at a misaligned offset would come back unchanged.
at::Tensor rows16(const at::Tensor& t) {
  const bool ok = t.stride(1) == 1 && (t.stride(0) * t.element_size()) % 16 == 0 && aligned16(t);
  return ok ? t : at::empty(t.sizes(), t.options()).copy_(t);
}

using Ref = at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&, const std::optional<at::Tensor>&,
                       c10::string_view);

at::Tensor w8a16_gemm_dispatch(const at::Tensor& x, const at::Tensor& w_q, const at::Tensor& w_scale_in,
                               const std::optional<at::Tensor>& bias_in) {
  const std::string reason = w8a16_reason(x, w_q, w_scale_in, bias_in);
  if (!reason.empty())
    return reference_op<Ref>("quantfuse::_w8a16_gemm_reference").call(x, w_q, w_scale_in, bias_in, reason);
  const int64_t M = x.size(0), N = w_q.size(0), K = x.size(1);
  if (M == 0) return at::empty({0, N}, x.options());
  const at::Tensor w_scale = w_scale_in.reshape({-1}).contiguous();
  const std::optional<at::Tensor> bias =
      bias_in.has_value() ? std::optional<at::Tensor>(bias_in->contiguous()) : std::nullopt;
  const int64_t decode_max_m = x.scalar_type() == at::kFloat ? w8a16::kMaxM : kDecodeMaxM;
  if (M <= decode_max_m && K % 16 == 0 && K > 0)
    return w8a16_decode_cuda(rows16(x), rows16(w_q), w_scale, bias, -1, -1, -1);
  return w8a16_prefill_cuda(x, w_q, w_scale, bias);
}

std::string w8a16_gemm_kernel_reason(const at::Tensor& x, const at::Tensor& w_q, const at::Tensor& w_scale,
                                     const std::optional<at::Tensor>& bias) {
  return w8a16_reason(x, w_q, w_scale, bias);
}

}  // namespace
}  // namespace quantfuse

TORCH_LIBRARY_FRAGMENT(quantfuse, m) {
  // Tests: the reason the CUDA dispatch would give for these operands ("" = a kernel runs).
  m.def("_w8a16_gemm_kernel_reason(Tensor x, Tensor w_q, Tensor w_scale, Tensor? bias=None) -> str");
}

TORCH_LIBRARY_IMPL(quantfuse, CUDA, m) {
  m.impl("w8a16_gemm", &quantfuse::w8a16_gemm_dispatch);
  m.impl("_w8a16_gemm_kernel_reason", &quantfuse::w8a16_gemm_kernel_reason);
}
