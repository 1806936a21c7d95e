// quantfuse::scaled_mm_azp and quantfuse::weight_colsum on CUDA, one dispatcher trip each.
//
// scaled_mm_azp follows scaled_mm's kernel choice (scaled_mm/scaled_mm_dispatch.cpp) with the
// zero-point epilogues (ScaledBiasAzp for a per-tensor zero point folded into azp_adj,
// ScaledBiasAzpToken for per-token ones).
//
// weight_colsum gives the azp_adj term, the column sums of an int8 [N, K] weight, made once
// per weight (common/derived_cache.h: again after any in-place write to it, never inside a
// CUDA-graph warm-up's pool) and handed out as a fresh copy, since the op is functional.
#include <ATen/ATen.h>
#include <torch/library.h>

#include <optional>
#include <string>

#include "common/derived_cache.h"
#include "common/reference.h"
#include "scaled_mm/scaled_mm_torch.h"

namespace quantfuse {
namespace {

at::Tensor scaled_mm_azp_cuda(const at::Tensor& a, const at::Tensor& b, const at::Tensor& scale_a,
                              const at::Tensor& scale_b, at::ScalarType out_dtype, const at::Tensor& azp_adj,
                              const std::optional<at::Tensor>& azp, const std::optional<at::Tensor>& bias) {
  return w8a8_dispatch(a, b, scale_a, scale_b, out_dtype, bias, azp_adj, azp);
}

at::Tensor weight_colsum_cuda(const at::Tensor& weight) {
  if (weight.scalar_type() != at::kChar || weight.dim() != 2) {
    return reference_op<at::Tensor(const at::Tensor&, c10::string_view)>("quantfuse::_weight_colsum_reference")
        .call(weight, "not a 2-D int8 weight");
  }
  const auto sums = derived(kWeightColsum, {weight}, 0, [&] {
    return std::vector<at::Tensor>{weight.sum(1, false, at::kInt)};
  });
  return sums[0].clone();
}

}  // namespace
}  // namespace quantfuse

TORCH_LIBRARY_IMPL(quantfuse, CUDA, m) {
  m.impl("scaled_mm_azp", &quantfuse::scaled_mm_azp_cuda);
  m.impl("weight_colsum", &quantfuse::weight_colsum_cuda);
}
