// W8A16 decode kernels (M <= 16): stream the int8 weight once at DRAM bandwidth.
//
// float16 / bfloat16 activations (tensor cores).  A "swapped" product, Y^T = W X^T: the weight
// [N, K] is the A operand of mma.sync m16n8k16 (16 output channels per m16 tile), the tokens
// the B operand (8 per n8 tile; M <= 8 one tile, M <= 16 two).  Lane (g = lane / 4,
// t = lane % 4) loads 16 contiguous weight bytes of rows g and g + 8 at k = c*64 + 16t
// (16-byte evict-first loads with the L2::256B prefetch-size hint: the weight is read once) and
// the same 16 activations of token g of each n8 tile.  The fragments want logical k {2t, 2t+1} and {2t+8, 2t+9}; the four mma of a
// 64-element chunk take the lane's elements 4i..4i+3 as those (mma i): logical 2t+e <->
// physical 16t+4i+e, 2t+8+e <-> 16t+4i+2+e.  Weights and activations use the same map, so the
// dot products are unchanged and no repack is needed.  int8 -> float16 exactly: the biased
// byte (b + 128) ORed into the mantissa of 1024.0, minus 1152; -> bfloat16: the same in float32
// (2^23), then a paired conversion (exact: |b| <= 128 fits bfloat16's 8-bit significand).
// Accumulation in float32 (the mma's C).
//
// float32 activations (CUDA cores, fp32 FMA; tensor cores have no exact float32 input): each
// warp owns 2 rows, its lanes step along K by 16 elements each; per-lane sums are reduced with
// shuffles.  Less tuned than the tensor-core path: float32 decode is rare.
//
// Work split (DecodeConfig, w8a16_gemm.h) of the tensor-core kernel: a warp owns 16 channels
// and a contiguous range of 64-element K chunks; a CTA's warps split K, on sm_90 so can the
// CTAs of a cluster (small N).  Partial sums go to shared memory; each CTA (after a cluster
// barrier, through distributed shared memory) reduces a slice of its 16 x 8*NT outputs in a
// fixed order (reproducible; common/decode_reduce.cuh), applies the epilogue (acc * s[n], then
// + bias[n], each rounded in float32, then one rounding to the output type) and stores.
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
#include "w8a16_gemm/w8a16_gemm.h"

