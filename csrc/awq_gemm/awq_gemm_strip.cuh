// quantfuse AWQ W4A16 decode kernels: what every kernel that owns one 64-row strip of N shares
// (the MMA tiling of a strip, its group scales and zeros and their fold into the totals, the
// block's reduction buffer, and the store of the strip's outputs, with the K splits summed over
// a thread-block cluster or through a workspace).
#pragma once

#include <cooperative_groups.h>
#include <cuda_runtime.h>

#include "awq_gemm/awq_dequant.cuh"
#include "awq_gemm/awq_gemm.h"
#include "common/mma.cuh"

namespace quantfuse {
namespace awq {

constexpr int kTiles = kStripN / 16;     // 16-row MMA tiles per strip
constexpr int kRedStride = kStripN + 4;  // floats per token row of the reduction buffer:
                                         // 2 * 68 = 8 (mod 32 banks) keeps the adds conflict-free
constexpr int kMaxCluster = 8;           // portable cluster size

// One quantization group's scales and zeros for the two rows a lane loads: rows 16t + g and
// 16t + g + 8 of the strip (tile t, rows g and g + 8), raw, so that the next group's can be in
// flight while this one is used.  The four lanes of one g hold the four tiles between them.
struct GroupRaw {
  uint32_t s[2];  // scale bits
  uint2 z;        // the two packed zero words holding those rows (AWQ nibble order)
};

// What folds one group's accumulators into the lane's totals, per row g + 8h of tile j.
struct GroupFold {
  float S[kTiles][2], Z[kTiles][2];
};

// Where a lane's group scales and zeros are, and the fold constants made from them.
template <typename T>
struct StripGroups {
  const uint16_t* s_lane;  // scale of row 16t + g of the strip, group 0
  const uint2* z_lane;     // packed zero words 2t, 2t + 1 of the strip, group 0
  int N;
  int zshift;              // the lane's nibble in a packed zero word: awq_order(g)
  float inv_unit;          // of the lane's tile t

  __device__ __forceinline__ StripGroups(const T* scales, const uint32_t* qzeros, int n, int strip, int lane)
      : s_lane(reinterpret_cast<const uint16_t*>(scales) + strip * kStripN + 16 * (lane & 3) + (lane >> 2)),
        z_lane(reinterpret_cast<const uint2*>(qzeros + strip * (kStripN / 8)) + (lane & 3)),
        N(n),
        zshift(4 * awq_order(lane >> 2)),
        inv_unit(Dq<T>::inv_unit(lane & 3)) {}

  // The zero of the lane's row 16t + g + 8h (h = 0, 1).
  __device__ __forceinline__ uint32_t zero(const GroupRaw& r, int h) const {
    return ((h ? r.z.y : r.z.x) >> zshift) & 0xFu;
  }

  __device__ __forceinline__ void load(int grp, GroupRaw& r) const {
    const uint16_t* sp = s_lane + (size_t)grp * N;
    r.s[0] = __ldg(sp);
    r.s[1] = __ldg(sp + 8);
    r.z = __ldg(z_lane + (size_t)grp * (N >> 4));
  }

  // The scaled path's dequantization constants of the group for the lane's rows (rows[j][h]: row
  // 16j + g + 8h); made like fold_constants.  All 32 lanes must call it.
  __device__ __forceinline__ void rows(const GroupRaw& r, int lane, typename Dq<T>::Row (&out)[kTiles][2]) const {
    using Row = typename Dq<T>::Row;
    constexpr int kWords = sizeof(Row) / sizeof(uint32_t);
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const Row own = Dq<T>::make(r.s[h], zero(r, h));
      const uint32_t* ow = reinterpret_cast<const uint32_t*>(&own);
#pragma unroll
      for (int j = 0; j < kTiles; ++j) {
        uint32_t* dst = reinterpret_cast<uint32_t*>(&out[j][h]);
#pragma unroll
        for (int i = 0; i < kWords; ++i) dst[i] = __shfl_sync(0xffffffffu, ow[i], (lane & ~3) | j);
      }
    }
  }

