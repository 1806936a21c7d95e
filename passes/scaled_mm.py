"""Pattern family ``scaled_mm``: symmetric W8A8 matmuls into ``quantfuse::scaled_mm``.

Forms (DESIGN.md "Passes"), each as declarative pattern expressions of
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
op's output: ``+ bias`` (per-channel, in the op's output dtype) becomes the
op's ``bias``; ``.to(dt)`` of a float32 result becomes ``out_dtype`` (with a
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
same on both sides), dequant dtype and output dtype float16/bfloat16/float32,
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
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import torch
from torch._inductor.pattern_matcher import (
    MULTIPLE,
    CallFunction,
    Ignored,
    KeywordArg,
    Match,
    PatternExpr,
    PatternMatcherPass,
    register_graph_pattern,
)
from torch.fx import Node
from torch.fx.experimental.symbolic_shapes import statically_known_true

from . import report

FAMILY = "scaled_mm"
SLOT = "joint_custom_pre_pass"
# Second chance when the joint passes did not run on a graph (or another pass in the
# joint slot hid a chain from us): the post-grad pre slot, before Inductor's own
# post-grad rewrites.  A chain fused in the joint slot is gone by then.
SLOTS = ("joint_custom_pre_pass", "post_grad_custom_pre_pass")

aten, prims = torch.ops.aten, torch.ops.prims
CONVERT = prims.convert_element_type.default
MUL = aten.mul.Tensor
ADD = aten.add.Tensor
VIEWS = (aten.view.default, aten.reshape.default, aten._unsafe_view.default)
QUANT_DTYPES = (torch.int8, torch.float8_e4m3fn)
OUT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
F32 = torch.float32


# --------------------------------------------------------------------------- shape/dtype helpers


def val(x):
    """The fake value of a node (or the constant itself)."""
    return x.meta.get("val") if isinstance(x, Node) else x


def known(cond) -> bool:
    return bool(statically_known_true(cond))


def shape_str(t) -> str:
    return "[" + ", ".join(str(s) for s in t.shape) + "]" if isinstance(t, torch.Tensor) else repr(t)


def is_scalar_like(s) -> bool:
    """A Python number or a tensor with one element."""
    if isinstance(s, (int, float)) and not isinstance(s, bool):
        return True
    return isinstance(s, torch.Tensor) and known(s.numel() == 1)


class Reject(Exception):
    """A candidate failed a check; the message says which."""


def require(cond: bool, reason: str) -> None:
    if not cond:
        raise Reject(reason)


def check_scale_dtype(name: str, s) -> None:
    if isinstance(s, torch.Tensor):
        require(s.dtype in OUT_DTYPES, f"{name} has dtype {s.dtype}; expected a floating scale")
    else:
        require(isinstance(s, (int, float)) and not isinstance(s, bool),
                f"{name} is {s!r}; expected a tensor or a number")


def is_per_token_shape(t, a) -> bool:
    """``t`` is ``[*lead, 1]`` for the activation ``a`` ``[*lead, K]`` (provably, without guards)."""
    return (t.dim() == a.dim() and known(t.shape[-1] == 1)
            and all(known(t.shape[i] == a.shape[i]) for i in range(a.dim() - 1)))


def activation_scale_kind(s, a) -> str:
    """``scale_a`` multiplying the activation ``a`` ``[*lead, K]``: per-tensor or per-token."""
    check_scale_dtype("activation scale", s)
    if is_scalar_like(s):
        return "per-tensor"
    require(is_per_token_shape(s, a),
            f"activation scale of shape {shape_str(s)} is neither per-tensor nor per-token "
            f"for an activation of shape {shape_str(a)}")
    return "per-token"


def weight_scale_kind(s, w) -> str:
    """``scale_b`` multiplying the weight ``w`` ``[N, K]``: per-tensor or per-channel ``[N, 1]``."""
    check_scale_dtype("weight scale", s)
    if is_scalar_like(s):
        return "per-tensor"
    ok = s.dim() == 2 and known(s.shape[0] == w.shape[0]) and known(s.shape[1] == 1)
    require(ok, f"weight scale of shape {shape_str(s)} is neither per-tensor nor per-channel "
                f"([N, 1]) for a weight of shape {shape_str(w)}")
    return "per-channel"


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


def bias_ok(bias, n, out_dtype, ndim=2, upcast=False) -> bool:
    """``bias`` broadcasts as a per-channel row over an output ``[..., N]`` of ``out_dtype``.

    ``upcast``: a float16/bfloat16 bias added to a float32 output is fine too (type
    promotion converts it exactly).
    """
    dtype_ok = isinstance(bias, torch.Tensor) and (
        bias.dtype == out_dtype or (upcast and out_dtype == F32 and bias.dtype in OUT_DTYPES))
    return (dtype_ok and 1 <= bias.dim() <= ndim
            and known(bias.shape[-1] == n) and all(known(d == 1) for d in bias.shape[:-1]))


def as_scale_vector(s, like: torch.Tensor) -> torch.Tensor:
    """A scale (number or tensor) as the float32 vector the op takes (1, M or N elements)."""
    if isinstance(s, torch.Tensor):
        return s.to(F32).reshape(-1)
    return torch.full((1,), float(s), dtype=F32, device=like.device)


# --------------------------------------------------------------------------- pattern pieces


def mul_either(x: PatternExpr, y: PatternExpr, users=1) -> list[PatternExpr]:
    """``x * y`` in both operand orders (the matcher does not know ``mul`` commutes)."""
    return [CallFunction(MUL, x, y, _users=users), CallFunction(MUL, y, x, _users=users)]


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


def weight_dequant_t() -> Iterator[PatternExpr]:
    """``(w.to(dt) * scale_b).t()`` (``t`` decomposes to ``permute([1, 0])``)."""
    w = CallFunction(CONVERT, KeywordArg("w"), KeywordArg("w_dt"))
    for deq in mul_either(w, KeywordArg("scale_b")):
        yield CallFunction(aten.permute.default, deq, [1, 0])


def dequant_matmul_patterns(zero_point: bool) -> Iterator[tuple[str, PatternExpr]]:
    """Every (form, pattern) of form 2b (2c with ``zero_point``)."""
    for act, viewed in activation_dequant(zero_point):
        for wt in weight_dequant_t():
            yield "dequant-mm" + ("-3d" if viewed else ""), CallFunction(aten.mm.default, act, wt)
            yield ("dequant-addmm" + ("-3d" if viewed else ""),
                   CallFunction(aten.addmm.default, KeywordArg("bias"), act, wt))


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


# --------------------------------------------------------------------------- matching and replacing


@dataclass
class Plan:
    """What a checked candidate becomes: ``build(**tensors)`` traced as the replacement."""

    inputs: dict  # name -> Node or constant, in the order the replacement takes them
    build: Callable
    detail: str
    extra: dict = field(default_factory=dict)


def matmul_node(match: Match) -> Node | None:
    for n in match.nodes:
        if n.target in (aten.mm.default, aten.addmm.default, aten._int_mm.default):
            return n
    return None


def replace_with_plan(match: Match, plan: Plan) -> None:
    names = list(plan.inputs)
    node_names = [k for k in names if isinstance(plan.inputs[k], Node)]
    constants = {k: v for k, v in plan.inputs.items() if not isinstance(v, Node)}

    def replacement(*tensors):
        return plan.build(**dict(zip(node_names, tensors)), **constants)

    match.replace_by_example(replacement, [plan.inputs[k] for k in node_names])


def register_checked(pattern: PatternExpr, passes, family: str, form: str,
                     plan_fn: Callable[[Match], Plan]) -> None:
    """Register ``pattern``; ``plan_fn`` checks a match (raising ``Reject``) and plans its replacement."""

    def extra_check(match: Match) -> bool:
        try:
            match.quantfuse_plan = plan_fn(match)
            return True
        except Reject as exc:
            mm = matmul_node(match)
            if mm is not None:
                report.note_reason(mm, f"{family} ({form}): {exc}")
            return False

    def handler(match: Match, *args, **kwargs) -> None:
        plan = match.quantfuse_plan
        replace_with_plan(match, plan)
        report.record_fused(family, form, plan.detail)

    register_graph_pattern(pattern, extra_check=extra_check, pass_dict=passes)(handler)


def check_quantized_pair(a, w, a_dt, w_dt, *, zero_point: bool) -> torch.dtype:
    require(isinstance(a, torch.Tensor) and a.dtype in QUANT_DTYPES,
            f"activation has dtype {getattr(a, 'dtype', a)}; expected int8 or float8_e4m3fn")
    require(isinstance(w, torch.Tensor) and w.dtype == a.dtype,
            f"weight has dtype {getattr(w, 'dtype', w)}; expected the activation's {a.dtype}")
    require(w.dim() == 2 and known(w.shape[1] == a.shape[-1]),
            f"weight of shape {shape_str(w)} does not match activation of shape {shape_str(a)}")
    require(a_dt == w_dt and a_dt in OUT_DTYPES,
            f"dequantized to {a_dt} / {w_dt}; expected one of float16, bfloat16, float32")
    if zero_point:
        require(a.dtype == torch.int8, "a zero point needs int8 activations")
    return a_dt


@dataclass
class DequantMatmul:
    """What the checks of a dequant-then-matmul match established (shared with scaled_mm_azp)."""

    a: torch.Tensor
    w: torch.Tensor
    out_dtype: torch.dtype
    sa_kind: str
    sb_kind: str
    bias: Node | None


def check_dequant_matmul(match: Match, *, viewed: bool, zero_point: bool) -> DequantMatmul:
    kw = match.kwargs
    a, w = val(kw["a"]), val(kw["w"])
    out_dtype = check_quantized_pair(a, w, kw["a_dt"], kw["w_dt"], zero_point=zero_point)
    sa_kind = activation_scale_kind(val(kw["scale_a"]), a)
    sb_kind = weight_scale_kind(val(kw["scale_b"]), w)
    check_view(match, a, viewed)
    bias = kw.get("bias")
    if bias is not None:
        require(bias_ok(val(bias), w.shape[0], out_dtype),
                f"addmm input of shape {shape_str(val(bias))} is not a per-channel bias in {out_dtype}")
    return DequantMatmul(a, w, out_dtype, sa_kind, sb_kind, bias)


def as_bias_vector(bias):
    """An ``addmm`` bias of shape ``[1, N]`` as the op's ``[N]``."""
    return bias if bias is None or bias.dim() == 1 else bias.reshape(-1)


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
    return Plan(inputs, build, detail)


