// quantfuse AWQ W4A16 decode kernels: what every kernel that owns one 64-row strip of N shares
// (the MMA tiling of a strip, its group scales and zeros, the block's reduction buffer, and the
// store of the strip's outputs, with the K splits summed over a thread-block cluster or through a
// workspace).
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

// One quantization group's scales and zeros for a lane's 8 rows (rows g and g + 8 of the strip's
// four 16-row tiles), raw, so that the next group's can be in flight while this one is used.
struct GroupRaw {
  uint4 z[2];             // the strip's 8 packed zero words (AWQ nibble order)
  uint32_t s[kTiles][2];  // scale bits of rows 16j + g and 16j + g + 8
};

// Where a lane's group scales and zeros are, and the per-row dequantization constants made from
// them (Dq<T>::Row).
template <typename T>
struct StripGroups {
  const uint16_t* s_lane;  // scale of row g of the strip, group 0
  const uint4* z_strip;    // the strip's zero words, group 0
  int N;
  int zshift;              // the lane's nibble in a packed zero word: awq_order(g)

  __device__ __forceinline__ StripGroups(const T* scales, const uint32_t* qzeros, int n, int strip, int lane)
      : s_lane(reinterpret_cast<const uint16_t*>(scales) + strip * kStripN + (lane >> 2)),
        z_strip(reinterpret_cast<const uint4*>(qzeros + strip * (kStripN / 8))),
        N(n),
        zshift(4 * awq_order(lane >> 2)) {}

  __device__ __forceinline__ void load(int grp, GroupRaw& r) const {
    const uint4* zp = z_strip + (size_t)grp * (N >> 5);
    r.z[0] = __ldg(zp);
    r.z[1] = __ldg(zp + 1);
    const uint16_t* sp = s_lane + (size_t)grp * N;
#pragma unroll
    for (int j = 0; j < kTiles; ++j) {
      r.s[j][0] = __ldg(sp + 16 * j);
      r.s[j][1] = __ldg(sp + 16 * j + 8);
    }
  }

  __device__ __forceinline__ void rows(const GroupRaw& r, typename Dq<T>::Row (&out)[kTiles][2]) const {
    const uint32_t zw[8] = {r.z[0].x, r.z[0].y, r.z[0].z, r.z[0].w, r.z[1].x, r.z[1].y, r.z[1].z, r.z[1].w};
#pragma unroll
    for (int j = 0; j < kTiles; ++j) {
      // row 16j + g + 8h of the strip: packed word 2j + h, nibble awq_order(g)
      out[j][0] = Dq<T>::make(r.s[j][0], (zw[2 * j] >> zshift) & 0xFu);
      out[j][1] = Dq<T>::make(r.s[j][1], (zw[2 * j + 1] >> zshift) & 0xFu);
    }
  }
};

template <int NT>
__device__ __forceinline__ void zero_acc(float (&acc)[kTiles][NT][4]) {
#pragma unroll
  for (int j = 0; j < kTiles; ++j)
#pragma unroll
    for (int nt = 0; nt < NT; ++nt)
#pragma unroll
      for (int i = 0; i < 4; ++i) acc[j][nt][i] = 0.0f;
}

// The lane's activations in each token tile: row m0 + 8nt + g (B-fragment column g), from k-slot
// 4t of every k-step (the K permutation of the kernels); null past the M rows.
template <typename T, int NT>
__device__ __forceinline__ void activation_rows(const T* x, int M, int K, int m0, int lane, const T* (&xrow)[NT]) {
#pragma unroll
  for (int nt = 0; nt < NT; ++nt) {
    const int m = m0 + nt * 8 + (lane >> 2);
    xrow[nt] = m < M ? x + (size_t)m * K + 4 * (lane & 3) : nullptr;
  }
}

// One k-step of a strip: the lane's 16 weight bytes dequantized into the A fragments of the four
// 16-row tiles, each multiplied with every token tile's B fragment.
template <typename T, int NT>
__device__ __forceinline__ void mma_kstep(const uint4& w, const typename Dq<T>::Row (&rows)[kTiles][2],
                                          const uint32_t (&b)[NT][2], float (&acc)[kTiles][NT][4]) {
  const uint32_t words[kTiles] = {w.x, w.y, w.z, w.w};
#pragma unroll
  for (int j = 0; j < kTiles; ++j) {
    uint32_t a[4];
    Dq<T>::frag(words[j], rows[j][0], rows[j][1], a);
#pragma unroll
    for (int nt = 0; nt < NT; ++nt) Dq<T>::mma(acc[j][nt], a, b[nt]);
  }
}

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
