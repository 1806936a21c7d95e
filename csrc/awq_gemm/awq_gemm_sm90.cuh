// AWQ W4A16 prefill GEMM on Hopper: CUTLASS 3.x mixed-input warp-specialized kernel
// assembly, tile configurations and the prepared int4 layout.  Included only by
// awq_gemm_sm90.cu and awq_gemm_sm90_tiles_c<C>.cu (and nothing here includes torch).
//
// Problem (swapped, see awq_gemm_sm90.h):  D^T[N, M] = W^T[N, K] . x^T[K, M] + bias[N]
//   kernel "A"  = the int4 weight, [N, K] K-major, cutlass::uint4b_t (q in 0..15), with
//                 group-wise scale [K/g, N] and zero' = -z*s [K/g, N] (both N-contiguous,
//                 which is what the collective's "MN-major" scale stride means here);
//   kernel "B"  = x [M, K] K-major;
//   kernel "D"  = D^T [N, M] column-major == out [M, N] row-major, through an EVT
//                 acc + bias, bias a column broadcast (per kernel row = per channel), nullable.
#pragma once

// Device asserts make ptxas serialise the wgmma pipeline; build without them.
#ifndef NDEBUG
#define NDEBUG
#endif

#include <cuda_runtime.h>
#include <type_traits>

#include "cutlass/cutlass.h"
#include "cute/tensor.hpp"
#include "cutlass/numeric_types.h"
#include "cutlass/gemm/dispatch_policy.hpp"
#include "cutlass/gemm/collective/collective_builder.hpp"
#include "cutlass/epilogue/collective/collective_builder.hpp"
#include "cutlass/epilogue/fusion/sm90_visitor_tma_warpspecialized.hpp"
#include "cutlass/epilogue/fusion/sm90_visitor_load_tma_warpspecialized.hpp"
#include "cutlass/epilogue/fusion/sm90_visitor_compute_tma_warpspecialized.hpp"
#include "cutlass/gemm/kernel/gemm_universal.hpp"
#include "cutlass/gemm/device/gemm_universal_adapter.h"

#include "awq_gemm/awq_gemm_sm90.h"
#include "common/cutlass_run.h"
#include "common/device_attribute.h"

