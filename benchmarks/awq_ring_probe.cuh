// Probe only (benchmarks/awq_stream_probe.cu, PROBE_RING=1): the AWQ decode GEMM with a
// producer warp that streams each block's weights into a shared-memory ring (bulk copies,
// mbarriers) and C consumer warps that dequantize and multiply from it.  Measured in session 7
// against the register kernel (csrc/awq_gemm/awq_gemm_kernels.cu) and not adopted: its copy side
// is faster on every shape, the whole kernel slower (benchmarks/notes_awq.md).  This is the third
// version; the first two (every piece of a stage copied into the ring: activation rows, scales,
// zeros) are in git history at 97df689.  sm_90 only; included after the kernel file (uses its
// Dq, StripGroups, store_strip, reduce_splits).  Since session 9 its consumers do the register
// kernel's math (raw nibbles into the MMA, zeros and scales folded in once per share of a stage).
//
// Block: C consumer warps + 1 producer warp, one 64-row strip of N and a contiguous range of K
// (K split over a cluster, or a workspace, as the register kernel).  A stage holds kR3Steps
// k-steps of weights (16 KB, one bulk copy: the strip is contiguous in the repacked layout);
// consumer warp w takes k-steps [w, w + 1) * kR3Steps / C of each stage (one group of 128) and
// loads its activations and the next stage's scales and zeros from global memory.  Group sizes:
// multiples of 128.  Knob: -DQF_RING_SKIP_MATH (consumers only release stages: the ring's own
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


// ----------------------------------------------------------------------------- kernel

constexpr int kR3Steps = 32;  // k-steps per stage, split over the C consumer warps
constexpr int kR3Stages = 3;
// Blocks per SM the register budget is sized for: 4 blocks of 5 warps, or 2 of 9.
__host__ __device__ constexpr int r3_blocks_per_sm(int consumers) { return consumers == 8 ? 2 : 4; }
__host__ __device__ constexpr int r3_head_bytes(int nt) { return red_floats(nt) * 4 + 16 * kR3Stages; }

template <typename T, int NT, bool CLUSTER, int C>
__global__ void __launch_bounds__((C + 1) * 32, r3_blocks_per_sm(C)) awq_gemm_ring_kernel(
    const T* __restrict__ x, const uint4* __restrict__ wp, const T* __restrict__ scales,
    const uint32_t* __restrict__ qzeros, const T* __restrict__ bias, T* __restrict__ out,
    float* __restrict__ partial, int M, int N, int K, int group_size) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  constexpr int kPerWarp = kR3Steps / C;
  constexpr int kThreads = (C + 1) * 32;
  extern __shared__ __align__(128) uint8_t smem[];
  float* red = reinterpret_cast<float*>(smem);
  uint64_t* full = reinterpret_cast<uint64_t*>(smem + red_floats(NT) * 4);
  uint64_t* empty = full + kR3Stages;
  uint8_t* ring = smem + r3_head_bytes(NT);
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
    mbar_init(full, kR3Stages, 1);  // the producer's arrive with the stage's bytes
    mbar_init(empty, kR3Stages, C);  // one arrive per consumer warp
  }
  __syncthreads();
  if (warp == C) {
    if (lane == 0) {
      const char* wsrc = reinterpret_cast<const char*>(wp + (size_t)strip * KT * 32);
      int st = 0;
      uint32_t parity = 0;  // of the empty phase to wait for, once the ring has wrapped
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
    float tot[kTiles][NT][4], acc[kTiles][NT][4];
    zero_acc<NT>(tot);
    zero_acc<NT>(acc);
    TokenSums<T, NT> sx;
    sx.zero();
    const T* xrow[NT];
    activation_rows<T, NT>(x, M, K, m0, lane, xrow);
    const StripGroups<T> meta(scales, qzeros, N, strip, lane);
    const int s0 = warp * kPerWarp;
    auto grp_of = [&](int i) { return ((kb + i * kR3Steps + s0) * 16) / group_size; };
    GroupRaw raw, cur_raw;  // the group of the warp's next stage, loaded a stage ahead; this one's
    int cur = -1;
    if (slots > 0 && s0 < min(kR3Steps, ke - kb)) meta.load(grp_of(0), raw);
    int st = 0;
    uint32_t parity = 0;
    for (int i = 0; i < slots; ++i) {
      const int k0 = kb + i * kR3Steps;
      const int n = min(kR3Steps, ke - k0);
      const bool active = s0 < n;
      uint32_t b[kPerWarp][NT][2];  // activations, asked for before the stage is waited for
#pragma unroll
      for (int u = 0; u < kPerWarp; ++u)
#pragma unroll
        for (int nt = 0; nt < NT; ++nt) {
          uint2 v = make_uint2(0u, 0u);
          if (xrow[nt] != nullptr && s0 + u < n)
            v = __ldg(reinterpret_cast<const uint2*>(xrow[nt] + ((k0 + s0 + u) << 4)));
          b[u][nt][0] = v.x;
          b[u][nt][1] = v.y;
        }
      if (active) {
        const int gh = grp_of(i);
        if (gh != cur) {
          cur = gh;
          cur_raw = raw;
        }
        if (i + 1 < slots && s0 < min(kR3Steps, ke - k0 - kR3Steps)) {
          const int gn = grp_of(i + 1);
          if (gn != cur) meta.load(gn, raw);
        }
      }
      mbar_wait(&full[st], parity);
#ifndef QF_RING_SKIP_MATH
      const uint8_t* slot = ring + st * kR3Steps * 512;
      auto step = [&](int u) {
        mma_kstep<T, NT>(*reinterpret_cast<const uint4*>(slot + (s0 + u) * 512 + lane * 16), b[u], acc, sx);
      };
      if (s0 + kPerWarp <= n) {  // the common case, branch-free so the steps interleave
#pragma unroll
        for (int u = 0; u < kPerWarp; ++u) step(u);
      } else {
#pragma unroll
        for (int u = 0; u < kPerWarp; ++u)
          if (s0 + u < n) step(u);
      }
      if (active) fold_group<T, NT>(meta.fold_constants(cur_raw, lane), acc, sx, tot, lane);  // a share: one group
#endif
      __syncwarp();  // every lane has read the stage
      if (lane == 0) mbar_arrive(&empty[st]);
      if (++st == kR3Stages) {
        st = 0;
        parity ^= 1u;
      }
    }
    add_to_red<NT>(red, tot, lane);
  }
  __syncthreads();
  store_strip<T, CLUSTER, kThreads>(red, bias, out, partial, M, N, m0, mb);
#endif
}

