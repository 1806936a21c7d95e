// torch dtype -> QDType for the W8A8 op files (scaled_mm_ops.cpp, scaled_mm_decode_ops.cpp).
#pragma once

#include <c10/core/ScalarType.h>

#include "common/check.h"
#include "scaled_mm/scaled_mm_launch.h"

namespace quantfuse {

// `op` names the calling op in the error for any other dtype.
inline QDType to_qdtype(at::ScalarType t, const char* op) {
  switch (t) {
    case at::kChar: return QDType::kInt8;
    case at::kFloat8_e4m3fn: return QDType::kFp8E4M3;
    case at::kHalf: return QDType::kF16;
    case at::kBFloat16: return QDType::kBF16;
    case at::kFloat: return QDType::kF32;
    default: fail("%s: unsupported dtype %s", op, c10::toString(t));
  }
}

}  // namespace quantfuse
