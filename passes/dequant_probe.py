"""Probing a weight-side dequantization subgraph: what it computes, not how it is written.

A family that fuses ``dequantize(weight) -> matmul`` needs to know that the
subgraph feeding the matmul's weight operand computes the dequantization its op
implements.  Instead of listing the ways people write it, a family

1. collects the subgraph (``collect``): the nodes between the weight operand and
   its leaves, through a closed set of ops (``ALLOWED``: elementwise arithmetic,
   shifts and masks, casts, views, reshapes, permutes, expands, slices,
   stacks/cats, gathers by constant indices, factories such as ``arange``);
   a leaf is a placeholder, a ``get_attr`` or any node outside that set;
2. names its leaves' roles (the family's business: ``qweight``, ``scales``...);
3. evaluates the subgraph on probe inputs (``evaluate``: the FX nodes re-run
   with torch on small CPU tensors) and compares each result with its op's
   reference on the same inputs.

Every op in ``ALLOWED`` is deterministic and moves data by sizes and constant
indices only, so what it computes at one output position depends on fixed
input positions through a fixed elementwise expression; probes that give every
position a telling value (the family chooses them) decide it.

Small shapes.  The graph's size arguments (``view`` shapes, ``expand`` sizes,
slice bounds, ``arange`` ends) are literal ints of the real shapes.  A family
gives the real values of the quantities its shapes are made of
(``SizeMap.shrink``: e.g. K, N/8 and the group count) and the probe runs at
small values of the same quantities: each literal int that equals a product of
quantities is replaced by that product of the small values, the others are
kept.  The small values are chosen so that two such products are equal at the
small values exactly when they are equal at the real ones, so the replacement
is well defined.  A literal in an index computation (``arange(K) // G``) is a
value, not a size argument; a family may evaluate once with such values mapped
the same way (``map_values``) and once without (a shift table ``arange(8) * 4``
must keep its 4).  Since the small values keep the products distinct that are
distinct at the real sizes, a literal naming the wrong quantity stays wrong at
the small sizes.  Every evaluated node's shape must then be the image of its
real shape (``ProbeMismatch`` otherwise: a size written some other way, a
constant tensor of a real size); a family falls back to the real sizes when
they are small enough (``REAL_SIZE_LIMIT``).
"""

from __future__ import annotations

import functools
import itertools
import operator
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

import torch
from torch.fx import Node

aten, prims = torch.ops.aten, torch.ops.prims

# The ops a dequantization subgraph may be built from.
ELEMENTWISE = {
    aten.bitwise_and.Scalar, aten.bitwise_and.Tensor, aten.__and__.Scalar, aten.__and__.Tensor,
    aten.bitwise_or.Scalar, aten.bitwise_or.Tensor, aten.__or__.Scalar, aten.__or__.Tensor,
    aten.bitwise_xor.Scalar, aten.bitwise_xor.Tensor,
    aten.__rshift__.Scalar, aten.__rshift__.Tensor, aten.bitwise_right_shift.Tensor,
    aten.bitwise_right_shift.Tensor_Scalar, aten.bitwise_right_shift.Scalar_Tensor,
    aten.__lshift__.Scalar, aten.__lshift__.Tensor, aten.bitwise_left_shift.Tensor,
    aten.bitwise_left_shift.Tensor_Scalar,
    aten.floor_divide.default, aten.floor_divide.Scalar, aten.remainder.Scalar, aten.remainder.Tensor,
    aten.div.Tensor, aten.div.Scalar, aten.div.Tensor_mode, aten.div.Scalar_mode,
    aten.sub.Tensor, aten.sub.Scalar, aten.rsub.Scalar, aten.rsub.Tensor, aten.add.Tensor, aten.add.Scalar,
    aten.mul.Tensor, aten.mul.Scalar, aten.neg.default,
}
CASTS = {prims.convert_element_type.default, aten._to_copy.default, aten.to.dtype}
LAYOUT = {
    aten.view.default, aten.reshape.default, aten._unsafe_view.default, aten.unsqueeze.default,
    aten.squeeze.dim, aten.squeeze.dims, aten.squeeze.default, aten.permute.default, aten.t.default,
    aten.transpose.int, aten.expand.default, aten.clone.default, aten.alias.default, aten.lift_fresh_copy.default,
    aten.slice.Tensor, aten.select.int, aten.narrow.default, aten.cat.default, aten.stack.default,
    aten.repeat_interleave.self_int, aten.repeat.default,
}
GATHERS = {aten.index.Tensor, aten.index_select.default, aten.gather.default}
FACTORIES = {
    aten.arange.default, aten.arange.start, aten.arange.start_step, prims.iota.default, aten.full.default,
    aten.scalar_tensor.default,
}
ALLOWED = ELEMENTWISE | CASTS | LAYOUT | GATHERS | FACTORIES

