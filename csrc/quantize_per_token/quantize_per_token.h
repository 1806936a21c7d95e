// Plain C++ interface of the per-token activation quantization kernel, shared by its torch-facing
// dispatch (quantize_per_token_dispatch.cpp) and the kernel (quantize_per_token_kernels.cu).  No
// torch and no CUDA headers here.
//
// Contract (compile_backend/ops/quantize_per_token.py): per row m of x [M, K], symmetric:
// scale = max(amax|x_m| * (1 / qmax), 1e-8), q = clamp(round(x / scale)) (int8) or
// e4m3(clamp(x / scale, +-448)) (fp8), zero point 0; asymmetric int8: scale = max((max(x_m, 0) -
// min(x_m, 0)) * (1 / 255), 1e-8), zero point = clamp(round(-128 - min / scale), -128, 127),
// q = clamp(round(x / scale) + zero point, -128, 127).  Maxima, minima and clamps propagate NaN.
#pragma once

#include "common/launch_status.h"  // Dt, kOk, kUnsupported, kLaunchFailed

#include <cstdint>

namespace quantfuse::quantize_per_token {

struct Params {
  const void* x = nullptr;    // [M, K] in `dtype`, unit column stride, row pitch ldx elements (0: one row for all)
  void* q = nullptr;          // [M, K] int8 or float8_e4m3fn, dense
  float* scale = nullptr;     // [M]
  float* zero_point = nullptr;  // [M] (0 for symmetric)
  int64_t M = 0, K = 0, ldx = 0;
  Dt dtype = Dt::kF16;
  bool fp8 = false;
  bool symmetric = true;
  void* stream = nullptr;  // cudaStream_t
};

int launch(const Params& p, int* cuda_error);

}  // namespace quantfuse::quantize_per_token
