"""Pattern family ``scaled_mm``: symmetric W8A8 matmuls into ``quantfuse::scaled_mm``.

Forms (docs/DESIGN.md "Passes"), each as declarative pattern expressions of
Inductor's pattern matcher, with the variants generated below rather than
written out:

2a. integer GEMM: ``torch._int_mm(a, w.t())`` → ``float()`` → ``* s1 * s2``
    (either order, either operand order, or ``* (s1 * s2)`` pre-multiplied;
    the ``float()`` may also be left to type promotion by float32 scales);
    the per-row scale becomes ``scale_a``, the per-column one ``scale_b``.
    Two more spellings of the same product, both from torchao's
    ``Int8DynamicActivationInt8WeightConfig``:
    * ``u8s8`` (CPUs with VNNI): ``_int_mm((a.to(int32) + 128).to(uint8), w.t())
      - 128 * w.t().sum(0, keepdim=True, dtype=int32)``, which is ``a @ w.t()``
      exactly (the offset 128 on both sides is checked);
    * ``-rounded``: the result rounded to bfloat16/float16 between the two scale
      multiplications (``(acc * s1).to(dt) * s2``).  The op rounds once, so the
      fused result differs from the source by at most that intermediate rounding
      (docs/DESIGN.md, "Rules": rounding); a rounding to a non-float dtype
      between the scales changes the meaning and is not fused.
    A scale may be ``expand``-ed to the product's shape (torchao on CUDA).
2b. dequantize-then-matmul, int8 and float8_e4m3fn:
    ``(a.to(dt) * s_a)`` [viewed to 2-D] into ``mm`` / ``addmm`` (what
    ``F.linear``, ``x @ w.t()``, ``torch.mm`` and ``torch.matmul`` decompose
    to), with ``dt`` float32 (``W8A8Linear``), bfloat16 or float16, times any
    weight operand that computes ``w.t() * s_b``, the product rounded once to
    the weight's dtype: ``passes/scaled_weight.py`` decides by evaluating it on
    probes (``(w.to(dt) * s_b[:, None]).t()``, ``w.to(dt).t() * s_b``, an
    expanded or reshaped scale, a Python number, the cast left to type
    promotion, ...); the op reads ``w`` through ``.t()`` and the scale from the
    node the probe named.
2d. ``torch._scaled_mm(a, b, scale_a, scale_b, bias, None, out_dtype)`` (float8_e4m3fn,
    per-tensor or row-wise scales; torchao's ``Float8DynamicActivationFloat8WeightConfig``
    calls it): the same product as the op.  Replaced on CPU and on Hopper, where
    the C++ dispatch picks the kernel (cuBLASLt through ``at::_scaled_mm`` where
    that was measured faster); ``use_fast_accum`` is dropped: the op accumulates in
    float32 at full precision.  Kept on other GPUs: the op's fp8 kernels there
    cover decode sizes only, and larger M would run the reference.

Epilogues are absorbed afterwards, one step at a time, by small rules on the
op's output (``fx_helpers.register_epilogue_rules``, shared with
``scaled_mm_azp``): ``+ bias`` (per-channel, in the op's output dtype) becomes
the op's ``bias``; ``.to(dt)`` of a float32 result becomes ``out_dtype`` (with a
float32 bias that is ``bias_dt.to(float32)``, the bias goes back to ``dt``);
a view between the op and its epilogue (3-D activations: ``mm`` →
``view([B, S, N])`` → ``+ bias``) is sunk below the epilogue first.  Each rule
keeps the math: the op computes its epilogue in float32 and rounds once.

Not matched (reported as unfused candidates): a weight stored already
transposed (``x @ w_kn.float() * s``, an int8 ``[K, N]`` tensor): the op's
kernels read ``b`` as the column-major transpose of a row-major ``[N, K]``
weight, and making one would copy the weight per call.

Checks (a candidate failing one is left alone, and the reason is remembered on
its matmul node for the report): quantized dtypes (int8 / float8_e4m3fn, the
same on both sides), dequant dtype and output dtype float16/bfloat16/float32
(the output dtype is the source matmul's own, type promotion included: a
float16 dequantization times float32 scale tensors is a float32 matmul),
``scale_a`` per-tensor or per-token (shape ``[*lead, 1]`` of the activation),
``scale_b`` per-tensor or per-output-channel (on the weight: what the probe
proves; ``[N]`` or ``[1, N]`` on the output), floating scales, views that only
flatten the leading dimensions, a bias that is per-channel.  Shapes are compared with
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
from torch.fx import Node

from .dequant_matmul import check_dequant_matmul, dequant_matmul_patterns
from .fx_helpers import (
    ADD,
    CONVERT,
    F32,
    MUL,
    OpSignature,
    Plan,
    Reject,
    as_bias_vector,
    as_scale_vector,
    bias_ok,
    check_scale_dtype,
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


def int_products() -> Iterator[tuple[str, PatternExpr]]:
    """The exact int32 product ``a @ w.t()``, as (tag, pattern): ``_int_mm`` and torchao's u8s8 form."""
    wt = CallFunction(aten.permute.default, KeywordArg("w"), [1, 0])
    yield "", CallFunction(aten._int_mm.default, KeywordArg("a"), wt)
    # (a + 128) as uint8 times w, minus 128 * colsum(w): the sign change of ``a`` undone.
    wt2 = CallFunction(aten.permute.default, KeywordArg("w"), [1, 0], _users=2)
    wide = CallFunction(CONVERT, KeywordArg("a"), KeywordArg("wide_dt"))
    shifted = CallFunction(CONVERT, CallFunction(ADD, wide, KeywordArg("shift")), KeywordArg("u8_dt"))
    colsum = CallFunction(aten.sum.dim_IntList, wt2, [0], True, dtype=torch.int32)
    yield "-u8", CallFunction(aten.sub.Tensor, CallFunction(aten._int_mm.default, shifted, wt2),
                              CallFunction(MUL, colsum, KeywordArg("comp")))


