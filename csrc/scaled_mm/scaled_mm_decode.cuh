// W8A8 decode kernel (M <= 16): streams the weight once at DRAM bandwidth through
// mma.sync tensor-core instructions (int8: m16n8k32 s8 x s8 -> s32, sm_80+; fp8 e4m3:
// m16n8k32 e4m3 x e4m3 -> f32, sm_89+).
//
// Roles (a "swapped" product, D^T = W A^T): the WEIGHT [N, K] (row-major; b is its
// transpose) is the mma A operand, 16 output channels per m16 tile; the activations are
// the B operand, 8 tokens per n8 tile (M <= 8: one tile, M <= 16: two).
//
// K permutation, no repack.  In a warp, lane (g = lane / 4, t = lane % 4) loads 16
// contiguous bytes at k = c*64 + t*16 of weight rows g and g+8 of each m16 tile, and the
// same 16 bytes of token g of each n8 tile.  The m16n8k32 fragments want, per lane, rows g
// and g+8 at logical k {4t..4t+3} and {16+4t..16+4t+3}; two mma per 64-byte chunk take
// bytes 0-7 and 8-15 of the lane's 16: logical k 4t+i <-> physical t*16+8h+i and
// 16+4t+i <-> t*16+8h+4+i (mma h = 0, 1).  Weights and activations use the same map, so
// the dot products are unchanged and every loaded register is a fragment register as is.
//
// Work split (DecodeConfig, scaled_mm_decode.h): a warp owns 32 channels (two m16 tiles)
// and a contiguous range of 64-byte K chunks; the warps of a CTA split K, and on sm_90 so
// do the up to 8 CTAs of a thread-block cluster.  Partial sums go to shared memory; after
// a cluster barrier each CTA reduces a slice of the 32 x 8*NT outputs over every warp of
// every CTA of its cluster through distributed shared memory, in a fixed order (bitwise
// reproducible), applies the epilogue and stores.  No workspace, no second kernel.
//
// Loads: weights with ld.global.nc.L1::no_allocate.L2::256B, 16 bytes straight into
// fragment registers; ptxas interleaves these loads with the mma that consume them (a few
// in flight per warp), but the L2::256B hint makes the first load of each row fetch the
// whole 256-byte batch (kBatch chunks) of that row, and on sm_90 the warp also asks the
// TMA engine to prefetch the next batch of its 32 rows into L2 (cp.async.bulk.prefetch)
// while it computes on this one.  Activations (tiny, re-read by every channel tile) through
// the L1-cached read-only path.
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

#include <cooperative_groups.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <type_traits>

#include "scaled_mm/scaled_mm_decode.h"

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
  int splits;           // CTAs per cluster along K (gridDim.x = splits * N / 32 rounded up)
  int chunks_per_part;  // 64-byte K chunks per (CTA, warp)
};

// Streamed weight load: read once, keep it out of L1; L2 fetches the whole 256-byte block
// (4 chunks of this row), so the first loads of a batch bring in the whole batch.
__device__ __forceinline__ uint4 load_stream(const uint8_t* p) {
  uint4 v;
  asm volatile("ld.global.nc.L1::no_allocate.L2::256B.v4.u32 {%0, %1, %2, %3}, [%4];"
               : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
               : "l"(p));
  return v;
}

// sm_90: ask the TMA engine to bring `bytes` (a multiple of 16, 16-byte aligned) of one
// weight row into L2 ahead of the register loads (the next batch while this one computes).
// The operands must be warp-uniform (else the compiler serialises over the lanes).
__device__ __forceinline__ void prefetch_l2(const uint8_t* p, int bytes) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("cp.async.bulk.prefetch.L2.global [%0], %1;" ::"l"(p), "r"(bytes) : "memory");
#endif
}

// Activation load: small and re-read by every channel tile, so L1-cached.
__device__ __forceinline__ uint4 load_act(const uint8_t* p) { return __ldg(reinterpret_cast<const uint4*>(p)); }

template <bool kFp8>
struct Mma;

template <>
struct Mma<false> {
  using Acc = int32_t;
  __device__ __forceinline__ static void run(int32_t (&c)[4], uint32_t a0, uint32_t a1, uint32_t a2, uint32_t a3,
                                             uint32_t b0, uint32_t b1) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
    asm("mma.sync.aligned.m16n8k32.row.col.s32.s8.s8.s32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
        "{%0, %1, %2, %3};"
        : "+r"(c[0]), "+r"(c[1]), "+r"(c[2]), "+r"(c[3])
        : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
#else
    __trap();
#endif
  }
};

template <>
struct Mma<true> {
  using Acc = float;
  __device__ __forceinline__ static void run(float (&c)[4], uint32_t a0, uint32_t a1, uint32_t a2, uint32_t a3,
                                             uint32_t b0, uint32_t b1) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 890
    asm("mma.sync.aligned.m16n8k32.row.col.f32.e4m3.e4m3.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
        "{%0, %1, %2, %3};"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
#else
    __trap();
#endif
  }
};

