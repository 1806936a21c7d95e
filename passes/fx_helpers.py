"""FX helpers shared by every pattern family (``scaled_mm``, ``scaled_mm_azp``, ``awq_gemm``).

A family module holds its patterns and the checks only it makes; everything
two families need lives here, once:

* values and shapes of nodes (``val``, ``tensor_val``, ``static_shape``,
  ``known``, ``shape_str``) and the aten targets the patterns are written in;
* checks: ``Reject`` / ``require`` (a failed check names itself) and
  ``no_alpha``;
* registration: ``register_checked`` registers a pattern whose ``plan_fn``
  checks a match and returns a ``Plan`` (the replacement), remembering the
  reason of a failed check on the matmul for the report;
* the W8A8 scale-granularity and bias checks, and ``mul_either`` (both operand orders);
* the epilogue rules that fold ``+ bias``, ``.to(dt)`` and views between them
  into a W8A8 op (``register_epilogue_rules``).

Dtype tuples come from ``compile_backend.ops``, the op contract.  This module imports no family
and no analysis (``dequant_probe``, ``scaled_weight``, ``dequant_matmul``): they build on it.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import torch
from torch._inductor.pattern_matcher import (
    CallFunction,
    Ignored,
    KeywordArg,
    Match,
    PatternExpr,
    register_graph_pattern,
)
from torch.fx import Node
from torch.fx.experimental.symbolic_shapes import statically_known_true

from compile_backend.ops import OUT_DTYPES

from . import report

aten, prims = torch.ops.aten, torch.ops.prims
CONVERT = prims.convert_element_type.default
MUL = aten.mul.Tensor
ADD = aten.add.Tensor
VIEWS = (aten.view.default, aten.reshape.default, aten._unsafe_view.default)
F32 = torch.float32


# --------------------------------------------------------------------------- values and shapes of nodes


def val(x):
    """The fake value of a node (or the constant itself)."""
    return x.meta.get("val") if isinstance(x, Node) else x


def tensor_val(x) -> torch.Tensor | None:
    """The fake tensor of a node (or a tensor constant), else None."""
    v = val(x)
    return v if isinstance(v, torch.Tensor) else None


def static_shape(t: torch.Tensor | None):
    """The shape as a tuple of ints, or None when any size is symbolic (or ``t`` is None)."""
    if t is None:
        return None
    shape = tuple(t.shape)
    return shape if all(type(s) is int for s in shape) else None


def known(cond) -> bool:
    """``cond`` holds for every value of its symbols; never adds a guard."""
    return bool(statically_known_true(cond))


def shape_str(t) -> str:
    return "[" + ", ".join(str(s) for s in t.shape) + "]" if isinstance(t, torch.Tensor) else repr(t)


def is_scalar_like(s) -> bool:
    """A Python number or a tensor with one element."""
    if isinstance(s, (int, float)) and not isinstance(s, bool):
        return True
    return isinstance(s, torch.Tensor) and known(s.numel() == 1)


# --------------------------------------------------------------------------- joint (forward + backward) graphs
#
# Under grad mode (any input requires grad, e.g. a trainable LayerNorm before a
# quantized linear) AOTAutograd traces one joint graph of the forward and its
# backward, and the joint-graph slot runs on it before the partitioner splits it.
# The backward there is eager's own autograd of the source, and it reads forward
# values: ``mm(x_dq, w_deq.t())`` has ``grad_x_dq = grad_y @ w_deq`` reading the
# dequantized weight, and a scale computed from ``x`` gets
# ``sum(grad_x_dq * q)`` reading the quantized activation.  A family therefore
# fuses only the forward: its patterns accept extra users of the dequantization
# nodes when those users are backward nodes (``dequant_probe.private_reason``), the fused op
# replaces the forward matmul, and the backward keeps reading the dequantization
# nodes, which the partitioner then computes in the backward graph.  Gradients
# are eager's, computed by eager's formulas.


def is_backward(node) -> bool:
    """Whether ``node`` belongs to the backward part of an AOTAutograd joint graph.

    AOTAutograd tags every node it traces for the backward (``partitioner_tag``
    ``"is_backward"``, ``autograd_backward``); the tags survive partitioning, so a
    backward graph's nodes carry them too.  The incoming gradients are the
    ``tangents_*`` placeholders.
    """
    if not isinstance(node, Node):
        return False
    meta = node.meta
    if meta.get("partitioner_tag") == "is_backward" or meta.get("autograd_backward"):
        return True
    return node.op == "placeholder" and str(node.target).startswith("tangents")


# --------------------------------------------------------------------------- checks


class Reject(Exception):
    """A candidate failed a check; the message says which."""


def require(cond: bool, reason: str) -> None:
    if not cond:
        raise Reject(reason)


def no_alpha(node: Node) -> bool:
    """An ``add``/``sub`` without a scaling ``alpha``."""
    return node.kwargs.get("alpha", 1) == 1


# --------------------------------------------------------------------------- registration


@dataclass
class Plan:
    """What a checked candidate becomes: ``build(**tensors)`` traced as the replacement.

    ``form``: the source form for the report when the pattern alone does not
    say (``register_checked`` was given ``form=None``).
    """

    inputs: dict  # name -> Node or constant, in the order the replacement takes them
    build: Callable
    detail: str
    out_dtype: torch.dtype  # what the replacement returns
    extra: dict = field(default_factory=dict)
    form: str | None = None


MATMUL_TARGETS = (aten.mm.default, aten.addmm.default, aten._int_mm.default, aten._scaled_mm.default)


def matmul_node(match: Match) -> Node | None:
    for n in match.nodes:
        if n.target in MATMUL_TARGETS:
            return n
    return None


def replace_with_plan(match: Match, plan: Plan) -> None:
    names = list(plan.inputs)
    node_names = [k for k in names if isinstance(plan.inputs[k], Node)]
    constants = {k: v for k, v in plan.inputs.items() if not isinstance(v, Node)}

    def replacement(*tensors):
        return plan.build(**dict(zip(node_names, tensors)), **constants)

    match.replace_by_example(replacement, [plan.inputs[k] for k in node_names])


def register_checked(pattern: PatternExpr, passes, family: str, form: str | None,
                     plan_fn: Callable[[Match], Plan | None]) -> None:
    """Register ``pattern``; ``plan_fn`` checks a match (raising ``Reject``) and plans its replacement.

    A failed check is remembered on the match's matmul node as
    ``"<family> (<form>): <reason>"`` (``"<family>: <reason>"`` without a form).
    ``plan_fn`` returns None for a match that is no candidate of the family at all
    (a pattern as wide as any ``mm``): nothing is remembered.
    """
    label = family if form is None else f"{family} ({form})"

    def extra_check(match: Match) -> bool:
        if is_backward(match.output_node()):
            return False  # a joint graph's backward stays eager's own autograd
        try:
            plan = plan_fn(match)
            if plan is None:
                return False
            # The replacement returns the source's dtype, whatever the checks concluded.
            source = tensor_val(match.output_node())
            require(source is not None and plan.out_dtype == source.dtype,
                    f"the fused op would return {plan.out_dtype} where the source returns "
                    f"{getattr(source, 'dtype', None)}")
            match.quantfuse_plan = plan
            return True
        except Reject as exc:
            mm = matmul_node(match)
            if mm is not None:
                report.note_reason(mm, f"{label}: {exc}")
            return False

    def handler(match: Match, *args, **kwargs) -> None:
        plan = match.quantfuse_plan
        replace_with_plan(match, plan)
        report.record_fused(family, plan.form or form, plan.detail)

    register_graph_pattern(pattern, extra_check=extra_check, pass_dict=passes)(handler)


@functools.cache
def register_cached_output_lowering(op) -> None:
    """Inductor lowers ``op`` (whose outputs are a derived-value cache's tensors: ``concat_weights``,
    ``gptq_to_awq``) as a fallback kernel whose outputs are never reused.

    Inductor hands the memory of a buffer whose last reader has run to a later buffer of the
    same size (and lets a kernel write its output in place of a dead input).  The op's outputs
    are the cache's tensors, read again on every call: writing into them would corrupt the weights
    of every later call.
    """
    from torch._inductor import ir
    from torch._inductor.lowering import fallback_handler, register_lowering
    from torch._inductor.virtualized import V

    fallback = fallback_handler(op)

    @register_lowering(op, type_promotion_kind=None)
    def _never_reused(*args, **kwargs):
        result = fallback(*args, **kwargs)
        for leaf in torch.utils._pytree.tree_leaves(result):
            if isinstance(leaf, ir.IRNode):
                V.graph.never_reuse_buffers.add(leaf.get_name())
        return result


# --------------------------------------------------------------------------- W8A8 scale and bias checks


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


def as_bias_vector(bias):
    """An ``addmm`` bias of shape ``[1, N]`` as the op's ``[N]``."""
    return bias if bias is None or bias.dim() == 1 else bias.reshape(-1)


