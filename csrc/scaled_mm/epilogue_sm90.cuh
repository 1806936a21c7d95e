// Epilogue visitor trees (CUTLASS 3.x, SM90) for the W8A8 family.
//
// Every epilogue is composed from three kinds of leaves and compute nodes:
//   * Sm90AccFetch                      -- the accumulator (int32 for int8, fp32 for fp8)
//   * Sm90ColBroadcast<Stride<bool,..>> -- scale_a: per-token column [M] or, with a runtime
//                                          stride of 0, a per-tensor scalar (one kernel for both)
//   * Sm90RowBroadcast<Stride<..,bool>> -- scale_b: per-channel row [N] or per-tensor scalar
//   * Sm90RowBroadcast (nullable)       -- bias [N] (null -> 0), azp_adj [N]
//   * Sm90ColBroadcast                  -- azp [M] (per-token zero points)
//   * Sm90Compute<multiplies | minus | homogeneous_multiply_add>
//
//   Scaled             = s_a * (s_b * acc)
//   ScaledBias         = s_a * (s_b * acc) + bias           (MulAdd over the Scaled subtree)
//   ScaledBiasAzp      = s_a * (s_b * (acc - azp_adj)) + bias
//   ScaledBiasAzpToken = s_a * (s_b * (acc - azp * azp_adj)) + bias
// The zero-point terms are computed in int32 (exact, like the float64 reference);
// everything after the first scale in float32, one rounding to the output dtype.
#pragma once

#include "cutlass/cutlass.h"
#include "cutlass/functional.h"
#include "cutlass/epilogue/fusion/sm90_visitor_tma_warpspecialized.hpp"
#include "cutlass/epilogue/fusion/sm90_visitor_load_tma_warpspecialized.hpp"
#include "cutlass/epilogue/fusion/sm90_visitor_compute_tma_warpspecialized.hpp"

#include "scaled_mm/scaled_mm_launch.h"

namespace quantfuse::sm90 {

using namespace cute;
namespace fusion = cutlass::epilogue::fusion;

template <class Node>
struct is_row_bcast : std::false_type {};
template <int S, class C, class E, class EC, class St, int A, bool Nl>
struct is_row_bcast<fusion::Sm90RowBroadcast<S, C, E, EC, St, A, Nl>> : std::true_type {};

// Swap = true: the kernel computes D^T = B^T A^T (weights as the wgmma "A" operand, so
// that small M uses the narrow N-tile of the MMA instead of a 64-row tile that is mostly
// padding).  Then per-token quantities become row broadcasts and per-channel ones column
// broadcasts; the tree itself is unchanged.
template <class TileShape, class ElementD, bool Swap = false>
struct EpiNodes {
  static constexpr auto kRound = cutlass::FloatRoundStyle::round_to_nearest;
  using Acc = fusion::Sm90AccFetch;
  // Broadcasts along the token (M) and channel (N) axes of D.
  template <class T, int Align, bool Nullable>
  using ChanVec = std::conditional_t<Swap,
      fusion::Sm90ColBroadcast<0, TileShape, T, T, Stride<_1, _0, _0>, 1, Nullable>,
      fusion::Sm90RowBroadcast<0, TileShape, T, T, Stride<_0, _1, _0>, Align, Nullable>>;
  template <class T>
  using TokVec = std::conditional_t<Swap,
      fusion::Sm90RowBroadcast<0, TileShape, T, T, Stride<_0, _1, _0>, 1, false>,
      fusion::Sm90ColBroadcast<0, TileShape, T, T, Stride<_1, _0, _0>, 1, false>>;
  // Scalar-or-vector broadcasts: the bool stride is chosen at run time.
  using TokScale = std::conditional_t<Swap,
      fusion::Sm90RowBroadcast<0, TileShape, float, float, Stride<_0, bool, _0>, 1, false>,
      fusion::Sm90ColBroadcast<0, TileShape, float, float, Stride<bool, _0, _0>, 1, false>>;
  using ChanScale = std::conditional_t<Swap,
      fusion::Sm90ColBroadcast<0, TileShape, float, float, Stride<bool, _0, _0>, 1, false>,
      fusion::Sm90RowBroadcast<0, TileShape, float, float, Stride<_0, bool, _0>, 4, false>>;

  using ScaleA = TokScale;
  using ScaleB = ChanScale;
  using Bias = ChanVec<ElementD, 128 / cutlass::sizeof_bits<ElementD>::value, true>;
  using AzpAdj = ChanVec<int32_t, 4, false>;
  using Azp = TokVec<int32_t>;

  template <template <class> class Fn, class Out, class Compute = float>
  using Op = fusion::Sm90Compute<Fn, Out, Compute, kRound>;