namespace quantfuse::w8a16 {

__device__ __forceinline__ float to_float(float v) { return v; }
__device__ __forceinline__ float to_float(__half v) { return __half2float(v); }
__device__ __forceinline__ float to_float(__nv_bfloat16 v) { return __bfloat162float(v); }

__device__ __forceinline__ void store(float* p, float v) { *p = v; }
__device__ __forceinline__ void store(__half* p, float v) { *p = __float2half_rn(v); }
__device__ __forceinline__ void store(__nv_bfloat16* p, float v) { *p = __float2bfloat16_rn(v); }

// The epilogue of every path: (acc * s) + bias in float32 without contraction, one rounding.
template <class T, class S>
struct Epilogue {
  const S* scale;
  const T* bias;
  bool per_channel;
  __device__ __forceinline__ float operator()(int n, float acc) const {
    float v = __fmul_rn(acc, to_float(scale[per_channel ? n : 0]));
    if (bias != nullptr) v = __fadd_rn(v, to_float(bias[n]));
    return v;
  }
};

// ------------------------------------------------------------------------ tensor-core pieces

// Four int8 weights (one 32-bit word) -> two packed pairs of T (the A fragment registers of
// mma_m16n8k16<T>): lo = bytes 0, 1; hi = bytes 2, 3.
template <class T>
struct Frag;

template <>
struct Frag<__half> {
  __device__ __forceinline__ static void convert(uint32_t w, uint32_t& lo, uint32_t& hi) {
    const uint32_t u = w ^ 0x80808080u;  // b + 128 in each byte
    const uint32_t l = __byte_perm(u, 0x64646464u, 0x4140), h = __byte_perm(u, 0x64646464u, 0x4342);
    const uint32_t magic = 0x64806480u;  // 1152.0 twice
    asm("sub.f16x2 %0, %1, %2;" : "=r"(lo) : "r"(l), "r"(magic));
    asm("sub.f16x2 %0, %1, %2;" : "=r"(hi) : "r"(h), "r"(magic));
  }
};

template <>
struct Frag<__nv_bfloat16> {
  __device__ __forceinline__ static uint32_t pack(uint32_t u, uint32_t sel0, uint32_t sel1) {
    const float f0 = __uint_as_float(__byte_perm(u, 0x4B000000u, sel0)) - 8388736.0f;  // 2^23 + 128
    const float f1 = __uint_as_float(__byte_perm(u, 0x4B000000u, sel1)) - 8388736.0f;
    const __nv_bfloat162 v = __floats2bfloat162_rn(f0, f1);  // .x (low half) = f0
    return *reinterpret_cast<const uint32_t*>(&v);
  }
  __device__ __forceinline__ static void convert(uint32_t w, uint32_t& lo, uint32_t& hi) {
    const uint32_t u = w ^ 0x80808080u;
    lo = pack(u, 0x7650, 0x7651);
    hi = pack(u, 0x7652, 0x7653);
  }
};

__device__ __forceinline__ uint32_t word(const uint4& v, int i) {
  return i == 0 ? v.x : i == 1 ? v.y : i == 2 ? v.z : v.w;
}

struct DecodeArgs {
  const uint8_t* x;  // [M, K] 2-byte elements, row pitch ldx elements
  const uint8_t* w;  // [N, K] int8, row pitch ldw bytes
  void* y;
  int M, N, K;
  int64_t ldx, ldw, ldy;
  int splits, chunks_per_part;
  int slices;  // token slices of kMaxM rows (M > kMaxM): CTAs of one row tile, adjacent in the grid
  bool prefetch;  // QUANTFUSE_PDL_PREFETCH=l2 (common/pdl.h): weights asked into L2 before the wait
};

// One batch of register loads: kBatch chunks; per chunk and lane 16 weight bytes of rows g and
// g + 8 and 16 activations (two 16-byte words) of token g of each n8 tile.
template <int kBatch, int NT>
struct Batch {
  uint4 w[kBatch][2];
  uint4 x[kBatch][NT][2];
};

template <class T, int NT, int kBatch, bool kDouble, class Epi>
__global__ void __launch_bounds__(kMaxWarps * 32, 2) w8a16_decode_mma_kernel(const DecodeArgs args, const Epi epi) {
  extern __shared__ __align__(16) uint8_t smem[];
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, warps = blockDim.x >> 5;
  const int g = lane >> 2, t = lane & 3;
  const int S = args.splits;
  const int rank = blockIdx.x % S;
  // Grid order: row tile, then token slice, then cluster rank, so that the slices of one row tile
  // run side by side and all but the first read its weight rows from L2.
  const int slice = (blockIdx.x / S) % args.slices;
  const int n0 = (blockIdx.x / S / args.slices) * kRowsPerWarp;
  const int m0 = slice * kMaxM;
  const int M = min(args.M - m0, kMaxM), N = args.N, K = args.K;

  const int chunks = (K + kChunk - 1) / kChunk;
  const int c0 = (rank * warps + warp) * args.chunks_per_part;
  const int c_end = min(chunks, c0 + args.chunks_per_part);

  // Rows past N and tokens past M re-read the last valid one (never stored).
  const uint8_t* wrow[2];
#pragma unroll
  for (int h = 0; h < 2; ++h) wrow[h] = args.w + int64_t(min(n0 + 8 * h + g, N - 1)) * args.ldw + t * 16;
  const uint8_t* xrow[NT];
#pragma unroll
  for (int j = 0; j < NT; ++j) xrow[j] = args.x + (int64_t(m0 + min(8 * j + g, M - 1)) * args.ldx + t * 16) * 2;

  auto load = [&](Batch<kBatch, NT>& bt, int c) {
#pragma unroll
    for (int u = 0; u < kBatch; ++u) {
      const int cc = c + u;
      const bool ok = cc < c_end && cc * kChunk + t * 16 < K;
      const uint4 zero = make_uint4(0u, 0u, 0u, 0u);
      const int64_t k0 = int64_t(cc) * kChunk;
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        bt.w[u][h] = ok ? ld_stream_l2_256(wrow[h] + k0) : zero;
      }
#pragma unroll
      for (int j = 0; j < NT; ++j) {
        const uint4* px = reinterpret_cast<const uint4*>(xrow[j] + k0 * 2);
        bt.x[u][j][0] = ok ? __ldg(px) : zero;
        bt.x[u][j][1] = ok ? __ldg(px + 1) : zero;
      }
    }
  };

