// What the plain C++ kernel interfaces (w8a16_gemm.h, quantize_per_token.h) share: the activation
// dtype of a call and the status a launcher returns.  No torch and no CUDA headers here.
#pragma once

namespace quantfuse {

enum class Dt : int { kF16 = 0, kBF16 = 1, kF32 = 2 };

// Status of a launcher.
constexpr int kOk = 0;
constexpr int kUnsupported = 1;   // operands the kernel does not take
constexpr int kLaunchFailed = 2;  // the CUDA launch failed (its error is reported beside)

}  // namespace quantfuse
