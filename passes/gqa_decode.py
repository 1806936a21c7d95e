"""Grouped-query attention of one query token without repeating the keys and values.

Hugging Face's Llama (and every model on transformers' ``sdpa_attention_forward``) repeats
each key/value head for its query heads before ``scaled_dot_product_attention`` whenever an
attention mask is passed, as the static cache of a compiled decode step always does::

    k = k[:, :, None, :, :].expand(B, Hkv, n, L, D).reshape(B, Hkv * n, L, D)   # same for v
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, ...)           # q: [B, Hkv*n, 1, D]

Compiled, the two repeats are copies of the whole cache per layer and token (Llama-3-8B shapes,
681 cached positions: 2 × 5.6 MB written per layer, about 0.3 ms per token on an H200 at 32
layers, a tenth of an AWQ decode step), which the attention then reads.  With one query token
the same attention runs with the key/value heads as the batch and the ``n`` query heads of each
as its heads, over keys and values expanded along those heads (stride 0, no copy)::

    q' = q.unflatten(1, (Hkv, n)).flatten(0, 1)                              # [B*Hkv, n, 1, D]
    k' = k[:, :, None].expand(-1, -1, n, -1, -1).flatten(0, 1)               # [B*Hkv, n, L, D], a view
    out = F.scaled_dot_product_attention(q', k', v', attn_mask=mask', ...).unflatten(0, (-1, Hkv)).flatten(1, 2)

Every (batch, head) pair is computed from the same query, keys, values and mask as before, and
the attention kernel sees as many (batch, head) pairs as before.  (Not the ``n`` query heads as ``n``
query rows of one head, transformers' eager ``pack_gqa``: that gives the kernel a quarter of the
pairs, and cuDNN's kernel for that shape costs more than the copies do; benchmarks/RESULTS.md.)  The mask: its
head dimension, 1 or ``Hkv*n``, is regrouped the same way (a shared one expanded, a small copy
per call: ``B*Hkv`` rows of ``L``).

Runs on Dynamo's graph before Inductor (``backend._compile``), where the repeat and the
attention are still the user-level calls.  Rewritten only when every condition is checked
from the traced values: one query token, the repeat exactly as above with the key and value
repeated by the same ``n`` from ``[B, Hkv, L, D]`` inputs, no dropout, not causal, no
``enable_gqa``, and a mask of shape ``[B, 1 or Hkv*n, 1, L]`` (or none).  Anything else is left
as traced.

Where the graph will run on CUDA as a CUDA graph and no input requires grad, the attention is
instead one call of ``quantfuse::gqa_decode`` on the unrepeated keys and values
(compile_backend/ops/gqa_decode.py: Triton flash decoding, about 1.3x cuDNN's attention on this form).
The op is a Python call per launch, which only a CUDA graph's replay skips, and has no
derivative: elsewhere the ``scaled_dot_product_attention`` form above.
"""

from __future__ import annotations

import logging
import math
import operator

import torch
from torch.fx import GraphModule, Node
from torch.fx.experimental.symbolic_shapes import statically_known_true

log = logging.getLogger("quantfuse.gqa_decode")

SDPA = (torch._C._nn.scaled_dot_product_attention, torch.nn.functional.scaled_dot_product_attention)
_ALL = slice(None, None, None)
_HEAD_SLOT = (_ALL, _ALL, None, _ALL, _ALL)  # x[:, :, None, :, :]


def _shape(node) -> tuple | None:
    value = node.meta.get("example_value") if isinstance(node, Node) else None
    return tuple(value.shape) if isinstance(value, torch.Tensor) else None


def _same(a: tuple, b: tuple) -> bool:
    """Sizes known equal without a guard (a symbolic batch or cache length stays symbolic)."""
    return len(a) == len(b) and all(statically_known_true(x == y) for x, y in zip(a, b))


def _repeated(node) -> tuple[Node, int] | None:
    """(the [B, Hkv, L, D] tensor, n) where ``node`` is HF's ``repeat_kv`` of it, else None."""
    if not (isinstance(node, Node) and node.op == "call_method" and node.target == "reshape"):
        return None
    expand = node.args[0]
    if not (isinstance(expand, Node) and expand.op == "call_method" and expand.target == "expand"
            and len(expand.users) == 1):
        return None
    slot = expand.args[0]
    if not (isinstance(slot, Node) and slot.op == "call_function" and slot.target is operator.getitem
            and slot.args[1] == _HEAD_SLOT and len(slot.users) == 1):
        return None
    source = slot.args[0]
    src, expanded, out = _shape(source), _shape(expand), _shape(node)
    if src is None or expanded is None or out is None or len(src) != 4 or len(expanded) != 5:
        return None
    n = expanded[2]
    if not (isinstance(n, int) and isinstance(src[1], int) and n > 1):
        return None
    if not (_same(expanded, (src[0], src[1], n, src[2], src[3])) and _same(out, (src[0], src[1] * n, src[2], src[3]))):
        return None
    return source, n


