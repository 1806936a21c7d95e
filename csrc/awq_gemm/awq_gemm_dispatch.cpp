// quantfuse::awq_gemm and quantfuse::awq_dequantize on CUDA, one dispatcher trip each: the
// operand rules of compile_backend/ops/awq_gemm.py (check_awq) mirrored, then the kernel chosen by M
// (thresholds measured on an H100):
//
// * M <= kDecodeMaxM: the weight-streaming tensor-core kernel (awq_gemm_strip.cuh) on the
//   weight in its fragment layout;
// * larger M on Hopper, where it takes the shape (group size a multiple of 64 or per-channel,
//   K % 64, N % 128): the CUTLASS mixed-input kernel (awq_gemm_sm90.cuh) on the weight in its
//   prepared layout; its tile configuration is chosen by awq_gemm_sm90_choice.h;
// * otherwise the streaming kernel up to kKernelMaxM, above that the dequantize kernel to a
//   dense weight and cuBLAS.
//
// A qweight in the fragment layout ([N/64, K/16, 32, 4], what AWQLinear holds) is read as it is
// by the streaming kernel, and the prepared layout is made from it per call (one pass over the
// weight, measured on an H200 at 11-26% of a 2048-token GEMM's time, more at smaller M) and
// dropped: the module's tensor is the only copy of the weight.  A qweight in the AWQ layout ([K, N/8], other libraries' modules) gets
// both layouts made once and kept beside it (common/derived_cache.h; explain() reports them).
//
// Act-order (perm, int32 [K]): every path takes x gathered by the order first (one M x K gather inside
// the op).  A streaming kernel that read x through the order (four 2-byte loads for each 8-byte one)
// measured slower than the gather at batch 1 and 8 on an H200.
//
// Inputs no kernel takes (N % 64, K or group size not multiples of 16, CPU or mixed devices,
// pre-sm_80 GPUs, sizes beyond 32-bit indexing) and malformed inputs run the reference, which
// logs the reason or raises naming the argument.
#include <ATen/ATen.h>
#include <ATen/cuda/CUDAContext.h>
#include <torch/library.h>

#include <cstdint>
#include <optional>
#include <string>

#include "awq_gemm/awq_gemm.h"
#include "awq_gemm/awq_gemm_sm90.h"
#include "awq_gemm/awq_gemm_torch.h"
#include "common/derived_cache.h"
#include "common/reference.h"

