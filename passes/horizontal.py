"""Linears that share an input, merged: one quantfuse op over weights concatenated along N.

A decoder layer runs several linears on one activation (q/k/v projections, gate/up).  Once the
family passes have made each of them a quantfuse op, this pass finds ops of one family that
read the same activation operands and agree on everything but their weights, and replaces
them with one op over the members' weight-side operands concatenated along N, followed by a
slice of its output per member (views of the merged output: no copy).  One launch instead of
several, and a larger N, on which the decode kernels keep more of the DRAM bandwidth busy.

What a family's operands are is declared in ``MERGEABLE``, one ``Operand`` role per argument:

* ``shared``: the activation side (the quantized activation, its scale and zero point; ``x``).
  Equal when the same value, up to common subexpressions: HF's projections each quantize the
  same hidden state with nodes of their own, which ``equivalence`` maps to one (the pure nodes
  computing them are equal node by node);
* ``same``: constants (``out_dtype``, ``group_size``), equal in every member;
* ``rows_t`` (``b = w.t()``, concatenated along the weight's rows), ``rows`` (an ``[N, K]``
  weight), ``cols`` (AWQ's ``qweight`` / ``qzeros`` ``[., N/8]``, ``scales`` ``[G, N]``; a
  ``qweight`` in the fragment layout ``[N/64, K/16, 32, 4]`` holds N in its first dimension):
  graph inputs (parameters, buffers, frozen constants), concatenated along N;
* ``vector``: per-output-channel vectors (weight scales, bias), views of graph inputs, made
  one ``[N]`` vector; a per-tensor scale is broadcast to its member's N, unless every member
  reads the same one-element scale, which then stays as it is;
* ``colsum``: ``weight_colsum(w)`` of the member's own weight, made from the merged weight.

The concatenations are ``quantfuse::concat_weights`` nodes.  Their values derive from weights
only: the op makes them once and serves them from the derived-value cache (CUDA: C++,
``csrc/common/concat_weights.cpp``; CPU: ``ops/concat_weights.py``), made again after a part
changes in place (``copy_``, ``load_state_dict``), never in a CUDA graph's pool.  The cached
tensor itself comes back, so Inductor must never hand its memory to another buffer once the
merged op has read it: the op gets a lowering (``_register_lowering``) that marks its output
never to be reused.  Values the kernels derive in turn (the AWQ repack, column sums) are
cached against the concatenated tensor, whose address is stable.  Parts stored side by side in
one tensor (``quantize/merged.py``) are not copied on CUDA: the op reads that tensor in place.

Members are not merged (the group is reported with the reason) when a weight-side operand is
computed in the graph rather than read from a graph input (concatenating it would copy it on
every call), when optional operands (bias, zero point) are present in some members only, or
when the concatenation's checks refuse the parts (dtypes, shapes).

Numerics: each output column is computed as the member's op computes it, so the merged op's
results equal the members' for the reference implementations (integer and float64
accumulation per output element); a kernel chosen by N may accumulate a float product in
another order (AWQ), and a per-tensor scale broadcast per channel takes the per-channel
epilogue, where a kernel's per-tensor path may round the scale product differently.

Runs after the family patterns in every slot that holds them (``framework``), on forward
nodes only (a joint graph's backward stays as traced).
"""

from __future__ import annotations

import logging
import operator
from collections import defaultdict
from dataclasses import dataclass

import torch
from torch.fx import Graph, Node

import compile_backend.ops  # noqa: F401  (torch.ops.quantfuse.*)

from . import report
from .fx_helpers import VIEWS, is_backward, register_cached_output_lowering, val

log = logging.getLogger("quantfuse")

aten = torch.ops.aten
quantfuse = torch.ops.quantfuse
CONCAT = quantfuse.concat_weights.default
COLSUM = quantfuse.weight_colsum.default
SLICE = aten.slice.Tensor
PERMUTE = aten.permute.default
# Ops that only view their input with its elements in the same order.
_ORDER_KEEPING_VIEWS = (*VIEWS, aten.unsqueeze.default, aten.squeeze.dim, aten.squeeze.default,
                        aten.squeeze.dims, aten.alias.default)


