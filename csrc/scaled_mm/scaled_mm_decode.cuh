// W8A8 decode kernel (M <= 16): streams the weight once through mma.sync tensor-core
// instructions (int8: m16n8k32 s8 x s8 -> s32, sm_80+; fp8 e4m3: m16n8k32 e4m3 x e4m3 ->
// f32, sm_89+).  Whether the public ops route here is decided in scaled_mm_dispatch.cpp
// from H100 measurements (benchmarks/dev/bench_scaled_mm_decode.py).
//
// Roles (a "swapped" product, D^T = W A^T): the WEIGHT [N, K] (row-major; b is its
// transpose) is the mma A operand, 16 output channels per m16 tile; the activations are
// the B operand, 8 tokens per n8 tile (M <= 8: one tile, M <= 16: two).
//
// K permutation, no repack.  In a warp, lane (g = lane / 4, t = lane % 4) loads 16
// contiguous bytes at k = c*64 + t*16 of weight rows g and g+8 of the warp's m16 tile, and
// the same 16 bytes of token g of each n8 tile.  The m16n8k32 fragments want, per lane, rows
// g and g+8 at logical k {4t..4t+3} and {16+4t..16+4t+3}; two mma per 64-byte chunk take
// bytes 0-7 and 8-15 of the lane's 16: logical k 4t+i <-> physical t*16+8h+i and
// 16+4t+i <-> t*16+8h+4+i (mma h = 0, 1).  Weights and activations use the same map, so
// the dot products are unchanged and every loaded register is a fragment register as is.
//
// Work split (DecodeConfig, scaled_mm_decode.h): a warp owns 16 channels (one m16 tile)
// and a contiguous range of 64-byte K chunks; the warps of a CTA split K, and on sm_90 so
// can the up to 8 CTAs of a thread-block cluster (forced `splits`; the automatic choice
// uses none).  Partial sums go to shared memory; after a cluster barrier each CTA reduces
// a slice of the 16 x 8*NT outputs over every warp of every CTA of its cluster through
// distributed shared memory, in a fixed order (bitwise reproducible; common/decode_reduce.cuh),
// applies the epilogue and stores.  No workspace, no second kernel.
//
// Loads: registers, in batches of kBatch chunks issued back to back (the warp asks for 16
// rows x 256 bytes at once; 128 with two token tiles, whose registers would otherwise halve
// the resident warps), double-buffered: the next batch is in flight while this one feeds
// the mma.  On the H100 the request shape decides the bandwidth (a read-only kernel
// with a stand-in for the math): 16 rows x 256 B per warp-batch read the 28672 x 4096 weight
// at 2.45 TB/s, 32 rows x 64 B at a time (a cp.async pipeline's request shape) at 1.9.
//
// Epilogue: a tree of small functors (the idea of CUTLASS's epilogue visitor trees, see
// epilogue_sm90.cuh), evaluated per output element on the reduced accumulator:
//   Scaled             = MulToken(MulChannel(ToFloat(Acc)))
//   ScaledBias         = AddBias(Scaled)                      (null bias adds nothing)
//   ScaledBiasAzp      = AddBias(MulToken(MulChannel(ToFloat(SubAzp(Acc)))))
//   ScaledBiasAzpToken = AddBias(MulToken(MulChannel(ToFloat(SubAzpToken(Acc)))))
// The zero-point terms in int32 (exact), then float32 with the reference's operation order
// (acc * s_b * s_a + bias, no FMA contraction), one rounding to the output type.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <type_traits>

#include "common/cluster_launch.h"
#include "common/pdl.cuh"
#include "common/pdl.h"
#include "common/decode_reduce.cuh"
#include "common/mma.cuh"
#include "common/stream_load.h"
#include "scaled_mm/scaled_mm_decode.h"

// Weight loads with the L2::256B prefetch-size hint (1) or plain evict-first (0), a build-time
// knob for measurements (-DQF_DECODE_L2_256B=0).  The hint is used where a batch
// covers the 256-byte block of each row (batches of 4 chunks, one token tile): with batches of
// 2 (two token tiles) it measured 3% slower on 28672 x 4096 (and 3-6% faster on 6144 x 4096
// and 4096 x 14336), which put M = 16 behind _int_mm there.
#ifndef QF_DECODE_L2_256B
#define QF_DECODE_L2_256B 1
#endif