namespace quantfuse {
namespace {

constexpr int64_t kDecodeMaxM = 32;
constexpr int64_t kKernelMaxM = 64;
constexpr int64_t kPack = 8;  // int4 values per int32
constexpr int64_t kLimit = int64_t(1) << 31;

bool aligned(const at::Tensor& t, int bytes) { return reinterpret_cast<uintptr_t>(t.data_ptr()) % bytes == 0; }

at::Tensor dense(const at::Tensor& t, int bytes = 16) {
  return t.is_contiguous() && aligned(t, bytes) ? t : t.clone(at::MemoryFormat::Contiguous);
}

std::string n(int64_t v) { return std::to_string(v); }

// Why no kernel takes these AWQ operands ("" when they do); x and bias may be absent
// (awq_dequantize).
std::string awq_reason(const at::Tensor* x, const at::Tensor& qweight, const at::Tensor& scales,
                       const at::Tensor& qzeros, int64_t group_size, const std::optional<at::Tensor>& bias,
                       const std::optional<at::Tensor>& perm = std::nullopt) {
  if (!qweight.is_cuda()) return "qweight is not a CUDA tensor";
  const c10::Device dev = qweight.device();
  if (scales.device() != dev || qzeros.device() != dev || (x && x->device() != dev) ||
      (bias.has_value() && bias->device() != dev))
    return "operands are not all on the device of qweight";
  const bool fragments = qweight.dim() == 4;
  if (qweight.scalar_type() != at::kInt || !(qweight.dim() == 2 || (fragments && qweight.size(2) == 32 &&
                                                                    qweight.size(3) == 4)))
    return "qweight is neither int32 [K, N/8] nor int32 [N/64, K/16, 32, 4]";
  const int64_t K = fragments ? qweight.size(1) * 16 : qweight.size(0);
  const int64_t N = fragments ? qweight.size(0) * awq::kStripN : qweight.size(1) * kPack;
  if (scales.scalar_type() != at::kHalf && scales.scalar_type() != at::kBFloat16) return "scales are not float16/bfloat16";
  if (group_size <= 0 || K % group_size != 0) return "group_size does not divide K";
  const int64_t groups = K / group_size;
  if (scales.dim() != 2 || scales.size(0) != groups || scales.size(1) != N) return "scales are not [K/group_size, N]";
  if (qzeros.scalar_type() != at::kInt || qzeros.dim() != 2 || qzeros.size(0) != groups || qzeros.size(1) != N / kPack)
    return "qzeros are not int32 [K/group_size, N/8]";
  if (x && (x->scalar_type() != scales.scalar_type() || x->dim() != 2 || x->size(1) != K))
    return "x is not [M, K] in the dtype of scales";
  if (bias.has_value() && (bias->dim() != 1 || bias->size(0) != N || bias->scalar_type() != scales.scalar_type()))
    return "bias is not [N] in the dtype of scales";
  if (perm.has_value() && (perm->device() != dev || perm->scalar_type() != at::kInt || perm->dim() != 1 ||
                           perm->size(0) != K))
    return "perm is not int32 [K] on the device of qweight";
  const auto* props = at::cuda::getDeviceProperties(dev.index());
  if (props->major < 8) return "GPU older than sm_80 (no bf16 mma.sync)";
  if (N % awq::kStripN != 0) return "N = " + n(N) + " is not a multiple of " + n(awq::kStripN);
  if (K % 16 != 0 || group_size % 16 != 0) return "K = " + n(K) + " and group_size = " + n(group_size) + " must be multiples of 16";
  const int64_t M = x ? x->size(0) : 0;
  if (K * N >= kLimit || M * K >= kLimit || M * N >= kLimit) return "sizes exceed 32-bit indexing";
  return "";
}

bool sm90_prefill_takes(const at::Tensor& x, int64_t K, int64_t N, int64_t group_size) {
  const auto* props = at::cuda::getDeviceProperties(x.device().index());
  return props->major == 9 && props->minor == 0 && K % awq_sm90::kTileK == 0 && N % awq_sm90::kAlignN == 0 &&
         (group_size == K || group_size % awq_sm90::kTileK == 0);
}

using GemmRef = at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&, int64_t,
                           const std::optional<at::Tensor>&, const std::optional<at::Tensor>&, c10::string_view);
using DequantRef = at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&, int64_t, c10::string_view);