  float acc[NT][4];
#pragma unroll
  for (int j = 0; j < NT; ++j)
#pragma unroll
    for (int q = 0; q < 4; ++q) acc[j][q] = 0.0f;

  auto use = [&](const Batch<kBatch, NT>& bt, int c) {
#pragma unroll
    for (int u = 0; u < kBatch; ++u) {
      if (c + u >= c_end) break;  // warp-uniform
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        uint32_t a0, a1, a2, a3;
        Frag<T>::convert(word(bt.w[u][0], i), a0, a2);  // row g: k pairs (2t..) and (2t+8..)
        Frag<T>::convert(word(bt.w[u][1], i), a1, a3);  // row g + 8
#pragma unroll
        for (int j = 0; j < NT; ++j) {
          const uint4& xv = bt.x[u][j][i >> 1];
          const int wi = (i & 1) * 2;
          mma_m16n8k16<T>(acc[j], a0, a1, a2, a3, word(xv, wi), word(xv, wi + 1));
        }
      }
    }
  };

  // Nothing the previous kernel writes (the activations) is read before pdl_wait.
  if (args.prefetch) prefetch_rows_l2(wrow, t, int64_t(c0) * kChunk, min(int64_t(c_end) * kChunk, int64_t(K)));
  pdl_wait();

  if constexpr (kDouble) {  // the next batch in flight while this one feeds the mma
    Batch<kBatch, NT> b0, b1;
    load(b0, c0);
    for (int c = c0; c < c_end; c += 2 * kBatch) {
      load(b1, c + kBatch);
      use(b0, c);
      load(b0, c + 2 * kBatch);
      use(b1, c + kBatch);
    }
  } else {  // one larger batch at a time; the other resident warps keep DRAM busy meanwhile
    for (int c = c0; c < c_end; c += kBatch) {
      Batch<kBatch, NT> b;
      load(b, c);
      use(b, c);
    }
  }
  pdl_launch_dependents();

  store_partials<NT>(smem, warp, lane, acc);
  reduce_partials<NT, float>(smem, S, rank, warps, M, N, n0, [&](int m, int nl, float sum) {
    const int n = n0 + nl;
    store(static_cast<T*>(args.y) + int64_t(m0 + m) * args.ldy + n, epi(n, sum));
  });
}

// ------------------------------------------------------------------------ float32 (CUDA cores)

constexpr int kSimtRows = 2;  // weight rows per warp
constexpr int kSimtStep = 32 * 16;  // K elements per warp step

template <class Epi>
__global__ void __launch_bounds__(256) w8a16_decode_f32_kernel(const float* __restrict__ x, const int8_t* __restrict__ w,
                                                               float* __restrict__ y, int M, int N, int K, int64_t ldx,
                                                               int64_t ldw, int64_t ldy, const Epi epi) {
  const int lane = threadIdx.x & 31;
  const int n0 = (blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5)) * kSimtRows;
  if (n0 >= N) return;
  const int8_t* wr[kSimtRows];
#pragma unroll
  for (int r = 0; r < kSimtRows; ++r) wr[r] = w + int64_t(min(n0 + r, N - 1)) * ldw;
  float acc[kMaxM][kSimtRows];
#pragma unroll
  for (int m = 0; m < kMaxM; ++m)
