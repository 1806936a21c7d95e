"""Pattern family ``scaled_mm``: symmetric W8A8 matmuls into ``quantfuse::scaled_mm``.

Forms (docs/DESIGN.md "Passes"), each as declarative pattern expressions of
Inductor's pattern matcher, with the variants generated below rather than
written out:

2a. integer GEMM: ``torch._int_mm(a, w.t())`` → ``float()`` → ``* s1 * s2``
    (either order, either operand order, or ``* (s1 * s2)`` pre-multiplied;
    the ``float()`` may also be left to type promotion by float32 scales);
    the per-row scale becomes ``scale_a``, the per-column one ``scale_b``.
2b. dequantize-then-matmul, int8 and float8_e4m3fn:
    ``(a.to(dt) * s_a)`` [viewed to 2-D] and ``(w.to(dt) * s_b).t()`` into
    ``mm`` / ``addmm`` (what ``F.linear``, ``x @ w.t()``, ``torch.mm`` and
    ``torch.matmul`` decompose to), with ``dt`` float32 (``W8A8Linear``),
    bfloat16 or float16.

Epilogues are absorbed afterwards, one step at a time, by small rules on the
op's output (``fx_helpers.register_epilogue_rules``, shared with
``scaled_mm_azp``): ``+ bias`` (per-channel, in the op's output dtype) becomes
the op's ``bias``; ``.to(dt)`` of a float32 result becomes ``out_dtype`` (with a
float32 bias that is ``bias_dt.to(float32)``, the bias goes back to ``dt``);
a view between the op and its epilogue (3-D activations: ``mm`` →
``view([B, S, N])`` → ``+ bias``) is sunk below the epilogue first.  Each rule
keeps the math: the op computes its epilogue in float32 and rounds once.

Not matched (reported as unfused candidates): a weight stored already
transposed (``x @ w_kn.float() * s``): the op's kernels read ``b`` as the
column-major transpose of a row-major ``[N, K]`` weight, and making one would
copy the weight per call.

Checks (a candidate failing one is left alone, and the reason is remembered on
its matmul node for the report): quantized dtypes (int8 / float8_e4m3fn, the
same on both sides), dequant dtype and output dtype float16/bfloat16/float32
(the output dtype is the source matmul's own, type promotion included: a
float16 dequantization times float32 scale tensors is a float32 matmul),
``scale_a`` per-tensor or per-token (shape ``[*lead, 1]`` of the activation),
``scale_b`` per-tensor or per-output-channel (``[N, 1]`` on the weight, ``[N]``
or ``[1, N]`` on the output), floating scales, views that only flatten the
leading dimensions, a bias that is per-channel.  Shapes are compared with
``statically_known_true``: a check never adds a guard (``dynamic=True`` stays
dynamic), and what cannot be proven is not matched.

Slot: ``joint_custom_pre_pass``.  (1) With ``freezing=True`` Inductor
constant-folds the weight-side ``w.to(dt) * s_b`` into a dense float weight
before any post-grad pass runs; the joint graph still has it.  (2) The joint
pre slot runs before Inductor's own joint and post-grad rewrites (no
``view_to_reshape``, no ``mm + add → addmm``, no ``pointless_convert`` that
would fold the ``int8 → float`` casts), so the graph is what AOTAutograd made
of the user's code: ``aten.view`` and ``aten.permute``.  The patterns still
accept ``aten.reshape`` / ``aten._unsafe_view`` wherever they take a view, so
they also hold on a post-grad graph.  (3) For inference graphs Inductor runs
the joint passes on the forward graph too, so one slot covers both.  The same
patterns are also registered in ``post_grad_custom_pre_pass`` as a second
chance (a graph the joint passes did not see); there a chain fused in the
joint slot is already gone, and a chain that freezing folded is not
quantized-looking any more.
"""

from __future__ import annotations

import functools
from collections.abc import Iterator

import torch
from torch._inductor.pattern_matcher import CallFunction, KeywordArg, Match, PatternExpr, PatternMatcherPass

from .fx_helpers import (
    CONVERT,
    F32,
    MUL,
    OpSignature,
    Plan,
    Reject,
    as_bias_vector,
    as_scale_vector,
    check_dequant_matmul,
    check_scale_dtype,
    dequant_matmul_patterns,
    is_scalar_like,
    known,
    mul_either,
    register_checked,
    register_epilogue_rules,
    require,
    shape_str,
    val,
)

FAMILY = "scaled_mm"
# Second chance when the joint passes did not run on a graph (or another pass in the
# joint slot hid a chain from us): the post-grad pre slot, before Inductor's own
# post-grad rewrites.  A chain fused in the joint slot is gone by then.
SLOTS = ("joint_custom_pre_pass", "post_grad_custom_pre_pass")

aten = torch.ops.aten
SCALED_MM = OpSignature(torch.ops.quantfuse.scaled_mm.default, FAMILY)


