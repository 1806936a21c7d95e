"""An act-order layer's input order stored by the RMSNorm that makes the input.

An act-order ``AWQLinear`` (GPTQ ``desc_act``) puts its input in its order as a scatter by the inverse
order, ``torch.empty_like(x).index_copy_(-1, perm_inverse, x)``.  Before q/k/v and gate/up the input is
transformers' RMSNorm of the residual stream (``LlamaRMSNorm``, and every RMSNorm written like it)::

    s = a + b                                              # the decoder layer's residual add (or none)
    h = s.to(torch.float32)
    n = weight * (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)).to(s.dtype)
    x = torch.empty_like(n).index_copy_(-1, order, n)      # once per layer reading n (q, k, v; gate, up)

Inductor computes that in one kernel with one program per row, so at batch 1 one SM stores every
value to its scattered place: 7.6 µs per launch on an H200 against 2.4 for the same RMSNorm without
the order (benchmarks/RESULTS.md), 64 launches per 32-layer step.  Here it becomes
``quantfuse::add_rms_norm_ordered(a, b, weight, eps, order)`` (``rms_norm_ordered(s, weight, eps,
order)`` without the add; compile_backend/ops/rms_norm_ordered.py), whose kernel spreads each row
over several programs; the sum ``s`` is its second result, which the rest of the graph reads instead.

Runs on Dynamo's graph before Inductor (``backend._compile``), where the RMSNorm is still the calls
above.  Rewritten only where every condition holds on the traced values: each node of the RMSNorm read
by nothing but the next (``n`` by nothing but the scatters and their ``empty_like``), every scatter of
``n`` by the same order, a graph input (a module's buffer) of ``K`` int32 or int64 on ``n``'s device;
``a``, ``b`` and ``weight`` of ``s``'s shape (``[K]`` for the weight) and dtype, float16 or bfloat16;
``eps`` a number; every other reader of the sum after the first scatter (it reads the op's second
result); and, as for the decode attention's op (passes/gqa_decode.py), the graph runs on CUDA as a CUDA
graph (the op is a Python call per launch, which a replay skips) with no gradient to compute (the op
has none).  ``counters["quantfuse"]["rms_norm_ordered"]`` counts the rewrites.
"""

from __future__ import annotations

import logging
import operator

import torch
from torch._dynamo.utils import counters
from torch.fx import GraphModule, Node

from .dynamo_graph import act_order_scatters, example_value
from .dynamo_graph import takes_op as _takes_op  # a name of its own here: CPU tests replace it

log = logging.getLogger("quantfuse.rms_norm_ordered")

DTYPES = (torch.float16, torch.bfloat16)


def _is(node, name: str, *functions) -> bool:
    """``node`` is the tensor method ``name`` or one of ``functions``."""
    if not isinstance(node, Node):
        return False
    return ((node.op == "call_method" and node.target == name)
            or (node.op == "call_function" and node.target in functions))


def _only_user(node: Node, user: Node) -> bool:
    return set(node.users) == {user}


def _other(pair, node):
    """The operand of a two-operand call that is not ``node`` (None where neither or both are)."""
    if len(pair) != 2 or (pair[0] is node) == (pair[1] is node):
        return None
    return pair[1] if pair[0] is node else pair[0]


