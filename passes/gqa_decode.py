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

Where the op runs, the static cache's writes and the rotary embedding before them go into it too
when the graph is transformers' decode step (Llama's ``apply_rotary_pos_emb`` and
``StaticCache.update``)::

    q_r = q * cos + rotate_half(q) * sin;  k_r = k * cos + rotate_half(k) * sin     # same cos, sin
    k_cache.index_copy_(2, position, k_r);  v_cache.index_copy_(2, position, v)
    ... the attention above over k_cache and v_cache with q_r

becomes ``quantfuse::gqa_decode_rope(q, k, v, k_cache, v_cache, position, cos, sin, mask, scale)``
(compile_backend/ops/gqa_decode.py: one launch instead of the rotary's and the writes' few
launch-bound kernels per layer).  Only where each cache is read by nothing but its one write and the
attention, the rotated query and key by nothing but the attention and the write, ``cos``/``sin``
are ``[B or 1, 1, 1, D]`` and ``position`` one integer; else the attention alone becomes the op.
``counters["quantfuse"]["gqa_decode_rope"]`` counts these.  Where the position is the static cache's own
per-layer ``torch.arange(1) + counter`` followed by ``counter.add_(1)`` (transformers 5), the attention
becomes ``quantfuse::gqa_decode_rope_advance``, which reads the counter as its position and advances it,
and both nodes go (each was a launch per layer); only where the counter is a graph input that nothing
reads after its increment (``counters["quantfuse"]["gqa_decode_rope_counter"]``).

