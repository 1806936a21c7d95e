"""Pattern family ``w8a16_gemm``: int8 weight-only linears into ``quantfuse::w8a16_gemm``.

Forms (docs/DESIGN.md, "Source forms recognised", form 4), as declarative pattern
expressions on the aten graph Inductor hands to its custom passes; what the matmul's weight
operand ``W`` computes is decided by evaluating it on probes (``passes/scaled_weight.py``, the
W8A8 families' rule: however it is written, ``W[k, n] = w_q[n, k] · s[n]`` with the product
rounded once to ``W``'s dtype, or ``w_q[n, k]`` without a scale of its own):

4a. scale after the matmul (torchao's ``Int8WeightOnlyConfig``, per-row and
    per-tensor, the same code on CPU and CUDA)::

        y = mm(x, W) * s          # W computes w_q.t() (torchao: w_q.t().to(dt)); s: [N] / [1, N] / 1 element
        [y = y.view(*lead, N)] [+ bias]

    with the product in either operand order, and the view also before the product
    (``F.linear(x3d, w_q.to(dt)) * s``);
4b. dequantize-then-matmul (``F.linear(x, w_q.to(dt) * s[:, None], b)``, ``x @ (...).t()``)::

        y = mm(x, W)  |  addmm(bias, x, W)     # W computes w_q.t() * s; s: N elements / 1 element

    (``F.linear`` of a 3-D ``x`` is ``view`` → ``mm``/``addmm`` → ``view``: the op replaces the
    2-D matmul and the views stay);
4c. ``torch.ops.aten._weight_int8pack_mm(x, w_q, s)`` (s ``[N]`` in the activation dtype; what
    older torchao int8 weight-only layouts and gpt-fast call): the same math, replaced as is.

A ``+ bias`` after the op (with a view between them, 3-D activations) is folded into the
op by a second, small pattern set (the pass runs to a fixed point).

Checks (a candidate failing one is left alone and the reason is remembered on its matmul
for ``explain()``): ``w_q`` a 2-D int8 ``[N, K]`` tensor; ``x`` 2-D, float16 / bfloat16 /
float32 (the matmul's dtype, so ``W``'s); the scale a tensor (not a number), per-channel or
per-tensor as above, in float32 or the activation dtype; a bias per-channel in the
activation dtype; no forward user of the nodes computing ``W`` from ``w_q`` outside the
matmul (backward users of a joint graph are fine, ``dequant_probe.private_reason``); and ``x`` not itself
dequantized from an int8 / fp8 tensor: that is a W8A8 form, which ``scaled_mm``'s checks
decide (an activation it rejected stays unfused with its reason rather than becoming a
weight-only product).

Numerics: the op accumulates ``x · w_q`` in float32 and applies the scale and bias to the
accumulator, rounding once.  The sources round in between (4a: the matmul's result to
``dt`` before the scale; 4b: each dequantized weight element to ``dt``), so the fused
result may differ from them by that rounding (docs/DESIGN.md, "Rules").

Slots: ``joint_custom_pre_pass`` (before ``freezing`` folds ``w_q.to(dt) [* s]`` into a
dense weight, and before Inductor's ``mm + add → addmm``), and the same patterns in
``post_grad_custom_pre_pass`` as a second chance, as ``scaled_mm`` does.
"""

from __future__ import annotations

import functools

import torch
from torch._inductor.pattern_matcher import (
    CallFunction,
    KeywordArg,
    Match,
    PatternExpr,
    register_graph_pattern,
)

from compile_backend.ops.w8a16_gemm import W8A16_ACT_DTYPES

from .candidates import quantized_source
from .fx_helpers import (
    MUL,
    VIEWS,
    Plan,
    as_bias_vector,
    bias_add_patterns,
    bias_ok,
    is_scalar_like,
    known,
    matmul_node,
    no_alpha,
    register_checked,
    require,
    shape_str,
    tensor_val,
    val,
)
from .scaled_weight import analyze

aten = torch.ops.aten

FAMILY = "w8a16_gemm"
SLOTS = ("joint_custom_pre_pass", "post_grad_custom_pre_pass")
W8A16 = torch.ops.quantfuse.w8a16_gemm.default
# How far back from the activation a dequantization of an int8 / fp8 tensor is looked for:
# ``a.to(dt) [- z] * s [.view(...)]``.
_ACT_DEQUANT_DEPTH = 4


# --------------------------------------------------------------------------- patterns


def patterns():
    """Every (form, pattern) of forms 4a, 4b and 4c.  ``w_deq`` is the matmul's weight operand, any
    subgraph ``scaled_weight`` proves to be ``w_q.t()`` (4a) or ``w_q.t() * s`` (4b)."""
    x, s, w = KeywordArg("x"), KeywordArg("s"), KeywordArg("w_deq")
    mm = CallFunction(aten.mm.default, x, w)
    viewed = CallFunction(VIEWS, mm, KeywordArg("out_shape"))
    for y in (mm, viewed):
        yield "scale-after-mm", CallFunction(MUL, y, s)
        yield "scale-after-mm", CallFunction(MUL, s, y)
    yield "dequant-mm", CallFunction(aten.mm.default, x, w)
    yield "dequant-addmm", CallFunction(aten.addmm.default, KeywordArg("bias"), x, w)
    yield "weight_int8pack_mm", CallFunction(aten._weight_int8pack_mm.default, x, KeywordArg("w"), s)


# --------------------------------------------------------------------------- checks and plan