#pragma unroll
    for (int r = 0; r < kSimtRows; ++r) acc[m][r] = 0.0f;

  for (int k = lane * 16; k < K; k += kSimtStep) {
    float wf[kSimtRows][16];
#pragma unroll
    for (int r = 0; r < kSimtRows; ++r) {
      const uint4 v = ld_stream(wr[r] + k);
#pragma unroll
      for (int i = 0; i < 16; ++i) {
        const uint32_t wd = word(v, i >> 2);
        wf[r][i] = static_cast<float>(static_cast<int8_t>((wd >> (8 * (i & 3))) & 0xFF));
      }
    }
#pragma unroll
    for (int m = 0; m < kMaxM; ++m) {
      if (m >= M) break;  // warp-uniform
      const float4* px = reinterpret_cast<const float4*>(x + int64_t(m) * ldx + k);
#pragma unroll
      for (int q = 0; q < 4; ++q) {
        const float4 xv = __ldg(px + q);
#pragma unroll
        for (int r = 0; r < kSimtRows; ++r) {
          acc[m][r] = fmaf(xv.x, wf[r][4 * q + 0], acc[m][r]);
          acc[m][r] = fmaf(xv.y, wf[r][4 * q + 1], acc[m][r]);
          acc[m][r] = fmaf(xv.z, wf[r][4 * q + 2], acc[m][r]);
          acc[m][r] = fmaf(xv.w, wf[r][4 * q + 3], acc[m][r]);
        }
      }
    }
  }
#pragma unroll
  for (int m = 0; m < kMaxM; ++m) {
    if (m >= M) break;
#pragma unroll
    for (int r = 0; r < kSimtRows; ++r) {
      float v = acc[m][r];
#pragma unroll
      for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
      if (lane == 0 && n0 + r < N) y[int64_t(m) * ldy + n0 + r] = epi(n0 + r, v);
    }
  }
}

// ------------------------------------------------------------------------ prefill epilogue

template <class T, class Epi>
__global__ void w8a16_epilogue_kernel(const float* __restrict__ acc, T* __restrict__ y, int64_t M, int64_t N,
                                      int64_t ldy, const Epi epi) {
  const int64_t total = M * N;
  for (int64_t e = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; e < total; e += int64_t(gridDim.x) * blockDim.x) {
    const int64_t m = e / N;
    const int n = static_cast<int>(e - m * N);
    store(y + m * ldy + n, epi(n, acc[e]));
  }
}

// ------------------------------------------------------------------------ prefill weight cast

// int8 -> T, 16 weights per thread and step (16-byte loads, evict-first: the weight is read once).
template <class T>
__global__ void w8a16_cast_kernel(const int8_t* __restrict__ w, T* __restrict__ out, int64_t n16) {
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n16; i += int64_t(gridDim.x) * blockDim.x) {
    const uint4 v = ld_stream(w + 16 * i);
    T vals[16];
#pragma unroll
    for (int e = 0; e < 16; ++e) {
      const float f = static_cast<float>(static_cast<int8_t>((word(v, e >> 2) >> (8 * (e & 3))) & 0xFF));
      if constexpr (std::is_same_v<T, float>) vals[e] = f;
      else if constexpr (std::is_same_v<T, __half>) vals[e] = __float2half_rn(f);
      else vals[e] = __float2bfloat16_rn(f);
    }
    uint4* dst = reinterpret_cast<uint4*>(out + 16 * i);
#pragma unroll
    for (int q = 0; q < int(16 * sizeof(T) / 16); ++q) dst[q] = reinterpret_cast<const uint4*>(vals)[q];
  }
}

// ------------------------------------------------------------------------ host launch

inline int launch_status(cudaError_t err, int* cuda_error) {
  if (err == cudaSuccess) err = cudaGetLastError();
  if (err != cudaSuccess) {
    if (cuda_error) *cuda_error = static_cast<int>(err);
    return kLaunchFailed;
  }
  return kOk;
}

