// Launch configuration for cudaLaunchKernelEx with an optional (x, 1, 1) thread-block cluster and
// optional programmatic stream serialization (PDL: common/pdl.cuh).
#pragma once

#include <cuda_runtime.h>

#include <cstddef>

namespace quantfuse {

// `cfg` points into `attr`, so the object is neither copied nor moved; a cluster of 1 (or less)
// launches without the cluster attribute, pdl false without the PDL one.
struct ClusterLaunch {
  cudaLaunchConfig_t cfg = {};
  cudaLaunchAttribute attr[2] = {};

  ClusterLaunch(dim3 grid, dim3 block, size_t smem, cudaStream_t stream, int cluster_x, bool pdl = false) {
    cfg.gridDim = grid;
    cfg.blockDim = block;
    cfg.dynamicSmemBytes = smem;
    cfg.stream = stream;
    cfg.attrs = attr;
    cfg.numAttrs = 0;
    if (cluster_x > 1) {
      attr[0].id = cudaLaunchAttributeClusterDimension;
      attr[0].val.clusterDim.x = static_cast<unsigned>(cluster_x);
      attr[0].val.clusterDim.y = 1;
      attr[0].val.clusterDim.z = 1;
      cfg.numAttrs = 1;
    }
    if (pdl) {
      attr[cfg.numAttrs].id = cudaLaunchAttributeProgrammaticStreamSerialization;
      attr[cfg.numAttrs].val.programmaticStreamSerializationAllowed = 1;
      cfg.numAttrs += 1;
    }
  }
  ClusterLaunch(const ClusterLaunch&) = delete;
  ClusterLaunch& operator=(const ClusterLaunch&) = delete;
};

}  // namespace quantfuse
