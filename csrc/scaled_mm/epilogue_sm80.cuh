// Epilogue visitor trees (CUTLASS 2.x, SM80 "EVT") for the W8A8 family.
//
// Composed only from CUTLASS's 2.x visitor nodes (cutlass/epilogue/threadblock/fusion):
//   * VisitorAccFetch                       -- the int32 accumulator
//   * VisitorScalarBroadcast (device ptr)   -- per-tensor s_a / s_b; a null pointer gives 1.0
//   * VisitorColBroadcast  (nullable)       -- per-token s_a [M] (null -> 1.0), azp [M] (null -> 1)
//   * VisitorRowBroadcast  (nullable)       -- per-channel s_b [N] (null -> 1.0), bias [N] (null -> 0),
//                                              azp_adj [N]
//   * VisitorCompute<multiplies | minus | homogeneous_multiply_add>
//   * VisitorAuxStore                       -- D [M, N] row-major, leading dimension ldd
//
// A scale is per-tensor or per-row/column at run time without separate kernels: each scale
// is the product of a scalar broadcast and a vector broadcast, and the one not given is a
// null pointer that reads as 1.0 (an exact multiplication).  Likewise the per-tensor
// zero point (azp_adj = z_a * colsum, no azp) is the per-token tree with a null azp that
// reads as 1.  So two trees cover the four epilogues of docs/DESIGN.md:
//
//   ScaledBias         = sa_v * (sa_s * (sb_v * (sb_s * acc))) + bias        (Scaled: bias null -> 0)
//   ScaledBiasAzpToken = sa_v * (sa_s * (sb_v * (sb_s * (acc - azp * azp_adj)))) + bias
//                                                               (ScaledBiasAzp: azp null -> 1)
// The zero-point terms are exact int32 (like the float64 reference); everything after the
// first scale is float32, with one rounding to the output dtype at the end.
#pragma once

#include "cutlass/cutlass.h"
#include "cutlass/functional.h"
#include "cutlass/epilogue/threadblock/fusion/visitors.hpp"

#include "scaled_mm/scaled_mm_launch.h"

namespace quantfuse::sm80 {

using namespace cute;
namespace tbf = cutlass::epilogue::threadblock;

// ThreadMap: the 2.x OutputTileThreadLayout of the kernel's tile configuration.
template <class ThreadMap, class ElementD>
struct EpiNodes {
  static constexpr auto kRound = cutlass::FloatRoundStyle::round_to_nearest;
  using ElementOut = ElementD;
  using Acc = tbf::VisitorAccFetch;
  using Scalar = tbf::VisitorScalarBroadcast<float>;  // reads *ptr, or 1.0 when ptr is null
  template <class T>
  using RowVec = tbf::VisitorRowBroadcast<ThreadMap, T, Stride<_0, _1, _0>, true>;  // [N], nullable
  template <class T>
  using ColVec = tbf::VisitorColBroadcast<ThreadMap, T, Stride<_1, _0, _0>, true>;  // [M], nullable
  using ScaleAVec = ColVec<float>;
  using ScaleBVec = RowVec<float>;
  using Bias = RowVec<ElementD>;
  using AzpAdj = RowVec<int32_t>;
  using Azp = ColVec<int32_t>;
  using Store = tbf::VisitorAuxStore<ThreadMap, ElementD, kRound, Stride<int64_t, _1, _0>>;

  template <template <class> class Fn, class Out, class Compute = float>
  using Op = tbf::VisitorCompute<Fn, Out, Compute, kRound>;
  using Mul = Op<cutlass::multiplies, float>;