at::Tensor awq_gemm_dispatch(const at::Tensor& x_in, const at::Tensor& qweight, const at::Tensor& scales_in,
                             const at::Tensor& qzeros_in, int64_t group_size, const std::optional<at::Tensor>& bias_in,
                             const std::optional<at::Tensor>& perm_in) {
  const std::string reason = awq_reason(&x_in, qweight, scales_in, qzeros_in, group_size, bias_in, perm_in);
  if (!reason.empty())
    return reference_op<GemmRef>("quantfuse::_awq_gemm_reference")
        .call(x_in, qweight, scales_in, qzeros_in, group_size, bias_in, perm_in, reason);
  const bool fragments = qweight.dim() == 4;
  const int64_t M = x_in.size(0), K = x_in.size(1), N = scales_in.size(1);
  if (M == 0) return at::empty({0, N}, x_in.options());
  const std::optional<at::Tensor> bias = bias_in.has_value() ? std::optional<at::Tensor>(dense(*bias_in)) : std::nullopt;
  // Act-order: x gathered by the order (one pass over M x K, small against the weight's K x N).
  const at::Tensor xg = perm_in.has_value() ? x_in.index_select(1, *perm_in) : x_in;
  if (fragments) {
    const at::Tensor w = dense(qweight);
    if (M > kDecodeMaxM && sm90_prefill_takes(x_in, K, N, group_size)) {
      const at::Tensor scales = dense(scales_in);
      auto [wq, zeros] = awq_prepare_sm90_from_fragments_cuda(w, scales, qzeros_in.contiguous(), group_size);
      return awq_gemm_sm90_cuda(dense(xg), wq, scales, zeros, group_size, bias, -1, -1);
    }
    const at::Tensor x = dense(xg, 8), scales = dense(scales_in), qzeros = dense(qzeros_in);
    if (M <= kKernelMaxM) return awq_gemm_cuda(x, w, scales, qzeros, group_size, bias, 0, 0, true);
    const at::Tensor dq = awq_dequantize_cuda(awq_unrepack_cuda(w), scales, qzeros, group_size);
    return bias.has_value() ? at::addmm(*bias, x, dq) : at::mm(x, dq);
  }
  if (M > kDecodeMaxM && sm90_prefill_takes(x_in, K, N, group_size)) {
    const auto prepared = derived(kAwqPrepareSm90, {qweight, scales_in, qzeros_in}, group_size, [&] {
      auto [wq, s, z] = awq_prepare_sm90_cuda(qweight.contiguous(), scales_in.contiguous(), qzeros_in.contiguous(),
                                              group_size);
      return std::vector<at::Tensor>{wq, s, z};
    });
    return awq_gemm_sm90_cuda(dense(xg), prepared[0], prepared[1], prepared[2], group_size, bias, -1, -1);
  }
  const at::Tensor x = dense(xg, 8), scales = dense(scales_in), qzeros = dense(qzeros_in);
  if (M <= kKernelMaxM) {
    const auto packed = derived(kAwqRepack, {qweight}, 0, [&] {
      return std::vector<at::Tensor>{awq_repack_cuda(qweight.contiguous())};
    });
    return awq_gemm_cuda(x, packed[0], scales, qzeros, group_size, bias, 0, 0, true);
  }
  const at::Tensor w = awq_dequantize_cuda(qweight.contiguous(), scales, qzeros, group_size);
  return bias.has_value() ? at::addmm(*bias, x, w) : at::mm(x, w);
}

at::Tensor awq_dequantize_dispatch(const at::Tensor& qweight, const at::Tensor& scales, const at::Tensor& qzeros,
                                   int64_t group_size) {
  const std::string reason = awq_reason(nullptr, qweight, scales, qzeros, group_size, std::nullopt);
  if (!reason.empty())
    return reference_op<DequantRef>("quantfuse::_awq_dequantize_reference")
        .call(qweight, scales, qzeros, group_size, reason);
  const at::Tensor awq = qweight.dim() == 4 ? awq_unrepack_cuda(qweight.contiguous()) : qweight.contiguous();
  return awq_dequantize_cuda(awq, dense(scales), qzeros.contiguous(), group_size);
}

std::string awq_gemm_kernel_reason(const at::Tensor& x, const at::Tensor& qweight, const at::Tensor& scales,
                                   const at::Tensor& qzeros, int64_t group_size, const std::optional<at::Tensor>& bias,
                                   const std::optional<at::Tensor>& perm) {
  return awq_reason(&x, qweight, scales, qzeros, group_size, bias, perm);
}

}  // namespace
}  // namespace quantfuse

TORCH_LIBRARY_FRAGMENT(quantfuse, m) {
  // Tests: the reason the CUDA dispatch would give for these operands ("" = a kernel runs).
  m.def("_awq_gemm_kernel_reason(Tensor x, Tensor qweight, Tensor scales, Tensor qzeros, int group_size, "
        "Tensor? bias=None, Tensor? perm=None) -> str");
}

TORCH_LIBRARY_IMPL(quantfuse, CUDA, m) {
  m.impl("awq_gemm", &quantfuse::awq_gemm_dispatch);
  m.impl("awq_dequantize", &quantfuse::awq_dequantize_dispatch);
  m.impl("_awq_gemm_kernel_reason", &quantfuse::awq_gemm_kernel_reason);
}