// ----------------------------------------------------------------------------- host

template <typename T, int NT, int C>
cudaError_t run_ring(const void* x, const uint32_t* wp, const void* scales, const uint32_t* qzeros, const void* bias,
                     void* out, float* partial, int M, int N, int K, int group_size, int splits, bool cluster,
                     cudaStream_t stream) {
  const dim3 grid(splits, N / kStripN, (M + 8 * NT - 1) / (8 * NT));
  const int smem = r3_head_bytes(NT) + kR3Stages * kR3Steps * 512;
  const T* xp = static_cast<const T*>(x);
  const uint4* wq = reinterpret_cast<const uint4*>(wp);
  const T* sp = static_cast<const T*>(scales);
  const T* bp = static_cast<const T*>(bias);
  T* op = static_cast<T*>(out);
  const bool in_cluster = splits > 1 && cluster;
  const cudaError_t err =
      cudaFuncSetAttribute(in_cluster ? awq_gemm_ring_kernel<T, NT, true, C> : awq_gemm_ring_kernel<T, NT, false, C>,
                           cudaFuncAttributeMaxDynamicSharedMemorySize, smem);
  if (err != cudaSuccess) return err;
  if (in_cluster) {
    const ClusterLaunch launch(grid, dim3((C + 1) * 32), smem, stream, splits);
    return cudaLaunchKernelEx(&launch.cfg, awq_gemm_ring_kernel<T, NT, true, C>, xp, wq, sp, qzeros, bp, op,
                              static_cast<float*>(nullptr), M, N, K, group_size);
  }
  awq_gemm_ring_kernel<T, NT, false, C><<<grid, (C + 1) * 32, smem, stream>>>(
      xp, wq, sp, qzeros, bp, op, splits > 1 ? partial : nullptr, M, N, K, group_size);
  return reduce_splits<T>(cudaGetLastError(), partial, bp, op, M, N, splits, stream);
}

// fp16 activations, C = consumers (4 or 8) consumer warps per block; group sizes multiples of 128;
// splits as given (the probe sweeps them).
cudaError_t launch_ring(const void* x, const uint32_t* wp, const void* scales, const uint32_t* qzeros,
                        const void* bias, void* out, float* partial, int M, int N, int K, int group_size, int splits,
                        bool cluster, int consumers, cudaStream_t stream) {
  if (group_size % 128 != 0 || (consumers != 4 && consumers != 8)) return cudaErrorInvalidValue;
  const bool one = M <= 8;  // one token tile, else two (several token blocks above 16)
  if (consumers == 8)
    return one ? run_ring<__half, 1, 8>(x, wp, scales, qzeros, bias, out, partial, M, N, K, group_size, splits,
                                        cluster, stream)
               : run_ring<__half, 2, 8>(x, wp, scales, qzeros, bias, out, partial, M, N, K, group_size, splits,
                                        cluster, stream);
  return one ? run_ring<__half, 1, 4>(x, wp, scales, qzeros, bias, out, partial, M, N, K, group_size, splits, cluster,
                                      stream)
             : run_ring<__half, 2, 4>(x, wp, scales, qzeros, bias, out, partial, M, N, K, group_size, splits, cluster,
                                      stream);
}

}  // namespace awq
}  // namespace quantfuse