def _rms_norm(n: Node):
    """``(s, weight, eps, chain)`` where ``n`` is transformers' RMSNorm of ``s`` (the module doc; ``chain``:
    its nodes from ``h`` to ``n``), else None."""
    if not (_is(n, "mul", operator.mul, torch.mul) and len(n.args) == 2 and not n.kwargs):
        return None
    for rounded, weight in ((n.args[1], n.args[0]), (n.args[0], n.args[1])):
        if not (_is(rounded, "to") and _only_user(rounded, n) and len(rounded.args) == 2 and not rounded.kwargs):
            continue
        scaled = rounded.args[0]
        if not (_is(scaled, "mul", operator.mul, torch.mul) and _only_user(scaled, rounded) and not scaled.kwargs):
            continue
        for h in scaled.args:
            rsqrt = _other(scaled.args, h)
            if not (_is(h, "to") and len(h.args) == 2 and h.args[1] is torch.float32 and not h.kwargs
                    and _is(rsqrt, "rsqrt", torch.rsqrt) and len(rsqrt.args) == 1 and _only_user(rsqrt, scaled)):
                continue
            plus = rsqrt.args[0]
            if not (_is(plus, "add", operator.add, torch.add) and _only_user(plus, rsqrt) and not plus.kwargs):
                continue
            mean = next((a for a in plus.args if _is(a, "mean", torch.mean)), None)
            eps = _other(plus.args, mean)
            if not (mean is not None and isinstance(eps, (int, float)) and not isinstance(eps, bool) and eps >= 0
                    and _only_user(mean, plus) and tuple(mean.args[1:]) == (-1,) and mean.kwargs == {"keepdim": True}):
                continue
            square = mean.args[0]
            if not (_is(square, "pow", torch.pow) and tuple(square.args) == (h, 2) and not square.kwargs
                    and _only_user(square, mean) and set(h.users) == {square, scaled}):
                continue
            s = h.args[0]
            sv, wv = example_value(s), example_value(weight)
            if not (isinstance(sv, torch.Tensor) and sv.dtype in DTYPES and rounded.args[1] is sv.dtype
                    and isinstance(wv, torch.Tensor) and wv.dtype == sv.dtype and tuple(wv.shape) == (sv.shape[-1],)
                    and wv.device == sv.device and sv.dim() >= 1):
                continue
            return s, weight, float(eps), [h, square, mean, plus, rsqrt, scaled, rounded, n]
    return None


def _residual_add(s: Node):
    """``(a, b)`` where ``s`` is ``a + b`` of two tensors of its shape and dtype, else None."""
    if not (_is(s, "add", operator.add, torch.add) and len(s.args) == 2 and not s.kwargs):
        return None
    sv = example_value(s)
    for operand in s.args:
        v = example_value(operand)
        if not (isinstance(v, torch.Tensor) and v.shape == sv.shape and v.dtype == sv.dtype and v.device == sv.device):
            return None
    return s.args


def _rewrite(graph, n: Node, on_cuda_graphs: bool, position: dict) -> bool:
    norm = _rms_norm(n)
    found = act_order_scatters(n) if norm is not None else None
    if found is None:
        return False
    s, weight, eps, chain = norm
    order, pairs = found
    added = _residual_add(s)
    # The scatters' results require grad where a gradient would flow through them (from the weight too).
    if not _takes_op([s, order, *(added or ()), *(scatter for _, scatter in pairs)], on_cuda_graphs):
        return False
    first = min((scatter for _, scatter in pairs), key=position.get)
    # Whatever else reads the sum reads the op's second result, so it must come after the op.
    others = [u for u in s.users if u is not chain[0]]
    if added is not None and any(position.get(u, -1) < position[first] for u in others):
        return False
    with graph.inserting_before(first):
        if added is None:
            out = graph.call_function(torch.ops.quantfuse.rms_norm_ordered.default, (s, weight, eps, order))
            out.meta["example_value"] = example_value(pairs[0][1])
        else:
            op = graph.call_function(torch.ops.quantfuse.add_rms_norm_ordered.default, (*added, weight, eps, order))
            op.meta["example_value"] = (example_value(pairs[0][1]), example_value(s))
            out = graph.call_function(operator.getitem, (op, 0))
            out.meta["example_value"] = example_value(pairs[0][1])
            total = graph.call_function(operator.getitem, (op, 1))
            total.meta["example_value"] = example_value(s)
    for empty, scatter in pairs:
        scatter.replace_all_uses_with(out)
        graph.erase_node(scatter)
        graph.erase_node(empty)
    for node in reversed(chain):
        graph.erase_node(node)
    if added is not None:
        s.replace_all_uses_with(total)
        graph.erase_node(s)
    return True


def fuse_rms_norm_ordered(gm: GraphModule, on_cuda_graphs: bool = False) -> int:
    """Rewrites each act-order input order made from an RMSNorm in ``gm`` (see the module doc); returns
    how many.  ``on_cuda_graphs``: the graph will run as a CUDA graph."""
    graph = gm.graph
    position = {node: i for i, node in enumerate(graph.nodes)}
    rewritten = sum(_rewrite(graph, node, on_cuda_graphs, position) for node in list(graph.nodes)
                    if not getattr(node, "_erased", False) and _is(node, "mul", operator.mul, torch.mul))
    if rewritten:
        graph.lint()
        gm.recompile()
        counters["quantfuse"]["rms_norm_ordered"] += rewritten
        log.info("quantfuse: %d act-order input order(s) stored by the RMSNorm that makes the input", rewritten)
    return rewritten