def int_mm_patterns() -> Iterator[tuple[str, PatternExpr]]:
    """Every pattern of form 2a: the int32 product, ``float()``, times two scales."""
    s1, s2 = KeywordArg("s1"), KeywordArg("s2")
    for tag, product in int_products():
        # The int32 result converted explicitly (``.float()``), or promoted by the first
        # multiplication (``int32 * float32 scale``; checked to be float32).
        for acc in (CallFunction(CONVERT, product, KeywordArg("acc_dt")), product):
            for inner in mul_either(acc, s1):
                for outer in mul_either(inner, s2):
                    yield f"int_mm{tag}", outer
                rounded = CallFunction(CONVERT, inner, KeywordArg("mid_dt"))
                for outer in mul_either(rounded, s2):
                    yield f"int_mm{tag}-rounded", outer
            for pre in mul_either(s1, s2):
                for outer in mul_either(acc, pre):
                    yield f"int_mm{tag}-premultiplied", outer


SCALED_MM_ARGS = [a.name for a in aten._scaled_mm.default._schema.arguments]
SCALED_MM_REQUIRED = 4  # self, mat2, scale_a, scale_b


def torch_scaled_mm_patterns() -> Iterator[tuple[str, PatternExpr]]:
    """Form 2d: ``aten._scaled_mm`` with any number of its trailing defaults spelled out."""
    for n in range(SCALED_MM_REQUIRED, len(SCALED_MM_ARGS) + 1):
        yield "torch-scaled_mm", CallFunction(aten._scaled_mm.default,
                                              *(KeywordArg(name) for name in SCALED_MM_ARGS[:n]))


# --------------------------------------------------------------------------- plans


def plan_dequant_matmul(match: Match, *, form: str, viewed: bool) -> Plan | None:
    c = check_dequant_matmul(match, viewed=viewed, zero_point=False)
    if c is None:
        return None
    a, out_dtype, sa_kind, sb_kind = c.a, c.out_dtype, c.sa_kind, c.sb_kind

    def build(a, w, scale_a, scale_b=1.0, bias=None):
        a2 = a.reshape(-1, a.shape[-1]) if viewed else a
        return torch.ops.quantfuse.scaled_mm(
            a2, w.t(), as_scale_vector(scale_a, a), as_scale_vector(scale_b, a), out_dtype, as_bias_vector(bias))

    detail = f"{a.dtype} {sa_kind} x {sb_kind} in {out_dtype}".replace("torch.", "")
    return Plan(c.inputs(match), build, detail, out_dtype)