def bias_add_patterns(op_calls) -> Iterator[tuple[PatternExpr, bool]]:
    """(pattern, viewed) pairs: ``op_call [.view(shape)] + bias`` for each of ``op_calls`` (a fused
    op's call patterns), the bias on either side (the matcher does not know ``add`` commutes) and
    the output viewed to 3-D or not, for the families that fold a bias added after their op."""
    for y in op_calls:
        for view in (False, True):
            out = CallFunction(VIEWS, y, KeywordArg("out_shape")) if view else y
            for bias_first in (False, True):
                bias = KeywordArg("bias")
                yield CallFunction(aten.add.Tensor, *((bias, out) if bias_first else (out, bias))), view


# --------------------------------------------------------------------------- pattern builders


def mul_either(x: PatternExpr, y: PatternExpr, users=1) -> list[PatternExpr]:
    """``x * y`` in both operand orders (the matcher does not know ``mul`` commutes)."""
    return [CallFunction(MUL, x, y, _users=users), CallFunction(MUL, y, x, _users=users)]


# --------------------------------------------------------------------------- W8A8 epilogue absorption
#
# ``+ bias`` (per-channel, in the op's output dtype) becomes the op's ``bias``;
# ``.to(dt)`` of a float32 result becomes ``out_dtype`` (with a float32 bias that
# is ``bias_dt.to(float32)``, the bias goes back to ``dt``); a view between the
# op and its epilogue (3-D activations: ``mm`` -> ``view([B, S, N])`` -> ``+ bias``)
# is sunk below the epilogue first.  Each rule keeps the math: the op computes
# its epilogue in float32 and rounds once.


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
    """``+ bias``, ``.to(dt)`` and views between them, folded into ``sig.op`` (see above)."""
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

    # --- a view of a view of the op: one view (the op's output is contiguous), so the rules above see it
    def collapse_handler(match: Match, *args, **kwargs) -> None:
        graph, outer, node = match.graph, match.output_node(), op_node(match)
        with graph.inserting_before(outer):
            new_view = graph.call_function(outer.target, (node, *outer.args[1:]))
        new_view.meta["val"] = val(outer)
        outer.replace_all_uses_with(new_view)
        match.erase_nodes()

    bias = KeywordArg("bias")
    for opx in ops:
        register_graph_pattern(CallFunction(VIEWS, CallFunction(VIEWS, opx, Ignored()), Ignored()),
                               pass_dict=passes)(collapse_handler)
        for add in (CallFunction(ADD, opx, bias), CallFunction(ADD, bias, opx)):
            register_graph_pattern(add, extra_check=bias_check, pass_dict=passes)(bias_handler)
        register_graph_pattern(CallFunction(CONVERT, opx, KeywordArg("dt")), extra_check=convert_check,
                               pass_dict=passes)(convert_handler)
        viewed = CallFunction(VIEWS, opx, Ignored())
        for add in (CallFunction(ADD, viewed, bias), CallFunction(ADD, bias, viewed)):
            register_graph_pattern(add, extra_check=sink_check, pass_dict=passes)(sink_handler)
        register_graph_pattern(CallFunction(CONVERT, viewed, KeywordArg("dt")), extra_check=sink_check,
                               pass_dict=passes)(sink_handler)