  static typename Scalar::Arguments scalar(const float* ptr, bool is_vector) {
    typename Scalar::Arguments a{};
    a.scalars[0] = 1.0f;
    a.scalar_ptrs[0] = is_vector ? nullptr : ptr;
    return a;
  }
  template <class Node, class T>
  static typename Node::Arguments row(const T* ptr, T null_default) {
    return {ptr, null_default, {}};
  }
  template <class Node, class T>
  static typename Node::Arguments col(const T* ptr, T null_default) {
    return {ptr, null_default, {}};
  }
  static typename ScaleAVec::Arguments scale_a_vec(const ScaledMmParams& p) {
    return col<ScaleAVec>(p.scale_a_per_token ? p.scale_a : nullptr, 1.0f);
  }
  static typename ScaleBVec::Arguments scale_b_vec(const ScaledMmParams& p) {
    return row<ScaleBVec>(p.scale_b_per_channel ? p.scale_b : nullptr, 1.0f);
  }
  static typename Bias::Arguments bias(const ScaledMmParams& p) {
    return row<Bias>(static_cast<const ElementD*>(p.bias), ElementD(0.0f));
  }
  static typename Store::Arguments store(const ScaledMmParams& p) {
    typename Store::Arguments a{};
    a.ptr_aux = static_cast<ElementD*>(p.d);
    get<0>(a.dAux) = p.ldd;
    return a;
  }
};

// s_a * (s_b * X) + bias for any int32- or float-valued subtree X, written out as
//   sa_v * (sa_s * (sb_v * (sb_s * X))) + bias  -> ElementD, then stored.
template <class N, class X>
struct ScaleAndBias {
  using SbS = tbf::Sm80EVT<typename N::Mul, typename N::Scalar, X>;
  using SbV = tbf::Sm80EVT<typename N::Mul, typename N::ScaleBVec, SbS>;
  using SaS = tbf::Sm80EVT<typename N::Mul, typename N::Scalar, SbV>;
  using Out = tbf::Sm80EVT<typename N::template Op<cutlass::homogeneous_multiply_add, typename N::ElementOut>,
                           typename N::ScaleAVec, SaS, typename N::Bias>;
  using EVT = tbf::Sm80EVT<typename N::Store, Out>;

  static typename EVT::Arguments args(const ScaledMmParams& p, typename X::Arguments x) {
    using NN = N;
    typename SbS::Arguments sbs{NN::scalar(p.scale_b, p.scale_b_per_channel), x, {}};
    typename SbV::Arguments sbv{NN::scale_b_vec(p), sbs, {}};
    typename SaS::Arguments sas{NN::scalar(p.scale_a, p.scale_a_per_token), sbv, {}};
    typename Out::Arguments out{NN::scale_a_vec(p), sas, NN::bias(p), {}};
    return {out, NN::store(p)};
  }
};

// Scaled and ScaledBias (a null bias broadcasts zero).
template <class ThreadMap, class ElementD>
struct ScaledBias {
  using N = EpiNodes<ThreadMap, ElementD>;
  using Tree = ScaleAndBias<N, typename N::Acc>;
  using EVT = typename Tree::EVT;
  static typename EVT::Arguments args(const ScaledMmParams& p) { return Tree::args(p, {}); }
};

// ScaledBiasAzpToken, and ScaledBiasAzp (per-tensor zero point folded into azp_adj) with a
// null azp that broadcasts 1.
template <class ThreadMap, class ElementD>
struct ScaledBiasAzp {
  using N = EpiNodes<ThreadMap, ElementD>;
  using AzpOuter = tbf::Sm80EVT<typename N::template Op<cutlass::multiplies, int32_t, int32_t>,
                                typename N::Azp, typename N::AzpAdj>;
  using AccMinusAzp = tbf::Sm80EVT<typename N::template Op<cutlass::minus, int32_t, int32_t>,
                                   typename N::Acc, AzpOuter>;
  using Tree = ScaleAndBias<N, AccMinusAzp>;
  using EVT = typename Tree::EVT;
  static typename EVT::Arguments args(const ScaledMmParams& p) {
    typename AzpOuter::Arguments outer{N::template col<typename N::Azp>(p.azp, int32_t(1)),
                                       N::template row<typename N::AzpAdj>(p.azp_adj, int32_t(0)), {}};
    return Tree::args(p, typename AccMinusAzp::Arguments{{}, outer, {}});
  }
};

}  // namespace quantfuse::sm80
