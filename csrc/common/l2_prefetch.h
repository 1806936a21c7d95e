// An L2 prefetch hint a weight-streaming decode kernel carries for the weights read next (the
// next linear layer's): once a warp's own loads are issued, it asks the L2 for its share of the
// range with one bulk prefetch (sm_90; a no-op elsewhere).  Between two linears of a decode
// step the GPU runs short kernels (norms, rotary, attention) that leave DRAM mostly idle; the
// next linear then reads from L2 what the hint brought in.  It is a hint only: nothing waits
// for it, and a range no longer cached is read from DRAM as before.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

namespace quantfuse {

// At most this much is asked for per launch.  On the H100 (32 Llama-3-8B layers of AWQ decode
// kernels in one CUDA graph, 3-15 us of other work between them) hints of 4 or 8 MB took 3.5%
// off the step, 16 MB nothing and 24 MB added 2%: beyond what the gap between two linears lets
// DRAM fetch, the hint only competes with the launch that reads it.
constexpr uint64_t kMaxPrefetchBytes = uint64_t(8) << 20;

struct L2Prefetch {
  const void* ptr = nullptr;  // 16-byte aligned
  uint32_t bytes = 0;         // a multiple of 16
};

// Warp `warp` of `warps` (over the whole grid) asks for its share; call from one lane.
__device__ __forceinline__ void l2_prefetch_share(const L2Prefetch& pf, uint32_t warp, uint32_t warps) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  if (pf.bytes == 0) return;
  const uint32_t share = ((pf.bytes + warps - 1) / warps + 15u) & ~15u;
  const uint64_t begin = (uint64_t)warp * share;
  if (begin >= pf.bytes) return;
  const uint32_t n = (uint32_t)min((uint64_t)share, (uint64_t)pf.bytes - begin);
  asm volatile("cp.async.bulk.prefetch.L2.global [%0], %1;" ::"l"(static_cast<const char*>(pf.ptr) + begin), "r"(n)
               : "memory");
#else
  (void)pf;
  (void)warp;
  (void)warps;
#endif
}

}  // namespace quantfuse