MAX_NODES = 256  # a dequantization is a few dozen ops; a larger subgraph is not one
REAL_SIZE_LIMIT = 1 << 20  # elements of the weight up to which a probe may run at the real sizes
CONSTANT_LIMIT = 1 << 22  # elements of a get_attr constant read for a probe


class ProbeMismatch(Exception):
    """Evaluating the subgraph did not reproduce the graph (a shape or dtype differs), or failed."""


# --------------------------------------------------------------------------- the subgraph


@dataclass
class Subgraph:
    """The nodes from a weight operand back to its leaves."""

    root: Node
    nodes: list[Node]  # interior nodes (ops of ALLOWED), producers before users
    inputs: list[Node]  # leaves that are not constants: placeholders, ops outside ALLOWED
    # get_attr leaves with real values; several nodes may read one attribute (the same target)
    constants: dict[Node, torch.Tensor] = field(default_factory=dict)

    def depending_on(self, leaves) -> set[Node]:
        """Interior nodes whose value depends on one of ``leaves`` (a get_attr leaf stands for every
        node reading the same attribute)."""
        targets = {n.target for n in leaves if n.op == "get_attr"}
        dep: set[Node] = set(leaves) | {n for n in self.constants if n.target in targets}
        interior = set()
        for n in self.nodes:
            if any(a in dep for a in n.all_input_nodes):
                dep.add(n)
                interior.add(n)
        return interior

    @functools.cached_property
    def dependent(self) -> set[Node]:
        """Interior nodes whose value depends on an input (the others are constants)."""
        return self.depending_on(self.inputs)

    def targets(self) -> set:
        return {n.target for n in self.nodes}

    def data_dependent_gather(self, leaves=None) -> Node | None:
        """A gather whose indices depend on one of ``leaves`` (default: the inputs): a lookup by value,
        not a fixed data movement."""
        leaves = set(self.inputs if leaves is None else leaves)
        dep = self.depending_on(leaves) | leaves
        for n in self.nodes:
            if n.target in GATHERS:
                used: list[Node] = []
                torch.fx.node.map_arg(n.args[1] if n.target is aten.index.Tensor else n.args[2], used.append)
                if any(a in dep for a in used):
                    return n
        return None


def _real_constant(node: Node) -> torch.Tensor | None:
    from torch._subclasses.fake_tensor import FakeTensor, unset_fake_temporarily

    obj = node.graph.owning_module
    for part in str(node.target).split("."):
        obj = getattr(obj, part, None)
    if not isinstance(obj, torch.Tensor) or isinstance(obj, FakeTensor) or obj.numel() > CONSTANT_LIMIT:
        return None
    with unset_fake_temporarily():
        return obj.detach()


