"""Pattern family ``scaled_mm_azp``: asymmetric int8 activations into ``quantfuse::scaled_mm_azp``.

Form 2c: ``((a.to(dt) - z_a) * s_a)`` [viewed to 2-D] and ``(w.to(dt) * s_b).t()``
into ``mm`` / ``addmm`` (``F.linear``, ``x @ w.t()``, ``torch.mm``,
``torch.matmul``), int8 only, with the same variants, checks and epilogue rules
as ``scaled_mm`` (the pattern builders, checks and epilogue rules both use live
in ``fx_helpers``; here they are generated with ``zero_point=True``).  Slots: ``joint_custom_pre_pass``, and
``post_grad_custom_pre_pass`` as a second chance, for the reasons
``scaled_mm``'s docstring gives.

The zero point must be per-tensor (one element: ``azp=None``,
``azp_adj = z_a · colsum(b)``) or per-token (``[*lead, 1]``: ``azp`` int32
``[M]``, ``azp_adj = colsum(b)``), and provably integer-valued: an integer
tensor, a conversion from one, ``round(...)`` (possibly clamped by integer
bounds) or an integral number.  A float zero point of unknown origin is left
alone (the op takes int32 zero points; truncating a fractional one would be
wrong).

``colsum(b)`` comes from ``quantfuse::weight_colsum(weight)``
(``compile_backend/weight_cache.py``): constant-folded under ``freezing``,
otherwise served from a per-weight cache, so the column sums are computed once
per weight, never per call.  For a per-tensor zero point the ``[N]`` product
``z_a · colsum`` is per call (``z_a`` may be computed per call); it is a
vector op Inductor fuses.
"""

from __future__ import annotations

import functools

import torch
from torch._inductor.pattern_matcher import Match, PatternMatcherPass
from torch.fx import Node

import compile_backend.weight_cache  # noqa: F401  (registers quantfuse::weight_colsum)

from .fx_helpers import (
    CONVERT,
    VIEWS,
    OpSignature,
    Plan,
    Reject,
    as_bias_vector,
    as_scale_vector,
    check_dequant_matmul,
    dequant_matmul_patterns,
    is_per_token_shape,
    known,
    register_checked,
    register_epilogue_rules,
    require,
    shape_str,
    val,
)

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


def plan_dequant_matmul_azp(match: Match, *, form: str, viewed: bool) -> Plan:
    kw = match.kwargs
    c = check_dequant_matmul(match, viewed=viewed, zero_point=True)
    a, out_dtype, sa_kind, sb_kind, bias = c.a, c.out_dtype, c.sa_kind, c.sb_kind, c.bias
    z_kind = zero_point_kind(kw["azp"], a)

    def build(a, w, scale_a, scale_b, azp, bias=None):
        a2 = a.reshape(-1, a.shape[-1]) if viewed else a
        colsum = torch.ops.quantfuse.weight_colsum(w)
        if z_kind == "per-tensor":
            z = azp.to(torch.int32).reshape(()) if isinstance(azp, torch.Tensor) else int(azp)
            azp_adj, azp_vec = colsum * z, None
        else:
            azp_adj, azp_vec = colsum, azp.to(torch.int32).reshape(-1)
        return torch.ops.quantfuse.scaled_mm_azp(
            a2, w.t(), as_scale_vector(scale_a, a), as_scale_vector(scale_b, a), out_dtype,
            azp_adj, azp_vec, as_bias_vector(bias))

    inputs = {"a": kw["a"], "w": kw["w"], "scale_a": kw["scale_a"], "scale_b": kw["scale_b"], "azp": kw["azp"]}
    if bias is not None:
        inputs["bias"] = bias
    detail = f"int8 {sa_kind} x {sb_kind}, {z_kind} zero point, in {out_dtype}".replace("torch.", "")
    return Plan(inputs, build, detail, out_dtype)


def register(passes: dict[str, PatternMatcherPass]) -> None:
    target = [passes[slot] for slot in SLOTS]
    for form, pattern in dequant_matmul_patterns(zero_point=True):
        form = form.replace("dequant-", "dequant-azp-")
        register_checked(pattern, target, FAMILY, form,
                         functools.partial(plan_dequant_matmul_azp, form=form, viewed=form.endswith("-3d")))
    register_epilogue_rules(target, SCALED_MM_AZP)


__all__ = ["FAMILY", "Reject", "is_integral", "register", "zero_point_kind"]
