// CUTLASS 3.x SM90 GEMM assembly for the W8A8 family: TMA + wgmma warp-specialized
// mainloops from the collective builders, EVT epilogues (epilogue_sm90.cuh), and the
// M/N-based choice of tile configuration.  Included only by the per-dtype .cu files.
#pragma once

// Device asserts become calls (__assertfail) that make ptxas serialise the wgmma
// pipeline (warning C7510); the kernels are built without them.
#ifndef NDEBUG
#define NDEBUG
#endif

#include <cuda_runtime.h>

#include "cutlass/cutlass.h"
#include "cute/tensor.hpp"
#include "cutlass/numeric_types.h"
#include "cutlass/gemm/dispatch_policy.hpp"
#include "cutlass/gemm/collective/collective_builder.hpp"
#include "cutlass/epilogue/collective/collective_builder.hpp"
#include "cutlass/gemm/kernel/gemm_universal.hpp"
#include "cutlass/gemm/device/gemm_universal_adapter.h"
#include "cutlass/util/packed_stride.hpp"

#include "common/cutlass_run.h"
#include "common/device_attribute.h"
#include "scaled_mm/epilogue_sm90.cuh"
#include "scaled_mm/scaled_mm_launch.h"

namespace quantfuse::sm90 {

using namespace cute;

// The sm_80 device pass (CI compiles every file for sm_90a and sm_80) must not
// instantiate the Hopper mainloop: the kernel body exists only for sm_90a.
template <class Kernel>
struct EnableSm90Only : Kernel {
  template <class... Args>
  CUTLASS_DEVICE void operator()(Args&&... args) {
#if defined(__CUDA_ARCH__) && (__CUDA_ARCH__ >= 900) && defined(__CUDA_ARCH_FEAT_SM90_ALL)
    Kernel::operator()(std::forward<Args>(args)...);
#endif
  }
};

// ---------------------------------------------------------------------- tile configs
// 3: decode (M <= 32), swapped: D^T = B^T A^T with 64 (of N) x 32 (of M) x 256 tiles: the
//    weight fills the 64-row wgmma operand, the few tokens the narrow side.  N/64 CTAs,
//    each streaming its 64 weight rows through a deep (auto, ~7 stage) TMA pipeline.
//    (128x32x128 cooperative tiles with the StreamKScheduler are slower here: 1x4096x4096
//    takes 21.4 µs against 14.9.)
struct ConfigSwapSmall {
  using Tile = Shape<_64, _32, _256>;
  using Cluster = Shape<_1, _1, _1>;
  using KernelSchedule = cutlass::gemm::KernelTmaWarpSpecialized;
  using EpiSchedule = cutlass::epilogue::TmaWarpSpecialized;
  using Scheduler = void;
  static constexpr int kStages = 0;
  static constexpr bool kSwap = true;
  static constexpr bool kFp8Cooperative = false;
  static constexpr int kSwizzle = 1;
  static constexpr int kRaster = 0;  // CUTLASS's heuristic: along the shorter side
};
// 0: small M (M <= 64; fp8 up to 128 when N is narrow): 64x32x256 tiles, one consumer
//    warpgroup, 4 stages so that two CTAs fit on an SM; many CTAs along N to stream the weight
//    at DRAM speed.
struct ConfigSmall {
  using Tile = Shape<_64, _32, _256>;
  using Cluster = Shape<_1, _1, _1>;
  using KernelSchedule = cutlass::gemm::KernelTmaWarpSpecialized;
  using EpiSchedule = cutlass::epilogue::TmaWarpSpecialized;
  using Scheduler = void;
  static constexpr int kStages = 4;
  static constexpr bool kSwap = false;
  static constexpr bool kFp8Cooperative = false;
  static constexpr int kSwizzle = 1;
  static constexpr int kRaster = 0;  // CUTLASS's heuristic: along the shorter side
};
// 1: medium M (64 < M <= 256): 64x128x128 ping-pong (two consumer warpgroups alternate
//    tiles so one's epilogue overlaps the other's mainloop), cluster 2x1.
struct ConfigMedium {
  using Tile = Shape<_64, _128, _128>;
  using Cluster = Shape<_2, _1, _1>;
  using KernelSchedule = cutlass::gemm::KernelTmaWarpSpecializedPingpong;
  using EpiSchedule = cutlass::epilogue::TmaWarpSpecialized;
  using Scheduler = void;
  static constexpr int kStages = 0;  // auto
  static constexpr bool kSwap = false;
  // 64-row tiles cannot be split over two warpgroups; 64x128 per warpgroup keeps the fp8
  // accumulator + promotion buffer at 2 x 64 registers, so ping-pong stays for fp8.
  static constexpr bool kFp8Cooperative = false;
  static constexpr int kSwizzle = 1;
  static constexpr int kRaster = 0;  // CUTLASS's heuristic: along the shorter side
};
// 2: large M: 128x128x128 ping-pong, cluster 2x1 (A/B multicast within the cluster).
//    fp8: cooperative instead.  The (non-fast-accum) FP8 mainloop keeps a second fp32
//    accumulator for the promotion; with ping-pong one warpgroup owns the whole 128x128
//    tile, 2 x 128 accumulator registers per thread, which spills.  Cooperative splits the
//    tile over two warpgroups (2 x 64 registers).
struct ConfigLarge {
  using Tile = Shape<_128, _128, _128>;
  using Cluster = Shape<_2, _1, _1>;
  using KernelSchedule = cutlass::gemm::KernelTmaWarpSpecializedPingpong;
  using EpiSchedule = cutlass::epilogue::TmaWarpSpecialized;
  using Scheduler = void;
  static constexpr int kStages = 0;
  static constexpr bool kSwap = false;
  static constexpr bool kFp8Cooperative = true;
  static constexpr int kSwizzle = 1;
  static constexpr int kRaster = 0;
};

// 4 (fp8 only): large M, 128x128x128 cooperative without a cluster: no per-stage coupling
//    of two CTAs through the multicast barrier.  (The fp8 row-wise kernel torch._scaled_mm runs
//    on the H100, cuBLASLt's nvjet 128x128x128, uses no cluster either.)  Tiles visited in
//    bands of 4 along M: at 28672 x 4096, M = 8192 Nsight Compute saw config 2 with a 53% L2
//    hit rate (cuBLASLt 90%), and the bands cut its time by 7-9%.
struct ConfigLargeNoCluster : ConfigLarge {
  using Cluster = Shape<_1, _1, _1>;
  static constexpr int kSwizzle = 4;
  static constexpr int kRaster = 1;  // along M
};

// By M, then by how well the output tiles fill the SMs (H100 sweep, 128 <= M <= 8192 on the
// four LLM shapes: benchmarks/dev/bench_scaled_mm_configs.py):
// * 64 < M <= 256 takes the medium 64x128 tiles while they fit in one wave, else the large
//   128x128 ones (N = 6144 or 28672 at M = 256: 6-26% faster, int8 and fp8);
// * fp8 at 64 < M <= 128 takes the small tiles when the medium ones would fill less than half
//   the GPU (N = 4096: 25-30% faster; the fp8 ping-pong mainloop pays for its promotion);
// * fp8 large tiles run without a cluster, in bands of 4 tiles along M (config 4).  Against
//   config 2 in one run: 12-20% faster at M = 1024 (equal on 4096 x 4096), 1-11% at M = 8192,
//   -2..+7% at M = 4096, up to 6% slower at M = 2048.
inline int choose_config(int64_t M, int64_t N, int sms, bool fp8) {
  if (M <= 32) return 3;
  if (M <= 64) return 0;
  const int64_t medium_tiles = ((M + 63) / 64) * ((N + 127) / 128);
  if (M <= 128 && fp8 && sms > 0 && 2 * medium_tiles < sms) return 0;
  if (M <= 256 && (sms <= 0 || medium_tiles <= sms)) return 1;
  return fp8 ? 4 : 2;
}

template <class ElementAB, class ElementD, template <class, class, bool> class Epi, class Config>
struct Sm90Gemm {
  using ElementAcc = std::conditional_t<std::is_same_v<ElementAB, int8_t>, int32_t, float>;
  using Tile = typename Config::Tile;
  using Cluster = typename Config::Cluster;
  static constexpr bool kSwap = Config::kSwap;
  static constexpr bool kCoop = !std::is_same_v<ElementAB, int8_t> && Config::kFp8Cooperative;
  using KernelSchedule = std::conditional_t<kCoop, cutlass::gemm::KernelTmaWarpSpecializedCooperative,
                                            typename Config::KernelSchedule>;
  using EpiSchedule = std::conditional_t<kCoop, cutlass::epilogue::TmaWarpSpecializedCooperative,
                                         typename Config::EpiSchedule>;
  using Epilogue = Epi<Tile, ElementD, kSwap>;
  // D [M, N] row-major; swapped, the kernel writes D^T [N, M], i.e. column-major.
  using LayoutD = std::conditional_t<kSwap, cutlass::layout::ColumnMajor, cutlass::layout::RowMajor>;
  using EVT = typename Epilogue::EVT;

