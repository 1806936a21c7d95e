// cuTensorMapEncodeTiled for CUTLASS's TMA descriptors, looked up in the driver once.
//
// CUTLASS encodes each TMA descriptor on the host (four to five per SM90 GEMM call); by default it
// first asks the runtime for the driver function by name (cudaGetDriverEntryPoint[ByVersion]) on
// every descriptor.
// The build (compile_backend/kernels/build_config.py, DRIVER_DEFINES) makes CUTLASS call the function
// directly and renames it to this one, which caches the driver's entry point.  The library is
// not linked against libcuda: it loads wherever torch's CUDA build loads.
#include <cuda.h>
#include <cuda_runtime_api.h>
#include <cudaTypedefs.h>

namespace {

PFN_cuTensorMapEncodeTiled_v12000 lookup() {
  void* fn = nullptr;
  cudaDriverEntryPointQueryResult found{};
#if CUDART_VERSION >= 12050
  const cudaError_t err = cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &fn, 12000, cudaEnableDefault,
                                                           &found);
#else
  const cudaError_t err = cudaGetDriverEntryPoint("cuTensorMapEncodeTiled", &fn, cudaEnableDefault, &found);
#endif
  if (err != cudaSuccess || found != cudaDriverEntryPointSuccess) return nullptr;
  return reinterpret_cast<PFN_cuTensorMapEncodeTiled_v12000>(fn);
}

}  // namespace

extern "C" CUresult quantfuse_cuTensorMapEncodeTiled(CUtensorMap* map, CUtensorMapDataType type, cuuint32_t rank,
                                                     void* address, const cuuint64_t* dims, const cuuint64_t* strides,
                                                     const cuuint32_t* box, const cuuint32_t* element_strides,
                                                     CUtensorMapInterleave interleave, CUtensorMapSwizzle swizzle,
                                                     CUtensorMapL2promotion l2_promotion,
                                                     CUtensorMapFloatOOBfill oob_fill) {
  static const PFN_cuTensorMapEncodeTiled_v12000 encode = lookup();
  if (encode == nullptr) return CUDA_ERROR_NOT_FOUND;
  return encode(map, type, rank, address, dims, strides, box, element_strides, interleave, swizzle, l2_promotion,
                oob_fill);
}
