// Plain C++ interface of the W8A8 decode kernels (M <= 16), shared by the torch-facing
// op file (scaled_mm_decode_ops.cpp) and the kernels (scaled_mm_decode_*.cu).  No torch
// and no CUDA headers here.  The parameters are the CUTLASS path's (scaled_mm_launch.h);
// `config` there is unused, the work split is a DecodeConfig.
#pragma once

#include <algorithm>
#include <cstdint>

#include "scaled_mm/scaled_mm_launch.h"

namespace quantfuse::decode {

// Geometry of the kernel (scaled_mm_decode.cuh): each warp owns kRowsPerWarp output
// channels (one m16 tensor-core tile of weight rows) and a contiguous range of K chunks of
// kChunkBytes; a CTA's warps split K, and so do the CTAs of one thread-block cluster.
constexpr int kRowsPerWarp = 16;
constexpr int kChunkBytes = 64;  // K bytes per warp step: 4 lanes x 16 bytes per weight row
constexpr int kMaxWarps = 8;     // warps per CTA
constexpr int kMaxSplits = 8;    // CTAs per cluster along K (portable cluster size limit)
constexpr int kMaxM = 16;        // two n8 tiles of tokens

struct DecodeConfig {
  int splits = 1;           // CTAs of one cluster along K (1: no cluster)
  int warps = 4;            // warps per CTA, each a K partition
  int chunks_per_part = 1;  // K chunks per (CTA, warp) partition
  int batch = 0;            // chunks per batch of register loads (2 or 4; 0: by token tiles)
};

constexpr int kWarpsPerSm = 16;  // resident warps per SM at the kernel's 128-register bound

// The work split for an N x K weight on a GPU with `sms` SMs.  `splits` > 0 forces the
// cluster size (tests, benchmarks), `warps` > 0 the warps per CTA and `batch` > 0 the
// chunks per load batch (benchmarks); clusters (splits > 1) need sm_90 (`clusters`).
// Chosen (H100, benchmarks/dev/bench_scaled_mm_decode.py): no cluster; 4 or 8 warps per CTA
// splitting K, whichever leaves the last wave of warps fuller (4 on a tie: fewer partial
// sums), e.g. 8 for N = 4096 (one full wave instead of half of one) and N = 28672 (6.8 waves
// instead of 3.4), 4 for N = 6144; batches of 4 chunks for one token tile, 2 for two
// (chosen at launch, `batch` = 0).
inline DecodeConfig choose_config(int64_t N, int64_t K, int sms, bool clusters, int splits = -1, int warps = -1,
                                  int batch = -1) {
  const int64_t chunks = (K + kChunkBytes - 1) / kChunkBytes;
  const int64_t tiles = (N + kRowsPerWarp - 1) / kRowsPerWarp;
  DecodeConfig c;
  if (splits > 0) {
    c.splits = static_cast<int>(std::min<int64_t>(std::min(splits, clusters ? kMaxSplits : 1), chunks));
    c.warps = static_cast<int>(std::clamp<int64_t>((chunks + c.splits - 1) / c.splits, 1, 4));
  } else {
    auto last_wave_fill = [&](int w) {
      const double waves = double(tiles * w) / (double(std::max(sms, 1)) * kWarpsPerSm);
      return waves / std::max(1.0, double(static_cast<int64_t>(waves + 0.999999)));
    };
    c.splits = 1;
    c.warps = last_wave_fill(8) > last_wave_fill(4) + 0.02 ? 8 : 4;
    c.warps = static_cast<int>(std::min<int64_t>(c.warps, chunks));
  }
  if (warps > 0) c.warps = std::min(warps, kMaxWarps);
  if (batch > 0) c.batch = batch;
  const int64_t p = int64_t(c.splits) * c.warps;
  c.chunks_per_part = static_cast<int>(std::max<int64_t>(1, (chunks + p - 1) / p));
  return c;
}

// Per-input-dtype launchers (one .cu file each); kQOk or a QStatus.  The caller checks
// the contract: M <= kMaxM, K % 16 == 0, 16-byte aligned a/b starts and row pitches.
// `cuda_error` receives the cudaError_t of a failed launch.
int launch_i8(const ScaledMmParams& p, const DecodeConfig& c, int* cuda_error);
int launch_fp8(const ScaledMmParams& p, const DecodeConfig& c, int* cuda_error);

}  // namespace quantfuse::decode
