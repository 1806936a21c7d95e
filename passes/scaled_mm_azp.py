"""Pattern family ``scaled_mm_azp``: asymmetric int8 activations into ``quantfuse::scaled_mm_azp``.

Form 2c: ``((a.to(dt) - z_a) * s_a)`` [viewed to 2-D] times any weight operand that computes
``w.t() * s_b`` (``passes/scaled_weight.py`` decides, by probes: ``(w.to(dt) * s_b).t()``,
``w.to(dt).t() * s_b``, ...) into ``mm`` / ``addmm`` (``F.linear``, ``x @ w.t()``,
``torch.mm``, ``torch.matmul``), int8 only, with the same variants, checks and epilogue
rules as ``scaled_mm`` (the pattern builders, checks and epilogue rules both use live in
``fx_helpers``; here they are generated with ``zero_point=True``).  Slots:
``joint_custom_pre_pass``, and ``post_grad_custom_pre_pass`` as a second chance, for the reasons
``scaled_mm``'s docstring gives.

The zero point must be per-tensor (one element: ``azp=None``,
``azp_adj = z_a · colsum(b)``) or per-token (``[*lead, 1]``: ``azp`` int32
``[M]``, ``azp_adj = colsum(b)``), and provably integer-valued: an integer
tensor, a conversion from one, ``round(...)`` (possibly clamped by integer
bounds) or an integral number.  A float zero point of unknown origin is left
alone (the op takes int32 zero points; truncating a fractional one would be
wrong).

The integer-GEMM form with a per-token zero point is torchao's
``Int8DynamicActivationInt8WeightConfig(act_mapping_type=ASYMMETRIC)``:
``(acc * s_a)[.to(dt)] - ((z.float() * s_a) * w.sum(-1).float())[.to(dt)]``, times the
weight scale, where ``acc`` is any spelling of the int32 product ``scaled_mm`` accepts
(``_int_mm``, the u8s8 form) and ``s_a`` may be ``expand``-ed.  That is
``s_a · s_b · (acc − z · colsum(b))``: the op, rounded once where the source rounds both
terms and their difference to ``dt`` (docs/DESIGN.md, "Rounding").  Both ``s_a`` must be
views of one scale, and the row sums those of the GEMM's own weight.

``colsum(b)`` comes from ``quantfuse::weight_colsum(weight)``
(``compile_backend/ops/scaled_mm_azp.py``): constant-folded under ``freezing``,
otherwise served from a per-weight cache, so the column sums are computed once
per weight, never per call.  For a per-tensor zero point the ``[N]`` product
``z_a · colsum`` is per call (``z_a`` may be computed per call); it is a
vector op Inductor fuses.
"""

from __future__ import annotations

import functools
from collections.abc import Iterator

import torch
from torch._inductor.pattern_matcher import CallFunction, KeywordArg, Match, PatternExpr, PatternMatcherPass
from torch.fx import Node

from compile_backend.ops.scaled_mm_azp import azp_operands

from .dequant_matmul import check_dequant_matmul, dequant_matmul_patterns
from .fx_helpers import (
    CONVERT,
    F32,
    MUL,
    VIEWS,
    OpSignature,
    Plan,
    Reject,
    as_bias_vector,
    as_scale_vector,
    is_per_token_shape,
    known,
    mul_either,
    register_checked,
    register_epilogue_rules,
    require,
    shape_str,
    val,
)
from .scaled_mm import ROUNDING_DTYPES, check_int_product, int_products, output_scale_kind, scale_source

FAMILY = "scaled_mm_azp"
SLOTS = ("joint_custom_pre_pass", "post_grad_custom_pre_pass")
SCALED_MM_AZP = OpSignature(torch.ops.quantfuse.scaled_mm_azp.default, FAMILY, out_dtype_index=4, bias_index=7)

aten = torch.ops.aten
_ROUNDING = (aten.round.default,)
_CLAMPS = (aten.clamp_min.default, aten.clamp_max.default, aten.clamp.default)
_PASS_THROUGH = (*VIEWS, aten.unsqueeze.default, aten.expand.default, aten.slice.Tensor)