constexpr int kBatch = 4;    // K chunks whose loads are issued together (8 KB per warp)
constexpr int kRedPitch = 36;  // shared-memory row pitch of the partial sums (conflict-free writes)

// One batch of kBatch chunks starting at chunk `c` (pointers already at chunk c).
// kGuard: the last, partial batch of a partition (chunks past `c_end` or past K are zero).
template <bool kFp8, int NT, bool kGuard>
__device__ __forceinline__ void mma_batch(typename Mma<kFp8>::Acc (&acc)[2][NT][4], const uint8_t* const (&wp)[4],
                                          const uint8_t* const (&xp)[NT], int c, int c_end, int K, int t) {
  uint4 w[kBatch][4];
  uint4 x[kBatch][NT];
#pragma unroll
  for (int u = 0; u < kBatch; ++u) {
    bool ok = true;
    if constexpr (kGuard) ok = c + u < c_end && (c + u) * kChunkBytes + t * 16 < K;
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      w[u][i] = make_uint4(0, 0, 0, 0);
      if (ok) w[u][i] = load_stream(wp[i] + u * kChunkBytes);
    }
#pragma unroll
    for (int j = 0; j < NT; ++j) {
      x[u][j] = make_uint4(0, 0, 0, 0);
      if (ok) x[u][j] = load_act(xp[j] + u * kChunkBytes);
    }
  }
#pragma unroll
  for (int u = 0; u < kBatch; ++u) {
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      const uint4 lo = w[u][2 * r], hi = w[u][2 * r + 1];  // rows g, g+8 of m16 tile r
#pragma unroll
      for (int j = 0; j < NT; ++j) {
        Mma<kFp8>::run(acc[r][j], lo.x, hi.x, lo.y, hi.y, x[u][j].x, x[u][j].y);
        Mma<kFp8>::run(acc[r][j], lo.z, hi.z, lo.w, hi.w, x[u][j].z, x[u][j].w);
      }
    }
  }
}

template <bool kFp8, int NT, class Out, class Epi>
__global__ void __launch_bounds__(kMaxWarps * 32) scaled_mm_decode_kernel(const KernelArgs args, const Epi epi) {
  using Acc = typename Mma<kFp8>::Acc;
  constexpr int kTokens = 8 * NT;
  __shared__ Acc red[kMaxWarps][kTokens][kRedPitch];

  // The warp index through a warp reduction: the compiler then knows it (and the K range
  // derived from it) to be warp-uniform, which the bulk prefetch's operands must be.
  const int lane = threadIdx.x & 31, warp = __reduce_max_sync(0xffffffffu, threadIdx.x >> 5);
  const int warps = blockDim.x >> 5;
  const int g = lane >> 2, t = lane & 3;
  const int S = args.splits;
  const int rank = blockIdx.x % S;  // the CTA's rank in its (S, 1, 1) cluster
  const int n0 = (blockIdx.x / S) * kRowsPerWarp;
  const int M = args.M, N = args.N, K = args.K;

  // This warp's K chunks.
  const int chunks = (K + kChunkBytes - 1) / kChunkBytes;
  int c = (rank * warps + warp) * args.chunks_per_part;
  const int c_end = min(chunks, c + args.chunks_per_part);
  const int c_full = min(c_end, K / kChunkBytes);  // chunks entirely inside K

  // Row / token pointers at chunk c; rows past N and tokens past M re-read the last valid
  // one (their results are never stored).
  const int64_t koff = int64_t(c) * kChunkBytes + t * 16;
  const uint8_t* wp[4];
#pragma unroll
  for (int i = 0; i < 4; ++i) wp[i] = args.b + int64_t(min(n0 + 8 * i + g, N - 1)) * args.ldb + koff;
  const uint8_t* xp[NT];
#pragma unroll
  for (int j = 0; j < NT; ++j) xp[j] = args.a + int64_t(min(8 * j + g, M - 1)) * args.lda + koff;
  // (wp[i], i = 2r + h: rows n0 + 16r + 8h + g, i.e. row g / g+8 of m16 tile r.)

  Acc acc[2][NT][4];
#pragma unroll
  for (int r = 0; r < 2; ++r)
#pragma unroll
    for (int j = 0; j < NT; ++j)
#pragma unroll
      for (int q = 0; q < 4; ++q) acc[r][j][q] = Acc(0);

  // sm_90: the warp prefetches its 32 rows of the next batch.
  auto prefetch_batch = [&](int from) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    const int to = min(from + kBatch, c_end);
    if (from >= to) return;
    const int bytes = min(to * kChunkBytes, K) - from * kChunkBytes;
    const uint8_t* row = args.b + int64_t(n0) * args.ldb + int64_t(from) * kChunkBytes;
    const int rows = min(kRowsPerWarp, N - n0);
#pragma unroll 4
    for (int r = 0; r < rows; ++r, row += args.ldb) prefetch_l2(row, bytes);
#endif
  };
  for (; c + kBatch <= c_full; c += kBatch) {
    prefetch_batch(c + kBatch);
    mma_batch<kFp8, NT, false>(acc, wp, xp, c, c_end, K, t);
#pragma unroll
    for (int i = 0; i < 4; ++i) wp[i] += kBatch * kChunkBytes;
#pragma unroll
    for (int j = 0; j < NT; ++j) xp[j] += kBatch * kChunkBytes;
  }
  if (c < c_end) mma_batch<kFp8, NT, true>(acc, wp, xp, c, c_end, K, t);

  // Partial sums to shared memory: red[warp][token][channel - n0].
  // C fragment of m16n8 tile (r, j): c0, c1 at channel 16r + g, tokens 8j + 2t + {0, 1};
  // c2, c3 at channel 16r + g + 8.
