// quantfuse AWQ W4A16 CUDA kernels (CUDA headers only; no torch).
//
// * awq_gemm_kernel (small M): streams the repacked int4 weights once (16-byte evict-first
//   loads issued in contiguous batches, double-buffered in registers) and makes them
//   mma.sync.m16n8k16 A fragments in registers, accumulating in fp32.  Two paths (fold_path):
//   raw nibbles by masks alone (fp16 subnormals, or bf16 with a magic-number offset) with each
//   group's zeros and scales applied to the accumulators once per group, or (q - z) * s made
//   in the fragments, for the block shapes whose registers the first does not fit.  A block
//   owns a 64-row strip of N; its warps and, when the strips cannot fill the GPU, a cluster
//   of blocks split K (details at the kernel).  The per-dtype fragments and MMA are in
//   awq_dequant.cuh, the group fold, the strip's reduction buffer and output store in
//   awq_gemm_strip.cuh.
// * awq_dequantize_kernel: the original AWQ layout to a dense [K, N] weight.
// * awq_repack_kernel: the original AWQ layout to the GEMM's fragment layout;
//   awq_unrepack_kernel: back.

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "awq_gemm/awq_dequant.cuh"
#include "awq_gemm/awq_gemm.h"
#include "awq_gemm/awq_gemm_strip.cuh"
#include "common/cluster_launch.h"
#include "common/device_attribute.h"
#include "common/pdl.cuh"
#include "common/pdl.h"

