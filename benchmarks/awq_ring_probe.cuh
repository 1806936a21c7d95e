// Probe only (benchmarks/awq_stream_probe.cu, PROBE_RING=1): the AWQ decode GEMM with a
// producer warp that streams each block's weights into a shared-memory ring (bulk copies,
// mbarriers) and four consumer warps that dequantize and multiply from it.  Written and measured
// in session 7 against the register kernel (csrc/awq_gemm/awq_gemm_kernels.cu) and not adopted:
// slower on every shape, see benchmarks/notes_awq.md.  sm_90 only; included after the kernel
// file (uses its Dq, store_strip, reduce_splits and sm_count).
//
// Block: kRingConsumers consumer warps + 1 producer warp, one 64-row strip of N and a contiguous
// range of K (K split over a cluster, or a workspace, as the register kernel).  A slot holds
// kRingSteps k-steps (16 x 512 B of weights, contiguous per strip in the repacked layout), the
// block's activation rows for those k, and the scales and packed zeros of the quantization groups
// they span; consumer warp w takes the slot's k-steps [kRingPerWarp * w, kRingPerWarp * (w + 1)).
// Knobs: -DQF_RING_PER_WARP=n, -DQF_RING_SKIP_MATH (consumers only release slots: the ring's own
// throughput).
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

namespace quantfuse {
namespace awq {

// ----------------------------------------------------------------------------- ring primitives

__device__ __forceinline__ uint32_t smem_addr(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

// Initializes n barriers that each complete a phase after `arrivals` arrivals (and the bytes
// announced with expect_tx).  One thread calls it; a __syncthreads() must follow.
__device__ __forceinline__ void mbar_init(uint64_t* bars, int n, int arrivals) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  for (int i = 0; i < n; ++i)
    asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(smem_addr(&bars[i])), "r"(arrivals));
  // makes the initialized barriers visible to the async proxy (the bulk copies)
  asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
#endif
}

// One arrival that also announces `bytes` still to land through bulk copies on this phase.
__device__ __forceinline__ void mbar_arrive_expect_tx(uint64_t* bar, uint32_t bytes) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(smem_addr(bar)), "r"(bytes)
               : "memory");
#endif
}

__device__ __forceinline__ void mbar_arrive(uint64_t* bar) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];" ::"r"(smem_addr(bar)) : "memory");
#endif
}

// Waits until the phase with this parity (0 for the first, then alternating) has completed.
// The suspend-time hint lets the warp sleep in try_wait until the phase completes instead of
// spinning: a spinning producer or consumer takes issue slots from the warps doing the math.
__device__ __forceinline__ void mbar_wait(uint64_t* bar, uint32_t parity) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  constexpr uint32_t kSuspendNs = 0x989680;  // an upper bound; the wait ends with the phase
  uint32_t done = 0;
  while (!done)
    asm volatile(
        "{ .reg .pred p; mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2, %3; selp.u32 %0, 1, 0, p; }"
        : "=r"(done)
        : "r"(smem_addr(bar)), "r"(parity), "n"(kSuspendNs)
        : "memory");
#endif
}

// bytes (a multiple of 16; both addresses 16-byte aligned) from global src to this block's
// shared dst; completion is counted on bar, whose phase must have announced them.
__device__ __forceinline__ void bulk_g2s(void* dst, const void* src, uint32_t bytes, uint64_t* bar) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];" ::"r"(
                   smem_addr(dst)),
               "l"(src), "r"(bytes), "r"(smem_addr(bar))
               : "memory");
#endif
}

// 16 bytes from global to shared (cp.async.cg: through L2 only); both 16-byte aligned.
__device__ __forceinline__ void cp_async_16(void* dst, const void* src) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" ::"r"(smem_addr(dst)), "l"(src) : "memory");
#endif
}

// One arrival on bar once every cp.async this thread issued before has landed (.noinc: the
// barrier's expected arrivals must count it).
__device__ __forceinline__ void mbar_arrive_cp_async(uint64_t* bar) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("cp.async.mbarrier.arrive.noinc.shared::cta.b64 [%0];" ::"r"(smem_addr(bar)) : "memory");
#endif
}

