// quantfuse AWQ W4A16 prefill GEMM for Hopper (sm_90a): plain C++ interface.
//
// No torch and no CUTLASS headers here: awq_gemm_sm90.cu and awq_gemm_sm90_tiles_c<C>.cu
// implement these with CUDA + CUTLASS only, awq_gemm_sm90_ops.cpp checks tensors and calls
// them; awq_gemm_sm90_choice.h holds the tile configurations and the choice among them.
//
// The kernel is CUTLASS 3.x's mixed-input warp-specialized GEMM (TMA + wgmma, the int4
// operand converted in registers: w = q * scale + zero) on the swapped problem
//   D^T [N, M] = W^T [N, K] . x^T [K, M],
// so that the narrow operand is the register-sourced wgmma "A".  D^T column-major is
// out [M, N] row-major.  AWQ's W[k, n] = (q - z) * s becomes q * s + zero' with
// zero' = -z * s, precomputed once per weight by launch_prepare_zeros.
#pragma once

#include <cstddef>
#include <cstdint>
#include <cuda_runtime.h>

#include "awq_gemm/awq_gemm_sm90_choice.h"

namespace quantfuse {
namespace awq_sm90 {

enum class DType : int { kHalf = 0, kBFloat16 = 1 };

// Shape limits of the kernel (checked by the op and by awq_gemm_dispatch.cpp).
constexpr int kTileK = 64;    // K tile: K % 64 == 0; group_size % 64 == 0 or group_size == K
constexpr int kAlignN = 128;  // N % 128 == 0 (weight-row tiles of 64 or 128)

// Prepared int4 weight: N*K/2 bytes, q[k, n] (0..15) of AWQ's qweight [K, N/8] moved to
// the [N, K] K-major operand in CUTLASS's "memory reordering" layout (each thread's 8
// wgmma A-fragment values contiguous, in the value order [0,2,4,6,1,3,5,7] the fast
// int4 -> 16-bit converter wants), tiled over 16x16 (n, k) blocks, n-blocks fastest.
// (Measured: 13-20% faster than the plain row-major [N, K] layout.)  tmp: N*K bytes scratch.
cudaError_t launch_prepare_weight(const uint32_t* qweight, uint8_t* tmp, uint8_t* out, int K, int N,
                                  cudaStream_t stream);

// The same prepared weight from the decode kernel's fragment layout [N/64, K/16, 32, 4]
// (awq_gemm.h) in one pass, no scratch.  K % 64 == 0, N % 128 == 0.
cudaError_t launch_prepare_weight_from_fragments(const uint32_t* fragments, uint8_t* out, int K, int N,
                                                 cudaStream_t stream);

// zeros_out [K/g, N] = -z * s in the activation dtype (one rounding of an exact product).
cudaError_t launch_prepare_zeros(DType dtype, const uint32_t* qzeros, const void* scales, void* zeros_out, int groups,
                                 int N, cudaStream_t stream);

using WorkspaceAlloc = void* (*)(std::size_t bytes, void* ctx);

struct GemmParams {
  const void* x = nullptr;       // [M, K] row-major (K contiguous), 16-byte aligned
  const void* wq = nullptr;      // prepared int4 weight (launch_prepare_weight)
  const void* scales = nullptr;  // [K/g, N] activation dtype
  const void* zeros = nullptr;   // [K/g, N] activation dtype, -z * s
  const void* bias = nullptr;    // [N] activation dtype, or null
  void* out = nullptr;           // [M, N] row-major
  int64_t M = 0, N = 0, K = 0;
  int group_size = 0;
  int config = -1;  // -1: choose_config; 0..kNumConfigs-1 forces one (tests, benchmarks)
  int device = 0;
  void* stream = nullptr;  // cudaStream_t
  WorkspaceAlloc alloc = nullptr;
  void* alloc_ctx = nullptr;
};

// Return codes.
enum Status : int { kOk = 0, kUnsupported = 1, kCannotImplement = 2, kInitFailed = 3, kLaunchFailed = 4 };

int gemm_f16(const GemmParams& p);
int gemm_bf16(const GemmParams& p);

}  // namespace awq_sm90
}  // namespace quantfuse
