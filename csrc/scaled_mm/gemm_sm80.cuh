// CUTLASS 2.x SM80 GEMM assembly for the int8 W8A8 family: multistage cp.async mainloop
// with mma.sync m16n8k32 (int8 x int8 -> int32, saturating), data-parallel tile order, and
// the 2.x epilogue visitor trees of epilogue_sm80.cuh.  Runs on A100-class GPUs (sm_80..89)
// and, since mma.sync / cp.async exist on Hopper too, on an H100 when forced (arch=80).
// Included only by the per-output-dtype .cu files.
#pragma once

#ifndef NDEBUG
#define NDEBUG
#endif

#include <cuda_runtime.h>

#include "cutlass/cutlass.h"
#include "cutlass/numeric_types.h"
#include "cutlass/gemm/gemm.h"
#include "cutlass/gemm/device/gemm_universal_adapter.h"
#include "cutlass/gemm/kernel/default_gemm_universal_with_visitor.h"
#include "cutlass/gemm/threadblock/threadblock_swizzle.h"
#include "cutlass/epilogue/threadblock/fusion/visitors.hpp"

#include "common/device_attribute.h"
#include "scaled_mm/epilogue_sm80.cuh"
#include "scaled_mm/scaled_mm_launch.h"

namespace quantfuse::sm80 {

using cutlass::gemm::GemmShape;

// ---------------------------------------------------------------------- tile configs
// Shared memory per stage: (TM + TN) * TK bytes.  Tiles run data-parallel (one CTA per output
// tile).  Stream-K (ThreadblockSwizzleStreamK) is slower on the H100 at every M and N
// measured (e.g. 4096x4096x4096: 187 vs 162 µs; M=1: 18.9 vs 16.9 µs), and its fix-up
// path costs a 1 KiB stack frame and 45% more compile time (benchmarks/bench_scaled_mm_sm80.py).
//
// 0: narrow (M <= 32): 32x64x128 tiles, 2 warps of 32x32, 6 stages (72 KiB).
//    Decode is a weight stream: narrow N tiles (N/64 CTAs), deep K tiles, many stages in flight.
struct ConfigNarrow {
  using Tile = GemmShape<32, 64, 128>;
  using Warp = GemmShape<32, 32, 128>;
  static constexpr int kStages = 6;
};
// 1: medium (32 < M <= 128, and larger M while 128x128 tiles would not fill the GPU):
//    64x128x64 tiles, 4 warps of 32x64, 6 stages (72 KiB).
struct ConfigMedium {
  using Tile = GemmShape<64, 128, 64>;
  using Warp = GemmShape<32, 64, 64>;
  static constexpr int kStages = 6;
};
// 2: large (M > 128 with at least one 128x128 tile per SM): 128x128x64 tiles, 4 warps of
//    64x64, 5 stages (80 KiB; two CTAs per SM on an A100's 164 KiB).
struct ConfigLarge {
  using Tile = GemmShape<128, 128, 64>;
  using Warp = GemmShape<64, 64, 64>;
  static constexpr int kStages = 5;
};

// By M, and for M > 128 by N: 128x128 tiles once there are at least as many as SMs, else the
// 64x128 ones (twice the CTAs).  H100 (132 SMs), bf16 out: M=256 N=4096 -> medium (22.9 vs
// 27.2 µs), M=256 N=28672 -> large (87.6 vs 103.1), M=1024 N=4096 -> large (44.4 vs 57.0).
inline int choose_config(int64_t M, int64_t N, int sms) {
  if (M <= 32) return 0;
  if (M <= 128) return 1;
  const int64_t large_tiles = ((M + 127) / 128) * ((N + 127) / 128);
  return large_tiles >= sms ? 2 : 1;
}

template <class ElementD, template <class, class> class Epi, class Config>
struct Sm80Gemm {
  using Tile = typename Config::Tile;
  using Warp = typename Config::Warp;
  using Instruction = GemmShape<16, 8, 32>;
  static constexpr int kAlignAB = 16;  // int8 elements: 16-byte cp.async
  // The 2.x epilogue's thread map: accumulators leave the warps through shared memory in
  // rows of 4-element (fp32-sized) accesses; the visitor nodes are partitioned with it.
  static constexpr int kAlignC = 4;
  using ThreadMap = cutlass::epilogue::threadblock::OutputTileThreadLayout<Tile, Warp, float, kAlignC, 1>;
  using Epilogue = Epi<ThreadMap, ElementD>;
  using EVT = typename Epilogue::EVT;

  using Kernel = typename cutlass::gemm::kernel::DefaultGemmWithVisitor<
      int8_t, cutlass::layout::RowMajor, cutlass::ComplexTransform::kNone, kAlignAB,
      int8_t, cutlass::layout::ColumnMajor, cutlass::ComplexTransform::kNone, kAlignAB,
      float, cutlass::layout::RowMajor, kAlignC,
      int32_t, float, cutlass::arch::OpClassTensorOp, cutlass::arch::Sm80,
      Tile, Warp, Instruction, EVT,
      cutlass::gemm::threadblock::GemmIdentityThreadblockSwizzle<>, Config::kStages,
      cutlass::arch::OpMultiplyAddSaturate, 1>::GemmKernel;
  using Gemm = cutlass::gemm::device::GemmUniversalAdapter<Kernel>;

  static int run(const ScaledMmParams& p) {
    const cutlass::gemm::GemmCoord size{static_cast<int>(p.M), static_cast<int>(p.N), static_cast<int>(p.K)};
    typename Gemm::Arguments args(cutlass::gemm::GemmUniversalMode::kGemm, size, /*batch_split=*/1,
                                  Epilogue::args(p), p.a, p.b, /*ptr_C=*/nullptr, /*ptr_D=*/nullptr,
                                  /*batch strides=*/0, 0, 0, 0, p.lda, p.ldb, /*ldc=*/0, /*ldd=*/0);
    Gemm gemm;
    if (gemm.can_implement(args) != cutlass::Status::kSuccess) return kQCannotImplement;
    size_t ws_bytes = Gemm::get_workspace_size(args);
    void* ws = nullptr;
    if (ws_bytes > 0) {
      if (p.alloc == nullptr) return kQInitFailed;
      ws = p.alloc(ws_bytes, p.alloc_ctx);
    }
    auto stream = static_cast<cudaStream_t>(p.stream);
    if (gemm.initialize(args, ws, stream) != cutlass::Status::kSuccess) return kQInitFailed;
    if (gemm.run(stream) != cutlass::Status::kSuccess) return kQLaunchFailed;
    return kQOk;
  }
};

template <class ElementD, template <class, class> class Epi>
int dispatch(const ScaledMmParams& p) {
  if (p.in_dtype != QDType::kInt8) return kQUnsupported;
  switch (p.config >= 0 ? p.config : choose_config(p.M, p.N, quantfuse::sm_count(p.device, 108))) {
    case 0: return Sm80Gemm<ElementD, Epi, ConfigNarrow>::run(p);
    case 1: return Sm80Gemm<ElementD, Epi, ConfigMedium>::run(p);
    case 2: return Sm80Gemm<ElementD, Epi, ConfigLarge>::run(p);
    default: return kQUnsupported;
  }
}

}  // namespace quantfuse::sm80

// One entry point per (output dtype, epilogue tree) translation unit.
#define QF_SM80_ENTRY(name, ElementD, Epi)                                                      \
  namespace quantfuse {                                                                         \
  int name(const ScaledMmParams& p) { return sm80::dispatch<ElementD, sm80::Epi>(p); }         \
  }
