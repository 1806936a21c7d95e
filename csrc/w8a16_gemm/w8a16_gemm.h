// Plain C++ interface of the W8A16 kernels (int8 weight-only), shared by the torch-facing files
// (w8a16_gemm_dispatch.cpp, w8a16_gemm_ops.cpp) and the kernels (w8a16_gemm_*.cu).  No torch
// and no CUDA headers here.
//
// Contract (compile_backend/ops/w8a16_gemm.py, w8a16_gemm): y[m, n] = (sum_k x[m, k] * w[n, k]) * s[n] +
// bias[n], products accumulated in float32, the scale and the bias applied to the accumulator in
// float32 (multiply, then add; no contraction), one rounding to x's dtype.
#pragma once

#include "common/launch_status.h"

#include <algorithm>
#include <cstdint>

namespace quantfuse::w8a16 {

using ::quantfuse::Dt;
using ::quantfuse::kLaunchFailed;
using ::quantfuse::kOk;
using ::quantfuse::kUnsupported;

struct Params {
  const void* x = nullptr;     // [M, K] in `dtype`, row pitch ldx elements
  const int8_t* w = nullptr;   // [N, K] int8, row pitch ldw bytes
  const void* scale = nullptr; // float32 (scale_f32) or `dtype`; N elements, or 1 (per-tensor)
  const void* bias = nullptr;  // [N] in `dtype`, or null
  void* y = nullptr;           // [M, N] in `dtype`, row pitch ldy elements
  int64_t M = 0, N = 0, K = 0;
  int64_t ldx = 0, ldw = 0, ldy = 0;
  Dt dtype = Dt::kF16;
  bool scale_f32 = true;
  bool scale_per_channel = true;
  void* stream = nullptr;  // cudaStream_t
  bool pdl = false;        // the decode kernel launched with programmatic dependent launch (common/pdl.cuh)
};

// ---------------------------------------------------------------- decode kernel (M <= kMaxM)
//
// Geometry (w8a16_gemm_decode.cuh): a warp owns kRowsPerWarp output channels and a contiguous
// range of K chunks of kChunk elements; the warps of a CTA split K, and on sm_90 so can the
// CTAs of a thread-block cluster (`splits`) when N is too small to fill the GPU otherwise.
constexpr int kMaxM = 16;        // tokens per slice: two n8 tiles
constexpr int kRowsPerWarp = 16; // one m16 tile of weight rows
constexpr int kChunk = 64;       // K elements per warp step: 4 lanes x 16
constexpr int kMaxWarps = 8;
constexpr int kMaxSplits = 8;    // portable cluster size
constexpr int kWarpsPerSm = 16;  // resident warps per SM at the kernel's 128-register bound

struct DecodeConfig {
  int splits = 1;           // CTAs of one cluster along K (1: no cluster)
  int warps = 8;            // warps per CTA, each a K partition
  int chunks_per_part = 1;  // K chunks per (CTA, warp) partition
  int batch = 0;            // chunks per load batch: 0 = double-buffered default, 4 (M <= 8) /
                            // 2 (M > 8) = one batch of twice the size at a time
};

// The work split for an N x K weight on a GPU with `sms` SMs: 8 warps per CTA splitting K
// (4 when K has fewer chunks), and, where clusters exist (sm_90) and the row tiles times the
// warps fill less than half of the resident warp slots, a cluster of CTAs per row tile splitting
// K further so that every SM streams.  `splits` / `warps` > 0 force them (tests, benchmarks).
inline DecodeConfig choose_config(int64_t M, int64_t N, int64_t K, int sms, bool clusters, int splits = -1,
                                  int warps = -1, int batch = -1) {
  const int64_t chunks = (K + kChunk - 1) / kChunk;
  const int64_t tiles = (N + kRowsPerWarp - 1) / kRowsPerWarp * ((std::max<int64_t>(M, 1) + kMaxM - 1) / kMaxM);
  DecodeConfig c;
  c.warps = static_cast<int>(std::clamp<int64_t>(warps > 0 ? warps : 8, 1, std::min<int64_t>(kMaxWarps, chunks)));
  if (splits > 0) {
    c.splits = splits;
  } else {
    const int64_t slots = int64_t(std::max(sms, 1)) * kWarpsPerSm;
    const int64_t busy = tiles * c.warps;
    c.splits = busy * 2 <= slots ? static_cast<int>((slots + busy - 1) / busy) : 1;
  }
  c.splits = static_cast<int>(std::clamp<int64_t>(c.splits, 1, clusters ? kMaxSplits : 1));
  c.splits = static_cast<int>(std::max<int64_t>(1, std::min<int64_t>(c.splits, chunks / c.warps)));
  const int64_t parts = int64_t(c.splits) * c.warps;
  c.chunks_per_part = static_cast<int>(std::max<int64_t>(1, (chunks + parts - 1) / parts));
  if (batch > 0) c.batch = batch;
  return c;
}

// Launches the decode kernel: float16 / bfloat16 on tensor cores (mma.sync m16n8k16, weights
// converted to the activation type exactly), float32 on CUDA cores.  The caller checks the
// contract: M >= 1 (float16 / bfloat16: slices of kMaxM tokens side by side in the grid;
// float32: M <= kMaxM), K % 16 == 0, x / w starts and row pitches 16-byte aligned.
int launch_decode(const Params& p, const DecodeConfig& c, int* cuda_error);

// Prefill: the int8 weight converted to `dtype` (exact; n % 16 == 0, 16-byte aligned), and the
// epilogue y = acc * s + bias from a float32 [M, N] accumulator (row pitch N).
int launch_cast(const int8_t* w, void* out, int64_t n, Dt dtype, void* stream, int* cuda_error);
int launch_epilogue(const float* acc, const Params& p, int* cuda_error);

}  // namespace quantfuse::w8a16