def collect(root: Node, max_nodes: int = MAX_NODES) -> Subgraph | str:
    """The subgraph computing ``root`` from its leaves through ``ALLOWED`` ops, or why there is none."""
    order: list[Node] = []
    inputs: list[Node] = []
    constants: dict[Node, torch.Tensor] = {}
    seen: set[Node] = set()
    stack: list[tuple[Node, bool]] = [(root, False)]
    while stack:
        node, expanded = stack.pop()
        if expanded:
            order.append(node)
            continue
        if node in seen:
            continue
        seen.add(node)
        if node.op == "call_function" and node.target in ALLOWED:
            if len(order) + len(stack) > max_nodes:
                return f"the weight is computed by more than {max_nodes} ops"
            stack.append((node, True))
            stack.extend((a, False) for a in reversed(node.all_input_nodes) if a not in seen)
        elif node.op == "get_attr" and (value := _real_constant(node)) is not None:
            constants[node] = value
        else:
            inputs.append(node)
    if root not in order:
        return "the weight is not computed in the graph"
    return Subgraph(root, order, inputs, constants)


# --------------------------------------------------------------------------- small sizes


def _monomials(values: Mapping[str, int]) -> list[tuple[str, ...]]:
    names = sorted(values)
    return [tuple(n for n, e in zip(names, exps) if e) for exps in itertools.product((0, 1), repeat=len(names))]


def _product(mono, values) -> int:
    return functools.reduce(operator.mul, (values[n] for n in mono), 1)


def _equalities(monos, values) -> tuple:
    prods = [_product(m, values) for m in monos]
    return tuple(prods.index(p) for p in prods)


class SizeMap:
    """Real size -> small size, for shapes made of products of named quantities (see the module doc)."""

    def __init__(self, real: Mapping[str, int], small: Mapping[str, int]):
        self.real, self.small = dict(real), dict(small)
        self._map = {}
        for m in _monomials(self.real):
            self._map.setdefault(_product(m, self.real), _product(m, self.small))

    def __call__(self, v):
        return self._map.get(v, v) if type(v) is int else v

    def shape(self, shape) -> tuple:
        return tuple(self(int(s)) for s in shape)

    @property
    def identity(self) -> bool:
        return self.real == self.small

    @staticmethod
    def real_sizes(real: Mapping[str, int]) -> SizeMap:
        return SizeMap(real, real)

    @staticmethod
    def shrink(real: Mapping[str, int], fixed: Mapping[str, int] = ()) -> SizeMap | None:
        """Small values for the names of ``real`` (``fixed`` ones keep theirs) that keep every
        equality between products of the names, the smallest product first; None if there is none."""
        return _shrink(tuple(sorted(real.items())), tuple(sorted(dict(fixed).items())))


@functools.lru_cache(maxsize=256)
def _shrink(real_items, fixed_items, bounds=(4, 8, 16, 32, 64)) -> SizeMap | None:
    real, fixed = dict(real_items), dict(fixed_items)
    monos = _monomials(real)
    want = _equalities(monos, real)
    free = [n for n in real if n not in fixed]
    for bound in bounds:
        # Per name, the values that keep its equalities with 1 and with the fixed names.
        ranges = [[v for v in range(1, min(bound, real[n]) + 1)
                   if (v == 1) == (real[n] == 1) and all((v == fv) == (real[n] == real[f]) for f, fv in fixed.items())]
                  for n in free]
        best = None
        for combo in itertools.product(*ranges):
            small = {**fixed, **dict(zip(free, combo))}
            size = _product(tuple(small), small)
            if (best is None or size < best[0]) and _equalities(monos, small) == want:
                best = (size, small)
        if best is not None:
            return SizeMap(real, best[1])
    return None


# --------------------------------------------------------------------------- evaluation

# Positions of size arguments (ints or lists of ints), by op.
_SIZE_ARGS = {
    aten.view.default: (1,), aten.reshape.default: (1,), aten._unsafe_view.default: (1,),
    aten.expand.default: (1,), aten.repeat.default: (1,), aten.full.default: (0,),
    aten.slice.Tensor: (2, 3, 4), aten.narrow.default: (2, 3), aten.repeat_interleave.self_int: (1,),
}
_SIZE_KWARGS = {"start", "end", "step", "output_size", "length", "size"}