#pragma unroll
  for (int r = 0; r < 2; ++r)
#pragma unroll
    for (int j = 0; j < NT; ++j) {
      const int n = 16 * r + g, m = 8 * j + 2 * t;
      red[warp][m][n] = acc[r][j][0];
      red[warp][m + 1][n] = acc[r][j][1];
      red[warp][m][n + 8] = acc[r][j][2];
      red[warp][m + 1][n + 8] = acc[r][j][3];
    }

  constexpr int kOutputs = kTokens * kRowsPerWarp;
  auto finish = [&](int m, int nl, Acc sum) {
    const int n = n0 + nl;
    Out* d = static_cast<Out*>(args.d) + int64_t(m) * args.ldd + n;
    store(d, epi(m, n, sum));
  };

#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  if (S > 1) {
    namespace cg = cooperative_groups;
    cg::cluster_group cluster = cg::this_cluster();
    cluster.sync();  // every CTA's partials are in its shared memory
    for (int e = rank * blockDim.x + threadIdx.x; e < kOutputs; e += S * blockDim.x) {
      const int m = e / kRowsPerWarp, nl = e % kRowsPerWarp;
      if (m >= M || n0 + nl >= N) continue;
      Acc sum = Acc(0);
      for (int s = 0; s < S; ++s) {
        const Acc* part = cluster.map_shared_rank(&red[0][m][nl], s);
#pragma unroll 4
        for (int w = 0; w < warps; ++w) sum += part[w * kTokens * kRedPitch];
      }
      finish(m, nl, sum);
    }
    cluster.sync();  // keep this CTA's shared memory alive until the others have read it
    return;
  }
#endif
  __syncthreads();
  for (int e = threadIdx.x; e < kOutputs; e += blockDim.x) {
    const int m = e / kRowsPerWarp, nl = e % kRowsPerWarp;
    if (m >= M || n0 + nl >= N) continue;
    Acc sum = Acc(0);
    for (int w = 0; w < warps; ++w) sum += red[w][m][nl];
    finish(m, nl, sum);
  }
}

// ------------------------------------------------------------------------ host launch

template <bool kFp8, int NT, class Out, class Epi>
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
  const Epi epi = Epi::make(p);
  const int row_blocks = static_cast<int>((p.N + kRowsPerWarp - 1) / kRowsPerWarp);

  cudaLaunchConfig_t cfg = {};
  cfg.gridDim = dim3(static_cast<unsigned>(row_blocks) * c.splits, 1, 1);
  cfg.blockDim = dim3(32 * c.warps, 1, 1);
  cfg.dynamicSmemBytes = 0;
  cfg.stream = static_cast<cudaStream_t>(p.stream);
  cudaLaunchAttribute attr[1];
  if (c.splits > 1) {
    attr[0].id = cudaLaunchAttributeClusterDimension;
    attr[0].val.clusterDim.x = c.splits;
    attr[0].val.clusterDim.y = 1;
    attr[0].val.clusterDim.z = 1;
    cfg.attrs = attr;
    cfg.numAttrs = 1;
  }
  cudaError_t err = cudaLaunchKernelEx(&cfg, scaled_mm_decode_kernel<kFp8, NT, Out, Epi>, args, epi);
  if (err == cudaSuccess) err = cudaGetLastError();
  if (err != cudaSuccess) {
    if (cuda_error) *cuda_error = static_cast<int>(err);
    return kQLaunchFailed;
  }
  return kQOk;
}

// Output type x token tiles for one epilogue tree template.
template <bool kFp8, template <class> class Tree>
int launch_tree(const ScaledMmParams& p, const DecodeConfig& c, int* cuda_error) {
  const bool two = p.M > 8;
  switch (p.out_dtype) {
    case QDType::kF16:
      return two ? launch_one<kFp8, 2, __half, Tree<__half>>(p, c, cuda_error)
                 : launch_one<kFp8, 1, __half, Tree<__half>>(p, c, cuda_error);
    case QDType::kBF16:
      return two ? launch_one<kFp8, 2, __nv_bfloat16, Tree<__nv_bfloat16>>(p, c, cuda_error)
                 : launch_one<kFp8, 1, __nv_bfloat16, Tree<__nv_bfloat16>>(p, c, cuda_error);
    case QDType::kF32:
      return two ? launch_one<kFp8, 2, float, Tree<float>>(p, c, cuda_error)
                 : launch_one<kFp8, 1, float, Tree<float>>(p, c, cuda_error);
    default:
      return kQUnsupported;
  }
}

}  // namespace quantfuse::decode