def is_integral(x, depth: int = 8) -> bool:
    """Whether ``x`` (a node or number) is provably integer-valued."""
    if isinstance(x, bool):
        return False
    if isinstance(x, int):
        return True
    if isinstance(x, float):
        return x.is_integer()
    if not isinstance(x, Node) or depth == 0:
        return False
    v = val(x)
    if isinstance(v, torch.Tensor) and not v.dtype.is_floating_point and not v.dtype.is_complex:
        return v.dtype != torch.bool
    if x.target in _ROUNDING and not x.kwargs.get("decimals") and len(x.args) == 1:
        return True
    if x.target is CONVERT:
        return is_integral(x.args[0], depth - 1)
    if x.target in _CLAMPS:
        bounds = [b for b in x.args[1:] if b is not None]
        return all(is_integral(b, depth - 1) for b in bounds) and is_integral(x.args[0], depth - 1)
    if x.target in _PASS_THROUGH:
        return is_integral(x.args[0], depth - 1)
    return False


def zero_point_kind(z, a) -> str:
    require(is_integral(z), "zero point is not provably integer-valued (expected an integer tensor, "
                            "round(...) or an integral number)")
    zv = val(z)
    if not isinstance(zv, torch.Tensor) or known(zv.numel() == 1):
        return "per-tensor"
    require(is_per_token_shape(zv, a),
            f"zero point of shape {shape_str(zv)} is neither per-tensor nor per-token "
            f"for an activation of shape {shape_str(a)}")
    return "per-token"


def call_scaled_mm_azp(a, w, scale_a, scale_b, azp, z_kind: str, out_dtype, bias=None):
    """``quantfuse::scaled_mm_azp`` for an int8 ``a`` [M, K] and weight ``w`` [N, K] with zero point ``azp``."""
    azp_adj, azp_vec = azp_operands(w, azp, per_tensor=z_kind == "per-tensor")
    return torch.ops.quantfuse.scaled_mm_azp(
        a, w.t(), as_scale_vector(scale_a, a), as_scale_vector(scale_b, a), out_dtype, azp_adj, azp_vec,
        as_bias_vector(bias))


def plan_dequant_matmul_azp(match: Match, *, form: str, viewed: bool) -> Plan | None:
    kw = match.kwargs
    c = check_dequant_matmul(match, viewed=viewed, zero_point=True)
    if c is None:
        return None
    a, out_dtype, sa_kind, sb_kind = c.a, c.out_dtype, c.sa_kind, c.sb_kind
    z_kind = zero_point_kind(kw["azp"], a)

    def build(a, w, scale_a, azp, scale_b=1.0, bias=None):
        a2 = a.reshape(-1, a.shape[-1]) if viewed else a
        return call_scaled_mm_azp(a2, w, scale_a, scale_b, azp, z_kind, out_dtype, bias)

    detail = f"int8 {sa_kind} x {sb_kind}, {z_kind} zero point, in {out_dtype}".replace("torch.", "")
    return Plan(c.inputs(match, azp=kw["azp"]), build, detail, out_dtype)


# --------------------------------------------------------------------------- integer GEMM with a zero point


def int_mm_azp_patterns() -> Iterator[tuple[str, PatternExpr]]:
    """torchao's asymmetric chain (see the module docstring), over every int32 product spelling."""
    z = CallFunction(CONVERT, KeywordArg("azp"), KeywordArg("z_dt"))
    rowsum = CallFunction(CONVERT, CallFunction(aten.sum.dim_IntList, KeywordArg("w"), KeywordArg("sum_dims")),
                          KeywordArg("rs_dt"))
    z_term = CallFunction(MUL, CallFunction(MUL, z, KeywordArg("sa2")), rowsum)
    for tag, product in int_products():
        for acc in (CallFunction(CONVERT, product, KeywordArg("acc_dt")), product):
            for scaled in mul_either(acc, KeywordArg("sa")):
                for rounded in (False, True):
                    left = CallFunction(CONVERT, scaled, KeywordArg("mid_dt")) if rounded else scaled
                    right = CallFunction(CONVERT, z_term, KeywordArg("mid_dt2")) if rounded else z_term
                    for out in mul_either(CallFunction(aten.sub.Tensor, left, right), KeywordArg("sb")):
                        yield f"int_mm{tag}-azp" + ("-rounded" if rounded else ""), out


