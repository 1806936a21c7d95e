"""What the passes that run on Dynamo's graph before Inductor share (``backend._compile``:
``gqa_decode.py``, ``rms_norm_ordered.py``): the traced value of a node, and where their Triton ops,
called from Python, may replace what the traced nodes compute."""

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