// ----------------------------------------------------------------------------- kernel

constexpr int kRingConsumers = 4;
constexpr int kRingThreads = (kRingConsumers + 1) * 32;
#ifndef QF_RING_PER_WARP
#define QF_RING_PER_WARP 4
#endif
constexpr int kRingPerWarp = QF_RING_PER_WARP;                // k-steps per consumer warp per slot
constexpr int kRingSteps = kRingConsumers * kRingPerWarp;    // k-steps per slot
constexpr int kRingSlotK = kRingSteps * 16;                   // K per slot
constexpr int kRingMaxStages = 8;
// Shared memory per block the stages may fill: 4 blocks (20 warps) per SM on the H100's 228 KB.
constexpr int kRingSmemBudget = 55 * 1024;
constexpr int kRingBlocksPerSm = 4;

// A slot starts at a multiple of kRingSlotK, so it spans whole groups (group sizes dividing
// kRingSlotK) or lies inside one (multiples of it); other group sizes use the register kernel.
__host__ __device__ constexpr bool ring_takes_group(int group_size) {
  return group_size > 0 && group_size % 16 == 0 && (kRingSlotK % group_size == 0 || group_size % kRingSlotK == 0);
}

// Byte layout of one stage (every offset and size a multiple of 16, as bulk copies need).
struct RingStage {
  int rows;     // activation rows staged: the block's tokens, at most 8 * NT
  int groups;   // quantization groups a slot spans
  int xstride;  // bytes per staged activation row: 16 more than the row, so the 8 rows of a
                // B fragment fall in distinct banks
  int x_off, s_off, z_off, bytes;
};

__host__ __device__ inline RingStage ring_stage(int nt, int M, int group_size) {
  RingStage r;
  r.rows = M < 8 * nt ? M : 8 * nt;
  r.groups = group_size >= kRingSlotK ? 1 : kRingSlotK / group_size;
  r.xstride = kRingSteps * 32 + 16;
  r.x_off = kRingSteps * 512;
  r.s_off = r.x_off + r.rows * r.xstride;
  r.z_off = r.s_off + r.groups * kStripN * 2;
  r.bytes = r.z_off + r.groups * (kStripN / 8) * 4;
  return r;
}

// Dynamic shared memory: the reduction buffer, full[stages] and empty[stages], the stages.
__host__ __device__ inline int ring_head_bytes(int nt, int stages) { return red_floats(nt) * 4 + 16 * stages; }
__host__ __device__ inline int ring_smem_bytes(int nt, int M, int group_size, int stages) {
  return ring_head_bytes(nt, stages) + stages * ring_stage(nt, M, group_size).bytes;
}
// As many stages as fit the budget (at least 2).
__host__ __device__ inline int ring_stages(int nt, int M, int group_size) {
  const int stage = ring_stage(nt, M, group_size).bytes;
  int s = (kRingSmemBudget - ring_head_bytes(nt, kRingMaxStages)) / stage;
  return s < 2 ? 2 : (s > kRingMaxStages ? kRingMaxStages : s);
}

