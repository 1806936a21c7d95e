// Torch-facing entry points of the AWQ kernels, shared by the private ops (awq_gemm_ops.cpp,
// awq_gemm_sm90_ops.cpp) and the public ops' CUDA dispatch (awq_gemm_dispatch.cpp).
#pragma once

#include <ATen/core/Tensor.h>

#include <optional>
#include <tuple>

namespace quantfuse {

// qweight [K, N/8] (AWQ order) -> the decode kernel's fragment layout.
at::Tensor awq_repack_cuda(const at::Tensor& qweight);
// The fragment layout -> qweight [K, N/8] (AWQ order).
at::Tensor awq_unrepack_cuda(const at::Tensor& packed);
// [K, N] = (q - z) * s in the dtype of scales.
at::Tensor awq_dequantize_cuda(const at::Tensor& qweight, const at::Tensor& scales, const at::Tensor& qzeros,
                               int64_t group_size);
// The weight-streaming kernel on a repacked weight; warps/splits 0 = chosen; pdl: -1 launched with
// programmatic dependent launch where the GPU has it unless QUANTFUSE_PDL=0 (common/pdl.h), 0 off, 1 on.
at::Tensor awq_gemm_cuda(const at::Tensor& x, const at::Tensor& wpacked, const at::Tensor& scales,
                         const at::Tensor& qzeros, int64_t group_size, const std::optional<at::Tensor>& bias,
                         int64_t warps, int64_t splits, bool cluster, int64_t pdl = -1);
// Hopper prefill: (wq, scales, zeros) prepared once per weight, then the CUTLASS kernel.
std::tuple<at::Tensor, at::Tensor, at::Tensor> awq_prepare_sm90_cuda(const at::Tensor& qweight,
                                                                     const at::Tensor& scales,
                                                                     const at::Tensor& qzeros, int64_t group_size);
// Hopper prefill from a weight held in the fragment layout, made per call (nothing kept):
// (wq, zeros) for awq_gemm_sm90_cuda with the caller's scales.
std::tuple<at::Tensor, at::Tensor> awq_prepare_sm90_from_fragments_cuda(const at::Tensor& fragments,
                                                                        const at::Tensor& scales,
                                                                        const at::Tensor& qzeros, int64_t group_size);
at::Tensor awq_gemm_sm90_cuda(const at::Tensor& x, const at::Tensor& wq, const at::Tensor& scales,
                              const at::Tensor& zeros, int64_t group_size, const std::optional<at::Tensor>& bias,
                              int64_t config, int64_t pad);

}  // namespace quantfuse