namespace quantfuse::awq_sm90 {

using namespace cute;

// ------------------------------------------------------------------ prepared int4 layout
// One warp's share of a 64x16 (rows x k) wgmma A fragment is a 16x16 block; lane
// l = 4*(r%8) + (k%8)/2 holds 8 values v = (k%2) + 2*(r/8) + 4*(k/8).  Storing each lane's
// 8 values contiguously (one 32-bit shared-memory load per fragment) at position
// 4*(v%2) + v/2 (order [0,2,4,6,1,3,5,7]: value pairs (0,1), (2,3), ... sit in nibbles
// i and i+4, which the converter turns into one half2/bfloat162 each with one lop3 + one
// sub/fma) gives offset(r, k) = 32*(r%8) + (r/8) + 4*(k%2) + 8*((k/2)%4) + 2*(k/8).
// This is the atom CUTLASS's compute_memory_reordering_atom<T, _1, [0,2,4,6,1,3,5,7]>
// yields for 16-bit MMAs (checked offline: identical for all 256 points).
using QuantAtom = Layout<Shape<Shape<_8, _2>, Shape<_2, _4, _2>>, Stride<Stride<_32, _1>, Stride<_4, _8, _2>>>;
// Tiled over (N, K, L=1): 16x16 atoms, n-blocks fastest.
using LayoutQReordered = decltype(tile_to_shape(QuantAtom{}, make_shape(int{}, int{}, int{})));

inline LayoutQReordered make_layout_q_reordered(int N, int K) {
  return tile_to_shape(QuantAtom{}, make_shape(N, K, 1));
}

// The sm_80 device pass (CI compiles every file for sm_90a and sm_80) must not
// instantiate the Hopper mainloop: the kernel body exists only for sm_90a.
template <class Kernel>
struct Sm90Only : Kernel {
  template <class... Args>
  CUTLASS_DEVICE void operator()(Args&&... args) {
#if defined(__CUDA_ARCH__) && (__CUDA_ARCH__ >= 900) && defined(__CUDA_ARCH_FEAT_SM90_ALL)
    Kernel::operator()(std::forward<Args>(args)...);
#endif
  }
};

// ------------------------------------------------------------------ tile configurations
// Tile = (weight rows [kernel M], tokens [kernel N], K).  Pingpong: one consumer warpgroup
// per tile, two alternating (one's epilogue hides under the other's mainloop); Cooperative:
// both warpgroups on one tile (128 weight rows, 64 each).  Scheduler: CUTLASS's persistent
// tile scheduler (void), or its stream-K scheduler (cooperative kernels only), which splits
// the K loop of the last tiles over the SMs that the whole tiles leave idle.
template <int TM, int TN, int TK, bool Coop, int ClusterM = 1, class Scheduler_ = void>
struct Config {
  using Scheduler = Scheduler_;
  using Tile = Shape<Int<TM>, Int<TN>, Int<TK>>;
  using Cluster = Shape<Int<ClusterM>, _1, _1>;
  using KernelSchedule = std::conditional_t<Coop, cutlass::gemm::KernelTmaWarpSpecializedCooperative,
                                            cutlass::gemm::KernelTmaWarpSpecializedPingpong>;
  using EpiSchedule = std::conditional_t<Coop, cutlass::epilogue::TmaWarpSpecializedCooperative,
                                         cutlass::epilogue::TmaWarpSpecialized>;
  static constexpr int kTileM = TM;
  static constexpr int kTileN = TN;
  static constexpr int kTileK = TK;
};

// Measured on an H100 (fp16, group 128, the four Llama shapes, M 128..8192): chosen by
// choose_config (awq_gemm_sm90_choice.h), a wave cost model over the configurations below.
// 0: 64 weight rows x 128 tokens x 64, ping-pong: small M, any group size.
using ConfigSmall = Config<64, 128, 64, false>;
// 1: same with 128-deep K tiles (half the barrier round trips per K): ~10% faster at
//    M <= 256, needs group_size % 128 == 0 (or per-channel) and K % 128 == 0.
using ConfigSmallK128 = Config<64, 128, 128, false>;
// 2: 64 x 256 x 64 ping-pong: medium M where 128-row tiles leave SMs idle.
using ConfigMedium = Config<64, 256, 64, false>;
// 3: 128 x 256 x 64 cooperative, cluster 2x1 (the x tile multicast to both CTAs): large M.
//    (Same tile without the cluster: 0-15% slower; 128x128 tiles, 64x64 tiles, 128-deep K
//    for large tiles and the plain (not reordered) int4 layout were all slower.)
using ConfigLarge = Config<128, 256, 64, true, 2>;
// 4: 128 x 128 x 64 cooperative with the stream-K scheduler: M where whole tiles leave much
//    of the last wave idle (e.g. 6144 x 4096 at M = 384: 144 tiles on 132 SMs).
using ConfigStreamK = Config<128, 128, 64, true, 1, cutlass::gemm::StreamKScheduler>;
// 5-7: 64 weight rows x 160 / 192 / 224 tokens x 128, ping-pong; 8-10: 128 x 160 / 192 /
//    224 x 64 cooperative, cluster 2x1.  Token tiles sized to M between the multiples of
//    128: the kernel keeps up with cuBLAS where its tiles fill whole waves (4096 x 4096 at
//    M = 256 and 512), and at M = 320 a 160-token tile fills the wave that 128- and
//    256-token tiles miss (cuBLAS runs 80-token tiles there).  (64 x 256 x 128 is never
//    faster than config 2; the ping-pong widths with a 2x1 cluster multicasting x are within
//    1.5% of these at the median for 128-192 tokens, and for 224 2% faster and 8% slower at
//    the two points where 64 x 224 is chosen.)
template <int TN>
using ConfigWideK128 = Config<64, TN, 128, false>;
template <int TN>
using ConfigWideCoop = Config<128, TN, 64, true, 2>;
// 11, 12: 128 x 256 and 128 x 192 tiles, K 64 deep, cooperative, cluster 2x1, with the
//    stream-K scheduler: large M where the whole tiles of configs 3 and 9 leave most of the
//    last wave idle (4096 x 14336 at M = 1152: 160 tiles of 128 x 256 on 132 SMs, 0.81x cuBLAS
//    at best with whole tiles, 0.95-0.97x with config 12).
template <int TN>
using ConfigWideStreamK = Config<128, TN, 64, true, 2, cutlass::gemm::StreamKScheduler>;
// 13: 64 x 64 x 128 ping-pong: at most 64 tokens, where a 128-token tile is half padding (x
//    copied into a padded buffer, or TMA's out-of-bounds fill, which runs slowly).
using ConfigNarrow = Config<64, 64, 128, false>;

// Configuration index -> type; kCosts (awq_gemm_sm90_choice.h) lists the same tiles.
template <int C> struct ConfigAt;
template <> struct ConfigAt<0> { using type = ConfigSmall; };
template <> struct ConfigAt<1> { using type = ConfigSmallK128; };
template <> struct ConfigAt<2> { using type = ConfigMedium; };
template <> struct ConfigAt<3> { using type = ConfigLarge; };
template <> struct ConfigAt<4> { using type = ConfigStreamK; };
template <> struct ConfigAt<5> { using type = ConfigWideK128<160>; };
template <> struct ConfigAt<6> { using type = ConfigWideK128<192>; };
template <> struct ConfigAt<7> { using type = ConfigWideK128<224>; };
template <> struct ConfigAt<8> { using type = ConfigWideCoop<160>; };
template <> struct ConfigAt<9> { using type = ConfigWideCoop<192>; };
template <> struct ConfigAt<10> { using type = ConfigWideCoop<224>; };
template <> struct ConfigAt<11> { using type = ConfigWideStreamK<256>; };
template <> struct ConfigAt<12> { using type = ConfigWideStreamK<192>; };
template <> struct ConfigAt<13> { using type = ConfigNarrow; };

template <class T, class Cfg>
struct AwqGemm {
  using ElementQ = cutlass::uint4b_t;
  using ElementAcc = float;
  using Tile = typename Cfg::Tile;
  using Cluster = typename Cfg::Cluster;
  using LayoutQ = LayoutQReordered;
  using LayoutX = cutlass::layout::ColumnMajor;  // x [M, K] as the kernel's "B" [M, K] K-major
  using LayoutD = cutlass::layout::ColumnMajor;  // D^T [N, M]
  static constexpr int kAlignQ = 128 / cutlass::sizeof_bits<ElementQ>::value;  // 32
  static constexpr int kAlignT = 128 / cutlass::sizeof_bits<T>::value;         // 8