def scale_source(s, shape):
    """A scale node ``expand``-ed to the product's ``shape`` is the scale itself, broadcast."""
    while (isinstance(s, Node) and s.target is aten.expand.default and val(s) is not None
           and val(s).dim() == len(shape) and all(known(d == e) for d, e in zip(val(s).shape, shape))):
        s = s.args[0]
    return s


ROUNDING_DTYPES = (torch.bfloat16, torch.float16, F32)


def check_int_product(kw: dict, form: str) -> None:
    a, w = val(kw["a"]), val(kw["w"])
    require(a.dtype == torch.int8 and w.dtype == torch.int8, "_int_mm operands are not int8")
    if "-u8" in form:
        require(kw["wide_dt"] in (torch.int32, torch.int64) and kw["u8_dt"] == torch.uint8,
                f"activation widened to {kw['wide_dt']} and narrowed to {kw['u8_dt']}; expected int32 "
                "and uint8")
        require(kw["shift"] == 128 and kw["comp"] == 128,
                f"activation shifted by {kw['shift']!r} and corrected by {kw['comp']!r} * colsum(w); "
                "only 128 and 128 give back the int8 product")


def check_accumulation(match: Match, kw: dict, form: str) -> torch.dtype:
    """The scale multiplications compute in float32 (or, after the rounding, in its dtype); returns the output dtype."""
    if "acc_dt" in kw:
        require(kw["acc_dt"] == F32, f"_int_mm result converted to {kw['acc_dt']}; expected float32")
    if "-rounded" in form:
        mid = kw["mid_dt"]
        require(mid in ROUNDING_DTYPES,
                f"rounded to {mid} between the two scales; expected bfloat16, float16 or float32 "
                "(anything else changes the result beyond one rounding)")
        inside = set(match.nodes)
        outer = match.output_node()
        rounding = next(x for x in outer.args if isinstance(x, Node) and x in inside)
        require(val(rounding.args[0]).dtype == F32,
                f"first scale multiplication computes in {val(rounding.args[0]).dtype}; expected float32")
        require(val(outer).dtype in (F32, mid),
                f"second scale multiplication computes in {val(outer).dtype}; expected float32 or {mid}")
        return val(outer).dtype
    if "acc_dt" not in kw:  # promoted by the multiplications themselves: they must compute in float32
        muls = [n for n in match.nodes if n.target is MUL]
        require(all(val(n).dtype == F32 for n in muls),
                "_int_mm result promoted by its scales to "
                f"{', '.join(sorted({str(val(n).dtype) for n in muls}))}; expected float32")
    return F32


def plan_int_mm(match: Match, *, form: str) -> Plan:
    kw = match.kwargs
    check_int_product(kw, form)
    out_dtype = check_accumulation(match, kw, form)
    a, w = val(kw["a"]), val(kw["w"])
    m, n = a.shape[0], w.shape[0]
    scales = {name: scale_source(kw[name], (m, n)) for name in ("s1", "s2")}
    kinds = {name: output_scale_kind(val(s), m, n) for name, s in scales.items()}
    rows = [k for k, v in kinds.items() if v == "per-row"]
    cols = [k for k, v in kinds.items() if v == "per-column"]
    require(len(rows) <= 1 and len(cols) <= 1,
            f"scales are {kinds['s1']} and {kinds['s2']}; expected one per-row and one per-column at most")
    sa_name = rows[0] if rows else next(k for k in ("s1", "s2") if k not in cols)
    sb_name = "s2" if sa_name == "s1" else "s1"

    def build(a, w, scale_a, scale_b):
        return torch.ops.quantfuse.scaled_mm(
            a, w.t(), as_scale_vector(scale_a, a), as_scale_vector(scale_b, a), out_dtype, None)

    inputs = {"a": kw["a"], "w": kw["w"], "scale_a": scales[sa_name], "scale_b": scales[sb_name]}
    sa_kind = "per-token" if rows else "per-tensor"
    sb_kind = "per-channel" if cols else "per-tensor"
    detail = f"int8 {sa_kind} x {sb_kind} in {out_dtype}".replace("torch.", "")
    if "-rounded" in form:
        detail += f"; rounds once where the source rounds to {kw['mid_dt']} between the scales".replace(
            "torch.", "")
    return Plan(inputs, build, detail, out_dtype)


