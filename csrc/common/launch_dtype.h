// The launch dtype (launch_status.h: Dt) of a torch activation, for the op files that fill a
// plain C++ kernel interface (w8a16_gemm.h, quantize_per_token.h).
#pragma once

#include <ATen/core/Tensor.h>

#include "common/check.h"
#include "common/launch_status.h"

namespace quantfuse {

// float16, bfloat16 or float32; any other dtype fails naming the op (`who`) and the argument.
inline Dt launch_dtype(const at::Tensor& t, const char* who, const char* name) {
  switch (t.scalar_type()) {
    case at::kHalf: return Dt::kF16;
    case at::kBFloat16: return Dt::kBF16;
    case at::kFloat: return Dt::kF32;
    default:
      fail("quantfuse %s: '%s' has dtype %s; expected float16, bfloat16 or float32", who, name,
           c10::toString(t.scalar_type()));
  }
}

}  // namespace quantfuse
