"""What the passes that run on Dynamo's graph before Inductor share (``backend._compile``:
``gqa_decode.py``, ``rms_norm_ordered.py``): the traced value of a node, where their Triton ops,
called from Python, may replace what the traced nodes compute, and the act-order scatter both move
into their ops."""

from __future__ import annotations

import torch
from torch.fx import Node


def example_value(node):
    """The value Dynamo traced for ``node`` (None for anything else)."""
    return node.meta.get("example_value") if isinstance(node, Node) else None


def takes_op(nodes, on_cuda_graphs: bool) -> bool:
    """Whether a Triton op may compute from these nodes' traced values: on CUDA, under CUDA graphs (the
    op is a Python call per launch, which a replay skips), and without a gradient to compute (the ops
    have no derivative).  Entries that are not nodes (constants) are not looked at."""
    values = [example_value(n) for n in nodes if isinstance(n, Node)]
    return on_cuda_graphs and all(isinstance(t, torch.Tensor) and t.device.type == "cuda" and not t.requires_grad
                                  for t in values)


def act_order_scatters(x: Node) -> tuple[Node, list[tuple[Node, Node]]] | None:
    """``(order, [(empty, scatter), ...])`` where everything that reads ``x`` is an act-order layer's
    scatter of it, ``torch.empty_like(x).index_copy_(-1, order, x)`` (``quantize.act_order``), each
    ``empty_like`` read by its scatter alone, all by one ``order``: a graph input (a placeholder, or a
    ``get_attr`` where Dynamo keeps a buffer as one) holding a 1-D integer tensor of ``x``'s last
    dimension's length on ``x``'s device.  Else None."""
    xv = example_value(x)
    if not isinstance(xv, torch.Tensor) or xv.dim() < 1:
        return None
    pairs, order = [], None
    for user in x.users:
        if user.op == "call_function" and user.target is torch.empty_like:
            continue  # met again as its scatter's first argument
        if not (user.op == "call_method" and user.target == "index_copy_" and len(user.args) == 4
                and not user.kwargs and user.args[3] is x and user.args[1] in (-1, xv.dim() - 1)):
            return None
        empty = user.args[0]
        if not (isinstance(empty, Node) and empty.op == "call_function" and empty.target is torch.empty_like
                and empty.args == (x,) and not empty.kwargs and set(empty.users) == {user}):
            return None
        if order is not None and user.args[2] is not order:
            return None
        order = user.args[2]
        pairs.append((empty, user))
    ov = example_value(order)
    if not (pairs and len(pairs) * 2 == len(x.users) and order.op in ("placeholder", "get_attr")
            and isinstance(ov, torch.Tensor) and ov.dtype in (torch.int32, torch.int64)
            and tuple(ov.shape) == (xv.shape[-1],) and ov.device == xv.device):
        return None
    return order, pairs