template <typename T, int NT, bool CLUSTER>
__global__ void __launch_bounds__(kRingThreads, kRingBlocksPerSm) awq_gemm_ring_kernel(
    const T* __restrict__ x, const uint4* __restrict__ wp, const T* __restrict__ scales,
    const uint32_t* __restrict__ qzeros, const T* __restrict__ bias, T* __restrict__ out,
    float* __restrict__ partial, int M, int N, int K, int group_size, int stages) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  using D = Dq<T>;
  using Row = typename D::Row;
  extern __shared__ __align__(128) uint8_t smem[];
  float* red = reinterpret_cast<float*>(smem);
  uint64_t* full = reinterpret_cast<uint64_t*>(smem + red_floats(NT) * 4);
  uint64_t* empty = full + stages;
  uint8_t* ring = smem + ring_head_bytes(NT, stages);
  const RingStage L = ring_stage(NT, M, group_size);

  const int splits = gridDim.x;
  const int split = blockIdx.x;
  const int strip = blockIdx.y;
  const int m0 = blockIdx.z * 8 * NT;
  const int mb = min(8 * NT, M - m0);  // tokens of this block
  const int warp = threadIdx.x >> 5;
  const int lane = threadIdx.x & 31;
  const int KT = K >> 4;
  // block K ranges start on slot boundaries
  const int per_block = ((KT + splits - 1) / splits + kRingSteps - 1) / kRingSteps * kRingSteps;
  const int kb = min(KT, split * per_block);
  const int ke = min(KT, kb + per_block);
  const int slots = (ke - kb + kRingSteps - 1) / kRingSteps;

  for (int i = threadIdx.x; i < red_floats(NT); i += kRingThreads) red[i] = 0.0f;
  if (threadIdx.x == 0) {
    mbar_init(full, stages, 33);  // producer lane 0's arrive with the weights' bytes, and one
                                  // arrive per producer lane once its cp.async pieces land
    mbar_init(empty, stages, kRingConsumers);  // one arrive per consumer warp
  }
  __syncthreads();

  if (warp == kRingConsumers) {
    // Producer: refills a stage once the consumers have released it.
    const char* wsrc = reinterpret_cast<const char*>(wp + (size_t)strip * KT * 32);
    int st = 0;
    uint32_t parity = 0;  // of the empty phase to wait for, once the ring has wrapped
    for (int i = 0; i < slots; ++i) {
      if (i >= stages) mbar_wait(&empty[st], parity);
      const int k0 = kb + i * kRingSteps;  // first k-step of the slot
      const int n = min(kRingSteps, ke - k0);
      const int g0 = (k0 * 16) / group_size;
      const int ng = group_size >= kRingSlotK ? 1 : (n * 16 + group_size - 1) / group_size;
      uint8_t* slot = ring + st * L.bytes;
      // The weights: one bulk copy by lane 0, counted in bytes.  The activations, scales and
      // zeros: small pieces, so 16-byte cp.async by every lane, counted as one arrival per lane.
      // Bulk copies have a fixed cost each: with the 16 activation rows of M = 16 as 16 more bulk
      // copies per 8 KB slot, the ring alone (no math) took 37.8 instead of 28.3 us on 28672 x
      // 4096 (H100; benchmarks/notes_awq.md, session 7).
      if (lane == 0) {
        mbar_arrive_expect_tx(&full[st], (uint32_t)(n * 512));
        bulk_g2s(slot, wsrc + (size_t)k0 * 512, n * 512, &full[st]);
      }
      const int xc = mb * 2 * n;                    // 16-byte pieces of activations
      const int sc = ng * (kStripN * 2 / 16);       // of scales
      const int pieces = xc + sc + ng * 2;          // and of zeros
      for (int c = lane; c < pieces; c += 32) {
        if (c < xc) {
          const int r = c / (2 * n), col = c - r * 2 * n;
          cp_async_16(slot + L.x_off + r * L.xstride + col * 16, x + (size_t)(m0 + r) * K + k0 * 16 + col * 8);
        } else if (c < xc + sc) {
          const int gi = (c - xc) >> 3, col = (c - xc) & 7;
          cp_async_16(slot + L.s_off + gi * kStripN * 2 + col * 16,
                      scales + (size_t)(g0 + gi) * N + strip * kStripN + col * 8);
        } else {
          const int gi = (c - xc - sc) >> 1, col = (c - xc - sc) & 1;
          cp_async_16(slot + L.z_off + gi * 32 + col * 16,
                      qzeros + (size_t)(g0 + gi) * (N / 8) + strip * (kStripN / 8) + col * 4);
        }
      }
      mbar_arrive_cp_async(&full[st]);
      if (++st == stages) {
        st = 0;
        if (i >= stages) parity ^= 1u;
      }
    }
  } else {
    const int g = lane >> 2;
    const int t = lane & 3;
    const int zshift = 4 * awq_order(g);
    // log2 of k-steps per group when groups are smaller than a slot (then a power of two)
    const int gshift = group_size >= kRingSlotK ? 0 : 31 - __clz(group_size >> 4);
    float acc[kTiles][NT][4];
#pragma unroll
    for (int j = 0; j < kTiles; ++j)
#pragma unroll
      for (int nt = 0; nt < NT; ++nt)
#pragma unroll
        for (int i = 0; i < 4; ++i) acc[j][nt][i] = 0.0f;
    // Activation row of B-fragment column g in token tile nt; rows past the block's tokens read
    // row 0 and are zeroed (their outputs are never stored).
    int xoff[NT];
    bool xvalid[NT];
#pragma unroll
    for (int nt = 0; nt < NT; ++nt) {
      const int r = nt * 8 + g;
      xvalid[nt] = r < mb;
      xoff[nt] = L.x_off + (xvalid[nt] ? r : 0) * L.xstride + 8 * t;
    }
    Row rows[kTiles][2];
    int cur = -1;  // group whose rows are built
    const int s0 = warp * kRingPerWarp;
    // The warp's kRingPerWarp steps lie in one group unless groups are shorter than that.
    const bool one_group = group_size >= kRingPerWarp * 16;
    auto build_rows = [&](const uint8_t* slot, int gl) {
      const uint16_t* sp = reinterpret_cast<const uint16_t*>(slot + L.s_off + gl * kStripN * 2) + g;
      const uint32_t* zp = reinterpret_cast<const uint32_t*>(slot + L.z_off + gl * 32);
#pragma unroll
      for (int j = 0; j < kTiles; ++j)
#pragma unroll
        for (int h = 0; h < 2; ++h)  // row 16j + g + 8h: packed word 2j + h, nibble awq_order(g)
          rows[j][h] = D::make(sp[16 * j + 8 * h], (zp[2 * j + h] >> zshift) & 0xFu);
    };
    auto step = [&](const uint8_t* slot, int s) {
      const uint4 w = *reinterpret_cast<const uint4*>(slot + s * 512 + lane * 16);
      uint32_t b[NT][2];
#pragma unroll
      for (int nt = 0; nt < NT; ++nt) {
        const uint2 v = *reinterpret_cast<const uint2*>(slot + xoff[nt] + s * 32);
        b[nt][0] = xvalid[nt] ? v.x : 0u;
        b[nt][1] = xvalid[nt] ? v.y : 0u;
      }
      const uint32_t words[kTiles] = {w.x, w.y, w.z, w.w};
#pragma unroll
      for (int j = 0; j < kTiles; ++j) {
        uint32_t a[4];
        D::frag(words[j], rows[j][0], rows[j][1], a);
#pragma unroll
        for (int nt = 0; nt < NT; ++nt) D::mma(acc[j][nt], a, b[nt]);
      }
    };
    int st = 0;
    uint32_t parity = 0;
    for (int i = 0; i < slots; ++i) {
      mbar_wait(&full[st], parity);
      const int k0 = kb + i * kRingSteps;
      const int n = min(kRingSteps, ke - k0);
      const int g0 = (k0 * 16) / group_size;
      const uint8_t* slot = ring + st * L.bytes;
#ifndef QF_RING_SKIP_MATH  // probe knob: the ring's own throughput, consumers only release slots
      if (one_group && n == kRingSteps) {
        // the common case, branch-free across the steps so their loads and math interleave
        const int gl = group_size >= kRingSlotK ? 0 : s0 >> gshift;  // group within the slot
        if (g0 + gl != cur) {
          cur = g0 + gl;
          build_rows(slot, gl);
        }
#pragma unroll
        for (int u = 0; u < kRingPerWarp; ++u) step(slot, s0 + u);
      } else {
        for (int s = s0; s < min(n, s0 + kRingPerWarp); ++s) {
          const int gl = group_size >= kRingSlotK ? 0 : s >> gshift;
          if (g0 + gl != cur) {
            cur = g0 + gl;
            build_rows(slot, gl);
          }
          step(slot, s);
        }
      }
#endif
      __syncwarp();  // every lane has read the slot
      if (lane == 0) mbar_arrive(&empty[st]);
      if (++st == stages) {
        st = 0;
        parity ^= 1u;
      }
    }
    add_to_red<NT>(red, acc, lane);
  }
  __syncthreads();
  store_strip<T, CLUSTER, kRingThreads>(red, bias, out, partial, M, N, m0, mb);