template <class T, int NT, int kBatch, bool kDouble, class Epi>
int launch_mma(const Params& p, const DecodeConfig& c, const Epi& epi, int* cuda_error) {
  DecodeArgs args;
  args.x = static_cast<const uint8_t*>(p.x);
  args.w = reinterpret_cast<const uint8_t*>(p.w);
  args.y = p.y;
  args.M = static_cast<int>(p.M);
  args.N = static_cast<int>(p.N);
  args.K = static_cast<int>(p.K);
  args.ldx = p.ldx;
  args.ldw = p.ldw;
  args.ldy = p.ldy;
  args.splits = c.splits;
  args.chunks_per_part = c.chunks_per_part;
  args.slices = static_cast<int>((p.M + kMaxM - 1) / kMaxM);
  args.prefetch = p.pdl && pdl_prefetch();
  const int row_blocks = static_cast<int>((p.N + kRowsPerWarp - 1) / kRowsPerWarp) * args.slices;
  const int smem = c.warps * warp_smem_bytes<NT>();  // <= 10 KB
  const ClusterLaunch launch(dim3(static_cast<unsigned>(row_blocks) * c.splits, 1, 1), dim3(32 * c.warps, 1, 1),
                             static_cast<size_t>(smem), static_cast<cudaStream_t>(p.stream), c.splits, p.pdl);
  return launch_status(
      cudaLaunchKernelEx(&launch.cfg, w8a16_decode_mma_kernel<T, NT, kBatch, kDouble, Epi>, args, epi), cuda_error);
}

template <class T, class S>
int launch_decode_typed(const Params& p, const DecodeConfig& c, int* cuda_error) {
  const Epilogue<T, S> epi{static_cast<const S*>(p.scale), static_cast<const T*>(p.bias), p.scale_per_channel};
  if constexpr (std::is_same_v<T, float>) {
    constexpr int kWarps = 8;
    const int64_t blocks = (p.N + kWarps * kSimtRows - 1) / (kWarps * kSimtRows);
    w8a16_decode_f32_kernel<<<static_cast<unsigned>(blocks), 32 * kWarps, 0, static_cast<cudaStream_t>(p.stream)>>>(
        static_cast<const float*>(p.x), p.w, static_cast<float*>(p.y), static_cast<int>(p.M), static_cast<int>(p.N),
        static_cast<int>(p.K), p.ldx, p.ldw, p.ldy, epi);
    return launch_status(cudaSuccess, cuda_error);
  } else {
    // Register budget 128 (16 warps per SM): double-buffered batches of 2 chunks for one token
    // tile, of 1 for two (default); or single batches of twice that (c.batch).
    if (p.M > 8)
      return c.batch == 2 ? launch_mma<T, 2, 2, false>(p, c, epi, cuda_error)
                          : launch_mma<T, 2, 1, true>(p, c, epi, cuda_error);
    return c.batch == 4 ? launch_mma<T, 1, 4, false>(p, c, epi, cuda_error)
                        : launch_mma<T, 1, 2, true>(p, c, epi, cuda_error);
  }
}

template <class T>
int launch_cast_typed(const int8_t* w, void* out, int64_t n, void* stream, int* cuda_error) {
  if (n == 0) return kOk;
  if (n % 16 != 0 || reinterpret_cast<uintptr_t>(w) % 16 != 0 || reinterpret_cast<uintptr_t>(out) % 16 != 0)
    return kUnsupported;
  const int threads = 256;
  const int64_t n16 = n / 16;
  const int64_t blocks = std::min<int64_t>((n16 + threads - 1) / threads, 132 * 16);
  w8a16_cast_kernel<T><<<static_cast<unsigned>(blocks), threads, 0, static_cast<cudaStream_t>(stream)>>>(
      w, static_cast<T*>(out), n16);
  return launch_status(cudaSuccess, cuda_error);
}

template <class T, class S>
int launch_epilogue_typed(const float* acc, const Params& p, int* cuda_error) {
  const Epilogue<T, S> epi{static_cast<const S*>(p.scale), static_cast<const T*>(p.bias), p.scale_per_channel};
  const int64_t total = p.M * p.N;
  const int threads = 256;
  const int64_t blocks = std::min<int64_t>((total + threads - 1) / threads, 65535 * 8);
  if (total == 0) return kOk;
  w8a16_epilogue_kernel<T><<<static_cast<unsigned>(blocks), threads, 0, static_cast<cudaStream_t>(p.stream)>>>(
      acc, static_cast<T*>(p.y), p.M, p.N, p.ldy, epi);
  return launch_status(cudaSuccess, cuda_error);
}

}  // namespace quantfuse::w8a16