  using Bias = cutlass::epilogue::fusion::Sm90ColBroadcast<0, Tile, T, float, Stride<_1, _0, _0>, 1, true>;
  using Add = cutlass::epilogue::fusion::Sm90Compute<cutlass::plus, T, float,
                                                     cutlass::FloatRoundStyle::round_to_nearest>;
  using EVT = cutlass::epilogue::fusion::Sm90EVT<Add, cutlass::epilogue::fusion::Sm90AccFetch, Bias>;

  using CollectiveEpilogue = typename cutlass::epilogue::collective::CollectiveBuilder<
      cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, Tile, Cluster,
      cutlass::epilogue::collective::EpilogueTileAuto, ElementAcc, float,
      void, LayoutD, kAlignT,  // no C operand
      T, LayoutD, kAlignT, typename Cfg::EpiSchedule, EVT>::CollectiveOp;

  using CollectiveMainloop = typename cutlass::gemm::collective::CollectiveBuilder<
      cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp,
      cute::tuple<ElementQ, T, T>, LayoutQ, kAlignQ,  // ConvertAndScaleWithZero
      T, LayoutX, kAlignT,
      ElementAcc, Tile, Cluster,
      cutlass::gemm::collective::StageCountAutoCarveout<static_cast<int>(
          sizeof(typename CollectiveEpilogue::SharedStorage))>,
      typename Cfg::KernelSchedule>::CollectiveOp;

  using KernelBase = cutlass::gemm::kernel::GemmUniversal<Shape<int, int, int, int>, CollectiveMainloop,
                                                          CollectiveEpilogue, typename Cfg::Scheduler>;
  using Gemm = cutlass::gemm::device::GemmUniversalAdapter<Sm90Only<KernelBase>>;