def scaled_mm_scale_kind(name: str, s, length, other) -> str:
    """A ``_scaled_mm`` scale: one element (per-tensor) or one per row of ``a`` / column of ``b``."""
    require(isinstance(s, torch.Tensor) and s.dtype == F32,
            f"{name} has dtype {getattr(s, 'dtype', s)}; expected float32")
    if known(s.numel() == 1):
        return "per-tensor"
    shape = (length, 1) if name == "scale_a" else (1, length)
    require(s.dim() == 2 and known(s.shape[0] == shape[0]) and known(s.shape[1] == shape[1]),
            f"{name} of shape {shape_str(s)} is neither per-tensor nor row-wise "
            f"([{shape[0]}, {shape[1]}]) for {other}")
    return "per-token" if name == "scale_a" else "per-channel"


def plan_torch_scaled_mm(match: Match, *, form: str) -> Plan:
    kw = {name: match.kwargs.get(name, arg.default_value)
          for name, arg in zip(SCALED_MM_ARGS, aten._scaled_mm.default._schema.arguments)}
    a, b = val(kw["self"]), val(kw["mat2"])
    require(a.dtype == torch.float8_e4m3fn and b.dtype == torch.float8_e4m3fn,
            f"operands are {a.dtype} and {b.dtype}; expected float8_e4m3fn")
    require(a.dim() == 2 and b.dim() == 2, f"operands of shapes {shape_str(a)} and {shape_str(b)}; expected 2-D")
    out_dtype = kw["out_dtype"]
    require(out_dtype in (torch.float16, torch.bfloat16, F32),
            f"out_dtype is {out_dtype}; expected float16, bfloat16 or float32")
    require(kw["scale_result"] is None, "an output scale (scale_result) is given; the op has none")
    if a.device.type == "cuda":
        major, minor = torch.cuda.get_device_capability(a.device)
        require(major == 9, f"float8 on sm_{major}{minor}: the op's fp8 kernels beyond decode sizes are "
                            "Hopper's (sm_90), torch._scaled_mm is kept")
    m, n = a.shape[0], b.shape[1]
    sa_kind = scaled_mm_scale_kind("scale_a", val(kw["scale_a"]), m, f"a of shape {shape_str(a)}")
    sb_kind = scaled_mm_scale_kind("scale_b", val(kw["scale_b"]), n, f"b of shape {shape_str(b)}")
    bias = kw["bias"]
    if bias is not None:
        require(bias_ok(val(bias), n, out_dtype, ndim=1),
                f"bias of shape {shape_str(val(bias))} and dtype {val(bias).dtype} is not [N] in {out_dtype}")

    def build(a, b, scale_a, scale_b, bias=None):
        return torch.ops.quantfuse.scaled_mm(
            a, b, as_scale_vector(scale_a, a), as_scale_vector(scale_b, a), out_dtype, bias)

    inputs = {"a": kw["self"], "b": kw["mat2"], "scale_a": kw["scale_a"], "scale_b": kw["scale_b"]}
    if bias is not None:
        inputs["bias"] = bias
    detail = f"float8_e4m3fn {sa_kind} x {sb_kind} in {out_dtype}".replace("torch.", "")
    return Plan(inputs, build, detail, out_dtype)


# --------------------------------------------------------------------------- registration


def register(passes: dict[str, PatternMatcherPass]) -> None:
    target = [passes[slot] for slot in SLOTS]
    for form, pattern in dequant_matmul_patterns(zero_point=False):
        viewed = form.endswith("-3d")
        register_checked(pattern, target, FAMILY, form,
                         functools.partial(plan_dequant_matmul, form=form, viewed=viewed))
    for form, pattern in int_mm_patterns():
        register_checked(pattern, target, FAMILY, form, functools.partial(plan_int_mm, form=form))
    for form, pattern in torch_scaled_mm_patterns():
        register_checked(pattern, target, FAMILY, form, functools.partial(plan_torch_scaled_mm, form=form))
    register_epilogue_rules(target, SCALED_MM)