namespace quantfuse::decode {

// ------------------------------------------------------------------------ epilogue nodes

// The (reduced) accumulator: int32 for int8, float for fp8.
template <class Acc>
struct AccFetch {
  using Value = Acc;
  static AccFetch make(const ScaledMmParams&) { return {}; }
  __device__ __forceinline__ Acc operator()(int, int, Acc acc) const { return acc; }
};

// acc - azp_adj[n]  (per-tensor zero point folded into azp_adj = z_a * colsum(b)); int32.
template <class Child>
struct SubAzp {
  using Value = int32_t;
  Child child;
  const int32_t* azp_adj;
  static SubAzp make(const ScaledMmParams& p) { return {Child::make(p), p.azp_adj}; }
  template <class Acc>
  __device__ __forceinline__ int32_t operator()(int m, int n, Acc acc) const {
    return child(m, n, acc) - __ldg(azp_adj + n);
  }
};

// acc - azp[m] * azp_adj[n]  (per-token zero points, azp_adj = colsum(b)); int32.
template <class Child>
struct SubAzpToken {
  using Value = int32_t;
  Child child;
  const int32_t* azp_adj;
  const int32_t* azp;
  static SubAzpToken make(const ScaledMmParams& p) { return {Child::make(p), p.azp_adj, p.azp}; }
  template <class Acc>
  __device__ __forceinline__ int32_t operator()(int m, int n, Acc acc) const {
    return child(m, n, acc) - __ldg(azp + m) * __ldg(azp_adj + n);
  }
};

// int32 -> float32, round to nearest (identity for a float accumulator).
template <class Child>
struct ToFloat {
  using Value = float;
  Child child;
  static ToFloat make(const ScaledMmParams& p) { return {Child::make(p)}; }
  template <class Acc>
  __device__ __forceinline__ float operator()(int m, int n, Acc acc) const {
    const auto v = child(m, n, acc);
    if constexpr (std::is_floating_point_v<std::remove_cv_t<decltype(v)>>) return v;
    else return __int2float_rn(v);
  }
};

// Scalar-or-vector broadcast of a float32 scale along the channel (n) or token (m) axis;
// `vec` is chosen at run time, so one kernel serves both granularities.
template <class Child, bool kAlongN>
struct MulScale {
  using Value = float;
  Child child;
  const float* scale;
  bool vec;
  static MulScale make(const ScaledMmParams& p) {
    return kAlongN ? MulScale{Child::make(p), p.scale_b, p.scale_b_per_channel}
                   : MulScale{Child::make(p), p.scale_a, p.scale_a_per_token};
  }
  template <class Acc>
  __device__ __forceinline__ float operator()(int m, int n, Acc acc) const {
    const int i = vec ? (kAlongN ? n : m) : 0;
    return __fmul_rn(child(m, n, acc), __ldg(scale + i));
  }
};
template <class Child>
using MulChannel = MulScale<Child, true>;
template <class Child>
using MulToken = MulScale<Child, false>;

__device__ __forceinline__ float to_float(float x) { return x; }
__device__ __forceinline__ float to_float(__half x) { return __half2float(x); }
__device__ __forceinline__ float to_float(__nv_bfloat16 x) { return __bfloat162float(x); }

// + bias[n] in the output type (nullable: no bias adds nothing).
template <class Child, class T>
struct AddBias {
  using Value = float;
  Child child;
  const T* bias;
  static AddBias make(const ScaledMmParams& p) { return {Child::make(p), static_cast<const T*>(p.bias)}; }
  template <class Acc>
  __device__ __forceinline__ float operator()(int m, int n, Acc acc) const {
    const float v = child(m, n, acc);
    return bias != nullptr ? __fadd_rn(v, to_float(bias[n])) : v;
  }
};

template <class Acc>
using Scaled = MulToken<MulChannel<ToFloat<AccFetch<Acc>>>>;
template <class Acc, class T>
using ScaledBias = AddBias<Scaled<Acc>, T>;
template <class T>
using ScaledBiasAzp = AddBias<MulToken<MulChannel<ToFloat<SubAzp<AccFetch<int32_t>>>>>, T>;
template <class T>
using ScaledBiasAzpToken = AddBias<MulToken<MulChannel<ToFloat<SubAzpToken<AccFetch<int32_t>>>>>, T>;

__device__ __forceinline__ void store(float* p, float v) { *p = v; }
__device__ __forceinline__ void store(__half* p, float v) { *p = __float2half_rn(v); }
__device__ __forceinline__ void store(__nv_bfloat16* p, float v) { *p = __float2bfloat16_rn(v); }

// ------------------------------------------------------------------------ mainloop pieces

struct KernelArgs {
  const uint8_t* a;  // [M, K], row pitch lda bytes
  const uint8_t* b;  // weight [N, K], row pitch ldb bytes
  void* d;           // [M, N], row pitch ldd elements
  int M, N, K;
  int64_t lda, ldb, ldd;
  int splits;           // CTAs per cluster along K (gridDim.x = splits * N / 16 rounded up)
  int chunks_per_part;  // 64-byte K chunks per (CTA, warp)
  bool prefetch;        // QUANTFUSE_PDL_PREFETCH=l2 (common/pdl.h): weights asked into L2 before the wait
};

// The 8-bit operand type of the kernel's m16n8k32 (common/mma.cuh).
template <bool kFp8>
using Operand = std::conditional_t<kFp8, __nv_fp8_e4m3, int8_t>;

// Loads of one batch: kBatch 64-byte chunks of the warp's K range; per chunk and lane the 16
// bytes of weight rows g and g + 8 and of token g of each n8 tile.  Chunks past the range or
// past K are zeros (no memory access).
template <int kBatch, int NT>
struct Batch {
  uint4 w[kBatch][2];
  uint4 x[kBatch][NT];
};

template <bool kFp8, int NT, int kBatch, class Out, class Epi>
// 128 registers (16 warps per SM) for one token tile, or two with batches of 2 chunks; two
// token tiles with batches of 4 need ~208 (8 warps per SM).  (Loading the activations at use
// instead of a batch ahead also fits two tiles in 128 registers, but measured 5-15% slower.)
__global__ void __launch_bounds__(kMaxWarps * 32, (NT == 1 || kBatch <= 2) ? 2 : 1)
    scaled_mm_decode_kernel(const KernelArgs args, const Epi epi) {
  using Acc = MmaAcc<Operand<kFp8>>;
  extern __shared__ __align__(16) uint8_t smem[];

  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, warps = blockDim.x >> 5;
  const int g = lane >> 2, t = lane & 3;
  const int S = args.splits;
  const int rank = blockIdx.x % S;  // the CTA's rank in its (S, 1, 1) cluster
  const int n0 = (blockIdx.x / S) * kRowsPerWarp;
  const int M = args.M, N = args.N, K = args.K;

  // This warp's K chunks [c0, c_end).
  const int chunks = (K + kChunkBytes - 1) / kChunkBytes;
  const int c0 = (rank * warps + warp) * args.chunks_per_part;
  const int c_end = min(chunks, c0 + args.chunks_per_part);

  // Row pointers at k = 16t: weight rows n0 + g, n0 + g + 8, token rows 8j + g; rows past N
  // and tokens past M re-read the last valid one (never stored).
  const uint8_t* wrow[2];
#pragma unroll
  for (int h = 0; h < 2; ++h) wrow[h] = args.b + int64_t(min(n0 + 8 * h + g, N - 1)) * args.ldb + t * 16;
  const uint8_t* xrow[NT];
#pragma unroll
  for (int j = 0; j < NT; ++j) xrow[j] = args.a + int64_t(min(8 * j + g, M - 1)) * args.lda + t * 16;

  auto load = [&](Batch<kBatch, NT>& bt, int c) {
#pragma unroll
    for (int u = 0; u < kBatch; ++u) {
      const int cc = c + u;
      const bool ok = cc < c_end && cc * kChunkBytes + t * 16 < K;
      const int64_t off = int64_t(cc) * kChunkBytes;
      const uint4 zero = make_uint4(0u, 0u, 0u, 0u);
      // The weight is read once: evict-first.  The activations are re-read by every row tile.
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        if constexpr (QF_DECODE_L2_256B && kBatch * kChunkBytes >= 256)
          bt.w[u][h] = ok ? ld_stream_l2_256(wrow[h] + off) : zero;
        else
          bt.w[u][h] = ok ? ld_stream(wrow[h] + off) : zero;
      }
#pragma unroll
      for (int j = 0; j < NT; ++j) bt.x[u][j] = ok ? __ldg(reinterpret_cast<const uint4*>(xrow[j] + off)) : zero;
    }
  };

