// Programmatic dependent launch (PDL, sm_90+): a kernel launched with programmatic stream
// serialization may start while the kernel before it on the stream is still running, once that
// one's blocks have all triggered (griddepcontrol.launch_dependents) or exited.  It must not read
// anything the previous kernel writes before griddepcontrol.wait, which returns once the
// previous kernels have completed and their writes are visible.  What it may do before: issue
// L2 prefetches of its weights (L2 is the point of coherence, so a line the previous kernel
// writes afterwards is still seen by the later loads) and compute addresses.
//
// On sm_80 builds, and in a kernel launched without the attribute, both instructions do nothing.
// The host side (whether to launch with it): common/pdl.h.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

namespace quantfuse {

__device__ __forceinline__ void pdl_wait() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
}

__device__ __forceinline__ void pdl_launch_dependents() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.launch_dependents;" :::);
#endif
}

// An L2 prefetch of the 128-byte line at p (a hint: no register written, nothing waited for).
__device__ __forceinline__ void prefetch_l2(const void* p) {
  asm volatile("prefetch.global.L2 [%0];" ::"l"(p));
}

// The decode kernels' weight rows: lane (g, t) holds the pointers of rows g and g + 8 at byte 16t of
// a chunk.  Asks the bytes [lo, hi) of both rows into L2, lane t taking every fourth 128-byte line.
__device__ __forceinline__ void prefetch_rows_l2(const uint8_t* const (&wrow)[2], int t, int64_t lo, int64_t hi) {
  lo &= ~int64_t(127);
#pragma unroll
  for (int h = 0; h < 2; ++h)
    for (int64_t off = lo + t * 128; off < hi; off += 512) prefetch_l2(wrow[h] - t * 16 + off);
}

}  // namespace quantfuse
