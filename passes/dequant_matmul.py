"""The W8A8 dequantize-then-matmul form (pass form 2) that ``scaled_mm`` and ``scaled_mm_azp``
are both generated from: the activation-side pattern builders, and ``check_dequant_matmul``,
whose weight operand ``scaled_weight.analyze`` decides.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import torch
from torch._inductor.pattern_matcher import MULTIPLE, CallFunction, Ignored, KeywordArg, Match, PatternExpr
from torch.fx import Node

from compile_backend.ops.library import OUT_DTYPES
from compile_backend.ops.scaled_mm import W8A8_INPUT_DTYPES

from .fx_helpers import (
    CONVERT,
    VIEWS,
    activation_scale_kind,
    aten,
    bias_ok,
    check_scale_dtype,
    known,
    matmul_node,
    mul_either,
    require,
    shape_str,
    tensor_val,
    val,
)
from .scaled_weight import ScaledWeight, analyze


def activation_dequant(zero_point: bool) -> Iterator[tuple[PatternExpr, bool]]:
    """``(a.to(dt) [- azp]) * scale_a`` [viewed to 2-D]: (pattern, viewed).

    The activation side may feed several matmuls (q/k/v projections of one
    dequantized input): its nodes may have other users.
    """
    q = CallFunction(CONVERT, KeywordArg("a"), KeywordArg("a_dt"), _users=MULTIPLE)
    if zero_point:
        q = CallFunction(aten.sub.Tensor, q, KeywordArg("azp"), _users=MULTIPLE)
    for deq in mul_either(q, KeywordArg("scale_a"), users=MULTIPLE):
        yield deq, False
        yield CallFunction(VIEWS, deq, Ignored(), _users=MULTIPLE), True


def dequant_matmul_patterns(zero_point: bool) -> Iterator[tuple[str, PatternExpr]]:
    """Every (form, pattern) of form 2b (2c with ``zero_point``): the dequantized activation into
    ``mm`` / ``addmm`` with any weight operand (``w_deq``), which ``check_dequant_matmul`` has probed."""
    for act, viewed in activation_dequant(zero_point):
        w = KeywordArg("w_deq")
        yield "dequant-mm" + ("-3d" if viewed else ""), CallFunction(aten.mm.default, act, w)
        yield ("dequant-addmm" + ("-3d" if viewed else ""),
               CallFunction(aten.addmm.default, KeywordArg("bias"), act, w))


def check_quantized_pair(a, a_dt, weight: ScaledWeight | str, *, zero_point: bool) -> None:
    """The activation ``a`` (dequantized to ``a_dt``) and, when the probe proved one, the quantized weight."""
    require(isinstance(a, torch.Tensor) and a.dtype in W8A8_INPUT_DTYPES,
            f"activation has dtype {getattr(a, 'dtype', a)}; expected int8 or float8_e4m3fn")
    if not isinstance(weight, str):
        w = val(weight.q)
        require(w.dtype == a.dtype, f"weight has dtype {w.dtype}; expected the activation's {a.dtype}")
        require(known(w.shape[1] == a.shape[-1]),
                f"weight of shape {shape_str(w)} does not match activation of shape {shape_str(a)}")
    require(a_dt in OUT_DTYPES, f"activation dequantized to {a_dt}; expected one of float16, bfloat16, float32")
    if zero_point:
        require(a.dtype == torch.int8, "a zero point needs int8 activations")


@dataclass
class DequantMatmul:
    """What the checks of a dequant-then-matmul match established."""

    a: torch.Tensor
    weight: ScaledWeight  # the quantized [N, K] weight and its scale
    out_dtype: torch.dtype
    sa_kind: str
    bias: Node | None

    @property
    def sb_kind(self) -> str:
        return self.weight.kind

    def inputs(self, match: Match, **more) -> dict:
        """The replacement's inputs in the order its ``build`` takes them: ``a``, the quantized weight,
        ``scale_a``, ``more`` (a family's own operands), then the weight scale and the bias where there
        are any."""
        kw = match.kwargs
        inputs = {"a": kw["a"], "w": self.weight.q, "scale_a": kw["scale_a"], **more}
        if self.weight.scale is not None:
            inputs["scale_b"] = self.weight.scale
        if self.bias is not None:
            inputs["bias"] = self.bias
        return inputs


def check_view(match: Match, a, viewed: bool) -> None:
    if not viewed:
        return
    view = next(n for n in match.nodes if n.target in VIEWS)
    out = val(view)
    require(out.dim() == 2 and known(out.shape[1] == a.shape[-1]),
            f"view to {shape_str(out)} does not just flatten the activation's leading dimensions "
            f"({shape_str(a)})")


def check_dequant_matmul(match: Match, *, viewed: bool, zero_point: bool) -> DequantMatmul | None:
    """The checks of a dequant-then-matmul match; None when its weight operand is no dequantization of a
    quantized tensor (no W8A8 candidate)."""
    kw = match.kwargs
    mm = matmul_node(match)
    weight = analyze(kw["w_deq"], mm, W8A8_INPUT_DTYPES)
    if weight is None:
        return None
    a = val(kw["a"])
    check_quantized_pair(a, kw["a_dt"], weight, zero_point=zero_point)
    # The op returns what the source's matmul returns.  Type promotion decides that, not
    # the casts: ``a.to(float16) * scale_f32`` (a [M, 1] scale) is float32, and so is the
    # matmul of it.  The int8/fp8 -> dt casts are exact, so the float32 epilogue computes
    # what the source computes.
    out = tensor_val(match.output_node())
    require(out is not None and out.dtype in OUT_DTYPES,
            f"the matmul computes in {getattr(out, 'dtype', None)}; expected float16, bfloat16 or float32")
    out_dtype = out.dtype
    sa_kind = activation_scale_kind(val(kw["scale_a"]), a)
    check_view(match, a, viewed)
    require(not isinstance(weight, str), weight)
    w = val(weight.q)
    if weight.scale is not None:
        check_scale_dtype("weight scale", val(weight.scale))
    bias = kw.get("bias")
    if bias is not None:
        require(bias_ok(val(bias), w.shape[0], out_dtype),
                f"addmm input of shape {shape_str(val(bias))} is not a per-channel bias in {out_dtype}")
    return DequantMatmul(a, weight, out_dtype, sa_kind, bias)
