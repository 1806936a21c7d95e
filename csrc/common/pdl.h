// Programmatic dependent launch (sm_90+): a kernel launched with the
// ProgrammaticStreamSerialization attribute may be scheduled while the kernel before it in the
// stream is still finishing, instead of after it has completed.  It must not touch memory that
// kernel may write before `pdl_wait()` returns (griddepcontrol.wait: the previous grid has
// completed and its writes are visible).  `pdl_launch_dependents()` lets the next such kernel be
// scheduled as this one's blocks retire; it only takes effect once every block has called it or
// exited, and the next kernel still waits for this one's completion before touching memory.
// Both instructions do nothing when the kernel was launched without the attribute, and compile
// to nothing below sm_90.
#pragma once

#include <cuda_runtime.h>

#include <cstdlib>
#include <cstring>

namespace quantfuse {

__device__ __forceinline__ void pdl_wait() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
}

__device__ __forceinline__ void pdl_launch_dependents() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
}

// Asks L2 for `bytes` (a multiple of 16) at `p` (16-byte aligned), with no register or
// architectural effect: safe before pdl_wait() even on memory the previous kernel writes, since
// L2 is where its writes land (a line fetched early is updated in place).  One thread issues it.
__device__ __forceinline__ void prefetch_l2(const void* p, unsigned bytes) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("cp.async.bulk.prefetch.L2.global [%0], %1;" ::"l"(p), "r"(bytes) : "memory");
#endif
}

// -1: launch with the attribute on sm_90+ unless QUANTFUSE_PDL=0; 0 / 1: off / on (probes).
inline int& pdl_mode() {
  static int mode = -1;
  return mode;
}

// Whether kernels that call pdl_wait() before their first global access are launched with the
// attribute on `device`.
inline bool pdl_launch(int device) {
  if (pdl_mode() >= 0) return pdl_mode() == 1;
  static int cached[64] = {0};  // 0 unknown, 1 no, 2 yes
  if (device < 0 || device >= 64) return false;
  if (cached[device] == 0) {
    int major = 0;
    const char* env = std::getenv("QUANTFUSE_PDL");
    const bool off = env != nullptr && std::strcmp(env, "0") == 0;
    if (cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device) != cudaSuccess) major = 0;
    cached[device] = !off && major >= 9 ? 2 : 1;
  }
  return cached[device] == 2;
}

}  // namespace quantfuse