def _resize_args(node: Node, args: list, kwargs: dict, sizes: SizeMap) -> tuple[list, dict]:
    target = node.target
    if target in (aten.arange.default, aten.arange.start, aten.arange.start_step, prims.iota.default):
        # An index range: resized by its length (a shift table arange(0, 32, 4) keeps its 8 entries).
        length = int(node.meta["val"].shape[0])
        small = sizes(length)
        if small == length:
            return args, kwargs
        if target is prims.iota.default:
            if kwargs.get("start", 0) != 0 or kwargs.get("step", 1) != 1:
                raise ProbeMismatch(f"{node.name}: a range of a real size with a start or step")
            return [small, *args[1:]], kwargs
        start, step = (args[0] if len(args) > 1 else 0), (args[2] if len(args) > 2 else 1)
        if start != 0 or step != 1:
            raise ProbeMismatch(f"{node.name}: a range of a real size with a start or step")
        return ([small] if target is aten.arange.default else [0, small, *args[2:]]), kwargs

    def resize(v):
        return [sizes(x) for x in v] if isinstance(v, (list, tuple)) else sizes(v)

    for i in _SIZE_ARGS.get(target, ()):
        if i < len(args):
            args[i] = resize(args[i])
    if target in _SIZE_ARGS:
        kwargs = {k: (resize(v) if k in _SIZE_KWARGS else v) for k, v in kwargs.items()}
    return args, kwargs


def _cpu(v):
    return torch.device("cpu") if isinstance(v, torch.device) else v


def evaluate(sub: Subgraph, feeds: Mapping[Node, torch.Tensor], sizes: SizeMap,
             map_values: bool = False) -> torch.Tensor:
    """``sub.root`` computed from ``feeds`` (a value for every input and for any constant to replace)
    on CPU, with the size arguments mapped by ``sizes``.  ``map_values``: integer operands of the
    elementwise ops of index computations (nodes that depend on no fed value, e.g. the ``// G`` of
    ``arange(K) // G``) are mapped too.

    Raises ``ProbeMismatch`` when a node's result does not have the dtype and (mapped) shape of the
    node in the graph, or an op fails.
    """
    from torch._subclasses.fake_tensor import unset_fake_temporarily

    env: dict[Node, torch.Tensor] = {}
    variable = sub.depending_on(list(feeds)) if map_values else set()
    for n in sub.inputs:
        env[n] = feeds[n]
    # A constant fed as a role is fed wherever the graph reads it (get_attr nodes of one target).
    fed = {n.target: v for n, v in feeds.items() if n.op == "get_attr"}
    for n, c in sub.constants.items():
        if n.target not in fed and sizes.shape(c.shape) != tuple(c.shape):
            raise ProbeMismatch(f"the constant {n.name} has a size of the weight")
        env[n] = fed.get(n.target, c)

    def arg(a):
        return env[a] if isinstance(a, Node) else _cpu(a)

    with unset_fake_temporarily(), torch.no_grad():
        env.update({n: v.cpu() for n, v in env.items()})
        for n in sub.nodes:
            expected = n.meta.get("val")
            if not isinstance(expected, torch.Tensor) or any(type(s) is not int for s in expected.shape):
                raise ProbeMismatch(f"{n.name} has no static tensor metadata")
            args = list(torch.fx.node.map_aggregate(n.args, arg))
            kwargs = dict(torch.fx.node.map_aggregate(dict(n.kwargs), arg))
            if not sizes.identity:
                args, kwargs = _resize_args(n, args, kwargs, sizes)
                if map_values and n.target in ELEMENTWISE and n not in variable:
                    args = [sizes(a) for a in args]
            try:
                out = n.target(*args, **kwargs)
            except Exception as exc:  # an op that cannot run on the probe's sizes
                raise ProbeMismatch(f"{n.name}: {type(exc).__name__}: {exc}") from None
            if not isinstance(out, torch.Tensor):
                raise ProbeMismatch(f"{n.name} does not compute a tensor")
            if out.dtype != expected.dtype or tuple(out.shape) != sizes.shape(expected.shape):
                raise ProbeMismatch(f"{n.name} computes {out.dtype}{list(out.shape)} at the probe's sizes, "
                                    f"not {expected.dtype}{list(sizes.shape(expected.shape))}")
            env[n] = out
    return env[sub.root]


