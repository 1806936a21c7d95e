// Plain C++ interface between the torch-facing op file (scaled_mm_ops.cpp) and the
// CUTLASS kernels (*.cu).  No torch and no CUDA headers here: the .cu files include
// only CUDA + CUTLASS/CuTe, so they compile quickly and independently.
#pragma once

#include <cstddef>
#include <cstdint>

namespace quantfuse {

enum class QDType : int { kInt8 = 0, kFp8E4M3 = 1, kF16 = 2, kBF16 = 3, kF32 = 4 };

// Epilogue families (docs/DESIGN.md):  D = s_a * s_b * (A B - azp term) + bias
//   kScaled:       D = s_a * (s_b * acc)
//   kScaledBias:   D = s_a * (s_b * acc) + bias           (bias may be null -> zero)
//   kAzp:          D = s_a * (s_b * (acc - azp_adj)) + bias  (azp_adj = z_a * colsum(b))
//   kAzpToken:     D = s_a * (s_b * (acc - azp (x) azp_adj)) + bias
enum class QEpilogue : int { kScaled = 0, kScaledBias = 1, kAzp = 2, kAzpToken = 3 };

// Workspace allocator supplied by the caller (the op file allocates a torch tensor).
using QWorkspaceAlloc = void* (*)(std::size_t bytes, void* ctx);

struct ScaledMmParams {
  const void* a = nullptr;  // [M, K] row-major, leading dimension lda (elements)
  const void* b = nullptr;  // [K, N] column-major, i.e. [N, K] row-major with ldb
  void* d = nullptr;        // [M, N] row-major, ldd
  int64_t M = 0, N = 0, K = 0;
  int64_t lda = 0, ldb = 0, ldd = 0;
  const float* scale_a = nullptr;  // 1 or M elements
  bool scale_a_per_token = false;
  const float* scale_b = nullptr;  // 1 or N elements
  bool scale_b_per_channel = false;
  const void* bias = nullptr;        // [N] in the output dtype, or null
  const int32_t* azp_adj = nullptr;  // [N]
  const int32_t* azp = nullptr;      // [M] (kAzpToken)
  QDType in_dtype = QDType::kInt8;
  QDType out_dtype = QDType::kBF16;
  QEpilogue epilogue = QEpilogue::kScaledBias;
  int config = -1;  // -1: choose by M/N; >= 0 forces a tile config (tests/benchmarks)
  // SM90 persistent tile scheduler: raster swizzle (0: the tile config's; else 1, 2, 4 or 8
  // tiles) and raster order (0: the tile config's, CUTLASS's heuristic except config 4;
  // 1: along M; 2: along N).
  int swizzle = 0;
  int raster = 0;
  int device = 0;
  void* stream = nullptr;  // cudaStream_t
  bool pdl = false;        // the decode kernel launched with programmatic dependent launch (common/pdl.cuh)
  QWorkspaceAlloc alloc = nullptr;
  void* alloc_ctx = nullptr;
};

// Return codes of the launchers.
enum QStatus : int {
  kQOk = 0,
  kQUnsupported = 1,     // no kernel instantiated for this combination
  kQCannotImplement = 2, // CUTLASS can_implement refused (alignment, ...)
  kQInitFailed = 3,
  kQLaunchFailed = 4,
};

const char* status_string(int status);

// SM90 (Hopper, sm_90a): CUTLASS 3.x TMA + wgmma warp-specialized kernels, EVT epilogues.
int scaled_mm_sm90(const ScaledMmParams& p);

// Per-(input dtype, output dtype, epilogue) entry points, one per .cu file.
#define QF_DECLARE(name) int name(const ScaledMmParams& p);
QF_DECLARE(sm90_i8_f16_bias)
QF_DECLARE(sm90_i8_bf16_bias)
QF_DECLARE(sm90_i8_f32_bias)
QF_DECLARE(sm90_fp8_f16_bias)
QF_DECLARE(sm90_fp8_bf16_bias)
QF_DECLARE(sm90_fp8_f32_bias)
#undef QF_DECLARE

// SM80 (A100 class; also runs on Hopper when forced): CUTLASS 2.x mma.sync multistage
// kernels, 2.x EVT epilogues.  int8 inputs only.
int scaled_mm_sm80(const ScaledMmParams& p);
// Per-output-dtype entries: *_bias = Scaled/ScaledBias (the zero-point ones: scaled_mm_azp/
// scaled_mm_azp_launch.h).
int sm80_i8_f16_bias(const ScaledMmParams& p);
int sm80_i8_bf16_bias(const ScaledMmParams& p);
int sm80_i8_f32_bias(const ScaledMmParams& p);

}  // namespace quantfuse