  // The group's fold constants for the lane's rows (see awq_dequant.cuh): S = s * inv_unit(tile),
  // Z = -s * (z + kOffset); each lane makes its own two rows' and takes the other tiles' from
  // the lanes of its g.  All 32 lanes must call it.
  __device__ __forceinline__ GroupFold fold_constants(const GroupRaw& r, int lane) const {
    float S[2], Z[2];
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const float s = Dq<T>::bits_to_float(r.s[h]);
      const float z = static_cast<float>(zero(r, h));
      S[h] = s * inv_unit;
      Z[h] = -s * (z + Dq<T>::kOffset);
    }
    GroupFold f;
#pragma unroll
    for (int j = 0; j < kTiles; ++j)
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        f.S[j][h] = __shfl_sync(0xffffffffu, S[h], (lane & ~3) | j);
        f.Z[j][h] = __shfl_sync(0xffffffffu, Z[h], (lane & ~3) | j);
      }
    return f;
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

// Each token's activations summed over the current group (for the zeros): the D fragments of MMAs
// with the activations as the A operand (token tiles 2p and 2p + 1 as rows 0-7 and 8-15) and an
// all-ones B, so c[p][0] = c[p][1] is token 16p + g's sum and c[p][2] = c[p][3] token 16p + g + 8's.
template <typename T, int NT>
struct TokenSums {
  static constexpr int kPairs = (NT + 1) / 2;
  float c[kPairs][4];

  __device__ __forceinline__ void zero() {
#pragma unroll
    for (int p = 0; p < kPairs; ++p)
#pragma unroll
      for (int i = 0; i < 4; ++i) c[p][i] = 0.0f;
  }
  __device__ __forceinline__ void add(const uint32_t (&b)[NT][2]) {
    const uint32_t ones[2] = {Dq<T>::kOne2, Dq<T>::kOne2};
#pragma unroll
    for (int p = 0; p < kPairs; ++p) {
      const bool two = 2 * p + 1 < NT;
      const uint32_t a[4] = {b[2 * p][0], two ? b[2 * p + 1][0] : 0u, b[2 * p][1], two ? b[2 * p + 1][1] : 0u};
      mma_m16n8k16<T>(c[p], a, ones);
    }
  }
  // The sum of token 8nt + 2t + h of lane (g, t) (its C-fragment columns): held by the lanes of
  // g' = 2t + h.  All 32 lanes must call it.
  __device__ __forceinline__ float of(int nt, int h, int lane) const {
    return __shfl_sync(0xffffffffu, c[nt >> 1][2 * (nt & 1)], 4 * (2 * (lane & 3) + h));
  }
};

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

// One k-step of a strip: the lane's 16 weight bytes as the A fragments of the four 16-row tiles,
// each multiplied with every token tile's B fragment, and the activations' sums for the zeros.
// Every A fragment of a k-step times every token tile's B fragment.
template <typename T, int NT>
__device__ __forceinline__ void mma_tiles(const uint32_t (&a)[kTiles][4], const uint32_t (&b)[NT][2],
                                          float (&acc)[kTiles][NT][4]) {
#pragma unroll
  for (int j = 0; j < kTiles; ++j)
#pragma unroll
    for (int nt = 0; nt < NT; ++nt) mma_m16n8k16<T>(acc[j][nt], a[j], b[nt]);
}

template <typename T, int NT>
__device__ __forceinline__ void mma_kstep(const uint4& w, const uint32_t (&b)[NT][2], float (&acc)[kTiles][NT][4],
                                          TokenSums<T, NT>& sx) {
  uint32_t a[kTiles][4];
  Dq<T>::frags(w, a);
  mma_tiles<T, NT>(a, b, acc);
  sx.add(b);
}

// The scaled path's k-step: the same fragments dequantized (zeros and scales applied), into acc.
template <typename T, int NT>
__device__ __forceinline__ void mma_kstep_scaled(const uint4& w, const typename Dq<T>::Row (&rows)[kTiles][2],
                                                 const uint32_t (&b)[NT][2], float (&acc)[kTiles][NT][4]) {
  uint32_t a[kTiles][4];
  Dq<T>::frags_scaled(w, rows, a);
  mma_tiles<T, NT>(a, b, acc);
}

// The block's reduction buffer: slots of one warp's totals (8 * NT tokens x kRedStride floats
// each); warps beyond the slots add into the slot of warp w % slots in later rounds.  One or two
// token tiles take a slot per warp up to 34 KB (16 / NT slots), four take one slot: on the H100
// at M = 32 a larger buffer is slower (28672 x 4096: 49.2 us with one slot, 53.6 with four;
// shared memory taken from the L1 that caches the activations).
__host__ __device__ constexpr int red_slots(int nt, int w) { return nt >= 4 ? 1 : (16 / nt < w ? 16 / nt : w); }
__host__ __device__ constexpr int red_slot_floats(int nt) { return 8 * nt * kRedStride; }
__host__ __device__ constexpr int red_floats(int nt, int w) { return red_slots(nt, w) * red_slot_floats(nt); }

// Ends a group (or any part of one): tot += S * acc + Z * sx, and clears acc and sx for the
// next.  C fragment: [0], [1] = row 16j + g, tokens 8nt + 2t (+1); [2], [3] = row 16j + g + 8.
// All 32 lanes must call it.
template <typename T, int NT>
__device__ __forceinline__ void fold_group(const GroupFold& f, float (&acc)[kTiles][NT][4], TokenSums<T, NT>& sx,
                                           float (&tot)[kTiles][NT][4], int lane) {
  float xs[NT][2];
#pragma unroll
  for (int nt = 0; nt < NT; ++nt)
#pragma unroll
    for (int h = 0; h < 2; ++h) xs[nt][h] = sx.of(nt, h, lane);
#pragma unroll
  for (int j = 0; j < kTiles; ++j)
#pragma unroll
    for (int nt = 0; nt < NT; ++nt)
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        tot[j][nt][i] = fmaf(f.S[j][i >> 1], acc[j][nt][i], fmaf(f.Z[j][i >> 1], xs[nt][i & 1], tot[j][nt][i]));
        acc[j][nt][i] = 0.0f;
      }
  sx.zero();
}