def output_scale_kind(s, m, n) -> str:
    """A scale multiplying a GEMM result ``[M, N]``: per-tensor, per-row or per-column."""
    check_scale_dtype("scale", s)
    if is_scalar_like(s):
        return "per-tensor"
    if s.dim() == 2 and known(s.shape[0] == m) and known(s.shape[1] == 1):
        return "per-row"
    if 1 <= s.dim() <= 2 and known(s.shape[-1] == n) and (s.dim() == 1 or known(s.shape[0] == 1)):
        return "per-column"
    raise Reject(f"scale of shape {shape_str(s)} is not per-tensor, per-row or per-column for a "
                 f"[{m}, {n}] product")


def int_mm_patterns() -> Iterator[tuple[str, PatternExpr]]:
    """Every pattern of form 2a: ``_int_mm(a, w.t()).float()`` times two scales."""
    int_mm = CallFunction(aten._int_mm.default, KeywordArg("a"),
                          CallFunction(aten.permute.default, KeywordArg("w"), [1, 0]))
    s1, s2 = KeywordArg("s1"), KeywordArg("s2")
    # The int32 result converted explicitly (``.float()``), or promoted by the first
    # multiplication (``int32 * float32 scale``; checked to be float32).
    for acc in (CallFunction(CONVERT, int_mm, KeywordArg("acc_dt")), int_mm):
        for inner in mul_either(acc, s1):
            for outer in mul_either(inner, s2):
                yield "int_mm", outer
        for pre in mul_either(s1, s2):
            for outer in mul_either(acc, pre):
                yield "int_mm-premultiplied", outer


# --------------------------------------------------------------------------- plans


def plan_dequant_matmul(match: Match, *, form: str, viewed: bool) -> Plan:
    kw = match.kwargs
    c = check_dequant_matmul(match, viewed=viewed, zero_point=False)
    a, out_dtype, sa_kind, sb_kind, bias = c.a, c.out_dtype, c.sa_kind, c.sb_kind, c.bias

    def build(a, w, scale_a, scale_b, bias=None):
        a2 = a.reshape(-1, a.shape[-1]) if viewed else a
        return torch.ops.quantfuse.scaled_mm(
            a2, w.t(), as_scale_vector(scale_a, a), as_scale_vector(scale_b, a), out_dtype, as_bias_vector(bias))

    inputs = {"a": kw["a"], "w": kw["w"], "scale_a": kw["scale_a"], "scale_b": kw["scale_b"]}
    if bias is not None:
        inputs["bias"] = bias
    detail = f"{a.dtype} {sa_kind} x {sb_kind} in {out_dtype}".replace("torch.", "")
    return Plan(inputs, build, detail, out_dtype)


def plan_int_mm(match: Match, *, form: str) -> Plan:
    kw = match.kwargs
    a, w = val(kw["a"]), val(kw["w"])
    require(a.dtype == torch.int8 and w.dtype == torch.int8, "_int_mm operands are not int8")
    if "acc_dt" in kw:
        require(kw["acc_dt"] == F32, f"_int_mm result converted to {kw['acc_dt']}; expected float32")
    else:  # promoted by the multiplications themselves: they must compute in float32
        muls = [n for n in match.nodes if n.target is MUL]
        require(all(val(n).dtype == F32 for n in muls),
                "_int_mm result promoted by its scales to "
                f"{', '.join(sorted({str(val(n).dtype) for n in muls}))}; expected float32")
    m, n = a.shape[0], w.shape[0]
    kinds = {name: output_scale_kind(val(kw[name]), m, n) for name in ("s1", "s2")}
    rows = [k for k, v in kinds.items() if v == "per-row"]
    cols = [k for k, v in kinds.items() if v == "per-column"]
    require(len(rows) <= 1 and len(cols) <= 1,
            f"scales are {kinds['s1']} and {kinds['s2']}; expected one per-row and one per-column at most")
    sa_name = rows[0] if rows else next(k for k in ("s1", "s2") if k not in cols)
    sb_name = "s2" if sa_name == "s1" else "s1"

    def build(a, w, scale_a, scale_b):
        return torch.ops.quantfuse.scaled_mm(
            a, w.t(), as_scale_vector(scale_a, a), as_scale_vector(scale_b, a), F32, None)

    inputs = {"a": kw["a"], "w": kw["w"], "scale_a": kw[sa_name], "scale_b": kw[sb_name]}
    sa_kind = "per-token" if rows else "per-tensor"
    sb_kind = "per-channel" if cols else "per-tensor"
    return Plan(inputs, build, f"int8 {sa_kind} x {sb_kind} in float32", F32)


# --------------------------------------------------------------------------- registration


def register(passes: dict[str, PatternMatcherPass]) -> None:
    target = [passes[slot] for slot in SLOTS]
    for form, pattern in dequant_matmul_patterns(zero_point=False):
        viewed = form.endswith("-3d")
        register_checked(pattern, target, FAMILY, form,
                         functools.partial(plan_dequant_matmul, form=form, viewed=viewed))
    for form, pattern in int_mm_patterns():
        register_checked(pattern, target, FAMILY, form, functools.partial(plan_int_mm, form=form))
    register_epilogue_rules(target, SCALED_MM)
