// The K-split reduction of the weight-streaming decode kernels (w8a16_gemm, scaled_mm decode).
// A warp owns 16 output channels (one m16 tile) and 8 * NT tokens (NT n8 tiles) over a range of
// K; the warps of a CTA, and on sm_90 the CTAs of a thread-block cluster, split K.  Each warp's
// accumulators go to its slice of shared memory (store_partials); then each CTA reduces a slice
// of the 16 x 8*NT outputs over every warp of every CTA of its cluster, through distributed
// shared memory, in a fixed order (bitwise reproducible), and hands each sum to the kernel's
// epilogue (reduce_partials).
#pragma once

#include <cooperative_groups.h>
#include <cuda_runtime.h>

#include <cstdint>

namespace quantfuse {

// Row pitch (words) of a warp's partial sums red[token][channel]: the C fragment stores of
// lanes (g, t) hit word 2t * 20 + g (mod 32), all different.
constexpr int kRedPitch = 20;

// Shared memory of one warp's partial sums (4-byte accumulators).
template <int NT>
__host__ __device__ constexpr int warp_smem_bytes() {
  return 8 * NT * kRedPitch * 4;
}

// This warp's partial sums to its shared memory: red(w)[token][channel - n0], pitch kRedPitch.
// C fragment of m16n8 tile j: c0, c1 at channel g, tokens 8j + 2t + {0, 1}; c2, c3 at g + 8.
template <int NT, class Acc>
__device__ __forceinline__ void store_partials(uint8_t* smem, int warp, int lane, const Acc (&acc)[NT][4]) {
  constexpr int kWarpWords = warp_smem_bytes<NT>() / 4;
  const int g = lane >> 2, t = lane & 3;
  Acc* red = reinterpret_cast<Acc*>(smem) + warp * kWarpWords;
#pragma unroll
  for (int j = 0; j < NT; ++j) {
    const int m = 8 * j + 2 * t;
    red[m * kRedPitch + g] = acc[j][0];
    red[(m + 1) * kRedPitch + g] = acc[j][1];
    red[m * kRedPitch + g + 8] = acc[j][2];
    red[(m + 1) * kRedPitch + g + 8] = acc[j][3];
  }
}

// The sums of the outputs (token m < M, channel n0 + nl < N) over the `warps` warps of each of
// the S CTAs of the cluster (this CTA is `rank`), each passed to finish(m, nl, sum).  Every
// thread of the CTA calls it once, after store_partials.
template <int NT, class Acc, class Finish>
__device__ __forceinline__ void reduce_partials(const uint8_t* smem, int S, int rank, int warps, int M, int N, int n0,
                                                const Finish& finish) {
  constexpr int kWarpWords = warp_smem_bytes<NT>() / 4;
  constexpr int kRows = 16;
  constexpr int kOutputs = 8 * NT * kRows;
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  if (S > 1) {
    namespace cg = cooperative_groups;
    cg::cluster_group cluster = cg::this_cluster();
    cluster.sync();  // every CTA's partials are in its shared memory
    for (int e = rank * blockDim.x + threadIdx.x; e < kOutputs; e += S * blockDim.x) {
      const int m = e / kRows, nl = e % kRows;
      if (m >= M || n0 + nl >= N) continue;
      Acc sum = Acc(0);
      for (int s = 0; s < S; ++s) {
        const Acc* part = cluster.map_shared_rank(reinterpret_cast<const Acc*>(smem), s) + m * kRedPitch + nl;
#pragma unroll 4
        for (int w = 0; w < warps; ++w) sum += part[w * kWarpWords];
      }
      finish(m, nl, sum);
    }
    cluster.sync();  // keep this CTA's shared memory alive until the others have read it
    return;
  }
#endif
  __syncthreads();
  for (int e = threadIdx.x; e < kOutputs; e += blockDim.x) {
    const int m = e / kRows, nl = e % kRows;
    if (m >= M || n0 + nl >= N) continue;
    const Acc* part = reinterpret_cast<const Acc*>(smem) + m * kRedPitch + nl;
    Acc sum = Acc(0);
    for (int w = 0; w < warps; ++w) sum += part[w * kWarpWords];
    finish(m, nl, sum);
  }
}

}  // namespace quantfuse
