// Whether the decode kernels launch with programmatic dependent launch (common/pdl.cuh).
#pragma once

#include <cuda_runtime.h>

#include <cstdint>
#include <cstdlib>
#include <cstring>

namespace quantfuse {

// Whether the GPU has PDL: sm_90 or later.
inline bool pdl_supported(int device) {
  int major = 0;
  return cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device) == cudaSuccess && major >= 9;
}

// Whether kernels launch with PDL on `device` by default: where it has it, unless QUANTFUSE_PDL=0.
// The variable is read at every launch (a getenv, well under a microsecond of the host's launch cost;
// a captured CUDA graph keeps what its capture chose), so that one process may compare both.
inline bool pdl_default(int device) {
  const char* v = std::getenv("QUANTFUSE_PDL");
  return (v == nullptr || std::strcmp(v, "0") != 0) && pdl_supported(device);
}

// An op's `pdl` argument: -1 the default above, 0 off, 1 on where the GPU has it.
inline bool pdl_for(int64_t pdl, int device) {
  return pdl < 0 ? pdl_default(device) : (pdl != 0 && pdl_supported(device));
}

}  // namespace quantfuse
