// quantfuse::scaled_mm on CUDA, registered here so that a call takes one dispatcher trip:
// the operand rules of compile_backend/ops/scaled_mm.py (check_w8a8) mirrored, then the kernel chosen
// by M and the GPU:
//
// * M <= kDecodeMaxM: the weight-streaming decode kernel (scaled_mm_decode.cuh).  On the
//   H100, bf16 out, the four Llama shapes: M = 1 3-18% faster than the CUTLASS decode tile,
//   M = 12 up to 13% faster, M = 16 even.
// * fp8 with per-token x per-channel scales from kFp8CublasLtMinM rows on Hopper: cuBLASLt's
//   fp8 kernel through at::_scaled_mm (the same fused epilogue), which measured 1.0-1.2x
//   faster than our CUTLASS fp8 kernels there; below, ours are faster.
// * otherwise CUTLASS: the SM90 kernels on Hopper, the SM80 kernels (int8) on other sm_80+.
//
// Operands in another layout than a kernel reads (a not row-major, b not the column-major
// transpose of an [N, K] weight, misaligned starts, non-contiguous scales) are copied to it.
// Inputs no kernel takes (CPU or mixed devices, dtypes, shapes, int8 K >= 2^17 whose int32
// sums could overflow, pre-sm_80 GPUs) and malformed inputs run the reference, which logs the
// reason or raises naming the argument.
#include <ATen/ATen.h>
#include <ATen/cuda/CUDAContext.h>
#include <torch/library.h>

#include <cstdint>
#include <optional>
#include <string>

#include "common/reference.h"
#include "scaled_mm/scaled_mm_decode.h"
#include "scaled_mm/scaled_mm_torch.h"