  // Arguments of a row or column broadcast: pointer, and (for the bool-strided ones)
  // whether it is a vector (true) or a scalar (false).
  template <class Node, class T>
  static typename Node::Arguments vec_args(const T* ptr, bool is_vector = true) {
    typename Node::Arguments args{};
    if constexpr (is_row_bcast<Node>::value) {
      args.ptr_row = ptr;
      if constexpr (std::is_same_v<std::remove_cv_t<std::remove_reference_t<decltype(get<1>(args.dRow))>>, bool>)
        get<1>(args.dRow) = is_vector;
    } else {
      args.ptr_col = ptr;
      if constexpr (std::is_same_v<std::remove_cv_t<std::remove_reference_t<decltype(get<0>(args.dCol))>>, bool>)
        get<0>(args.dCol) = is_vector;
    }
    return args;
  }

  static typename ScaleA::Arguments scale_a(const ScaledMmParams& p) {
    return vec_args<ScaleA>(p.scale_a, p.scale_a_per_token);
  }
  static typename ScaleB::Arguments scale_b(const ScaledMmParams& p) {
    return vec_args<ScaleB>(p.scale_b, p.scale_b_per_channel);
  }
  static typename Bias::Arguments bias(const ScaledMmParams& p) {
    return vec_args<Bias>(static_cast<const ElementD*>(p.bias));
  }
  static typename AzpAdj::Arguments azp_adj(const ScaledMmParams& p) { return vec_args<AzpAdj>(p.azp_adj); }
  static typename Azp::Arguments azp(const ScaledMmParams& p) { return vec_args<Azp>(p.azp); }
};

// s_b * X (float), X being any subtree
template <class N, class X>
using ScaleBTimes = fusion::Sm90EVT<typename N::template Op<cutlass::multiplies, float>, typename N::ScaleB, X>;

template <class TileShape, class ElementD, bool Swap>
struct Scaled {
  using N = EpiNodes<TileShape, ElementD, Swap>;
  using Inner = ScaleBTimes<N, typename N::Acc>;
  using EVT = fusion::Sm90EVT<typename N::template Op<cutlass::multiplies, ElementD>, typename N::ScaleA, Inner>;
  static typename EVT::Arguments args(const ScaledMmParams& p) {
    return {N::scale_a(p), {N::scale_b(p), {}, {}}, {}};
  }
};

template <class TileShape, class ElementD, bool Swap>
struct ScaledBias {
  using N = EpiNodes<TileShape, ElementD, Swap>;
  using Inner = ScaleBTimes<N, typename N::Acc>;
  using EVT = fusion::Sm90EVT<typename N::template Op<cutlass::homogeneous_multiply_add, ElementD>,
                              typename N::ScaleA, Inner, typename N::Bias>;
  static typename EVT::Arguments args(const ScaledMmParams& p) {
    return {N::scale_a(p), {N::scale_b(p), {}, {}}, N::bias(p), {}};
  }
};

template <class TileShape, class ElementD, bool Swap>
struct ScaledBiasAzp {
  using N = EpiNodes<TileShape, ElementD, Swap>;
  // acc - azp_adj, in int32
  using AccMinusAdj = fusion::Sm90EVT<typename N::template Op<cutlass::minus, int32_t, int32_t>,
                                      typename N::Acc, typename N::AzpAdj>;
  using Inner = ScaleBTimes<N, AccMinusAdj>;
  using EVT = fusion::Sm90EVT<typename N::template Op<cutlass::homogeneous_multiply_add, ElementD>,
                              typename N::ScaleA, Inner, typename N::Bias>;
  static typename EVT::Arguments args(const ScaledMmParams& p) {
    return {N::scale_a(p), {N::scale_b(p), {{}, N::azp_adj(p), {}}, {}}, N::bias(p), {}};
  }
};

template <class TileShape, class ElementD, bool Swap>
struct ScaledBiasAzpToken {
  using N = EpiNodes<TileShape, ElementD, Swap>;
  // azp (x) azp_adj, in int32
  using AzpOuter = fusion::Sm90EVT<typename N::template Op<cutlass::multiplies, int32_t, int32_t>,
                                   typename N::Azp, typename N::AzpAdj>;
  using AccMinusOuter = fusion::Sm90EVT<typename N::template Op<cutlass::minus, int32_t, int32_t>,
                                        typename N::Acc, AzpOuter>;
  using Inner = ScaleBTimes<N, AccMinusOuter>;
  using EVT = fusion::Sm90EVT<typename N::template Op<cutlass::homogeneous_multiply_add, ElementD>,
                              typename N::ScaleA, Inner, typename N::Bias>;
  static typename EVT::Arguments args(const ScaledMmParams& p) {
    return {N::scale_a(p),
            {N::scale_b(p), {{}, {N::azp(p), N::azp_adj(p), {}}, {}}, {}},
            N::bias(p),
            {}};
  }
};

}  // namespace quantfuse::sm90
