// CUDA device attributes, each asked once per device and cached: the kernels' work splits and
// CUTLASS's hw_info want the SM count on every call, the launchers whether the GPU has thread block
// clusters and programmatic dependent launch.  CUDA runtime only, no torch.
#pragma once

#include <cuda_runtime.h>

#include <atomic>

namespace quantfuse {

// Attribute `kAttr` of `device` (its value + 1 in the cache, 0 while unknown); `fallback` when the
// device index is out of range or the query fails (a failure is not cached: asked again next time).
template <cudaDeviceAttr kAttr>
inline int device_attribute(int device, int fallback) {
  static std::atomic<int> cached[64];
  if (device < 0 || device >= 64) return fallback;
  const int known = cached[device].load(std::memory_order_relaxed);
  if (known > 0) return known - 1;
  int value = 0;
  if (cudaDeviceGetAttribute(&value, kAttr, device) != cudaSuccess || value < 0) return fallback;
  cached[device].store(value + 1, std::memory_order_relaxed);
  return value;
}

// The number of SMs; `fallback` where unknown.
inline int sm_count(int device, int fallback) {
  const int count = device_attribute<cudaDevAttrMultiProcessorCount>(device, fallback);
  return count > 0 ? count : fallback;
}

// Whether the GPU launches thread block clusters (sm_90 or later).
inline bool cluster_launch(int device) { return device_attribute<cudaDevAttrClusterLaunch>(device, 0) != 0; }

// Whether the GPU has programmatic dependent launch: sm_90 or later.
inline bool pdl_supported(int device) {
  return device_attribute<cudaDevAttrComputeCapabilityMajor>(device, 0) >= 9;
}

}  // namespace quantfuse