// The warps' totals of the block's first mb tokens into the reduction buffer red[slot][token][row]
// (C-fragment layout), with plain stores and adds in a fixed order: the sums are the same on
// every run, and faster than shared-memory float atomics (H100, M = 1: 4096 x 4096 7.2 us
// against 8.6, 6144 x 4096 8.2 against 9.6).
// All W * 32 threads of the block must call it; it ends with the block synchronized.
template <int NT, int W>
__device__ __forceinline__ void warps_to_red(float* red, const float (&tot)[kTiles][NT][4], int warp, int lane,
                                             int mb) {
  constexpr int kSlots = red_slots(NT, W);
  const int g = lane >> 2;
  const int t = lane & 3;
  float* slot = red + (warp % kSlots) * red_slot_floats(NT);
#pragma unroll
  for (int round = 0; round < W / kSlots; ++round) {
    if (warp / kSlots == round) {
#pragma unroll
      for (int j = 0; j < kTiles; ++j)
#pragma unroll
        for (int nt = 0; nt < NT; ++nt)
#pragma unroll
          for (int i = 0; i < 4; ++i) {
            const int token = nt * 8 + 2 * t + (i & 1);
            float* p = slot + token * kRedStride + 16 * j + g + 8 * (i >> 1);
            if (token < mb) *p = round == 0 ? tot[j][nt][i] : *p + tot[j][nt][i];
          }
    }
    __syncthreads();
  }
}

// The block's sum of output (token, col) of the strip: its slots added in order.
template <int NT, int W>
__device__ __forceinline__ float block_sum(const float* red, int token, int col) {
  float v = 0.0f;
#pragma unroll
  for (int s = 0; s < red_slots(NT, W); ++s) v += red[s * red_slot_floats(NT) + token * kRedStride + col];
  return v;
}

// Stores the strip's outputs once every warp of the block has put its totals into `red`
// (warps_to_red).  Blocks of one strip that split K (blockIdx.x of gridDim.x):
// with CLUSTER they form the cluster and each finishes a 1/splits share of the outputs from its
// peers' buffers (distributed shared memory); without, each writes fp32 partials to `partial`
// (summed by splitk_reduce_kernel) unless it is the only split.  All THREADS threads of the
// block must call it.
template <typename T, bool CLUSTER, int NT, int W>
__device__ __forceinline__ void store_strip(float* red, const T* __restrict__ bias, T* __restrict__ out,
                                            float* __restrict__ partial, int M, int N, int m0, int mb) {
  using D = Dq<T>;
  constexpr int THREADS = W * 32;
  const int split = blockIdx.x;
  const int strip = blockIdx.y;
  const int elems = mb * kStripN;
  if constexpr (CLUSTER) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    namespace cg = cooperative_groups;
    cg::cluster_group cluster = cg::this_cluster();
    const int splits = gridDim.x;
    if constexpr (red_slots(NT, W) > 1) {  // the block's sums into slot 0, for its peers to read
      for (int e = threadIdx.x; e < elems; e += THREADS) {
        const int token = e / kStripN;
        const int col = e - token * kStripN;
        red[token * kRedStride + col] = block_sum<NT, W>(red, token, col);
      }
    }
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
      const float v = block_sum<NT, W>(red, token, col);
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