def _scale_kind(s, n, *, after: bool, dt) -> str:
    require(isinstance(s, torch.Tensor), f"the scale is {s!r}; expected a tensor")
    require(s.dtype in (torch.float32, dt),
            f"the scale has dtype {s.dtype}; w8a16_gemm takes float32 or the activation dtype {dt}")
    if is_scalar_like(s):
        return "per-tensor"
    # After the matmul the scale multiplies the [M, N] output: [N] or [1, N].  On the weight,
    # ``scaled_weight`` has proven it per output channel (N elements).
    if after:
        ok = 1 <= s.dim() <= 2 and known(s.shape[-1] == n) and (s.dim() == 1 or known(s.shape[0] == 1))
        require(ok, f"scale of shape {shape_str(s)} is neither per-tensor nor per-channel ([N] or [1, N]) "
                    f"for N = {n}")
    return "per-channel"


def _weight(match: Match, form: str):
    """(w_q, scale) of the match: 4c's operands, or what ``scaled_weight`` proves the weight operand to
    be, or why it is none; None when it is no candidate of ``form`` (4a's weight has no scale of its
    own, 4b's has one)."""
    kw = match.kwargs
    if form == "weight_int8pack_mm":
        w = val(kw["w"])
        require(isinstance(w, torch.Tensor) and w.dtype == torch.int8 and w.dim() == 2,
                f"the weight is {getattr(w, 'dtype', w)} of shape {shape_str(w)}; expected a 2-D int8 tensor [N, K]")
        return kw["w"], kw["s"]
    weight = analyze(kw["w_deq"], matmul_node(match), (torch.int8,))
    if weight is None or isinstance(weight, str):
        return weight
    if (form == "scale-after-mm") != (weight.scale is None):
        return None
    return weight.q, kw["s"] if form == "scale-after-mm" else weight.scale


def plan(match: Match, *, form: str) -> Plan | None:
    kw = match.kwargs
    weight = _weight(match, form)
    if weight is None:
        return None
    x = val(kw["x"])
    require(isinstance(x, torch.Tensor) and x.dim() == 2 and x.dtype in W8A16_ACT_DTYPES,
            f"the activation is {getattr(x, 'dtype', x)} of shape {shape_str(x)}; expected a 2-D float16, "
            "bfloat16 or float32 tensor")
    source = quantized_source(kw["x"], depth=_ACT_DEQUANT_DEPTH)
    require(source is None, f"the activation is dequantized from {source} (a W8A8 form, not weight-only)")
    require(not isinstance(weight, str), weight)
    w_node, s_node = weight
    w, dt = val(w_node), x.dtype
    N, K = w.shape
    require(known(x.shape[1] == K), f"weight of shape {shape_str(w)} does not match activation {shape_str(x)}")
    kind = _scale_kind(val(s_node), N, after=form in ("scale-after-mm", "weight_int8pack_mm"), dt=dt)
    bias = kw.get("bias")
    if bias is not None:
        require(bias_ok(val(bias), N, dt),
                f"addmm input of shape {shape_str(val(bias))} is not a per-channel bias in {dt}")
    # A view between the matmul and the scale (3-D activations): re-applied to the op's result.
    shape = list(kw["out_shape"]) if "out_shape" in kw else None
    if shape is not None:
        viewed = val(next(n for n in match.nodes if n.target in VIEWS))
        require(known(viewed.shape[-1] == N), f"the view to {shape_str(viewed)} does not keep the N = {N} columns")
    syms = {f"size{i}": d for i, d in enumerate(shape or ()) if isinstance(d, torch.fx.Node)}

    def build(x, w, s, bias=None, **sizes):
        y = torch.ops.quantfuse.w8a16_gemm(x, w, s.reshape(-1), as_bias_vector(bias))
        if shape is None:
            return y
        return y.reshape([sizes[f"size{i}"] if isinstance(d, torch.fx.Node) else d for i, d in enumerate(shape)])

    inputs = {"x": kw["x"], "w": w_node, "s": s_node}
    if bias is not None:
        inputs["bias"] = bias
    inputs.update(syms)
    detail = f"{kind} K={K} N={N} {str(dt).removeprefix('torch.')}"
    return Plan(inputs, build, detail, dt)


# --------------------------------------------------------------------------- bias folding


def _op_call(n_args: int) -> PatternExpr:
    args = [KeywordArg(name) for name in ("x", "w", "s")] + [None] * (n_args - 3)
    return CallFunction(W8A16, *args)


def _bias_check(match: Match) -> bool:
    add = match.output_node()
    b, y = tensor_val(match.kwargs["bias"]), tensor_val(add)
    x, w = tensor_val(match.kwargs["x"]), tensor_val(match.kwargs["w"])
    if b is None or y is None or x is None or w is None or not no_alpha(add):
        return False
    return (b.dim() == 1 and known(b.shape[0] == w.shape[0]) and b.dtype == x.dtype == y.dtype
            and known(y.shape[-1] == w.shape[0]))


def _bias_handler(view: bool):
    def handler(match: Match, **kw):
        shape = list(kw["out_shape"]) if view else []
        sym = [s for s in shape if isinstance(s, torch.fx.Node)]

        def repl(x, w, s, bias, *sym_sizes):
            y = torch.ops.quantfuse.w8a16_gemm(x, w, s, bias)
            if not view:
                return y
            sizes = iter(sym_sizes)
            return y.reshape([next(sizes) if isinstance(d, torch.fx.Node) else d for d in shape])

        match.replace_by_example(repl, [kw["x"], kw["w"], kw["s"], kw["bias"], *sym])

    return handler


# --------------------------------------------------------------------------- registration


def register(passes: dict) -> None:
    target = [passes[slot] for slot in SLOTS]
    for form, pattern in patterns():
        register_checked(pattern, target, FAMILY, form, functools.partial(plan, form=form))
    for pattern, view in bias_add_patterns(_op_call(n_args) for n_args in (3, 4)):
        register_graph_pattern(pattern, extra_check=_bias_check, pass_dict=target)(_bias_handler(view))
