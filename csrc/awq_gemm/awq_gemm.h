// quantfuse AWQ W4A16 kernels: launcher interface.
//
// Plain C++ (no torch headers): awq_gemm_kernels.cu implements these with CUDA
// only, awq_gemm_ops.cpp checks tensors and calls them on the current stream.
#pragma once

#include <cstdint>
#include <cuda_runtime.h>

namespace quantfuse {
namespace awq {

enum class DType { kHalf = 0, kBFloat16 = 1 };

// Columns of one weight strip in the repacked layout (one warp's N tile).
constexpr int kStripN = 64;

// Repacks AWQ qweight [K, N/8] (int32, AWQ nibble order) into the fragment layout read by
// the GEMM kernel: [N/64][K/16][32 lanes][4 x uint32].  Lane l's words 2p and 2p + 1 hold its
// mma.m16n8k16 A fragments of tiles 2p (low nibble of each byte) and 2p + 1 (high nibble), for
// rows (columns of N) strip*64 + 16*tile + l/4 (+8) and k = 16*kt + 4*(l%4) + 0..3 (the kernel
// permutes K within a k-step; see awq_repack_kernel and awq_dequant.cuh).
// K % 16 == 0, N % 64 == 0.
cudaError_t launch_repack(const uint32_t* qweight, uint32_t* out, int K, int N, cudaStream_t stream);

// The fragment layout back to AWQ qweight [K, N/8].  K % 16 == 0, N % 64 == 0.
cudaError_t launch_unrepack(const uint32_t* packed, uint32_t* qweight, int K, int N, cudaStream_t stream);

// out[K, N] = (q - z) * s in the activation dtype, from the original AWQ layout.
// N % 8 == 0, K % group_size == 0; scales 16-byte aligned.
cudaError_t launch_dequantize(DType dtype, const uint32_t* qweight, const void* scales,
                              const uint32_t* qzeros, void* out, int K, int N, int group_size,
                              cudaStream_t stream);

// Number of K splits the GEMM launch will use for this shape: 1..8.
// warps: warps per block of the GEMM kernel, 4 or 8, or 16 for M <= 8; 0 = chosen by M and N.
int gemm_splits(DType dtype, int M, int N, int K, int device, int warps = 0);

// Whether the GEMM launch for this shape applies zeros and scales to fp32 accumulators once per
// group (W = (q - z) * s exactly), or makes (q - z) * s in the activation dtype (rounded once).
bool gemm_folds(int M, int N, int device, int warps = 0);

// Whether a launch with this many splits needs the fp32 workspace (splits > 1 on a GPU
// without thread block clusters, or with allow_cluster false; with a cluster the splits
// reduce on chip).
bool gemm_needs_workspace(int splits, int device, bool allow_cluster = true);

// out[M, N] = x[M, K] @ W + bias, W dequantized in registers from the repacked layout.
// partial: fp32 workspace of splits*M*N floats when gemm_needs_workspace (else may be null).
// pdl: launched with programmatic stream serialization (common/pdl.cuh): the kernel waits for the
// previous one before its first load (common/pdl.h: QUANTFUSE_PDL_PREFETCH's measurement modes
// work before it) and lets the next one launch after its main loop.
// N % 64 == 0, K % 16 == 0, group_size % 16 == 0, K % group_size == 0; x rows 8-byte aligned.
cudaError_t launch_gemm(DType dtype, const void* x, const uint32_t* wpacked, const void* scales,
                        const uint32_t* qzeros, const void* bias, void* out, float* partial,
                        int M, int N, int K, int group_size, int splits, int warps, int device,
                        bool allow_cluster, bool pdl, cudaStream_t stream);

}  // namespace awq
}  // namespace quantfuse