#endif
}

// ----------------------------------------------------------------------------- host

// The ring kernel's shared memory exceeds the 48 KB default: raise the limit once per kernel
// and device.
template <typename T, int NT, bool CLUSTER>
cudaError_t allow_ring_smem(int device) {
  static bool done[64] = {false};  // one per instantiation of this template, i.e. per kernel
  if (device >= 0 && device < 64 && done[device]) return cudaSuccess;
  const int most = kRingSmemBudget + ring_head_bytes(4, kRingMaxStages);
  const cudaError_t err = cudaFuncSetAttribute(awq_gemm_ring_kernel<T, NT, CLUSTER>,
                                               cudaFuncAttributeMaxDynamicSharedMemorySize, most);
  if (err == cudaSuccess && device >= 0 && device < 64) done[device] = true;
  return err;
}

template <typename T, int NT>
cudaError_t run_ring(const void* x, const uint32_t* wp, const void* scales, const uint32_t* qzeros, const void* bias,
                     void* out, float* partial, int M, int N, int K, int group_size, int splits, bool cluster,
                     int device, cudaStream_t stream) {
  const dim3 grid(splits, N / kStripN, (M + 8 * NT - 1) / (8 * NT));
  const int stages = ring_stages(NT, M, group_size);
  const size_t smem = (size_t)ring_smem_bytes(NT, M, group_size, stages);
  const T* xp = static_cast<const T*>(x);
  const uint4* wq = reinterpret_cast<const uint4*>(wp);
  const T* sp = static_cast<const T*>(scales);
  const T* bp = static_cast<const T*>(bias);
  T* op = static_cast<T*>(out);
  if (splits > 1 && cluster) {
    cudaError_t err = allow_ring_smem<T, NT, true>(device);
    if (err != cudaSuccess) return err;
    const ClusterLaunch launch(grid, dim3(kRingThreads), smem, stream, splits);
    return cudaLaunchKernelEx(&launch.cfg, awq_gemm_ring_kernel<T, NT, true>, xp, wq, sp, qzeros, bp, op,
                              static_cast<float*>(nullptr), M, N, K, group_size, stages);
  }
  cudaError_t err = allow_ring_smem<T, NT, false>(device);
  if (err != cudaSuccess) return err;
  awq_gemm_ring_kernel<T, NT, false><<<grid, kRingThreads, smem, stream>>>(
      xp, wq, sp, qzeros, bp, op, splits > 1 ? partial : nullptr, M, N, K, group_size, stages);
  return reduce_splits<T>(cudaGetLastError(), partial, bp, op, M, N, splits, stream);
}