  Acc acc[NT][4];
#pragma unroll
  for (int j = 0; j < NT; ++j)
#pragma unroll
    for (int q = 0; q < 4; ++q) acc[j][q] = Acc(0);

  auto use = [&](const Batch<kBatch, NT>& bt, int c) {
#pragma unroll
    for (int u = 0; u < kBatch; ++u) {
      if (c + u >= c_end) break;  // warp-uniform
      const uint4 lo = bt.w[u][0], hi = bt.w[u][1];  // rows g, g + 8
#pragma unroll
      for (int j = 0; j < NT; ++j) {
        const uint4 x = bt.x[u][j];
        mma_m16n8k32<Operand<kFp8>>(acc[j], lo.x, hi.x, lo.y, hi.y, x.x, x.y);
        mma_m16n8k32<Operand<kFp8>>(acc[j], lo.z, hi.z, lo.w, hi.w, x.z, x.w);
      }
    }
  };

  // Nothing the previous kernel writes (activations, their scales) is read before pdl_wait.
  if (args.prefetch) prefetch_rows_l2(wrow, t, int64_t(c0) * kChunkBytes, min(int64_t(c_end) * kChunkBytes, int64_t(K)));
  pdl_wait();

  // Double-buffered batches: the next batch's loads are all issued before this one's mma.
  Batch<kBatch, NT> b0, b1;
  load(b0, c0);
  for (int c = c0; c < c_end; c += 2 * kBatch) {
    load(b1, c + kBatch);
    use(b0, c);
    load(b0, c + 2 * kBatch);
    use(b1, c + kBatch);
  }
  pdl_launch_dependents();