@dataclass(frozen=True)
class Operand:
    name: str
    role: str  # shared, same, rows_t, rows, cols, vector, colsum (module docstring)


def _family(op_name: str, *operands: tuple[str, str]):
    op = getattr(quantfuse, op_name, None)
    return {} if op is None else {op.default: (op_name, tuple(Operand(n, r) for n, r in operands))}


MERGEABLE: dict = {
    **_family("scaled_mm", ("a", "shared"), ("b", "rows_t"), ("scale_a", "shared"), ("scale_b", "vector"),
              ("out_dtype", "same"), ("bias", "vector")),
    **_family("scaled_mm_azp", ("a", "shared"), ("b", "rows_t"), ("scale_a", "shared"), ("scale_b", "vector"),
              ("out_dtype", "same"), ("azp_adj", "colsum"), ("azp", "shared"), ("bias", "vector")),
    **_family("awq_gemm", ("x", "shared"), ("qweight", "cols"), ("scales", "cols"), ("qzeros", "cols"),
              ("group_size", "same"), ("bias", "vector"), ("perm", "shared")),
    **_family("w8a16_gemm", ("x", "shared"), ("w_q", "rows"), ("w_scale", "vector"), ("bias", "vector")),
}


_REPORTED = "quantfuse_not_merged_reported"
_MERGED = "quantfuse_merged"


class NotMergeable(Exception):
    """A member's operand cannot be concatenated; the message says why."""


# --------------------------------------------------------------------------- equivalent nodes


def _pure(node: Node) -> bool:
    if node.op != "call_function":
        return False
    if node.target is operator.getitem:
        return True
    target = node.target
    if not isinstance(target, torch._ops.OpOverload) or target._schema.is_mutable:
        return False
    return torch.Tag.nondeterministic_seeded not in target.tags and not node.is_impure()


def equivalence(graph: Graph) -> dict[Node, Node]:
    """Node -> the first node of the graph computing the same value (itself if none): pure
    call_function nodes with the same target and equivalent arguments are equivalent."""
    first: dict = {}
    canon: dict[Node, Node] = {}

    def norm(x):
        if isinstance(x, Node):
            return canon.get(x, x)
        if isinstance(x, (list, tuple)):
            return (type(x).__name__, *(norm(y) for y in x))
        if isinstance(x, dict):
            return ("dict", *sorted((k, norm(v)) for k, v in x.items()))
        if isinstance(x, float):  # 0.0 == -0.0, yet they are different arguments
            return ("float", repr(x))
        return (type(x).__name__, x)

    for node in graph.nodes:
        canon[node] = node
        if not _pure(node):
            continue
        try:
            key = (node.target, norm(node.args), norm(node.kwargs))
            canon[node] = first.setdefault(key, node)
        except TypeError:  # an unhashable constant: the node stays its own
            pass
    return canon


# --------------------------------------------------------------------------- members


def _args(node: Node) -> dict:
    schema = node.target._schema
    out = {}
    for i, arg in enumerate(schema.arguments):
        if i < len(node.args):
            out[arg.name] = node.args[i]
        else:
            out[arg.name] = node.kwargs.get(arg.name, arg.default_value)
    return out


def _is_input(node) -> bool:
    return isinstance(node, Node) and node.op in ("placeholder", "get_attr")


def _root(node, what: str) -> Node:
    """The graph input ``node`` views with its elements in order (``node`` itself if an input)."""
    x = node
    while isinstance(x, Node) and x.op == "call_function" and x.target in _ORDER_KEEPING_VIEWS:
        x = x.args[0]
    if not _is_input(x):
        desc = x.format_node() if isinstance(x, Node) else repr(x)
        raise NotMergeable(f"{what} is computed in the graph ({desc}), not read from a weight")
    return x