// ----------------------------------------------------------------------------- v3

// v3: the ring carries only the weights (one 16 KB bulk copy per stage, 32 k-steps), since every
// extra copy slowed v1/v2; consumer warp w takes 8 consecutive k-steps of a stage (one group of
// 128, so one rows build per stage) and loads its activations (L1) and the next stage's scales
// and zeros (prefetched a stage ahead, as the register kernel does) from global memory.
// Group sizes: multiples of 128.
constexpr int kR3Steps = 32;  // k-steps per stage, split over the C consumer warps
constexpr int kR3Stages = 3;

template <typename T>
struct R3Raw {
  uint4 z[2];
  uint32_t s[kTiles][2];
};

template <typename T, int NT, bool CLUSTER, int C>
__global__ void __launch_bounds__((C + 1) * 32, C == 8 ? 2 : kRingBlocksPerSm) awq_gemm_ring3_kernel(
    const T* __restrict__ x, const uint4* __restrict__ wp, const T* __restrict__ scales,
    const uint32_t* __restrict__ qzeros, const T* __restrict__ bias, T* __restrict__ out,
    float* __restrict__ partial, int M, int N, int K, int group_size) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  constexpr int kR3PerWarp = kR3Steps / C;
  constexpr int kThreads = (C + 1) * 32;
  using D = Dq<T>;
  using Row = typename D::Row;
  extern __shared__ __align__(128) uint8_t smem[];
  float* red = reinterpret_cast<float*>(smem);
  uint64_t* full = reinterpret_cast<uint64_t*>(smem + red_floats(NT) * 4);
  uint64_t* empty = full + kR3Stages;
  uint8_t* ring = smem + ring_head_bytes(NT, kR3Stages);
  const int splits = gridDim.x;
  const int split = blockIdx.x;
  const int strip = blockIdx.y;
  const int m0 = blockIdx.z * 8 * NT;
  const int mb = min(8 * NT, M - m0);
  const int warp = threadIdx.x >> 5;
  const int lane = threadIdx.x & 31;
  const int KT = K >> 4;
  const int per_block = ((KT + splits - 1) / splits + kR3Steps - 1) / kR3Steps * kR3Steps;
  const int kb = min(KT, split * per_block);
  const int ke = min(KT, kb + per_block);
  const int slots = (ke - kb + kR3Steps - 1) / kR3Steps;
  for (int i = threadIdx.x; i < red_floats(NT); i += kThreads) red[i] = 0.0f;
  if (threadIdx.x == 0) {
    mbar_init(full, kR3Stages, 1);
    mbar_init(empty, kR3Stages, C);
  }
  __syncthreads();
  if (warp == C) {
    if (lane == 0) {
      const char* wsrc = reinterpret_cast<const char*>(wp + (size_t)strip * KT * 32);
      int st = 0;
      uint32_t parity = 0;
      for (int i = 0; i < slots; ++i) {
        if (i >= kR3Stages) mbar_wait(&empty[st], parity);
        const int k0 = kb + i * kR3Steps;
        const int n = min(kR3Steps, ke - k0);
        mbar_arrive_expect_tx(&full[st], (uint32_t)(n * 512));
        bulk_g2s(ring + st * kR3Steps * 512, wsrc + (size_t)k0 * 512, n * 512, &full[st]);
        if (++st == kR3Stages) {
          st = 0;
          if (i >= kR3Stages) parity ^= 1u;
        }
      }
    }
  } else {
    const int g = lane >> 2;
    const int t = lane & 3;
    const int zshift = 4 * awq_order(g);
    float acc[kTiles][NT][4];
#pragma unroll
    for (int j = 0; j < kTiles; ++j)
#pragma unroll
      for (int nt = 0; nt < NT; ++nt)
#pragma unroll
        for (int i = 0; i < 4; ++i) acc[j][nt][i] = 0.0f;
    const T* xrow[NT];
#pragma unroll
    for (int nt = 0; nt < NT; ++nt) {
      const int m = m0 + nt * 8 + g;
      xrow[nt] = nt * 8 + g < mb ? x + (size_t)m * K + 4 * t : nullptr;
    }
    const uint16_t* s_lane = reinterpret_cast<const uint16_t*>(scales) + strip * kStripN + g;
    const uint4* z_strip = reinterpret_cast<const uint4*>(qzeros + strip * (kStripN / 8));
    auto load_group = [&](int grp, R3Raw<T>& r) {
      const uint4* zp = z_strip + (size_t)grp * (N >> 5);
      r.z[0] = __ldg(zp);
      r.z[1] = __ldg(zp + 1);
      const uint16_t* sp = s_lane + (size_t)grp * N;
#pragma unroll
      for (int j = 0; j < kTiles; ++j) {
        r.s[j][0] = __ldg(sp + 16 * j);
        r.s[j][1] = __ldg(sp + 16 * j + 8);
      }
    };
    Row rows[kTiles][2];
    const int s0 = warp * kR3PerWarp;
    auto grp_of = [&](int i) { return ((kb + i * kR3Steps + s0) * 16) / group_size; };
    R3Raw<T> raw;
    int cur = -1;
    if (slots > 0 && s0 < min(kR3Steps, ke - kb)) load_group(grp_of(0), raw);
    int st = 0;
    uint32_t parity = 0;
    for (int i = 0; i < slots; ++i) {
      const int k0 = kb + i * kR3Steps;
      const int n = min(kR3Steps, ke - k0);
      const bool active = s0 < n;
      uint32_t b[kR3PerWarp][NT][2];
#pragma unroll
      for (int u = 0; u < kR3PerWarp; ++u)
#pragma unroll
        for (int nt = 0; nt < NT; ++nt) {
          uint2 v = make_uint2(0u, 0u);
          if (xrow[nt] != nullptr && s0 + u < n) v = __ldg(reinterpret_cast<const uint2*>(xrow[nt] + ((k0 + s0 + u) << 4)));
          b[u][nt][0] = v.x;
          b[u][nt][1] = v.y;
        }
      if (active) {
        const int gh = grp_of(i);
        if (gh != cur) {
          cur = gh;
          const uint32_t zw[8] = {raw.z[0].x, raw.z[0].y, raw.z[0].z, raw.z[0].w,
                                  raw.z[1].x, raw.z[1].y, raw.z[1].z, raw.z[1].w};
#pragma unroll
          for (int j = 0; j < kTiles; ++j)
#pragma unroll
            for (int h = 0; h < 2; ++h) rows[j][h] = D::make(raw.s[j][h], (zw[2 * j + h] >> zshift) & 0xFu);
        }
        if (i + 1 < slots && s0 < min(kR3Steps, ke - k0 - kR3Steps)) {
          const int gn = grp_of(i + 1);
          if (gn != cur) load_group(gn, raw);
        }
      }
      mbar_wait(&full[st], parity);
#ifndef QF_RING_SKIP_MATH
      if (active) {
        const uint8_t* slot = ring + st * kR3Steps * 512;
        if (s0 + kR3PerWarp <= n) {
#pragma unroll
          for (int u = 0; u < kR3PerWarp; ++u) {
            const uint4 w = *reinterpret_cast<const uint4*>(slot + (s0 + u) * 512 + lane * 16);
            const uint32_t words[kTiles] = {w.x, w.y, w.z, w.w};
#pragma unroll
            for (int j = 0; j < kTiles; ++j) {
              uint32_t a[4];
              D::frag(words[j], rows[j][0], rows[j][1], a);
#pragma unroll
              for (int nt = 0; nt < NT; ++nt) D::mma(acc[j][nt], a, b[u][nt]);
            }
          }
        } else {
#pragma unroll
          for (int u = 0; u < kR3PerWarp; ++u)
            if (s0 + u < n) {
              const uint4 w = *reinterpret_cast<const uint4*>(slot + (s0 + u) * 512 + lane * 16);
              const uint32_t words[kTiles] = {w.x, w.y, w.z, w.w};
#pragma unroll
              for (int j = 0; j < kTiles; ++j) {
                uint32_t a[4];
                D::frag(words[j], rows[j][0], rows[j][1], a);
#pragma unroll
                for (int nt = 0; nt < NT; ++nt) D::mma(acc[j][nt], a, b[u][nt]);
              }
            }
        }
      }
#endif
      __syncwarp();
      if (lane == 0) mbar_arrive(&empty[st]);
      if (++st == kR3Stages) {
        st = 0;
        parity ^= 1u;
      }
    }
    add_to_red<NT>(red, acc, lane);
  }
  __syncthreads();
  store_strip<T, CLUSTER, kThreads>(red, bias, out, partial, M, N, m0, mb);
