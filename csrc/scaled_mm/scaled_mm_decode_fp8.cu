// float8_e4m3fn decode kernels (scaled_mm_decode.cuh): 2 token tiles x 3 output types x
// ScaledBias (Scaled runs with a null bias; zero points are int8-only) x 2 batch sizes = 12
// instantiations.
// The mma needs sm_89+; the sm_80 build of these kernels traps (never launched there).
#include "scaled_mm/scaled_mm_decode.cuh"

namespace quantfuse::decode {

template <class T>
using Fp8ScaledBias = ScaledBias<float, T>;

int launch_fp8(const ScaledMmParams& p, const DecodeConfig& c, int* cuda_error) {
  switch (p.epilogue) {
    case QEpilogue::kScaled:
    case QEpilogue::kScaledBias:
      return launch_tree<true, Fp8ScaledBias>(p, c, cuda_error);
    default:
      return kQUnsupported;
  }
}

}  // namespace quantfuse::decode
