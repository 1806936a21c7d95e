// W8A8 decode kernel (M <= 16): streams the weight once through mma.sync tensor-core
// instructions (int8: m16n8k32 s8 x s8 -> s32, sm_80+; fp8 e4m3: m16n8k32 e4m3 x e4m3 ->
// f32, sm_89+).  Measured on the H100: 31-63% of DRAM bandwidth, slower than the CUTLASS
// decode config, so not routed by default (benchmarks/notes_scaled_mm_decode.md).
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
// can the up to 8 CTAs of a thread-block cluster (forced `splits`; the automatic choice
// uses none: measured slower).  Partial sums go to shared memory; after
// a cluster barrier each CTA reduces a slice of the 32 x 8*NT outputs over every warp of
// every CTA of its cluster through distributed shared memory, in a fixed order (bitwise
// reproducible), applies the epilogue and stores.  No workspace, no second kernel.
//
// Loads: a kStages-deep cp.async pipeline per warp (16-byte copies global -> shared, L2
// only; zero-fill past K): kStages - 1 chunks of weights and activations in flight while
// one is consumed; each lane reads back (ld.shared.v4) exactly the 16-byte pieces it
// copied, which are its fragment registers.  (Plain register loads were tried first: ptxas
// interleaves them with the mma that consume them, leaving a few loads in flight per warp:
// 27-42% of DRAM bandwidth on the H100; see benchmarks/notes_scaled_mm_decode.md.)
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

// 16-byte asynchronous copy global -> shared (L2 only); src_bytes = 0 writes zeros.
__device__ __forceinline__ void cp_async16(uint32_t dst, const uint8_t* src, int src_bytes) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;" ::"r"(dst), "l"(src), "r"(src_bytes) : "memory");
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;" ::: "memory"); }
template <int N>
__device__ __forceinline__ void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;" ::"n"(N) : "memory");
}
__device__ __forceinline__ uint4 lds128(uint32_t addr) {
  uint4 v;
  asm volatile("ld.shared.v4.u32 {%0, %1, %2, %3}, [%4];" : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "r"(addr));
  return v;
}

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

constexpr int kRedPitch = 36;  // row pitch (words) of the partial sums: conflict-free writes

// Shared memory per warp: kStages slots of (4 weight + NT activation) pieces of 32 lanes x
// 16 bytes; after the mainloop the warp's partial sums reuse its own slots.
template <int NT, int kStages>
constexpr int warp_smem_bytes() {
  return kStages * (4 + NT) * 32 * 16;
}

template <bool kFp8, int NT, int kStages, class Out, class Epi>
__global__ void __launch_bounds__(kMaxWarps * 32) scaled_mm_decode_kernel(const KernelArgs args, const Epi epi) {
  using Acc = typename Mma<kFp8>::Acc;
  constexpr int kTokens = 8 * NT;
  constexpr int kPieces = 4 + NT;
  constexpr int kWarpBytes = warp_smem_bytes<NT, kStages>();
  static_assert(kTokens * kRedPitch * 4 <= kWarpBytes, "partials must fit in the warp's slots");
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

  // Global pointers at chunk c0 (wp[i], i = 2r + h: row n0 + 16r + 8h + g = row g / g+8 of
  // m16 tile r); rows past N and tokens past M re-read the last valid one (never stored).
  const int64_t koff = int64_t(c0) * kChunkBytes + t * 16;
  const uint8_t* src[kPieces];
#pragma unroll
  for (int i = 0; i < 4; ++i) src[i] = args.b + int64_t(min(n0 + 8 * i + g, N - 1)) * args.ldb + koff;
#pragma unroll
  for (int j = 0; j < NT; ++j) src[4 + j] = args.a + int64_t(min(8 * j + g, M - 1)) * args.lda + koff;

  const uint32_t warp_smem = static_cast<uint32_t>(__cvta_generic_to_shared(smem)) + warp * kWarpBytes;
  const uint32_t lane_smem = warp_smem + lane * 16;
  // Piece p of slot s of this lane: lane_smem + (s * kPieces + p) * 512.
  auto issue = [&](int c) {  // copies of chunk c (< c_end) into its slot; K tail -> zeros
    const int k = c - c0;
    const int bytes = c * kChunkBytes + t * 16 < K ? 16 : 0;
    const uint32_t dst = lane_smem + (unsigned(k) % kStages) * kPieces * 512;
#pragma unroll
    for (int p = 0; p < kPieces; ++p) cp_async16(dst + p * 512, src[p] + int64_t(k) * kChunkBytes, bytes);
  };

  Acc acc[2][NT][4];
#pragma unroll
  for (int r = 0; r < 2; ++r)
#pragma unroll
    for (int j = 0; j < NT; ++j)
#pragma unroll
      for (int q = 0; q < 4; ++q) acc[r][j][q] = Acc(0);

  // kStages-deep pipeline: kStages - 1 chunks in flight while one is consumed.  Each lane
  // reads back only what it copied itself, so its own cp.async.wait_group is the only sync.
#pragma unroll
  for (int s = 0; s < kStages - 1; ++s) {
    if (c0 + s < c_end) issue(c0 + s);
    cp_async_commit();
  }
  for (int c = c0; c < c_end; ++c) {
    cp_async_wait<kStages - 2>();  // chunk c has landed
    const uint32_t slot = lane_smem + (unsigned(c - c0) % kStages) * kPieces * 512;
    uint4 f[kPieces];
#pragma unroll
    for (int p = 0; p < kPieces; ++p) f[p] = lds128(slot + p * 512);
    if (c + kStages - 1 < c_end) issue(c + kStages - 1);  // into the slot read last iteration
    cp_async_commit();
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      const uint4 lo = f[2 * r], hi = f[2 * r + 1];  // rows g, g+8 of m16 tile r
#pragma unroll
      for (int j = 0; j < NT; ++j) {
        const uint4 x = f[4 + j];
        Mma<kFp8>::run(acc[r][j], lo.x, hi.x, lo.y, hi.y, x.x, x.y);
        Mma<kFp8>::run(acc[r][j], lo.z, hi.z, lo.w, hi.w, x.z, x.w);
      }
    }
  }
  cp_async_wait<0>();
  __syncwarp();  // every lane's reads of the slots are done before they hold partial sums

  // Partial sums to this warp's slots: red(w)[token][channel - n0], pitch kRedPitch.
  // C fragment of m16n8 tile (r, j): c0, c1 at channel 16r + g, tokens 8j + 2t + {0, 1};
  // c2, c3 at channel 16r + g + 8.
  Acc* red = reinterpret_cast<Acc*>(smem + warp * kWarpBytes);