def _numel(node: Node) -> int:
    n = val(node).numel()
    if type(n) is not int:
        raise NotMergeable(f"{node.name} has a symbolic number of elements")
    return n


@dataclass
class Member:
    node: Node
    args: dict
    n: int  # output columns
    parts: dict  # operand name -> what is concatenated (a root node), or a shared node / None


def _member(node: Node, operands: tuple[Operand, ...]) -> Member:
    args = _args(node)
    out = val(node)
    if out is None or out.dim() != 2 or type(out.shape[1]) is not int:
        raise NotMergeable(f"output of {node.name} is not a 2-D tensor with a static N")
    n = out.shape[1]
    parts: dict = {}
    for op in operands:
        x = args[op.name]
        if op.role in ("shared", "same"):
            continue
        if op.role == "rows_t":
            if not (isinstance(x, Node) and x.target is PERMUTE and list(x.args[1]) == [1, 0]):
                raise NotMergeable(f"'{op.name}' of {node.name} is not the transpose of a weight")
            parts[op.name] = _root(x.args[0], f"'{op.name}' of {node.name}")
            if parts[op.name] is not x.args[0]:
                raise NotMergeable(f"'{op.name}' of {node.name} transposes a view of a weight (a view made "
                                   "on every call cannot key the cached concatenation)")
        elif op.role in ("rows", "cols"):
            parts[op.name] = x if _is_input(x) else _root(x, f"'{op.name}' of {node.name}")
            if parts[op.name] is not x:
                raise NotMergeable(f"'{op.name}' of {node.name} is a view of a weight (a view made on every "
                                   "call cannot key the cached concatenation)")
        elif op.role == "vector":
            if x is None:
                parts[op.name] = None
                continue
            root = _root(x, f"'{op.name}' of {node.name}")
            if _numel(root) not in (1, n):
                raise NotMergeable(f"'{op.name}' of {node.name} has {_numel(root)} elements for N = {n}")
            parts[op.name] = root
        elif op.role == "colsum":
            weight = next(parts[o.name] for o in operands if o.role == "rows_t")
            if not (isinstance(x, Node) and x.target is COLSUM and x.args[0] is weight):
                raise NotMergeable(f"'{op.name}' of {node.name} is not the column sums of its own weight")
    return Member(node, args, n, parts)


def _group_key(member: Member, operands, canon) -> tuple:
    key = [member.node.target]
    for op in operands:
        x = member.args[op.name]
        if op.role == "shared":
            key.append(canon.get(x, x) if isinstance(x, Node) else ("const", x))
        elif op.role == "same":
            key.append(("const", x))
        elif op.role == "vector":
            key.append(x is None)
    return tuple(key)


# --------------------------------------------------------------------------- merging


def _call(graph: Graph, target, args: tuple, meta_from: Node) -> Node:
    node = graph.call_function(target, args)
    node.meta.update({k: v for k, v in meta_from.meta.items() if k not in ("val", "tensor_meta")})
    node.meta["val"] = target(*[[val(y) for y in a] if isinstance(a, list) else val(a) for a in args])
    return node


def _n_dim(op: Operand, part) -> int:
    """The dimension of a weight-side operand that holds N (see the module doc)."""
    return 1 if op.role == "cols" and part.dim() == 2 else 0


def _merged_operand(graph: Graph, op: Operand, members: list[Member], canon, cache: dict, first: Node):
    x0 = members[0].args[op.name]
    if op.role == "shared":
        return canon.get(x0, x0) if isinstance(x0, Node) else x0
    if op.role == "same":
        return x0
    if op.role == "colsum":
        rows = next(o for o in MERGEABLE[first.target][1] if o.role == "rows_t")
        return _call(graph, COLSUM, (cache[rows.name],), first)
    parts = [m.parts[op.name] for m in members]
    if op.role == "vector":
        if parts[0] is None:
            return None
        if all(p is parts[0] for p in parts) and _numel(parts[0]) == 1:
            return x0  # one per-tensor scale read by every member
        return _call(graph, CONCAT, (parts, 0, [m.n for m in members]), first)
    concat = _call(graph, CONCAT, (parts, _n_dim(op, val(parts[0]))), first)
    if op.role == "rows_t":
        cache[op.name] = concat
        return _call(graph, PERMUTE, (concat, [1, 0]), first)
    return concat


