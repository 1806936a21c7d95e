// 16-byte loads of data a kernel reads exactly once (quantized weights).
#pragma once

#include <cuda_runtime.h>

namespace quantfuse {

// Evict-first in L1 and L2 (ld.global.cs).
__device__ __forceinline__ uint4 ld_stream(const void* p) { return __ldcs(static_cast<const uint4*>(p)); }

// The same with the L2::256B prefetch-size hint: a miss fetches the whole aligned 256-byte
// block from DRAM, not only the requested sectors.  The W8A8 decode kernel's warps read 16 rows
// x 256 bytes per batch (one token tile); with the hint it took 4-6% less time at M = 1 on the
// H100.  The AWQ kernel's 512-byte steps gain nothing from it.
__device__ __forceinline__ uint4 ld_stream_l2_256(const void* p) {
  uint4 v;
  asm("ld.global.cs.L2::256B.v4.u32 {%0, %1, %2, %3}, [%4];"
      : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
      : "l"(p));
  return v;
}

}  // namespace quantfuse