namespace quantfuse {
namespace awq {
namespace {

// ----------------------------------------------------------------------------- GEMM

// The weight is the mma A operand (16 rows of N per fragment), the activations the B operand
// (8 tokens per n8 tile), so one 16-byte load per lane feeds four m16n8k16 MMAs (the four
// 16-row tiles of a 64-row strip at one k-step) with no data exchange between lanes.  K is
// permuted inside each k-step (the same way for weights and activations; a dot product does
// not care about order): lane t's mma k-slots {2t, 2t+1, 2t+8, 2t+9} hold actual k = 16*kt +
// 4t + {0, 1, 2, 3}, so its activations are one 8-byte load per token tile.
//
// Work split: a block owns one strip and a contiguous K range, its warps split that range;
// warp partials meet in shared memory (stores and adds in a fixed order, so a call's result is
// the same bits on every run); K splits across blocks are a thread
// block cluster on sm_90 (partials summed through distributed shared memory, no workspace,
// no second kernel), elsewhere an fp32 workspace and splitk_reduce_kernel.
// Weights are loaded kBatch k-steps at a time (2 for several token tiles in 4-warp blocks, see
// batch_for): each lane issues kBatch 16-byte loads back to back, so the warp asks for
// kBatch x 512 contiguous bytes at once, double-buffered (the next batch is in flight while
// this one is used).  On the H100 the same bytes asked for one 512-byte
// step at a time (a rolling ring) read at ~1.8 TB/s, in batches of 2 KB at ~2.5 TB/s
// (a read-only kernel with this grid and per-warp K ranges).
#ifndef QF_AWQ_BATCH
#define QF_AWQ_BATCH 4
#endif
constexpr int kBatch = QF_AWQ_BATCH;

// Weights are read once: a streaming load (evict-first in L1 and L2).
__device__ __forceinline__ uint4 load_stream(const uint4* p) { return __ldcs(p); }

// Resident warps per SM the register budget must allow: enough 16-byte loads in flight to
// cover DRAM latency (fewer for more token tiles, whose accumulators need the registers).
// Several token tiles in 4-warp blocks (chosen when the strips alone give two blocks per SM)
// load batches of 2 k-steps instead of 4, which fits about 128 registers and so 16 warps per
// SM: on the H100, 28672 x 4096 takes 34.5 us at M = 16 and 52.2 us at M = 32 this way,
// against 45.8 and 64.4 us with batches of 4 at 8 warps per SM.
// With 8-warp blocks (fewer strips) batches of 2 are slower, so those keep batches of 4 at
// 12 (two tiles) or 8 (four) warps per SM.
// (Landing the weights in a per-warp shared-memory ring by cp.async instead of registers is
// slower on the H100: more instructions per step.)
#ifndef QF_AWQ_NT1_WARPS  // measurement knob: resident warps per SM for one token tile
#define QF_AWQ_NT1_WARPS 16
#endif
__host__ __device__ constexpr int min_warps_per_sm(int nt, int w) {
  return nt == 1 ? QF_AWQ_NT1_WARPS : (w == 4 ? 16 : (nt == 2 ? 12 : 8));
}
__host__ __device__ constexpr int batch_for(int nt, int w) { return nt > 1 && w == 4 ? 2 : kBatch; }

// Two ways to apply a group's zeros and scales (awq_dequant.cuh), chosen by the block's shape:
// * fold: raw values into the MMA, zeros and scales once per group on fp32 accumulators, the
//   activations loaded a batch ahead with the weights.  ~38 instructions per k-step, but per-warp
//   totals and the activations ahead need registers: one token tile, or two in 8-warp blocks.
// * scaled: (q - z) * s made in half2/bfloat162 math in the fragments, activations loaded in
//   their k-step.  ~92 instructions per k-step; fits two token tiles in 4-warp blocks at 16 warps
//   per SM, and four.
// On the H100 the fold math is 7-11% faster for one token tile on the four Llama shapes and
// 3-7% for two in 8-warp blocks, and 15-25% slower where the other two configurations run
// (28672 x 4096 at 9 <= M <= 32).
__host__ __device__ constexpr bool fold_path(int nt, int w) { return nt == 1 || (nt == 2 && w == 8); }

// Where a group of the zeros and scales may end: BATCH_GROUPS, only where a batch of k-steps
// begins.  That holds when a group is a whole number of batches and every warp's K range starts
// on a batch (the kernel rounds its splits of K up to whole batches), and lets the group's fold
// (or, on the scaled path, its rows' constants) be compiled once per batch instead of once per
// k-step: half the kernel's code and fewer instructions per step (H200, group 128: 4096^2 5.6 us
// against 6.0 at M = 1, 11.8 against 13.0 at M = 32; 28672 x 4096 18.6 against 19.4 at M = 1).
// Other group sizes check every k-step, and so does the kernel of four token tiles in 4-warp
// blocks, which spills more registers this way (28672 x 4096, M = 32: 50.9 us against 48.6).
__host__ __device__ constexpr bool batch_groups_kernel(int nt, int w) { return !(nt == 4 && w == 4); }
__host__ __device__ constexpr bool batch_groups(int nt, int w, int group_size) {
  return batch_groups_kernel(nt, w) && (group_size / 16) % batch_for(nt, w) == 0;
}

template <typename T, int NT, int W, bool CLUSTER, bool BATCH_GROUPS>
__global__ void __launch_bounds__(W * 32, min_warps_per_sm(NT, W) / W) awq_gemm_kernel(
    const T* __restrict__ x, const uint4* __restrict__ wp, const T* __restrict__ scales,
    const uint32_t* __restrict__ qzeros, const T* __restrict__ bias, T* __restrict__ out,
    float* __restrict__ partial, int M, int N, int K, int group_size, int early) {
  constexpr bool kFold = fold_path(NT, W);
  __shared__ __align__(16) float red[red_floats(NT, W)];

  const int splits = gridDim.x;
  const int split = blockIdx.x;
  const int strip = blockIdx.y;
  const int m0 = blockIdx.z * 8 * NT;
  const int warp = threadIdx.x >> 5;
  const int lane = threadIdx.x & 31;
  constexpr int kB = batch_for(NT, W);  // k-steps per batch of loads (below)
  // k-steps: BATCH_GROUPS rounds the splits up to whole batches
  auto whole = [](int steps) { return BATCH_GROUPS ? (steps + kB - 1) / kB * kB : steps; };
  const int KT = K >> 4;
  const int per_block = whole((KT + splits - 1) / splits);
  const int kb = min(KT, split * per_block);
  const int ke = min(KT, kb + per_block);
  const int per_warp = whole((ke - kb + W - 1) / W);
  const int wb = min(ke, kb + warp * per_warp);
  const int we = min(ke, wb + per_warp);

  // tot: the warp's sums.  fold: acc and sx hold the current group's, added into tot at its end
  // (unused, and compiled away, on the scaled path, whose MMAs accumulate into tot).
  float tot[kTiles][NT][4], acc[kTiles][NT][4];
  zero_acc<NT>(tot);
  zero_acc<NT>(acc);
  TokenSums<T, NT> sx;
  sx.zero();
  const T* xrow[NT];
  activation_rows<T, NT>(x, M, K, m0, lane, xrow);
#ifdef QF_AWQ_PROBE_MATH_ONLY  // measurement knob: every strip reads strip 0's weights (from L2)
  const uint4* wl = wp + lane;
#else
  const uint4* wl = wp + (size_t)strip * KT * 32 + lane;
#endif
  // Launched with PDL it waits for the kernel before (pdl_wait below) before its first load.  The
  // measurement modes of `early` (common/pdl.h) work while that kernel may still run: the warp's weights
  // asked into L2 (each k-step is 512 bytes, four lines: 8 k-steps per pass of the warp's lanes), or its
  // first batch of weights and their groups' scales and zeros loaded (below); the activations, which
  // the kernel before writes, are read after the wait in every mode.
  if (early == kPdlEarlyL2) {
    const char* wbase = reinterpret_cast<const char*>(wl - lane);
    for (int k = wb + (lane >> 2); k < we; k += 8) prefetch_l2(wbase + (size_t)k * 512 + (lane & 3) * 128);
  }
  const int gsteps = group_size >> 4;
  const int groups = K / group_size;
  const StripGroups<T> meta(scales, qzeros, N, strip, lane);

  // A batch: kB k-steps of the lane's weights, and (fold) of its activations, asked for together
  // one batch ahead so that no k-step waits on a load issued in it.  Weights first: theirs is the
  // latency that matters.
  struct Batch {
    uint4 w[kB];
    uint2 x[kFold ? kB : 1][NT];
  };
  auto load_x = [&](int k, int nt) {
    return xrow[nt] != nullptr ? __ldg(reinterpret_cast<const uint2*>(xrow[nt] + (k << 4))) : make_uint2(0u, 0u);
  };
  auto load_weights = [&](Batch& bt, int k0) {
#pragma unroll
    for (int u = 0; u < kB; ++u)
      if (k0 + u < we) bt.w[u] = load_stream(wl + (size_t)(k0 + u) * 32);
  };
  auto load_acts = [&](Batch& bt, int k0) {
    if constexpr (kFold) {
#pragma unroll
      for (int u = 0; u < kB; ++u)
#pragma unroll
        for (int nt = 0; nt < NT; ++nt) bt.x[u][nt] = k0 + u < we ? load_x(k0 + u, nt) : make_uint2(0u, 0u);
    }
  };
  auto load_batch = [&](Batch& bt, int k0) {
    load_weights(bt, k0);
    load_acts(bt, k0);
  };
  Batch bat[2];
  int grp = wb / gsteps;
  int pos = wb - grp * gsteps;  // steps of the current group already behind us
  // Scales and zeros are asked for a group ahead, into the one buffer `meta_raw`.  fold: it holds
  // the current group's, used when the group ends; scaled: the next group's, whose rows'
  // dequantization constants are made when it starts.  (With a second buffer rotated into the
  // first, the compiler put the copy right after the load, so each group boundary waited for a
  // DRAM round trip: H200, M = 1, 28672 x 4096 21.7 us against 19.3, 4096^2 6.4 against 6.0.)
  GroupRaw meta_raw;
  typename Dq<T>::Row rows[kFold ? 1 : kTiles][2];
  auto load_groups = [&]() {
    if (wb < we) meta.load(grp, meta_raw);
  };
  const bool regs_early = early == kPdlEarlyRegisters;
  if (regs_early) {
    load_weights(bat[0], wb);
    load_groups();
  }
  pdl_wait();
  if (regs_early) {
    load_acts(bat[0], wb);
  } else {
    load_batch(bat[0], wb);
    load_groups();
  }
  if constexpr (!kFold)
    if (wb < we) {
      meta.rows(meta_raw, lane, rows);
      if (grp + 1 < groups) meta.load(grp + 1, meta_raw);
    }

  auto step = [&](const Batch& bt, int u, int k) {
    if ((!BATCH_GROUPS || u == 0) && pos == gsteps) {
      if constexpr (kFold)
        fold_group<T, NT>(meta.fold_constants(meta_raw, lane), acc, sx, tot, lane);
      else
        meta.rows(meta_raw, lane, rows);
      pos = 0;
      ++grp;
      // fold: the group that starts (a step follows); scaled: the one after it, if any.
      if (kFold || grp + 1 < groups) meta.load(kFold ? grp : grp + 1, meta_raw);
    }
    ++pos;
    uint32_t b[NT][2];
#pragma unroll
    for (int nt = 0; nt < NT; ++nt) {
      const uint2 v = kFold ? bt.x[kFold ? u : 0][nt] : load_x(k, nt);
      b[nt][0] = v.x;
      b[nt][1] = v.y;
    }
    if constexpr (kFold)
      mma_kstep<T, NT>(bt.w[u], b, acc, sx);
    else
      mma_kstep_scaled<T, NT>(bt.w[u], rows, b, tot);
  };

  // bat[0] holds the batch at kt; each half-iteration asks for the batch after the one it uses.
  int kt = wb;
  for (; kt + 2 * kB <= we; kt += 2 * kB) {
    load_batch(bat[1], kt + kB);
#pragma unroll
    for (int u = 0; u < kB; ++u) step(bat[0], u, kt + u);
    load_batch(bat[0], kt + 2 * kB);
#pragma unroll
    for (int u = 0; u < kB; ++u) step(bat[1], u, kt + kB + u);
  }
  // fewer than 2 * kB steps left
  load_batch(bat[1], kt + kB);
#pragma unroll
  for (int u = 0; u < kB; ++u)
    if (kt + u < we) step(bat[0], u, kt + u);
#pragma unroll
  for (int u = 0; u < kB; ++u)
    if (kt + kB + u < we) step(bat[1], u, kt + kB + u);

  if constexpr (kFold)
    if (wb < we) fold_group<T, NT>(meta.fold_constants(meta_raw, lane), acc, sx, tot, lane);
  // The next kernel may launch (a PDL one waits for this one's completion before it reads).
  pdl_launch_dependents();
  const int mb = min(8 * NT, M - m0);
  warps_to_red<NT, W>(red, tot, warp, lane, mb);
  store_strip<T, CLUSTER, NT, W>(red, bias, out, partial, M, N, m0, mb);
}

// out[m, n] = sum_s partial[s, m, n] + bias[n], 4 elements per thread (N % 4 == 0).
template <typename T>
__global__ void splitk_reduce_kernel(const float* __restrict__ partial, const T* __restrict__ bias,
                                     T* __restrict__ out, int M, int N, int splits) {
  using D = Dq<T>;
  const size_t total = (size_t)M * N;
  const size_t i = ((size_t)blockIdx.x * blockDim.x + threadIdx.x) * 4;
  if (i >= total) return;
  float4 s = *reinterpret_cast<const float4*>(partial + i);
  for (int p = 1; p < splits; ++p) {
    const float4 v = *reinterpret_cast<const float4*>(partial + (size_t)p * total + i);
    s.x += v.x; s.y += v.y; s.z += v.z; s.w += v.w;
  }
  if (bias != nullptr) {
    const int n = (int)(i % N);
    s.x += D::to_float(bias[n]); s.y += D::to_float(bias[n + 1]);
    s.z += D::to_float(bias[n + 2]); s.w += D::to_float(bias[n + 3]);
  }
  T o[4] = {D::from_float(s.x), D::from_float(s.y), D::from_float(s.z), D::from_float(s.w)};
  *reinterpret_cast<uint2*>(out + i) = *reinterpret_cast<const uint2*>(o);
}

// ----------------------------------------------------------------------------- dequantize

// One thread per packed int32: 8 outputs (16-byte store), 8 scales (16-byte load).
template <typename T>
__global__ void awq_dequantize_kernel(const uint32_t* __restrict__ qweight, const T* __restrict__ scales,
                                      const uint32_t* __restrict__ qzeros, T* __restrict__ out, int K, int N,
                                      int group_size) {
  using D = Dq<T>;
  const int n8 = N >> 3;
  const size_t total = (size_t)K * n8;
  for (size_t idx = (size_t)blockIdx.x * blockDim.x + threadIdx.x; idx < total;
       idx += (size_t)gridDim.x * blockDim.x) {
    const int k = (int)(idx / n8);
    const int c = (int)(idx % n8);
    const int g = k / group_size;
    const uint32_t q = __ldg(qweight + idx);
    const uint32_t z = __ldg(qzeros + (size_t)g * n8 + c);
    const uint4 s = __ldg(reinterpret_cast<const uint4*>(scales + (size_t)g * N + 8 * c));
    uint4 o;
    o.x = D::pair(q, z, s.x);
    o.y = D::pair(q >> 4, z >> 4, s.y);
    o.z = D::pair(q >> 8, z >> 8, s.z);
    o.w = D::pair(q >> 12, z >> 12, s.w);
    *reinterpret_cast<uint4*>(out + (size_t)k * N + 8 * c) = o;
  }
}

// ----------------------------------------------------------------------------- repack

// Word j of lane (g, t) at k-step kt of a strip: nibble i holds W[k][n] of tile
// 2*(j >> 1) + (i & 1) (low nibbles of each byte in the even tile, high ones in the odd), with
// n = strip*64 + 16*tile + g + 8*((i >> 1) & 1) and k = 16*kt + 4t + (i >> 2) + 2*(j & 1)
// (see Dq::frags in awq_dequant.cuh and the K permutation above).
__global__ void awq_repack_kernel(const uint32_t* __restrict__ qweight, uint32_t* __restrict__ out, int K, int N) {
  const int KT = K >> 4;
  const int n8 = N >> 3;
  const size_t total = (size_t)(N / kStripN) * KT * 128;
  for (size_t o = (size_t)blockIdx.x * blockDim.x + threadIdx.x; o < total; o += (size_t)gridDim.x * blockDim.x) {
    const int j = (int)(o & 3);
    const int lane = (int)((o >> 2) & 31);
    const int kt = (int)((o >> 7) % KT);
    const int strip = (int)((o >> 7) / KT);
    uint32_t word = 0;
#pragma unroll
    for (int i = 0; i < 8; ++i) {
      const int k = kt * 16 + 4 * (lane & 3) + (i >> 2) + 2 * (j & 1);
      const int n = strip * kStripN + (2 * (j >> 1) + (i & 1)) * 16 + (lane >> 2) + 8 * ((i >> 1) & 1);
      const uint32_t src = __ldg(qweight + (size_t)k * n8 + (n >> 3));
      const uint32_t q = (src >> (4 * awq_order(n & 7))) & 0xFu;
      word |= q << (4 * i);
    }
    out[o] = word;
  }
}

// The inverse of awq_repack_kernel: one thread per AWQ word (k, c), its 8 values gathered from
// the fragment layout by the same index map.  For the paths that want the AWQ layout from a
// weight held in fragments (dequantize, large M off Hopper): not on a decode path.
__global__ void awq_unrepack_kernel(const uint32_t* __restrict__ packed, uint32_t* __restrict__ qweight, int K,
                                    int N) {
  const int KT = K >> 4;
  const int n8 = N >> 3;
  const size_t total = (size_t)K * n8;
  for (size_t o = (size_t)blockIdx.x * blockDim.x + threadIdx.x; o < total; o += (size_t)gridDim.x * blockDim.x) {
    const int k = (int)(o / n8), c = (int)(o % n8);
    const int kt = k >> 4, kr = k & 15;
    const int t = kr >> 2, jl = (kr >> 1) & 1, ih = kr & 1;
    uint32_t word = 0;
#pragma unroll
    for (int jj = 0; jj < 8; ++jj) {
      const int n = 8 * c + jj, strip = n / kStripN, r = n % kStripN;
      const int lane = 4 * (r & 7) + t, j = 2 * (r >> 5) + jl, i = 4 * ih + 2 * ((r >> 3) & 1) + ((r >> 4) & 1);
      const uint32_t src = __ldg(packed + (((size_t)strip * KT + kt) * 32 + lane) * 4 + j);
      word |= ((src >> (4 * i)) & 0xFu) << (4 * awq_order(jj));
    }
    qweight[o] = word;
  }
}

// ----------------------------------------------------------------------------- host side

int sm_count(int device) { return quantfuse::sm_count(device, 132); }

template <typename T, int NT, int W, bool CLUSTER>
int occupancy_of() {  // both kernels of a shape (batch_groups) have the same bounds and shared memory
  static int cached = 0;
  if (cached == 0) {
    int n = 0;
    if (cudaOccupancyMaxActiveBlocksPerMultiprocessor(&n, awq_gemm_kernel<T, NT, W, CLUSTER, false>, W * 32, 0) !=
            cudaSuccess || n <= 0)
      n = 1;
    cached = n;
  }
  return cached;
}

// Token tiles of 8 per block: 1, 2 or 4 (M > 32 runs several token blocks).
int nt_for(int M) { return M <= 8 ? 1 : (M <= 16 ? 2 : 4); }
// Warps per block: as asked (4, 8, or 16 for one token tile), else chosen.
// * One token tile: 16 (one block per SM, whose warps split the strip's K) while the strips fit
//   in one block per SM, else 4 (more resident blocks to stream with).  A warp's k-steps are a
//   chain of dependent instructions, and with 2 warps per scheduler (4-warp blocks, 2 per SM)
//   the schedulers issue about once in 3.6 cycles (ncu, 4096 x 14336), so the strips of a
//   narrow weight want every warp slot of their SM.  Measured on the H100 at M = 1 (CUDA graph
//   of 32 launches, each on its own weight): 6144 x 4096 9.0 µs against 10.5 with 4-warp blocks
//   in clusters of 4, 4096 x 4096 8.4 against 8.9, 4096 x 14336 (2 splits) 17.2 against 19.9;
//   28672 x 4096 (448 strips) 26.9 with 4-warp blocks against 35.0 with 16.
// * Several token blocks (M > 32): 4.
// * 9 <= M <= 32 (168-255 registers, 1-3 blocks per SM): 8, unless the strips alone already
//   give two blocks per SM (4096 x 14336, M = 32: 33 µs with 8 warps against 46 with 4).
int warps_for(int warps, int M, int N, int device) {
  if (warps == 4 || warps == 8 || (warps == 16 && nt_for(M) == 1)) return warps;
  if (nt_for(M) == 1) return N / kStripN <= sm_count(device) ? 16 : 4;
  if (M > 32) return 4;
  return N / kStripN >= 2 * sm_count(device) ? 4 : 8;
}

template <typename T, int W>
int occupancy(int nt) {
  if constexpr (W == 16) {  // one token tile only (warps_for): no other kernel of 16 warps exists
    return occupancy_of<T, 1, 16, false>();
  } else {
    return nt == 1 ? occupancy_of<T, 1, W, false>() : (nt == 2 ? occupancy_of<T, 2, W, false>()
                                                               : occupancy_of<T, 4, W, false>());
  }
}

// Memory-bound: one wave of resident blocks, each streaming a contiguous K range.  K is split
// over blocks (a power of two, at most kMaxCluster) while the blocks fill at most 3/4 of the
// GPU's block slots (all of them for 8- and 16-warp blocks, of which 1-2 fit per SM) and each
// warp keeps at least 8 k-steps (16 in 16-warp blocks): on the H100, more and shorter splits
// measured slower (cluster scheduling, per-warp pipeline fill; 4096 x 4096 at M = 1 in 16-warp
// blocks: 8.4 µs unsplit, 8.7-8.9 with 2 splits of 8 k-steps per warp).
template <typename T>
int splits_for(int M, int N, int K, int device, int warps) {
  const int W = warps_for(warps, M, N, device);
  const int nt = nt_for(M);
  const int occ = W == 16 ? occupancy<T, 16>(nt) : (W == 8 ? occupancy<T, 8>(nt) : occupancy<T, 4>(nt));
  const int blocks = (N / kStripN) * ((M + 8 * nt - 1) / (8 * nt));
  const int slots = sm_count(device) * occ;
  const int budget = W == 4 ? slots * 3 / 4 : slots;
  const int min_steps = W == 16 ? 16 : 8;
  const int steps = K / 16;
  int s = 1;
  while (s * 2 <= kMaxCluster && blocks * s * 2 <= budget && steps / (s * 2 * W) >= min_steps) s *= 2;
  return s;
}

// After a split-K launch without a cluster: sums the fp32 partials (and adds the bias).
template <typename T>
cudaError_t reduce_splits(cudaError_t launched, const float* partial, const T* bias, T* out, int M, int N, int splits,
                          cudaStream_t stream) {
  if (launched != cudaSuccess || splits <= 1) return launched;
  const size_t quads = (size_t)M * N / 4;
  const int threads = 256;
  splitk_reduce_kernel<T><<<(unsigned)((quads + threads - 1) / threads), threads, 0, stream>>>(partial, bias, out, M,
                                                                                            N, splits);
  return cudaGetLastError();
}

// The kernel for a group size (batch_groups).
template <typename T, int NT, int W, bool CLUSTER>
auto kernel_for(int group_size) {
  if constexpr (batch_groups_kernel(NT, W))
    if (batch_groups(NT, W, group_size)) return awq_gemm_kernel<T, NT, W, CLUSTER, true>;
  return awq_gemm_kernel<T, NT, W, CLUSTER, false>;
}

template <typename T, int NT, int W>
cudaError_t run_gemm(const void* x, const uint32_t* wp, const void* scales, const uint32_t* qzeros,
                     const void* bias, void* out, float* partial, int M, int N, int K, int group_size, int splits,
                     bool cluster, bool pdl, cudaStream_t stream) {
  const dim3 grid(splits, N / kStripN, (M + 8 * NT - 1) / (8 * NT));
  const T* xp = static_cast<const T*>(x);
  const uint4* wq = reinterpret_cast<const uint4*>(wp);
  const T* sp = static_cast<const T*>(scales);
  const T* bp = static_cast<const T*>(bias);
  T* op = static_cast<T*>(out);
  const int early = pdl ? pdl_early() : kPdlEarlyNone;
  if (splits > 1 && cluster) {
    const ClusterLaunch launch(grid, dim3(W * 32), 0, stream, splits, pdl);
    return cudaLaunchKernelEx(&launch.cfg, kernel_for<T, NT, W, true>(group_size), xp, wq, sp, qzeros, bp, op,
                              static_cast<float*>(nullptr), M, N, K, group_size, early);
  }
  const ClusterLaunch launch(grid, dim3(W * 32), 0, stream, 1, pdl);
  float* part = splits > 1 ? partial : nullptr;
  return reduce_splits<T>(cudaLaunchKernelEx(&launch.cfg, kernel_for<T, NT, W, false>(group_size), xp, wq, sp, qzeros, bp,
                                             op, part, M, N, K, group_size, early),
                          partial, bp, op, M, N, splits, stream);
}

template <typename T, int W>
cudaError_t gemm_warps(const void* x, const uint32_t* wp, const void* scales, const uint32_t* qzeros,
                       const void* bias, void* out, float* partial, int M, int N, int K, int group_size, int splits,
                       bool cluster, bool pdl, cudaStream_t stream) {
  switch (nt_for(M)) {
    case 1: return run_gemm<T, 1, W>(x, wp, scales, qzeros, bias, out, partial, M, N, K, group_size, splits, cluster, pdl, stream);
    case 2: return run_gemm<T, 2, W>(x, wp, scales, qzeros, bias, out, partial, M, N, K, group_size, splits, cluster, pdl, stream);
    default: return run_gemm<T, 4, W>(x, wp, scales, qzeros, bias, out, partial, M, N, K, group_size, splits, cluster, pdl, stream);
  }
}

template <typename T>
cudaError_t gemm_dtype(const void* x, const uint32_t* wp, const void* scales, const uint32_t* qzeros,
                       const void* bias, void* out, float* partial, int M, int N, int K, int group_size, int splits,
                       int warps, bool cluster, bool pdl, int device, cudaStream_t stream) {
  const int W = warps_for(warps, M, N, device);
  if (W == 16)  // one token tile only (warps_for)
    return run_gemm<T, 1, 16>(x, wp, scales, qzeros, bias, out, partial, M, N, K, group_size, splits, cluster, pdl, stream);
  if (W == 8)
    return gemm_warps<T, 8>(x, wp, scales, qzeros, bias, out, partial, M, N, K, group_size, splits, cluster, pdl, stream);
  return gemm_warps<T, 4>(x, wp, scales, qzeros, bias, out, partial, M, N, K, group_size, splits, cluster, pdl, stream);
}

unsigned grid_for(size_t work, int threads) {
  size_t blocks = (work + threads - 1) / threads;
  const size_t cap = 132 * 32;
  return (unsigned)(blocks < cap ? (blocks > 0 ? blocks : 1) : cap);
}

}  // namespace

cudaError_t launch_repack(const uint32_t* qweight, uint32_t* out, int K, int N, cudaStream_t stream) {
  const size_t total = (size_t)(N / kStripN) * (K / 16) * 128;
  awq_repack_kernel<<<grid_for(total, 256), 256, 0, stream>>>(qweight, out, K, N);
  return cudaGetLastError();
}

cudaError_t launch_unrepack(const uint32_t* packed, uint32_t* qweight, int K, int N, cudaStream_t stream) {
  const size_t total = (size_t)K * (N / 8);
  awq_unrepack_kernel<<<grid_for(total, 256), 256, 0, stream>>>(packed, qweight, K, N);
  return cudaGetLastError();
}

cudaError_t launch_dequantize(DType dtype, const uint32_t* qweight, const void* scales, const uint32_t* qzeros,
                              void* out, int K, int N, int group_size, cudaStream_t stream) {
  const size_t total = (size_t)K * (N / 8);
  const unsigned grid = grid_for(total, 256);
  if (dtype == DType::kHalf)
    awq_dequantize_kernel<__half><<<grid, 256, 0, stream>>>(qweight, static_cast<const __half*>(scales), qzeros,
                                                            static_cast<__half*>(out), K, N, group_size);
  else
    awq_dequantize_kernel<__nv_bfloat16><<<grid, 256, 0, stream>>>(
        qweight, static_cast<const __nv_bfloat16*>(scales), qzeros, static_cast<__nv_bfloat16*>(out), K, N,
        group_size);
  return cudaGetLastError();
}

int gemm_splits(DType dtype, int M, int N, int K, int device, int warps) {
  return dtype == DType::kHalf ? splits_for<__half>(M, N, K, device, warps)
                               : splits_for<__nv_bfloat16>(M, N, K, device, warps);
}

bool gemm_folds(int M, int N, int device, int warps) { return fold_path(nt_for(M), warps_for(warps, M, N, device)); }

bool gemm_needs_workspace(int splits, int device, bool allow_cluster) {
  return splits > 1 && !(allow_cluster && cluster_launch(device));
}

cudaError_t launch_gemm(DType dtype, const void* x, const uint32_t* wpacked, const void* scales,
                        const uint32_t* qzeros, const void* bias, void* out, float* partial, int M, int N, int K,
                        int group_size, int splits, int warps, int device, bool allow_cluster, bool pdl,
                        cudaStream_t stream) {
  if (M <= 0) return cudaSuccess;
  if (splits < 1 || splits > kMaxCluster) return cudaErrorInvalidValue;
  const bool cluster = splits > 1 && !gemm_needs_workspace(splits, device, allow_cluster);
  if (splits > 1 && !cluster && partial == nullptr) return cudaErrorInvalidValue;
  if (dtype == DType::kHalf)
    return gemm_dtype<__half>(x, wpacked, scales, qzeros, bias, out, partial, M, N, K, group_size, splits, warps,
                              cluster, pdl, device, stream);
  return gemm_dtype<__nv_bfloat16>(x, wpacked, scales, qzeros, bias, out, partial, M, N, K, group_size, splits,
                                   warps, cluster, pdl, device, stream);
}

}  // namespace awq
}  // namespace quantfuse
