// quantfuse AWQ W4A16 decode kernels: what every kernel that owns one 64-row strip of N shares
// (the MMA tiling of a strip, the block's reduction buffer, and the store of the strip's
// outputs, with the K splits summed over a thread-block cluster or through a workspace).
#pragma once

#include <cooperative_groups.h>
#include <cuda_runtime.h>

#include "awq_gemm/awq_dequant.cuh"
#include "awq_gemm/awq_gemm.h"

namespace quantfuse {
namespace awq {

constexpr int kTiles = kStripN / 16;     // 16-row MMA tiles per strip
constexpr int kRedStride = kStripN + 4;  // floats per token row of the reduction buffer:
                                         // 2 * 68 = 8 (mod 32 banks) keeps the adds conflict-free
constexpr int kMaxCluster = 8;           // portable cluster size

// Floats of a block's reduction buffer for NT token tiles of 8.
__host__ __device__ constexpr int red_floats(int nt) { return 8 * nt * kRedStride; }

// Adds a warp's accumulators into the block's reduction buffer.  C fragment: [0], [1] = row
// 16j + g, tokens 8nt + 2t (+1); [2], [3] = row 16j + g + 8.
template <int NT>
__device__ __forceinline__ void add_to_red(float* red, const float (&acc)[kTiles][NT][4], int lane) {
  const int g = lane >> 2;
  const int t = lane & 3;
#pragma unroll
  for (int j = 0; j < kTiles; ++j)
#pragma unroll
    for (int nt = 0; nt < NT; ++nt)
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        const int token = nt * 8 + 2 * t + (i & 1);
        const int row = 16 * j + g + 8 * (i >> 1);
        atomicAdd(&red[token * kRedStride + row], acc[j][nt][i]);
      }
}

// Stores the strip's outputs once every warp of the block has added into `red` (the caller
// synchronizes the block first).  Blocks of one strip that split K (blockIdx.x of gridDim.x):
// with CLUSTER they form the cluster and each finishes a 1/splits share of the outputs from its
// peers' buffers (distributed shared memory); without, each writes fp32 partials to `partial`
// (summed by splitk_reduce_kernel) unless it is the only split.  All THREADS threads of the
// block must call it.
template <typename T, bool CLUSTER, int THREADS>
__device__ __forceinline__ void store_strip(float* red, const T* __restrict__ bias, T* __restrict__ out,
                                            float* __restrict__ partial, int M, int N, int m0, int mb) {
  using D = Dq<T>;
  const int split = blockIdx.x;
  const int strip = blockIdx.y;
  const int elems = mb * kStripN;
  if constexpr (CLUSTER) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    namespace cg = cooperative_groups;
    cg::cluster_group cluster = cg::this_cluster();
    const int splits = gridDim.x;
    cluster.sync();  // every block's partial is complete
    const int share = (elems + splits - 1) / splits;
    const int e0 = split * share;
    const int e1 = min(elems, e0 + share);
    for (int e = e0 + threadIdx.x; e < e1; e += THREADS) {
      const int token = e / kStripN;
      const int col = e - token * kStripN;
      float v = 0.0f;
      for (int r = 0; r < splits; ++r) v += cluster.map_shared_rank(red, r)[token * kRedStride + col];
      const int n = strip * kStripN + col;
      if (bias != nullptr) v += D::to_float(bias[n]);
      out[(size_t)(m0 + token) * N + n] = D::from_float(v);
    }
    cluster.sync();  // peers' shared memory stays alive until every block has read it
#endif
  } else {
    for (int e = threadIdx.x; e < elems; e += THREADS) {
      const int token = e / kStripN;
      const int col = e - token * kStripN;
      const float v = red[token * kRedStride + col];
      const int n = strip * kStripN + col;
      if (partial != nullptr) {
        partial[((size_t)split * M + m0 + token) * N + n] = v;
      } else {
        out[(size_t)(m0 + token) * N + n] = D::from_float(bias != nullptr ? v + D::to_float(bias[n]) : v);
      }
    }
  }
}

}  // namespace awq
}  // namespace quantfuse
