// Instantiations of the W8A16 kernels (w8a16_gemm_decode.cuh) by activation and scale dtype.
#include "w8a16_gemm/w8a16_gemm_decode.cuh"

namespace quantfuse::w8a16 {

int launch_decode(const Params& p, const DecodeConfig& c, int* cuda_error) {
  switch (p.dtype) {
    case Dt::kF16:
      return p.scale_f32 ? launch_decode_typed<__half, float>(p, c, cuda_error)
                         : launch_decode_typed<__half, __half>(p, c, cuda_error);
    case Dt::kBF16:
      return p.scale_f32 ? launch_decode_typed<__nv_bfloat16, float>(p, c, cuda_error)
                         : launch_decode_typed<__nv_bfloat16, __nv_bfloat16>(p, c, cuda_error);
    case Dt::kF32:
      return launch_decode_typed<float, float>(p, c, cuda_error);
  }
  return kUnsupported;
}

int launch_cast(const int8_t* w, void* out, int64_t n, Dt dtype, void* stream, int* cuda_error) {
  switch (dtype) {
    case Dt::kF16: return launch_cast_typed<__half>(w, out, n, stream, cuda_error);
    case Dt::kBF16: return launch_cast_typed<__nv_bfloat16>(w, out, n, stream, cuda_error);
    case Dt::kF32: return launch_cast_typed<float>(w, out, n, stream, cuda_error);
  }
  return kUnsupported;
}

int launch_epilogue(const float* acc, const Params& p, int* cuda_error) {
  switch (p.dtype) {
    case Dt::kF16:
      return p.scale_f32 ? launch_epilogue_typed<__half, float>(acc, p, cuda_error)
                         : launch_epilogue_typed<__half, __half>(acc, p, cuda_error);
    case Dt::kBF16:
      return p.scale_f32 ? launch_epilogue_typed<__nv_bfloat16, float>(acc, p, cuda_error)
                         : launch_epilogue_typed<__nv_bfloat16, __nv_bfloat16>(acc, p, cuda_error);
    case Dt::kF32:
      return launch_epilogue_typed<float, float>(acc, p, cuda_error);
  }
  return kUnsupported;
}

}  // namespace quantfuse::w8a16