#endif
}

template <typename T, int NT, int C>
cudaError_t run_ring3(const void* x, const uint32_t* wp, const void* scales, const uint32_t* qzeros, const void* bias,
                      void* out, float* partial, int M, int N, int K, int group_size, int splits, bool cluster,
                      cudaStream_t stream) {
  const dim3 grid(splits, N / kStripN, (M + 8 * NT - 1) / (8 * NT));
  const int smem = ring_head_bytes(NT, kR3Stages) + kR3Stages * kR3Steps * 512;
  const T* xp = static_cast<const T*>(x);
  const uint4* wq = reinterpret_cast<const uint4*>(wp);
  const T* sp = static_cast<const T*>(scales);
  const T* bp = static_cast<const T*>(bias);
  T* op = static_cast<T*>(out);
  if (splits > 1 && cluster) {
    cudaError_t err = cudaFuncSetAttribute(awq_gemm_ring3_kernel<T, NT, true, C>,
                                           cudaFuncAttributeMaxDynamicSharedMemorySize, smem);
    if (err != cudaSuccess) return err;
    const ClusterLaunch launch(grid, dim3((C + 1) * 32), smem, stream, splits);
    return cudaLaunchKernelEx(&launch.cfg, awq_gemm_ring3_kernel<T, NT, true, C>, xp, wq, sp, qzeros, bp, op,
                              static_cast<float*>(nullptr), M, N, K, group_size);
  }
  cudaError_t err = cudaFuncSetAttribute(awq_gemm_ring3_kernel<T, NT, false, C>,
                                         cudaFuncAttributeMaxDynamicSharedMemorySize, smem);
  if (err != cudaSuccess) return err;
  awq_gemm_ring3_kernel<T, NT, false, C><<<grid, (C + 1) * 32, smem, stream>>>(
      xp, wq, sp, qzeros, bp, op, splits > 1 ? partial : nullptr, M, N, K, group_size);
  return reduce_splits<T>(cudaGetLastError(), partial, bp, op, M, N, splits, stream);
}

