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

template <class TileShape, class ElementD>
struct EpiNodes {
  static constexpr auto kRound = cutlass::FloatRoundStyle::round_to_nearest;
  using Acc = fusion::Sm90AccFetch;
  // Scalar-or-vector broadcasts: the bool stride is chosen at run time.
  using ScaleA = fusion::Sm90ColBroadcast<0, TileShape, float, float, Stride<bool, _0, _0>, 1, false>;
  using ScaleB = fusion::Sm90RowBroadcast<0, TileShape, float, float, Stride<_0, bool, _0>, 4, false>;
  using Bias = fusion::Sm90RowBroadcast<0, TileShape, ElementD, ElementD, Stride<_0, _1, _0>,
                                        128 / cutlass::sizeof_bits<ElementD>::value, true>;
  using AzpAdj = fusion::Sm90RowBroadcast<0, TileShape, int32_t, int32_t, Stride<_0, _1, _0>, 4, false>;
  using Azp = fusion::Sm90ColBroadcast<0, TileShape, int32_t, int32_t, Stride<_1, _0, _0>, 1, false>;

  template <template <class> class Fn, class Out, class Compute = float>
  using Op = fusion::Sm90Compute<Fn, Out, Compute, kRound>;

  static typename ScaleA::Arguments scale_a(const ScaledMmParams& p) {
    return {p.scale_a, 0.f, {p.scale_a_per_token, {}, {}}};
  }
  static typename ScaleB::Arguments scale_b(const ScaledMmParams& p) {
    return {p.scale_b, 0.f, {{}, p.scale_b_per_channel, {}}};
  }
  static typename Bias::Arguments bias(const ScaledMmParams& p) {
    return {static_cast<const ElementD*>(p.bias), ElementD(0), {}};
  }
  static typename AzpAdj::Arguments azp_adj(const ScaledMmParams& p) { return {p.azp_adj, 0, {}}; }
  static typename Azp::Arguments azp(const ScaledMmParams& p) { return {p.azp, 0, {}}; }
};

// s_b * X (float), X being any subtree
template <class N, class X>
using ScaleBTimes = fusion::Sm90EVT<typename N::template Op<cutlass::multiplies, float>, typename N::ScaleB, X>;

template <class TileShape, class ElementD>
struct Scaled {
  using N = EpiNodes<TileShape, ElementD>;
  using Inner = ScaleBTimes<N, typename N::Acc>;
  using EVT = fusion::Sm90EVT<typename N::template Op<cutlass::multiplies, ElementD>, typename N::ScaleA, Inner>;
  static typename EVT::Arguments args(const ScaledMmParams& p) {
    return {N::scale_a(p), {N::scale_b(p), {}, {}}, {}};
  }
};

template <class TileShape, class ElementD>
struct ScaledBias {
  using N = EpiNodes<TileShape, ElementD>;
  using Inner = ScaleBTimes<N, typename N::Acc>;
  using EVT = fusion::Sm90EVT<typename N::template Op<cutlass::homogeneous_multiply_add, ElementD>,
                              typename N::ScaleA, Inner, typename N::Bias>;
  static typename EVT::Arguments args(const ScaledMmParams& p) {
    return {N::scale_a(p), {N::scale_b(p), {}, {}}, N::bias(p), {}};
  }
};

template <class TileShape, class ElementD>
struct ScaledBiasAzp {
  using N = EpiNodes<TileShape, ElementD>;
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

template <class TileShape, class ElementD>
struct ScaledBiasAzpToken {
  using N = EpiNodes<TileShape, ElementD>;
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