Where the op's result goes, through views only, to an act-order layer that puts its input in its order
(``AWQLinear``'s ``torch.empty_like(x).index_copy_(-1, perm_inverse, x)`` before ``o_proj``), the op
stores its values in that order itself (its ``out_order``) and the scatter is removed: the reshapes
between are checked by what they compute (each batch row of the result, heads then head dimensions,
is the last dimension of ``x``), nothing else reads the values in between, and the order is a graph
input (a module's buffer).  ``counters["quantfuse"]["gqa_decode_out_order"]`` counts these.
"""

from __future__ import annotations

import logging
import math
import operator

import torch
from torch._dynamo.utils import counters
from torch.fx import GraphModule, Node
from torch.fx.experimental.symbolic_shapes import statically_known_true

from .dynamo_graph import act_order_scatters, example_value
from .dynamo_graph import takes_op as _takes_op  # a name of its own here: CPU tests replace it

log = logging.getLogger("quantfuse.gqa_decode")

SDPA = (torch._C._nn.scaled_dot_product_attention, torch.nn.functional.scaled_dot_product_attention)
_ALL = slice(None, None, None)
_HEAD_SLOT = (_ALL, _ALL, None, _ALL, _ALL)  # x[:, :, None, :, :]


def _shape(node) -> tuple | None:
    value = example_value(node)
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


def _call(node, *targets) -> bool:
    return isinstance(node, Node) and node.op == "call_function" and node.target in targets


def _binary(node, targets) -> tuple | None:
    """The two operands of ``node`` where it is one of ``targets`` applied to exactly two, else None."""
    if _call(node, *targets) and len(node.args) == 2 and not node.kwargs:
        return node.args
    return None


def _half(node, x: Node, upper: bool) -> bool:
    """Whether ``node`` is ``x[..., D/2:]`` (``upper``) or ``x[..., :D/2]``."""
    if not (_call(node, operator.getitem) and node.args[0] is x):
        return False
    index, d = node.args[1], _shape(x)[-1]
    if not (isinstance(index, tuple) and len(index) == 2 and index[0] is Ellipsis and isinstance(index[1], slice)
            and isinstance(d, int) and d % 2 == 0):
        return False
    part = index[1]
    return part.step in (None, 1) and ((part.start, part.stop) == ((d // 2, None) if upper else (None, d // 2)))


def _rotate_half_of(node) -> Node | None:
    """``x`` where ``node`` is transformers' ``rotate_half(x)``: ``cat((-x[..., D/2:], x[..., :D/2]), -1)``."""
    if not _call(node, torch.cat):
        return None
    parts = node.args[0]
    dim = node.kwargs.get("dim", node.args[1] if len(node.args) > 1 else 0)
    if not (isinstance(parts, (tuple, list)) and len(parts) == 2 and dim in (-1, 3)):
        return None
    neg, lower = parts
    if not (_call(neg, operator.neg) and isinstance(neg.args[0], Node) and _call(neg.args[0], operator.getitem)):
        return None
    x = neg.args[0].args[0]
    shape = _shape(x)
    if shape is None or len(shape) != 4:
        return None
    return x if _half(neg.args[0], x, True) and _half(lower, x, False) else None


def _rope_of(node) -> tuple[Node, Node, Node] | None:
    """``(x, cos, sin)`` where ``node`` is ``x * cos + rotate_half(x) * sin`` (either operand order)."""
    terms = _binary(node, (operator.add, torch.add))
    if terms is None:
        return None
    for plain, rotated in (terms, terms[::-1]):
        first, second = _binary(plain, (operator.mul, torch.mul)), _binary(rotated, (operator.mul, torch.mul))
        if first is None or second is None:
            continue
        for x, cos in (first, first[::-1]):
            for half, sin in (second, second[::-1]):
                if all(isinstance(t, Node) for t in (x, cos, sin)) and _rotate_half_of(half) is x:
                    return x, cos, sin
    return None


def _cache_write(cache: Node) -> tuple[Node, Node, Node] | None:
    """``(the write, position, value written)`` where ``cache`` is written once by
    ``cache.index_copy_(2, position, value)`` and read by nothing else but the attention's repeat."""
    writes = [u for u in cache.users if u.op == "call_method" and u.target == "index_copy_"]
    if len(writes) != 1 or len(cache.users) != 2:
        return None
    write = writes[0]
    if write.users or write.kwargs or len(write.args) != 4:  # transformers passes (dim, index, source)
        return None
    _, dim, position, value = write.args
    if dim not in (2, -2) or not (isinstance(position, Node) and isinstance(value, Node)):
        return None
    return write, position, value


def _counter_of(graph, position: Node, writes: set[Node]) -> tuple[Node, Node, Node] | None:
    """``(counter, arange, increment)`` where ``position`` is transformers' per-layer static-cache position
    ``torch.arange(1) + counter`` read by ``writes`` alone, followed by ``counter.add_(1)``, a graph input
    that nothing reads after that increment (every other read comes before it)."""
    if not (_call(position, operator.add, torch.add) and len(position.args) == 2 and not position.kwargs
            and set(position.users) == writes):
        return None

    def arange_one(n) -> bool:
        v = example_value(n)
        return (_call(n, torch.arange) and n.args in ((1,), (0, 1)) and set(n.users) == {position}
                and isinstance(v, torch.Tensor) and v.shape == (1,))

    a, b = position.args
    arange, counter = (a, b) if arange_one(a) else (b, a) if arange_one(b) else (None, None)
    cv = example_value(counter)
    if not (isinstance(counter, Node) and counter.op == "placeholder" and isinstance(cv, torch.Tensor)
            and cv.numel() == 1 and cv.dtype in (torch.int32, torch.int64)):
        return None
    increments = [u for u in counter.users if u.op == "call_method" and u.target == "add_"]
    if len(increments) != 1:
        return None
    increment = increments[0]
    if increment.users or increment.kwargs or increment.args != (counter, 1):
        return None
    where = {n: i for i, n in enumerate(graph.nodes)}
    if any(where[u] > where[increment] for u in counter.users if u is not increment):
        return None
    return counter, arange, increment


def _fuse_rope(graph, sdpa: Node, q: Node, k_cache: Node, v_cache: Node, mask, scale: float) -> bool:
    """The attention, the rotary embedding of ``q`` and of the key written to ``k_cache``, and both
    caches' writes as one ``quantfuse::gqa_decode_rope`` (the module doc); False where the graph is
    not that form (nothing changed)."""
    kw, vw = _cache_write(k_cache), _cache_write(v_cache)
    if kw is None or vw is None or kw[1] is not vw[1]:
        return False
    position = kw[1]
    rq, rk = _rope_of(q), _rope_of(kw[2])
    if rq is None or rk is None or rq[1] is not rk[1] or rq[2] is not rk[2]:
        return False
    (q_raw, cos, sin), k_raw, v_new = rq, rk[0], vw[2]
    qs, ks, vs, cs, ss = (_shape(n) for n in (q_raw, k_raw, v_new, cos, sin))
    pv = position.meta.get("example_value")
    if not (isinstance(pv, torch.Tensor) and pv.dtype in (torch.int32, torch.int64) and pv.numel() == 1):
        return False
    hkv, d = _shape(k_cache)[1], qs[3]
    if not (_same(ks, (qs[0], hkv, 1, d)) and _same(vs, ks) and len(cs) == 4 and _same(cs[1:], (1, 1, d))
            and (_same(cs[:1], (1,)) or _same(cs[:1], qs[:1])) and _same(ss, cs)):
        return False
    if set(q.users) != {sdpa} or set(kw[2].users) != {kw[0]}:
        return False
    # The op's own checks, where the traced values show them: one device (the op runs there), the new
    # key and value in the caches' dtype, floating cos and sin.
    values = [n.meta.get("example_value") for n in (q_raw, k_raw, v_new, k_cache, position, cos, sin)]
    if not (_takes_op((q_raw, k_raw, v_new, position, cos, sin), True)
            and len({t.device for t in values}) == 1 and len({t.dtype for t in values[:4]}) == 1
            and values[5].dtype.is_floating_point and values[6].dtype.is_floating_point):
        return False
    counter = _counter_of(graph, position, {kw[0], vw[0]})
    # With the cache's counter: the op that reads it as the position and advances it.
    op = torch.ops.quantfuse.gqa_decode_rope if counter is None else torch.ops.quantfuse.gqa_decode_rope_advance
    with graph.inserting_before(sdpa):
        out = graph.call_function(op.default, (q_raw, k_raw, v_new, k_cache, v_cache,
                                               position if counter is None else counter[0], cos, sin, mask, scale))
    _replace(graph, sdpa, out, *sdpa.args[1:3])
    for write in (kw[0], vw[0]):
        graph.erase_node(write)
    if counter is not None:
        for node in (counter[2], position, counter[1]):  # the increment, the position's sum, its arange
            graph.erase_node(node)
        counters["quantfuse"]["gqa_decode_rope_counter"] += 1
    for rotated in (q, kw[2]):  # the rotary's nodes, now unused
        _erase_unused(graph, rotated)
    return True


def _erase_unused(graph, node: Node) -> None:
    """``node`` and then its inputs, each once nothing reads it (only pure nodes of the rotary)."""
    if node.users or node.op != "call_function":
        return
    inputs = [a for a in node.all_input_nodes]
    graph.erase_node(node)
    for a in dict.fromkeys(inputs):
        if _call(a, operator.add, torch.add, operator.mul, torch.mul, operator.neg, operator.getitem, torch.cat):
            _erase_unused(graph, a)


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
        if _fuse_rope(graph, sdpa, q, rk[0], rv[0], mask, scale):
            counters["quantfuse"]["gqa_decode_rope"] += 1
            return True
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


# What may stand between the op and the scatter: views and copies that keep every value (``to`` only
# changes the dtype); which element goes where is then checked on a probe (``_same_rows``).
_ORDER_METHODS = ("reshape", "view", "transpose", "contiguous", "flatten", "to")
_ORDER_FUNCTIONS = (torch.reshape, torch.transpose, torch.flatten)
OPS = (torch.ops.quantfuse.gqa_decode.default, torch.ops.quantfuse.gqa_decode_rope.default,
       torch.ops.quantfuse.gqa_decode_rope_advance.default)


def _keeps_values(node: Node, x: Node) -> bool:
    """``node`` is one of the views above applied to ``x``, with every other argument a constant."""
    if not ((node.op == "call_method" and node.target in _ORDER_METHODS)
            or (node.op == "call_function" and node.target in _ORDER_FUNCTIONS)):
        return False
    if not node.args or node.args[0] is not x:
        return False
    if node.target == "to":  # a dtype change only
        return len(node.args) == 2 and isinstance(node.args[1], torch.dtype) and not node.kwargs
    return not node.kwargs and node.all_input_nodes == [x]


def _same_rows(chain: list[Node], shape: tuple[int, ...]) -> bool:
    """Whether the views of ``chain`` take the op's ``[B, H, 1, D]`` result to a tensor whose last
    dimension is each batch row's ``H*D`` values in the op's order (run on an index probe)."""
    B = shape[0]
    probe = torch.arange(math.prod(shape), dtype=torch.float64).reshape(shape)
    t = probe
    try:
        for node in chain:
            if node.target == "to":
                continue
            args = node.args[1:]
            t = getattr(t, node.target)(*args) if node.op == "call_method" else node.target(t, *args)
    except Exception:  # a view these shapes do not allow: not the form
        return False
    row = math.prod(shape[1:])
    return t.dim() >= 1 and t.shape[-1] == row and torch.equal(t.reshape(-1, row), probe.reshape(B, row))


def _output_scatter(op: Node) -> tuple[Node, Node, Node, Node] | None:
    """``(x, empty, scatter, order)`` where ``op``'s result reaches ``x`` through views read by nothing
    else and ``x`` is put in ``order`` by ``torch.empty_like(x).index_copy_(-1, order, x)`` alone
    (``dynamo_graph.act_order_scatters``)."""
    shape = _shape(op.args[0])  # q: the result's [B, H, 1, D]
    if shape is None or not all(isinstance(d, int) for d in shape):
        return None
    x, chain = op, []
    while not any(u.op == "call_method" and u.target == "index_copy_" for u in x.users):
        users = list(x.users)
        if len(users) != 1 or not _keeps_values(users[0], x):
            return None
        x = users[0]
        chain.append(x)
    found = act_order_scatters(x)
    if found is None or len(found[1]) != 1:
        return None
    order, ((empty, scatter),) = found
    if example_value(order).shape[0] != math.prod(shape[1:]):
        return None
    return (x, empty, scatter, order) if _same_rows(chain, shape) else None


def _fold_output_order(graph, op: Node) -> bool:
    """Moves an act-order layer's input order after ``op`` into ``op`` (the module doc)."""
    found = _output_scatter(op)
    if found is None:
        return False
    x, empty, scatter, order = found
    op.kwargs = {**op.kwargs, "out_order": order}
    scatter.replace_all_uses_with(x)
    graph.erase_node(scatter)
    graph.erase_node(empty)
    return True


def pack_gqa_decode(gm: GraphModule, on_cuda_graphs: bool = False) -> int:
    """Rewrites each one-token attention over repeated keys and values in ``gm`` (see the module
    doc); returns how many.  The repeats it leaves unused are removed.  ``on_cuda_graphs``: the
    graph will run as a CUDA graph."""
    graph = gm.graph
    rewritten = sum(_rewrite(graph, node, on_cuda_graphs) for node in list(graph.nodes)
                    if node.op == "call_function" and node.target in SDPA)
    ordered = sum(_fold_output_order(graph, node) for node in list(graph.nodes)
                  if node.op == "call_function" and node.target in OPS)
    if ordered:
        counters["quantfuse"]["gqa_decode_out_order"] += ordered
        log.info("quantfuse: %d act-order input order(s) stored by the decode attention", ordered)
    if rewritten:
        graph.lint()
        gm.recompile()
        log.info("quantfuse: %d one-token attention(s) run on the key/value heads without repeating them", rewritten)
    return rewritten