namespace quantfuse {
namespace {

constexpr int64_t kDecodeMaxM = decode::kMaxM;
constexpr int64_t kFp8CublasLtMinM = 256;
// |sum of K int8 products| <= 128 * 128 * K must stay below 2^31 (compile_backend/ops/scaled_mm.py:
// INT8_EXACT_MAX_K).
constexpr int64_t kInt8ExactMaxK = int64_t(1) << 17;

bool aligned16(const at::Tensor& t) { return reinterpret_cast<uintptr_t>(t.data_ptr()) % 16 == 0; }

int capability(const at::Tensor& t) {
  const auto* props = at::cuda::getDeviceProperties(t.device().index());
  return props->major * 10 + props->minor;
}

std::string cat(const char* what, int64_t v) { return std::string(what) + std::to_string(v); }

bool out_dtype_ok(at::ScalarType o) { return o == at::kHalf || o == at::kBFloat16 || o == at::kFloat; }

// Row-major with 16-byte aligned start and row pitch, else a contiguous copy.
at::Tensor row_major(const at::Tensor& a) {
  const int64_t M = a.size(0), K = a.size(1);
  const bool ok = a.stride(1) == 1 && (M <= 1 || (a.stride(0) >= K && a.stride(0) % 16 == 0)) && aligned16(a);
  return ok ? a : a.clone(at::MemoryFormat::Contiguous);
}

// Column-major (an [N, K] weight transposed) with 16-byte aligned start and column pitch.
at::Tensor column_major(const at::Tensor& b) {
  const int64_t K = b.size(0), N = b.size(1);
  const bool ok = b.stride(0) == 1 && (N <= 1 || (b.stride(1) >= K && b.stride(1) % 16 == 0)) && aligned16(b);
  return ok ? b : b.t().clone(at::MemoryFormat::Contiguous).t();
}

// Contiguous, 16-byte aligned (the epilogues read scales, bias and zero points with vector loads).
at::Tensor dense(const at::Tensor& t) { return t.is_contiguous() && aligned16(t) ? t : t.clone(at::MemoryFormat::Contiguous); }

std::optional<at::Tensor> dense(const std::optional<at::Tensor>& t) {
  return t.has_value() ? std::optional<at::Tensor>(dense(*t)) : std::nullopt;
}

}  // namespace

std::string w8a8_kernel_reason(const at::Tensor& a, const at::Tensor& b, const at::Tensor& scale_a,
                               const at::Tensor& scale_b, at::ScalarType out_dtype,
                               const std::optional<at::Tensor>& bias, const std::optional<at::Tensor>& azp_adj,
                               const std::optional<at::Tensor>& azp) {
  if (!a.is_cuda()) return "a is not a CUDA tensor";
  const c10::Device dev = a.device();
  for (const at::Tensor* t : {&b, &scale_a, &scale_b})
    if (t->device() != dev) return "operands are not all on the device of a";
  for (const auto* t : {&bias, &azp_adj, &azp})
    if (t->has_value() && (*t)->device() != dev) return "operands are not all on the device of a";
  const bool fp8 = a.scalar_type() == at::kFloat8_e4m3fn;
  if (a.scalar_type() != at::kChar && !fp8) return "a is not int8 or float8_e4m3fn";
  if (b.scalar_type() != a.scalar_type()) return "b's dtype differs from a's";
  if (a.dim() != 2 || b.dim() != 2 || a.size(1) != b.size(0)) return "shapes are not [M, K] x [K, N]";
  if (!out_dtype_ok(out_dtype)) return "out_dtype is not float16, bfloat16 or float32";
  const int64_t M = a.size(0), K = a.size(1), N = b.size(1);
  if (scale_a.scalar_type() != at::kFloat || (scale_a.numel() != 1 && scale_a.numel() != M))
    return "scale_a is not float32 with 1 or M elements";
  if (scale_b.scalar_type() != at::kFloat || (scale_b.numel() != 1 && scale_b.numel() != N))
    return "scale_b is not float32 with 1 or N elements";
  if (bias.has_value() && (bias->dim() != 1 || bias->size(0) != N || bias->scalar_type() != out_dtype))
    return "bias is not [N] in out_dtype";
  if (azp_adj.has_value()) {
    if (fp8) return "zero points apply to int8 activations only";
    if (azp_adj->scalar_type() != at::kInt || azp_adj->dim() != 1 || azp_adj->size(0) != N)
      return "azp_adj is not int32 [N]";
    if (azp.has_value() && (azp->scalar_type() != at::kInt || azp->numel() != M)) return "azp is not int32 with M elements";
  } else if (azp.has_value()) {
    return "azp given without azp_adj";
  }
  if (N == 0 || K == 0) return "empty problem (N or K is 0)";
  if (M >= (int64_t(1) << 31) || N >= (int64_t(1) << 31) || K >= (int64_t(1) << 31))
    return "a dimension exceeds 32-bit problem shapes";
  if (K % 16 || N % 16) return "K = " + std::to_string(K) + " and N = " + std::to_string(N) + " must be multiples of 16";
  if (!fp8 && K >= kInt8ExactMaxK) return cat("int8 K = ", K) + " >= 2^17: int32 accumulation could overflow";
  const int cc = capability(a);
  if (cc < 80) return cat("compute capability sm_", cc) + ": the kernels need sm_80 or later";
  if (fp8 && !(cc >= 90 && cc < 100) && M > kDecodeMaxM)
    return cat("fp8 with M > 16 needs the SM90 kernels (Hopper); this GPU is sm_", cc);
  if (fp8 && cc < 89) return cat("fp8 needs sm_89 or later; this GPU is sm_", cc);
  return "";
}

at::Tensor w8a8_dispatch(const at::Tensor& a_in, const at::Tensor& b_in, const at::Tensor& scale_a_in,
                         const at::Tensor& scale_b_in, at::ScalarType out_dtype, const std::optional<at::Tensor>& bias_in,
                         const std::optional<at::Tensor>& azp_adj_in, const std::optional<at::Tensor>& azp_in) {
  const std::string reason = w8a8_kernel_reason(a_in, b_in, scale_a_in, scale_b_in, out_dtype, bias_in, azp_adj_in, azp_in);
  if (!reason.empty()) {
    if (azp_adj_in.has_value()) {
      return reference_op<at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&,
                                     at::ScalarType, const at::Tensor&, const std::optional<at::Tensor>&,
                                     const std::optional<at::Tensor>&, c10::string_view)>("quantfuse::_scaled_mm_azp_reference")
          .call(a_in, b_in, scale_a_in, scale_b_in, out_dtype, *azp_adj_in, azp_in, bias_in, reason);
    }
    return reference_op<at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&,
                                   at::ScalarType, const std::optional<at::Tensor>&, c10::string_view)>(
               "quantfuse::_scaled_mm_reference")
        .call(a_in, b_in, scale_a_in, scale_b_in, out_dtype, bias_in, reason);
  }
  const int64_t M = a_in.size(0), N = b_in.size(1);
  if (M == 0) return at::empty({0, N}, a_in.options().dtype(out_dtype));
  const at::Tensor a = row_major(a_in), b = column_major(b_in);
  const at::Tensor scale_a = dense(scale_a_in), scale_b = dense(scale_b_in);
  const auto bias = dense(bias_in), azp_adj = dense(azp_adj_in), azp = dense(azp_in);
  if (M <= kDecodeMaxM) return scaled_mm_decode(a, b, scale_a, scale_b, out_dtype, bias, azp_adj, azp, -1, -1, -1);
  const int cc = capability(a);
  const bool hopper = cc >= 90 && cc < 100;
  if (a.scalar_type() == at::kFloat8_e4m3fn && hopper && M >= kFp8CublasLtMinM && scale_a.numel() == M &&
      scale_b.numel() == N && !(bias.has_value() && out_dtype == at::kFloat)) {
    return at::_scaled_mm(a, b, scale_a.view({M, 1}), scale_b.view({1, N}), bias, std::nullopt, out_dtype, false);
  }
  return scaled_mm_cutlass(a, b, scale_a, scale_b, out_dtype, bias, azp_adj, azp, 0, -1, 0, 0);
}

namespace {

at::Tensor scaled_mm_cuda(const at::Tensor& a, const at::Tensor& b, const at::Tensor& scale_a, const at::Tensor& scale_b,
                          at::ScalarType out_dtype, const std::optional<at::Tensor>& bias) {
  return w8a8_dispatch(a, b, scale_a, scale_b, out_dtype, bias, std::nullopt, std::nullopt);
}

std::string scaled_mm_kernel_reason(const at::Tensor& a, const at::Tensor& b, const at::Tensor& scale_a,
                                    const at::Tensor& scale_b, at::ScalarType out_dtype,
                                    const std::optional<at::Tensor>& bias, const std::optional<at::Tensor>& azp_adj,
                                    const std::optional<at::Tensor>& azp) {
  return w8a8_kernel_reason(a, b, scale_a, scale_b, out_dtype, bias, azp_adj, azp);
}

}  // namespace
}  // namespace quantfuse

TORCH_LIBRARY_FRAGMENT(quantfuse, m) {
  // Tests: the reason the CUDA dispatch would give for these operands ("" = a kernel runs).
  m.def("_scaled_mm_kernel_reason(Tensor a, Tensor b, Tensor scale_a, Tensor scale_b, ScalarType out_dtype, "
        "Tensor? bias=None, Tensor? azp_adj=None, Tensor? azp=None) -> str");
}

TORCH_LIBRARY_IMPL(quantfuse, CUDA, m) {
  m.impl("scaled_mm", &quantfuse::scaled_mm_cuda);
  m.impl("_scaled_mm_kernel_reason", &quantfuse::scaled_mm_kernel_reason);
}