#pragma unroll
  for (int r = 0; r < 2; ++r)
#pragma unroll
    for (int j = 0; j < NT; ++j) {
      const int n = 16 * r + g, m = 8 * j + 2 * t;
      red[m * kRedPitch + n] = acc[r][j][0];
      red[(m + 1) * kRedPitch + n] = acc[r][j][1];
      red[m * kRedPitch + n + 8] = acc[r][j][2];
      red[(m + 1) * kRedPitch + n + 8] = acc[r][j][3];
    }

  constexpr int kOutputs = kTokens * kRowsPerWarp;
  constexpr int kWarpWords = kWarpBytes / 4;
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
    const int m = e / kRowsPerWarp, nl = e % kRowsPerWarp;
    if (m >= M || n0 + nl >= N) continue;
    const Acc* part = reinterpret_cast<const Acc*>(smem) + m * kRedPitch + nl;
    Acc sum = Acc(0);
    for (int w = 0; w < warps; ++w) sum += part[w * kWarpWords];
    finish(m, nl, sum);
  }
}

// ------------------------------------------------------------------------ host launch

template <bool kFp8, int NT, int kStages, class Out, class Epi>
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
  auto* kernel = scaled_mm_decode_kernel<kFp8, NT, kStages, Out, Epi>;
  const int smem = c.warps * warp_smem_bytes<NT, kStages>();
  cudaError_t err = cudaSuccess;
  if (smem > 48 * 1024) {  // opt in to large dynamic shared memory (once per kernel and device)
    static bool opted_in[64] = {};
    const int dev = p.device >= 0 && p.device < 64 ? p.device : 0;
    if (!opted_in[dev]) {
      err = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                 kMaxWarps * warp_smem_bytes<NT, kStages>());
      opted_in[dev] = err == cudaSuccess;
    }
  }

  cudaLaunchConfig_t cfg = {};
  cfg.gridDim = dim3(static_cast<unsigned>(row_blocks) * c.splits, 1, 1);
  cfg.blockDim = dim3(32 * c.warps, 1, 1);
  cfg.dynamicSmemBytes = static_cast<size_t>(smem);
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
  if (err == cudaSuccess) err = cudaLaunchKernelEx(&cfg, kernel, args, epi);
  if (err == cudaSuccess) err = cudaGetLastError();
  if (err != cudaSuccess) {
    if (cuda_error) *cuda_error = static_cast<int>(err);
    return kQLaunchFailed;
  }
  return kQOk;
}

template <bool kFp8, int NT, class Out, class Epi>
int launch_stages(const ScaledMmParams& p, const DecodeConfig& c, int* cuda_error) {
  // Only 4 stages are instantiated (8 measured slower on the H100: more shared memory per
  // warp, fewer warps per SM); the switch keeps the depth a launch parameter.
  switch (c.stages) {
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
      return two ? launch_stages<kFp8, 2, __half, Tree<__half>>(p, c, cuda_error)
                 : launch_stages<kFp8, 1, __half, Tree<__half>>(p, c, cuda_error);
    case QDType::kBF16:
      return two ? launch_stages<kFp8, 2, __nv_bfloat16, Tree<__nv_bfloat16>>(p, c, cuda_error)
                 : launch_stages<kFp8, 1, __nv_bfloat16, Tree<__nv_bfloat16>>(p, c, cuda_error);
    case QDType::kF32:
      return two ? launch_stages<kFp8, 2, float, Tree<float>>(p, c, cuda_error)
                 : launch_stages<kFp8, 1, float, Tree<float>>(p, c, cuda_error);
    default:
      return kQUnsupported;
  }
}

}  // namespace quantfuse::decode