def check_view(match: Match, a, viewed: bool) -> None:
    if not viewed:
        return
    view = next(n for n in match.nodes if n.target in VIEWS)
    out = val(view)
    require(out.dim() == 2 and known(out.shape[1] == a.shape[-1]),
            f"view to {shape_str(out)} does not just flatten the activation's leading dimensions "
            f"({shape_str(a)})")


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
    return Plan(inputs, build, f"int8 {sa_kind} x {sb_kind} in float32")


# --------------------------------------------------------------------------- epilogue absorption


@dataclass(frozen=True)
class OpSignature:
    """Where an op of the W8A8 family keeps its output dtype and bias."""

    op: torch._ops.OpOverload
    family: str
    out_dtype_index: int = 4
    bias_index: int = 5

    def args(self, node: Node) -> list:
        schema = self.op._schema
        args = list(node.args)
        for arg in schema.arguments[len(args):]:
            args.append(node.kwargs.get(arg.name, arg.default_value))
        return args


SCALED_MM = OpSignature(torch.ops.quantfuse.scaled_mm.default, "scaled_mm")


def _fake_out(sig: OpSignature, args: list):
    fake_args = [val(a) for a in args]
    return sig.op(*fake_args)


def _new_op_node(graph: torch.fx.Graph, sig: OpSignature, old: Node, args: list, before: Node) -> Node:
    with graph.inserting_before(before):
        new = graph.call_function(sig.op, tuple(args))
    new.meta.update({k: v for k, v in old.meta.items() if k not in ("val", "tensor_meta")})
    new.meta["val"] = _fake_out(sig, args)
    return new