  store_partials<NT>(smem, warp, lane, acc);
  reduce_partials<NT, Acc>(smem, S, rank, warps, M, N, n0, [&](int m, int nl, Acc sum) {
    const int n = n0 + nl;
    Out* d = static_cast<Out*>(args.d) + int64_t(m) * args.ldd + n;
    store(d, epi(m, n, sum));
  });
}

// ------------------------------------------------------------------------ host launch

template <bool kFp8, int NT, int kBatch, class Out, class Epi>
int launch_one(const ScaledMmParams& p, const DecodeConfig& c, int* cuda_error) {
  KernelArgs args;
  args.a = static_cast<const uint8_t*>(p.a);
  args.b = static_cast<const uint8_t*>(p.b);
  args.d = p.d;
  args.M = static_cast<int>(p.M);
  args.N = static_cast<int>(p.N);
  args.K = static_cast<int>(p.K);
  args.lda = p.lda;  // 1-byte inputs: elements = bytes
  args.ldb = p.ldb;
  args.ldd = p.ldd;
  args.splits = c.splits;
  args.chunks_per_part = c.chunks_per_part;
  args.prefetch = p.pdl && pdl_prefetch();
  const Epi epi = Epi::make(p);
  const int row_blocks = static_cast<int>((p.N + kRowsPerWarp - 1) / kRowsPerWarp);
  auto* kernel = scaled_mm_decode_kernel<kFp8, NT, kBatch, Out, Epi>;
  const int smem = c.warps * warp_smem_bytes<NT>();  // <= 10 KB: no opt-in needed
  cudaError_t err = cudaSuccess;

  const ClusterLaunch launch(dim3(static_cast<unsigned>(row_blocks) * c.splits, 1, 1), dim3(32 * c.warps, 1, 1),
                             static_cast<size_t>(smem), static_cast<cudaStream_t>(p.stream), c.splits, p.pdl);
  if (err == cudaSuccess) err = cudaLaunchKernelEx(&launch.cfg, kernel, args, epi);
  if (err == cudaSuccess) err = cudaGetLastError();
  if (err != cudaSuccess) {
    if (cuda_error) *cuda_error = static_cast<int>(err);
    return kQLaunchFailed;
  }
  return kQOk;
}

template <bool kFp8, int NT, class Out, class Epi>
int launch_batch(const ScaledMmParams& p, const DecodeConfig& c, int* cuda_error) {
  // Batches of 4 chunks for one token tile (the request shape that reads fastest on the H100:
  // 16 rows x 256 B per warp at once), of 2 for two, so that their registers leave 16 warps
  // per SM.
  switch (c.batch > 0 ? c.batch : (NT == 1 ? 4 : 2)) {
    case 2: return launch_one<kFp8, NT, 2, Out, Epi>(p, c, cuda_error);
    case 4: return launch_one<kFp8, NT, 4, Out, Epi>(p, c, cuda_error);
    default: return kQUnsupported;
  }
}

// Output type x token tiles for one epilogue tree template.
template <bool kFp8, template <class> class Tree>
int launch_tree(const ScaledMmParams& p, const DecodeConfig& c, int* cuda_error) {
  const bool two = p.M > 8;
  switch (p.out_dtype) {
    case QDType::kF16:
      return two ? launch_batch<kFp8, 2, __half, Tree<__half>>(p, c, cuda_error)
                 : launch_batch<kFp8, 1, __half, Tree<__half>>(p, c, cuda_error);
    case QDType::kBF16:
      return two ? launch_batch<kFp8, 2, __nv_bfloat16, Tree<__nv_bfloat16>>(p, c, cuda_error)
                 : launch_batch<kFp8, 1, __nv_bfloat16, Tree<__nv_bfloat16>>(p, c, cuda_error);
    case QDType::kF32:
      return two ? launch_batch<kFp8, 2, float, Tree<float>>(p, c, cuda_error)
                 : launch_batch<kFp8, 1, float, Tree<float>>(p, c, cuda_error);
    default:
      return kQUnsupported;
  }
}

}  // namespace quantfuse::decode
