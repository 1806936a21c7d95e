// Torch-facing entry points of the W8A8 kernels, shared by the private ops
// (scaled_mm_ops.cpp, scaled_mm_decode_ops.cpp) and the public ops' CUDA dispatch
// (scaled_mm_dispatch.cpp, scaled_mm_azp/scaled_mm_azp_dispatch.cpp).  Each checks its own
// operands and raises on what it cannot take.
#pragma once

#include <ATen/core/Tensor.h>

#include <optional>
#include <string>

namespace quantfuse {

// CUTLASS: arch 0 = best for this GPU (90 or 80); config -1 = chosen by M and N.
at::Tensor scaled_mm_cutlass(const at::Tensor& a, const at::Tensor& b, const at::Tensor& scale_a,
                             const at::Tensor& scale_b, at::ScalarType out_dtype,
                             const std::optional<at::Tensor>& bias, const std::optional<at::Tensor>& azp_adj,
                             const std::optional<at::Tensor>& azp, int64_t arch, int64_t config, int64_t swizzle,
                             int64_t raster);

// The weight-streaming decode kernel (M <= decode::kMaxM); -1 = chosen.
at::Tensor scaled_mm_decode(const at::Tensor& a, const at::Tensor& b, const at::Tensor& scale_a,
                            const at::Tensor& scale_b, at::ScalarType out_dtype, const std::optional<at::Tensor>& bias,
                            const std::optional<at::Tensor>& azp_adj, const std::optional<at::Tensor>& azp,
                            int64_t splits, int64_t warps, int64_t batch, int64_t pdl = -1);

// quantfuse::scaled_mm / scaled_mm_azp on CUDA: the kernel for these operands (copying them
// to the layout it reads where they are not in it), or the reference with the reason.
at::Tensor w8a8_dispatch(const at::Tensor& a, const at::Tensor& b, const at::Tensor& scale_a,
                         const at::Tensor& scale_b, at::ScalarType out_dtype, const std::optional<at::Tensor>& bias,
                         const std::optional<at::Tensor>& azp_adj, const std::optional<at::Tensor>& azp);

// Why no kernel takes these operands ("" when one does).
std::string w8a8_kernel_reason(const at::Tensor& a, const at::Tensor& b, const at::Tensor& scale_a,
                               const at::Tensor& scale_b, at::ScalarType out_dtype,
                               const std::optional<at::Tensor>& bias, const std::optional<at::Tensor>& azp_adj,
                               const std::optional<at::Tensor>& azp);

}  // namespace quantfuse