def _merge(graph: Graph, family: str, operands, members: list[Member], canon) -> None:
    first = members[0].node
    with graph.inserting_before(first):
        cache: dict = {}
        args = {}
        for op in operands:
            args[op.name] = _merged_operand(graph, op, members, canon, cache, first)
        merged = _call(graph, first.target, tuple(args[op.name] for op in operands), first)
        merged.meta[_MERGED] = True
        start = 0
        for m in members:
            piece = _call(graph, SLICE, (merged, 1, start, start + m.n), first)
            start += m.n
            m.node.replace_all_uses_with(piece)
    for m in members:
        graph.erase_node(m.node)
    widths = "+".join(str(m.n) for m in members)
    report.record_merged(family, tuple(m.node.name for m in members), f"N = {widths}")


def merge_shared_input(graph: Graph) -> int:
    """Merge every group of quantfuse ops of one family that read the same activation (module
    docstring); returns how many ops were removed."""
    # An op this pass made is not merged again (its weights are concatenations already).
    nodes = [n for n in graph.nodes if n.op == "call_function" and n.target in MERGEABLE
             and not is_backward(n) and not n.meta.get(_MERGED)]
    if len(nodes) < 2:
        return 0
    canon = equivalence(graph)
    order = {n: i for i, n in enumerate(graph.nodes)}
    groups: dict[tuple, list[Member]] = defaultdict(list)
    # Ops of one family reading the same first operand (the activation), and why some of them cannot merge.
    readers: dict[tuple, int] = defaultdict(int)
    refused: list[tuple[tuple, Node, str]] = []
    for node in nodes:
        operands = MERGEABLE[node.target][1]
        activation = (node.target, canon.get(node.args[0], node.args[0]))
        readers[activation] += 1
        try:
            member = _member(node, operands)
        except NotMergeable as exc:
            refused.append((activation, node, str(exc)))
            continue
        groups[_group_key(member, operands, canon)].append(member)
    for activation, node, reason in refused:
        # Reported once: the pass runs again in a later slot, on nodes that keep their meta.
        if readers[activation] > 1 and not node.meta.get(_REPORTED):
            report.record_not_merged(MERGEABLE[node.target][0], (node.name,), reason)
            node.meta[_REPORTED] = True
    removed = 0
    for key, members in groups.items():
        family, operands = MERGEABLE[key[0]]
        if len(members) < 2:
            continue
        members.sort(key=lambda m: order[m.node])
        try:
            _check_parts(operands, members)
        except (NotMergeable, ValueError) as exc:
            report.record_not_merged(family, tuple(m.node.name for m in members), str(exc))
            continue
        _merge(graph, family, operands, members, canon)
        removed += len(members) - 1
    if removed:
        register_lowering()
        graph.eliminate_dead_code()
    return removed


def _check_parts(operands, members: list[Member]) -> None:
    """The concatenations the merge would make pass the op's own checks (raises the reason)."""
    for op in operands:
        parts = [m.parts.get(op.name) for m in members]
        if op.role not in ("rows_t", "rows", "cols", "vector") or parts[0] is None:
            continue
        fakes = [val(p) for p in parts]
        if op.role == "vector":
            CONCAT(fakes, 0, [m.n for m in members])
        else:
            CONCAT(fakes, _n_dim(op, fakes[0]))


# --------------------------------------------------------------------------- Inductor lowering


def register_lowering() -> None:
    """Inductor lowers ``concat_weights`` as a fallback kernel whose output is never reused
    (``fx_helpers.register_cached_output_lowering``: the output is the cache's tensor)."""
    register_cached_output_lowering(CONCAT)