def bias_vector(graph: torch.fx.Graph, bias: Node, dtype: torch.dtype, before: Node) -> Node:
    """``bias`` as a 1-D ``[N]`` node of ``dtype`` (a view and/or an exact upcast when needed)."""
    with graph.inserting_before(before):
        if val(bias).dim() != 1:
            flat = graph.call_function(aten.view.default, (bias, [-1]))
            flat.meta["val"] = val(bias).reshape(-1)
            bias = flat
        if val(bias).dtype != dtype:
            up = graph.call_function(CONVERT, (bias, dtype))
            up.meta["val"] = val(bias).to(dtype)
            bias = up
    return bias


def register_epilogue_rules(passes, sig: OpSignature) -> None:
    """``+ bias``, ``.to(dt)`` and views between them, folded into ``sig.op`` (see module doc)."""
    schema_args = sig.op._schema.arguments
    required = sum(1 for a in schema_args if not a.has_default_value())
    # The op node as a replacement traced it or a rule rebuilt it: any number of trailing defaults.
    ops = [CallFunction(sig.op, *(Ignored() for _ in range(n))) for n in range(required, len(schema_args) + 1)]

    def op_node(match: Match) -> Node:
        return next(n for n in match.nodes if n.target is sig.op)

    # --- + bias
    def bias_check(match: Match) -> bool:
        node = op_node(match)
        args = sig.args(node)
        out = val(node)
        return args[sig.bias_index] is None and bias_ok(val(match.kwargs["bias"]), out.shape[1], out.dtype,
                                                        upcast=True)

    def bias_handler(match: Match, *args, **kwargs) -> None:
        node, add = op_node(match), match.output_node()
        new_args = sig.args(node)
        new_args[sig.bias_index] = bias_vector(match.graph, match.kwargs["bias"], val(node).dtype, add)
        new = _new_op_node(match.graph, sig, node, new_args, add)
        add.replace_all_uses_with(new)
        match.erase_nodes()

    # --- .to(dt)
    def convert_check(match: Match) -> bool:
        node = op_node(match)
        args = sig.args(node)
        dt = match.kwargs["dt"]
        if args[sig.out_dtype_index] != F32 or dt not in OUT_DTYPES or dt == F32:
            return False
        bias = args[sig.bias_index]
        if bias is None:
            return True
        return (isinstance(bias, Node) and bias.target is CONVERT and isinstance(bias.args[0], Node)
                and val(bias.args[0]).dtype == dt)

    def convert_handler(match: Match, *args, **kwargs) -> None:
        node, conv = op_node(match), match.output_node()
        new_args = sig.args(node)
        dt = match.kwargs["dt"]
        new_args[sig.out_dtype_index] = dt
        bias = new_args[sig.bias_index]
        if bias is not None:
            new_args[sig.bias_index] = bias.args[0]
        new = _new_op_node(match.graph, sig, node, new_args, conv)
        conv.replace_all_uses_with(new)
        match.erase_nodes()

    # --- views between the op and its epilogue: sink them below it
    def sink_check(match: Match) -> bool:
        node = op_node(match)
        out = val(match.output_node())
        if "bias" in match.kwargs:
            bias = val(match.kwargs["bias"])
            return (sig.args(node)[sig.bias_index] is None
                    and bias_ok(bias, out.shape[-1], out.dtype, ndim=out.dim(), upcast=True))
        return convert_check(match)

    def sink_handler(match: Match, *args, **kwargs) -> None:
        graph, epilogue = match.graph, match.output_node()
        view = next(n for n in match.nodes if n.target in VIEWS)
        node = op_node(match)
        with graph.inserting_before(epilogue):
            if "bias" in match.kwargs:
                flat = bias_vector(graph, match.kwargs["bias"], val(node).dtype, epilogue)
                inner = graph.call_function(ADD, (node, flat))
                inner.meta["val"] = val(node) + flat.meta["val"]
            else:
                inner = graph.call_function(CONVERT, (node, match.kwargs["dt"]))
                inner.meta["val"] = val(node).to(match.kwargs["dt"])
            new_view = graph.call_function(view.target, (inner, *view.args[1:]))
            new_view.meta["val"] = val(epilogue)
        epilogue.replace_all_uses_with(new_view)
        match.erase_nodes()

    bias = KeywordArg("bias")
    for opx in ops:
        for add in (CallFunction(ADD, opx, bias), CallFunction(ADD, bias, opx)):
            register_graph_pattern(add, extra_check=bias_check, pass_dict=passes)(bias_handler)
        register_graph_pattern(CallFunction(CONVERT, opx, KeywordArg("dt")), extra_check=convert_check,
                               pass_dict=passes)(convert_handler)
        viewed = CallFunction(VIEWS, opx, Ignored())
        for add in (CallFunction(ADD, viewed, bias), CallFunction(ADD, bias, viewed)):
            register_graph_pattern(add, extra_check=sink_check, pass_dict=passes)(sink_handler)
        register_graph_pattern(CallFunction(CONVERT, viewed, KeywordArg("dt")), extra_check=sink_check,
                               pass_dict=passes)(sink_handler)


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