  static int run(const GemmParams& p) {
    using StrideQ = typename CollectiveMainloop::StrideA;
    using StrideX = typename KernelBase::StrideB;
    using StrideD = typename KernelBase::StrideD;
    using StrideS = typename CollectiveMainloop::StrideScale;
    const int N = static_cast<int>(p.N), M = static_cast<int>(p.M), K = static_cast<int>(p.K);
    if (K % Cfg::kTileK != 0 || (p.group_size != K && p.group_size % Cfg::kTileK != 0)) return kCannotImplement;

    const StrideQ stride_q = make_layout_q_reordered(N, K);
    StrideX stride_x{};
    get<0>(stride_x) = K;
    get<2>(stride_x) = int64_t(M) * K;
    StrideD stride_d{};
    get<1>(stride_d) = N;
    get<2>(stride_d) = int64_t(M) * N;
    StrideS stride_s{};
    get<1>(stride_s) = N;
    get<2>(stride_s) = int64_t(N) * (K / p.group_size);

    typename EVT::Arguments evt{{}, {static_cast<const T*>(p.bias), T(0), {}}, {}};
    typename Gemm::Arguments args{
        cutlass::gemm::GemmUniversalMode::kGemm,
        {N, M, K, 1},
        {static_cast<const ElementQ*>(p.wq), stride_q, static_cast<const T*>(p.x), stride_x,
         static_cast<const T*>(p.scales), stride_s, p.group_size, static_cast<const T*>(p.zeros)},
        {evt, nullptr, stride_d, static_cast<T*>(p.out), stride_d}};
    args.hw_info.device_id = p.device;
    args.hw_info.sm_count = quantfuse::sm_count(p.device, 0);
    if constexpr (std::is_same_v<typename Cfg::Scheduler, cutlass::gemm::StreamKScheduler>) {
      // CUTLASS's heuristic keeps whole tiles when they fit one wave, which leaves SMs idle.
      args.scheduler.decomposition_mode = KernelBase::TileScheduler::DecompositionMode::StreamK;
    }

    if (Gemm::can_implement(args) != cutlass::Status::kSuccess) return kCannotImplement;
    const size_t ws_bytes = Gemm::get_workspace_size(args);
    void* ws = nullptr;
    if (ws_bytes > 0) {
      if (p.alloc == nullptr) return kInitFailed;
      ws = p.alloc(ws_bytes, p.alloc_ctx);
    }
    if (quantfuse::cutlass_run<Gemm>(args, ws, static_cast<cudaStream_t>(p.stream)) != cutlass::Status::kSuccess)
      return kLaunchFailed;
    return cudaPeekAtLastError() == cudaSuccess ? kOk : kLaunchFailed;
  }
};

// ------------------------------------------------------------------ weight preparation
// AWQ packing: logical column 8c+i of a packed int32 sits at nibble (i%2)*4 + i/2.
CUTLASS_HOST_DEVICE constexpr int awq_nibble(int i) { return (i % 2) * 4 + i / 2; }

// zeros_out[g, n] = -z[g, n] * s[g, n]: the product is exact in fp32 (4 x 11 bits), so one
// rounding to T.
template <class T>
__global__ void prepare_zeros_kernel(const uint32_t* __restrict__ qzeros, const T* __restrict__ scales,
                                     T* __restrict__ zeros_out, int64_t total, int N) {
  const int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i >= total) return;
  const int64_t g = i / N;
  const int n = static_cast<int>(i % N);
  const uint32_t z = (qzeros[g * (N / 8) + n / 8] >> (4 * awq_nibble(n % 8))) & 0xFu;
  zeros_out[i] = T(-static_cast<float>(z) * static_cast<float>(scales[i]));
}

template <class T>
cudaError_t prepare_zeros(const uint32_t* qzeros, const void* scales, void* zeros_out, int groups, int N,
                          cudaStream_t stream) {
  const int64_t total = int64_t(groups) * N;
  if (total == 0) return cudaSuccess;
  const int threads = 256;
  prepare_zeros_kernel<T><<<static_cast<unsigned>((total + threads - 1) / threads), threads, 0, stream>>>(
      qzeros, static_cast<const T*>(scales), static_cast<T*>(zeros_out), total, N);
  return cudaGetLastError();
}

// One configuration's kernel for one dtype.  Each is instantiated in its own translation
// unit (awq_gemm_sm90_tiles_c<C>.cu) so that a parallel build compiles them side by side;
// the extern declarations below keep every other file from instantiating them again.
template <class T, int C>
int run_config(const GemmParams& p) {
  using Cfg = typename ConfigAt<C>::type;
  static_assert(Cfg::kTileN == kCosts[C].tokens && Cfg::kTileM == kCosts[C].rows &&
                    std::is_same_v<typename Cfg::Scheduler, cutlass::gemm::StreamKScheduler> == kCosts[C].stream_k,
                "kCosts (awq_gemm_sm90_choice.h) and ConfigAt disagree");
  return AwqGemm<T, Cfg>::run(p);
}

#define QF_AWQ_SM90_EXTERN(C)                                                   \
  extern template int run_config<cutlass::half_t, C>(const GemmParams&);       \
  extern template int run_config<cutlass::bfloat16_t, C>(const GemmParams&);
QF_AWQ_SM90_EXTERN(0) QF_AWQ_SM90_EXTERN(1) QF_AWQ_SM90_EXTERN(2) QF_AWQ_SM90_EXTERN(3)
QF_AWQ_SM90_EXTERN(4) QF_AWQ_SM90_EXTERN(5) QF_AWQ_SM90_EXTERN(6) QF_AWQ_SM90_EXTERN(7)
QF_AWQ_SM90_EXTERN(8) QF_AWQ_SM90_EXTERN(9) QF_AWQ_SM90_EXTERN(10) QF_AWQ_SM90_EXTERN(11)
QF_AWQ_SM90_EXTERN(12) QF_AWQ_SM90_EXTERN(13)
#undef QF_AWQ_SM90_EXTERN

// Instantiates configuration C for both activation dtypes (one line per tiles file).
#define QF_AWQ_SM90_INSTANTIATE(C)                                     \
  namespace quantfuse::awq_sm90 {                                      \
  template int run_config<cutlass::half_t, C>(const GemmParams&);      \
  template int run_config<cutlass::bfloat16_t, C>(const GemmParams&);  \
  }

}  // namespace quantfuse::awq_sm90
