// The number of SMs of a CUDA device, asked once per device and cached (the kernels' work
// splits and CUTLASS's hw_info need it on every call).  CUDA runtime only, no torch.
#pragma once

#include <cuda_runtime.h>

namespace quantfuse {

// `fallback` when the device index is out of range or the query fails.
inline int sm_count(int device, int fallback) {
  static int counts[64] = {0};
  if (device < 0 || device >= 64) return fallback;
  if (counts[device] == 0) {
    int c = 0;
    if (cudaDeviceGetAttribute(&c, cudaDevAttrMultiProcessorCount, device) != cudaSuccess || c <= 0) return fallback;
    counts[device] = c;
  }
  return counts[device];
}

}  // namespace quantfuse