  static constexpr int kAlignAB = 16;  // elements (1 byte each): 16-byte TMA alignment
  static constexpr int kAlignD = 16 / sizeof(ElementD);

  using CollectiveEpilogue = typename cutlass::epilogue::collective::CollectiveBuilder<
      cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, Tile, Cluster,
      cutlass::epilogue::collective::EpilogueTileAuto, ElementAcc, float,
      void, LayoutD, kAlignD,       // no C operand: bias comes from the EVT
      ElementD, LayoutD, kAlignD,
      EpiSchedule, EVT>::CollectiveOp;

  using Stages = std::conditional_t<
      (Config::kStages > 0), cutlass::gemm::collective::StageCount<(Config::kStages > 0 ? Config::kStages : 1)>,
      cutlass::gemm::collective::StageCountAutoCarveout<static_cast<int>(
          sizeof(typename CollectiveEpilogue::SharedStorage))>>;

  using CollectiveMainloop = typename cutlass::gemm::collective::CollectiveBuilder<
      cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp,
      ElementAB, cutlass::layout::RowMajor, kAlignAB,
      ElementAB, cutlass::layout::ColumnMajor, kAlignAB,
      ElementAcc, Tile, Cluster, Stages, KernelSchedule>::CollectiveOp;

  using KernelBase = cutlass::gemm::kernel::GemmUniversal<Shape<int, int, int, int>, CollectiveMainloop,
                                                          CollectiveEpilogue, typename Config::Scheduler>;
  using Kernel = EnableSm90Only<KernelBase>;
  using Gemm = cutlass::gemm::device::GemmUniversalAdapter<Kernel>;

