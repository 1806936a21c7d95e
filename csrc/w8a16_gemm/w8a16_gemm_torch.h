// Torch-facing entry points of the W8A16 kernels, shared by the private ops (w8a16_gemm_ops.cpp)
// and the public op's CUDA dispatch (w8a16_gemm_dispatch.cpp).  Operands as the kernels read
// them: x [M, K] with unit column stride, w_q [N, K] int8 contiguous, w_scale 1 or N contiguous
// elements (float32 or x's dtype), bias [N] contiguous in x's dtype or absent.
#pragma once

#include <ATen/core/Tensor.h>

#include <optional>

namespace quantfuse {

// The weight-streaming decode kernel: K % 16 == 0, 16-byte aligned x and w_q rows, 1 <= M <= 16
// (float32) or 256 (float16 / bfloat16, in slices of 16 tokens); splits / warps / batch > 0
// force the work split and the load batching (tests, benchmarks); pdl as common/pdl.h's pdl_for.
at::Tensor w8a16_decode_cuda(const at::Tensor& x, const at::Tensor& w_q, const at::Tensor& w_scale,
                             const std::optional<at::Tensor>& bias, int64_t splits, int64_t warps, int64_t batch,
                             int64_t pdl = -1);
// Any M: w_q converted to x's dtype (exact; the cast kernel), cuBLAS with a float32 result, then the epilogue
// kernel (scale, bias, one rounding).
at::Tensor w8a16_prefill_cuda(const at::Tensor& x, const at::Tensor& w_q, const at::Tensor& w_scale,
                              const std::optional<at::Tensor>& bias);

}  // namespace quantfuse
