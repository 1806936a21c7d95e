// Whether the decode kernels launch with programmatic dependent launch (common/pdl.cuh).
#pragma once

#include <cuda_runtime.h>

#include <cstdint>
#include <cstdlib>
#include <cstring>

namespace quantfuse {

// Whether PDL is allowed on `device`: sm_90 or later, unless QUANTFUSE_PDL=0 (read once).
inline bool pdl_supported(int device) {
  int major = 0;
  return cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device) == cudaSuccess && major >= 9;
}

inline bool pdl_default(int device) {
  static const bool allowed = [] {
    const char* v = std::getenv("QUANTFUSE_PDL");
    return v == nullptr || std::strcmp(v, "0") != 0;
  }();
  return allowed && pdl_supported(device);
}

// An op's `pdl` argument: -1 the default above, 0 off, 1 on where the GPU has it.
inline bool pdl_for(int64_t pdl, int device) {
  return pdl < 0 ? pdl_default(device) : (pdl != 0 && pdl_supported(device));
}

}  // namespace quantfuse