def _op_scale(sdpa: Node, q_shape: tuple) -> float | None:
    """The attention's scale as a float for ``quantfuse::gqa_decode``, or None where it is not a
    number known when tracing."""
    scale = sdpa.kwargs.get("scale")
    if scale is None:
        return 1.0 / math.sqrt(q_shape[3]) if isinstance(q_shape[3], int) else None
    return float(scale) if isinstance(scale, (int, float)) else None


def _takes_op(nodes, on_cuda_graphs: bool) -> bool:
    """Whether the attention of these traced values runs as ``quantfuse::gqa_decode``: on CUDA,
    under CUDA graphs (the op is a Python call per launch, which a replay skips), and without a
    gradient to compute (the op has no derivative)."""
    values = [n.meta.get("example_value") for n in nodes if isinstance(n, Node)]
    return on_cuda_graphs and all(isinstance(t, torch.Tensor) and t.device.type == "cuda" and not t.requires_grad
                                  for t in values)


def _rewrite(graph, sdpa: Node, on_cuda_graphs: bool) -> bool:
    # HF passes q, k, v positionally and the rest by keyword; any other call is left alone.
    if len(sdpa.args) != 3:
        return False
    q, k, v = sdpa.args
    mask = sdpa.kwargs.get("attn_mask")
    if (sdpa.kwargs.get("dropout_p", 0.0) != 0.0 or sdpa.kwargs.get("is_causal", False) is not False
            or sdpa.kwargs.get("enable_gqa", False) is not False):
        return False
    rk, rv, qs = _repeated(k), _repeated(v), _shape(q)
    if rk is None or rv is None or rk[1] != rv[1] or qs is None or len(qs) != 4 or not _same(qs[2:3], (1,)):
        return False
    n = rk[1]
    hkv = _shape(rk[0])[1]
    if not _same(qs[1:2], (hkv * n,)):
        return False
    ms = _shape(mask) if mask is not None else None
    if mask is not None and not (ms is not None and len(ms) == 4 and _same((ms[0], ms[2]), (qs[0], 1))
                                 and (_same(ms[1:2], (1,)) or _same(ms[1:2], (hkv * n,)))):
        return False

    scale = _op_scale(sdpa, qs)
    if scale is not None and _takes_op((q, rk[0], rv[0], mask), on_cuda_graphs):
        with graph.inserting_before(sdpa):
            out = graph.call_function(torch.ops.quantfuse.gqa_decode.default, (q, rk[0], rv[0], mask, scale))
        _replace(graph, sdpa, out, k, v)
        return True

    def call(fn, *args):
        return graph.call_function(fn, args)

    def heads_as_batch(x):  # [B, Hkv*n, ...] -> [B*Hkv, n, ...]
        return call(torch.flatten, call(torch.unflatten, x, 1, (hkv, n)), 0, 1)

    def expanded(x, dim, size):  # size copies along a new dim, then the first two dims as one
        sizes = [-1] * 5
        sizes[dim] = size
        return call(torch.flatten, graph.call_method("expand", (call(torch.unsqueeze, x, dim), *sizes)), 0, 1)

    with graph.inserting_before(sdpa):
        packed_mask = mask
        if mask is not None:
            # [B*Hkv, 1 or n, 1, L]
            packed_mask = expanded(mask, 1, hkv) if _same(ms[1:2], (1,)) else heads_as_batch(mask)
        kwargs = {key: value for key, value in sdpa.kwargs.items() if key != "enable_gqa"}
        kwargs["attn_mask"] = packed_mask
        qkv = (heads_as_batch(q), expanded(rk[0], 2, n), expanded(rv[0], 2, n))  # [B*Hkv, n, ., D]
        packed = graph.call_function(sdpa.target, qkv, kwargs)
        out = call(torch.flatten, call(torch.unflatten, packed, 0, (-1, hkv)), 1, 2)
    _replace(graph, sdpa, out, k, v)
    return True


def _replace(graph, sdpa: Node, out: Node, k: Node, v: Node) -> None:
    sdpa.replace_all_uses_with(out)
    graph.erase_node(sdpa)
    # The repeats, now unused (only these nodes: a general dead-code pass could take in-place
    # writes Dynamo's graph keeps for their effect, such as the cache update).
    for repeat in dict.fromkeys((k, v)):
        chain = [repeat, repeat.args[0], repeat.args[0].args[0]]  # reshape, expand, x[:, :, None]
        for node in chain:
            if node.users:
                break
            graph.erase_node(node)


def pack_gqa_decode(gm: GraphModule, on_cuda_graphs: bool = False) -> int:
    """Rewrites each one-token attention over repeated keys and values in ``gm`` (see the module
    doc); returns how many.  The repeats it leaves unused are removed.  ``on_cuda_graphs``: the
    graph will run as a CUDA graph."""
    graph = gm.graph
    rewritten = sum(_rewrite(graph, node, on_cuda_graphs) for node in list(graph.nodes)
                    if node.op == "call_function" and node.target in SDPA)
    if rewritten:
        graph.lint()
        gm.recompile()
        log.info("quantfuse: %d one-token attention(s) run on the key/value heads without repeating them", rewritten)
    return rewritten