  static int run(const ScaledMmParams& p) {
    using StrideA = typename KernelBase::StrideA;
    using StrideB = typename KernelBase::StrideB;
    using StrideD = typename KernelBase::StrideD;
    using StrideC = typename KernelBase::StrideC;
    // Unswapped: A = activations (M, K), B = weights (N, K), both K-contiguous; D (M, N)
    // N-contiguous.  Swapped: A = weights, B = activations, D^T (N, M) with N contiguous.
    const void* ptr_a = kSwap ? p.b : p.a;
    const void* ptr_b = kSwap ? p.a : p.b;
    StrideA stride_a{};
    get<0>(stride_a) = kSwap ? p.ldb : p.lda;
    StrideB stride_b{};
    get<0>(stride_b) = kSwap ? p.lda : p.ldb;
    StrideD stride_d{};
    if constexpr (kSwap) {
      get<1>(stride_d) = p.ldd;
    } else {
      get<0>(stride_d) = p.ldd;
    }
    StrideC stride_c = stride_d;
    const int gm = static_cast<int>(kSwap ? p.N : p.M);
    const int gn = static_cast<int>(kSwap ? p.M : p.N);

    typename Gemm::Arguments args{
        cutlass::gemm::GemmUniversalMode::kGemm,
        {gm, gn, static_cast<int>(p.K), 1},
        {static_cast<const ElementAB*>(ptr_a), stride_a, static_cast<const ElementAB*>(ptr_b), stride_b},
        {Epilogue::args(p), nullptr, stride_c, static_cast<ElementD*>(p.d), stride_d}};
    if constexpr (!std::is_same_v<ElementAB, int8_t>) {
      // fp8: promote the wgmma accumulators to fp32 once per k-tile (CUTLASS requires a
      // multiple of the MMAs per k-tile; 4 MMAs of K=32 for 128-deep tiles, 8 for 256).
      args.mainloop.mma_promotion_interval = cute::max(4, int(size<2>(Tile{})) / 32);
    }
    // Persistent scheduler: the config's raster swizzle and order unless forced (tests,
    // benchmarks).  A swizzle of s visits the output tiles in bands s tiles wide.
    args.scheduler.max_swizzle_size = p.swizzle > 0 ? p.swizzle : Config::kSwizzle;
    using RasterOpt = cutlass::gemm::kernel::detail::RasterOrderOptions;
    const int raster = p.raster > 0 ? p.raster : Config::kRaster;
    args.scheduler.raster_order =
        raster == 1 ? RasterOpt::AlongM : (raster == 2 ? RasterOpt::AlongN : RasterOpt::Heuristic);
    args.hw_info.device_id = p.device;
    args.hw_info.sm_count = quantfuse::sm_count(p.device, 0);

    if (Gemm::can_implement(args) != cutlass::Status::kSuccess) return kQCannotImplement;
    size_t ws_bytes = Gemm::get_workspace_size(args);
    void* ws = nullptr;
    if (ws_bytes > 0) {
      if (p.alloc == nullptr) return kQInitFailed;
      ws = p.alloc(ws_bytes, p.alloc_ctx);
    }
    if (quantfuse::cutlass_run<Gemm>(args, ws, static_cast<cudaStream_t>(p.stream)) != cutlass::Status::kSuccess)
      return kQLaunchFailed;
    return kQOk;
  }

};

template <class ElementAB, class ElementD, template <class, class, bool> class Epi>
int dispatch(const ScaledMmParams& p) {
  constexpr bool kFp8 = !std::is_same_v<ElementAB, int8_t>;
  int cfg = p.config >= 0 ? p.config : choose_config(p.M, p.N, quantfuse::sm_count(p.device, 0), kFp8);
  switch (cfg) {
    case 0: return Sm90Gemm<ElementAB, ElementD, Epi, ConfigSmall>::run(p);
    case 1: return Sm90Gemm<ElementAB, ElementD, Epi, ConfigMedium>::run(p);
    case 2: return Sm90Gemm<ElementAB, ElementD, Epi, ConfigLarge>::run(p);
    case 3: return Sm90Gemm<ElementAB, ElementD, Epi, ConfigSwapSmall>::run(p);
    case 4:
      if constexpr (kFp8) return Sm90Gemm<ElementAB, ElementD, Epi, ConfigLargeNoCluster>::run(p);
      return kQUnsupported;
    default: return kQUnsupported;
  }
}

}  // namespace quantfuse::sm90

// One entry point per (input dtype, output dtype, epilogue) translation unit.
#define QF_SM90_ENTRY(name, ElementAB, ElementD, Epi)                                  \
  namespace quantfuse {                                                                \
  int name(const ScaledMmParams& p) { return sm90::dispatch<ElementAB, ElementD, sm90::Epi>(p); } \
  }
