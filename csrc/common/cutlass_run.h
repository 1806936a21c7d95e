// Launches a CUTLASS 3.x GEMM (a GemmUniversalAdapter): what its initialize() and run() do,
// except that the kernel's dynamic shared-memory limit is raised once per device rather than
// on every call (initialize() calls cudaFuncSetAttribute each time).
#pragma once

#include <cuda_runtime.h>

#include <atomic>

#include "cutlass/cutlass.h"
#include "cutlass/device_kernel.h"

namespace quantfuse {

// Raises the shared-memory limit of Kernel's entry point on the current device, once.
template <class Kernel>
bool cutlass_smem_ready() {
  constexpr int kBytes = static_cast<int>(Kernel::SharedStorageSize);
  if constexpr (kBytes < (48 << 10)) {
    return true;
  } else {
    static std::atomic<bool> ready[64] = {};
    int device = -1;
    if (cudaGetDevice(&device) != cudaSuccess) return false;
    const bool cached = device >= 0 && device < 64;
    if (cached && ready[device].load(std::memory_order_acquire)) return true;
    if (cudaFuncSetAttribute(cutlass::device_kernel<Kernel>, cudaFuncAttributeMaxDynamicSharedMemorySize, kBytes) !=
        cudaSuccess)
      return false;
    if (cached) ready[device].store(true, std::memory_order_release);
    return true;
  }
}

// Initialises the workspace, builds the kernel's parameters and launches it on `stream`.
template <class Gemm>
cutlass::Status cutlass_run(const typename Gemm::Arguments& args, void* workspace, cudaStream_t stream) {
  using Kernel = typename Gemm::GemmKernel;
  cutlass::Status status = Kernel::initialize_workspace(args, workspace, stream);
  if (status != cutlass::Status::kSuccess) return status;
  typename Kernel::Params params = Kernel::to_underlying_arguments(args, workspace);
  if (!cutlass_smem_ready<Kernel>()) return cutlass::Status::kErrorInternal;
  return Gemm::run(params, stream);
}

}  // namespace quantfuse
