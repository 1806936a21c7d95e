// Instantiations of the W8A16 kernels (w8a16_gemm_decode.cuh) by activation and scale dtype.
#include "w8a16_gemm/w8a16_gemm_decode.cuh"

namespace quantfuse::w8a16 {

// The activation dtype T and scale dtype S of a call, as types.
template <class T_, class S_>
struct Dtypes {
  using T = T_;
  using S = S_;
};

// launch(Dtypes<T, S>{}) for activation dtype `dtype` and scale dtype float32 (scale_f32) or
// that of the activations; float32 activations take float32 scales.
template <class Launch>
int with_dtypes(Dt dtype, bool scale_f32, const Launch& launch) {
  switch (dtype) {
    case Dt::kF16:
      return scale_f32 ? launch(Dtypes<__half, float>{}) : launch(Dtypes<__half, __half>{});
    case Dt::kBF16:
      return scale_f32 ? launch(Dtypes<__nv_bfloat16, float>{}) : launch(Dtypes<__nv_bfloat16, __nv_bfloat16>{});
    case Dt::kF32:
      return launch(Dtypes<float, float>{});
  }
  return kUnsupported;
}

int launch_decode(const Params& p, const DecodeConfig& c, int* cuda_error) {
  return with_dtypes(p.dtype, p.scale_f32, [&](auto d) {
    using D = decltype(d);
    return launch_decode_typed<typename D::T, typename D::S>(p, c, cuda_error);
  });
}

int launch_cast(const int8_t* w, void* out, int64_t n, Dt dtype, void* stream, int* cuda_error) {
  return with_dtypes(dtype, /*scale_f32=*/false, [&](auto d) {  // no scale: only T is used
    return launch_cast_typed<typename decltype(d)::T>(w, out, n, stream, cuda_error);
  });
}

int launch_epilogue(const float* acc, const Params& p, int* cuda_error) {
  return with_dtypes(p.dtype, p.scale_f32, [&](auto d) {
    using D = decltype(d);
    return launch_epilogue_typed<typename D::T, typename D::S>(acc, p, cuda_error);
  });
}

}  // namespace quantfuse::w8a16