@dataclass(frozen=True)
class Probe:
    """One probe: the inputs by role, and what a mismatch on it says."""

    name: str
    inputs: Mapping[str, torch.Tensor]
    explain: Callable[[torch.Tensor, torch.Tensor], str]  # (got, expected) -> reason


def run_probes(sub: Subgraph, roles: Mapping[str, Node], probes, reference: Callable[..., torch.Tensor],
               sizes: SizeMap, map_values: bool = False) -> str | None:
    """Evaluate ``sub`` on each probe (``roles``: role name -> leaf node); None if every result equals
    ``reference(**probe.inputs)`` exactly, else the first failing probe's explanation.

    Raises ``ProbeMismatch`` when the subgraph cannot be evaluated at ``sizes``.
    """
    for probe in probes:
        got = evaluate(sub, {roles[r]: t for r, t in probe.inputs.items()}, sizes, map_values)
        want = reference(**probe.inputs)
        if got.dtype != want.dtype or got.shape != want.shape:
            return f"the weight is {got.dtype}{list(got.shape)} where the dequantization gives " \
                   f"{want.dtype}{list(want.shape)}"
        if not torch.equal(got, want):
            return probe.explain(got, want)
    return None


def _hashable(v):
    if isinstance(v, (list, tuple)):
        return tuple(_hashable(x) for x in v)
    if isinstance(v, dict):
        return tuple(sorted((k, _hashable(x)) for k, x in v.items()))
    return v if isinstance(v, (int, float, bool, str, type(None), torch.dtype, torch.device)) else str(v)


def _content(t: torch.Tensor):
    from torch._subclasses.fake_tensor import unset_fake_temporarily

    with unset_fake_temporarily():
        flat = t.detach().cpu().contiguous().reshape(-1)
        return tuple(flat.tolist()) if flat.numel() <= 64 else hash(bytes(flat.view(torch.uint8).numpy()))


def signature(sub: Subgraph, roles: Mapping[str, Node]) -> tuple:
    """What evaluating ``sub`` on probes for ``roles`` depends on: its ops with their arguments, dtypes and
    shapes, which leaf plays which role, and the values of its other constants.  Subgraphs with equal
    signatures compute equal results on equal probes (a model's layers of one shape share one)."""
    role_of = {n: r for r, n in roles.items()}
    role_of_target = {n.target: r for n, r in role_of.items() if n.op == "get_attr"}
    index: dict[Node, tuple] = {}
    for i, n in enumerate(sub.inputs):
        index[n] = ("input", role_of.get(n, i))
    for n, c in sub.constants.items():
        role = role_of_target.get(n.target)
        index[n] = ("input", role) if role else ("constant", c.dtype, tuple(c.shape), _content(c))
    parts = []
    for i, n in enumerate(sub.nodes):
        args = torch.fx.node.map_aggregate((n.args, dict(n.kwargs)), lambda a: index[a] if isinstance(a, Node) else a)
        v = n.meta.get("val")
        parts.append((str(n.target), _hashable(args), getattr(v, "dtype", None), tuple(getattr(v, "shape", ()))))
        index[n] = ("node", i)
    leaves = tuple((index[n], getattr(n.meta.get("val"), "dtype", None), tuple(getattr(n.meta.get("val"), "shape", ())))
                   for n in [*sub.inputs, *roles.values()])
    return tuple(parts), leaves


def first_difference(got: torch.Tensor, want: torch.Tensor) -> tuple[int, ...]:
    """The first index (row-major) where two equally shaped tensors differ."""
    diff = (got != want).reshape(-1).nonzero()
    flat = int(diff[0]) if len(diff) else 0
    return tuple(int(i) for i in torch.unravel_index(torch.tensor(flat), got.shape))