cudaError_t launch_ring3(const void* x, const uint32_t* wp, const void* scales, const uint32_t* qzeros,
                         const void* bias, void* out, float* partial, int M, int N, int K, int group_size, int splits,
                         bool cluster, int consumers, cudaStream_t stream) {
  if (group_size % 128 != 0) return cudaErrorInvalidValue;
  if (consumers == 8)
    return M <= 8 ? run_ring3<__half, 1, 8>(x, wp, scales, qzeros, bias, out, partial, M, N, K, group_size, splits,
                                            cluster, stream)
                  : run_ring3<__half, 2, 8>(x, wp, scales, qzeros, bias, out, partial, M, N, K, group_size, splits,
                                            cluster, stream);
  return M <= 8 ? run_ring3<__half, 1, 4>(x, wp, scales, qzeros, bias, out, partial, M, N, K, group_size, splits,
                                          cluster, stream)
                : run_ring3<__half, 2, 4>(x, wp, scales, qzeros, bias, out, partial, M, N, K, group_size, splits,
                                          cluster, stream);
}

// Token tiles of the ring kernel: one for M <= 8, else two (more token blocks for M > 16).
int ring_nt(int M) { return M <= 8 ? 1 : 2; }

// As for the register kernel, one wave of blocks: K splits (a power of two, at most
// kMaxCluster) while the blocks fit kRingBlocksPerSm per SM and each keeps at least one slot.
int ring_splits(int M, int N, int K, int device) {
  const int nt = ring_nt(M);
  const int blocks = (N / kStripN) * ((M + 8 * nt - 1) / (8 * nt));
  const int slots = sm_count(device) * kRingBlocksPerSm;
  const int steps = K / 16;
  int s = 1;
  while (s * 2 <= kMaxCluster && blocks * s * 2 <= slots && steps / (s * 2) >= kRingSteps) s *= 2;
  return s;
}

// fp16 activations; group sizes dividing or divided by kRingSlotK; x 16-byte aligned.
cudaError_t launch_ring(const void* x, const uint32_t* wp, const void* scales, const uint32_t* qzeros,
                        const void* bias, void* out, float* partial, int M, int N, int K, int group_size, int splits,
                        bool cluster, int device, cudaStream_t stream) {
  if (!ring_takes_group(group_size)) return cudaErrorInvalidValue;
  return ring_nt(M) == 1 ? run_ring<__half, 1>(x, wp, scales, qzeros, bias, out, partial, M, N, K, group_size, splits, cluster,
                                      device, stream)
                         : run_ring<__half, 2>(x, wp, scales, qzeros, bias, out, partial, M, N, K, group_size, splits, cluster,
                                      device, stream);
}

}  // namespace awq
}  // namespace quantfuse
