// int8 decode kernels (scaled_mm_decode.cuh): 2 token tiles x 3 output types x 3 epilogue
// trees (Scaled runs as ScaledBias with a null bias) x 2 batch sizes = 36 instantiations.
#include "scaled_mm/scaled_mm_decode.cuh"

namespace quantfuse::decode {

template <class T>
using I8ScaledBias = ScaledBias<int32_t, T>;

int launch_i8(const ScaledMmParams& p, const DecodeConfig& c, int* cuda_error) {
  switch (p.epilogue) {
    case QEpilogue::kScaled:
    case QEpilogue::kScaledBias:
      return launch_tree<false, I8ScaledBias>(p, c, cuda_error);
    case QEpilogue::kAzp:
      return launch_tree<false, ScaledBiasAzp>(p, c, cuda_error);
    case QEpilogue::kAzpToken:
      return launch_tree<false, ScaledBiasAzpToken>(p, c, cuda_error);
  }
  return kQUnsupported;
}

}  // namespace quantfuse::decode