def _base(node):
    while isinstance(node, Node) and node.target in VIEWS:
        node = node.args[0]
    return node


def plan_int_mm_azp(match: Match, *, form: str) -> Plan:
    kw = match.kwargs
    check_int_product(kw, form)
    a, w = val(kw["a"]), val(kw["w"])
    m, n = a.shape[0], w.shape[0]
    if "acc_dt" in kw:
        require(kw["acc_dt"] == F32, f"_int_mm result converted to {kw['acc_dt']}; expected float32")
    require(kw["z_dt"] == F32 and kw["rs_dt"] == F32,
            f"zero point and row sums converted to {kw['z_dt']} and {kw['rs_dt']}; expected float32")
    require(list(kw["sum_dims"]) in ([-1], [1]), f"weight summed over dims {kw['sum_dims']}; expected its rows")
    inside = set(match.nodes)
    sub = next(x for x in match.output_node().args if isinstance(x, Node) and x in inside)
    left, right = sub.args
    if "-rounded" in form:
        require(kw["mid_dt"] == kw["mid_dt2"] and kw["mid_dt"] in ROUNDING_DTYPES,
                f"terms rounded to {kw['mid_dt']} and {kw['mid_dt2']}; expected one of bfloat16, float16, "
                "float32 for both")
        left, right = left.args[0], right.args[0]
    require(val(left).dtype == F32 and val(right).dtype == F32,
            f"terms computed in {val(left).dtype} and {val(right).dtype}; expected float32")
    out_dtype = val(match.output_node()).dtype
    require(out_dtype == F32 or ("-rounded" in form and out_dtype == kw["mid_dt"]),
            f"weight scale applied in {out_dtype}; expected float32")
    sa = scale_source(kw["sa"], (m, n))
    sa_kind = output_scale_kind(val(sa), m, n)
    require(sa_kind != "per-column", "the activation scale is per-column")
    sa2 = kw["sa2"]
    require(_base(sa) is _base(sa2) and known(val(sa).numel() == val(sa2).numel()),
            f"the zero-point term is scaled by {getattr(sa2, 'name', sa2)}, not by the activation scale "
            f"{getattr(sa, 'name', sa)}")
    z_kind = zero_point_kind(kw["azp"], a)
    sb = scale_source(kw["sb"], (m, n))
    sb_kind = output_scale_kind(val(sb), m, n)
    require(sb_kind != "per-row", "the weight scale is per-row")

    def build(a, w, scale_a, scale_b, azp):
        return call_scaled_mm_azp(a, w, scale_a, scale_b, azp, z_kind, out_dtype)

    inputs = {"a": kw["a"], "w": kw["w"], "scale_a": sa, "scale_b": sb, "azp": kw["azp"]}
    detail = (f"int8 {'per-token' if sa_kind == 'per-row' else 'per-tensor'} x "
              f"{'per-channel' if sb_kind == 'per-column' else 'per-tensor'}, {z_kind} zero point, "
              f"in {out_dtype}").replace("torch.", "")
    if "-rounded" in form:
        detail += f"; rounds once where the source rounds to {kw['mid_dt']} between the scales".replace(
            "torch.", "")
    return Plan(inputs, build, detail, out_dtype)


def register(passes: dict[str, PatternMatcherPass]) -> None:
    target = [passes[slot] for slot in SLOTS]
    for form, pattern in dequant_matmul_patterns(zero_point=True):
        form = form.replace("dequant-", "dequant-azp-")
        register_checked(pattern, target, FAMILY, form,
                         functools.partial(plan_dequant_matmul_azp, form=form, viewed=form.endswith("-3d")))
    for form, pattern in int_mm_azp_patterns():
        register_checked(pattern, target, FAMILY, form, functools.partial(plan_int_mm_azp, form=form))
    register_epilogue_rules(target, SCALED_MM_AZP)


__all__ = ["FAMILY", "Reject", "is_integral", "register", "zero_point_kind"]
