"""Probing a weight-side dequantization subgraph: what it computes, not how it is written.

A family that fuses ``dequantize(weight) -> matmul`` needs to know that the
subgraph feeding the matmul's weight operand computes the dequantization its op
implements.  Instead of listing the ways people write it, a family

1. collects the subgraph (``collect``): the nodes between the weight operand and
   its leaves, through a closed set of ops (``ALLOWED``: elementwise arithmetic,
   shifts and masks, casts, views, reshapes, permutes, expands, slices,
   stacks/cats, gathers by constant indices, factories such as ``arange``);
   a leaf is a placeholder, a ``get_attr`` or any node outside that set, or a
   node the family names a leaf (``collect(leaf=...)``: W8A8 stops at its
   quantized tensor and at the node it reads the scale from);
2. names its leaves' roles (the family's business: ``qweight``, ``scales``...); a
   number operand of an elementwise op may play a role too (``Literal``: a scale
   written as ``* 0.02``);
3. evaluates the subgraph on probe inputs (``evaluate``: the FX nodes re-run
   with torch on small CPU tensors) and compares each result with its op's
   reference on the same inputs (``run_probes``, at the sizes ``prove`` picks),
   once per subgraph signature (``cached``);
4. checks, when every role is a graph constant, the subgraph on their real
   values too (``check_constants``), and that nothing outside the matmul reads
   the dequantized weight (``private_reason``).

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

Symbolic sizes (``dynamic=True``).  A quantity whose real value is a symbol
(``s0``) gets a small value of its own, distinct from every other quantity's and
from every int literal of the subgraph, so no literal can stand for it by
accident; the graph then holds the symbol, not a literal, wherever it uses the
size (as a node feeding the size argument, evaluated at the small value), and
node shapes are the symbolic shapes at the small values.  The subgraph computes
the same function of the symbols at any value, so the small one decides it.
"""

from __future__ import annotations

import functools
import itertools
import math
import operator
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

import sympy
import torch
from torch.fx import Node

from .fx_helpers import is_backward

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
VERDICT_LIMIT = 4096  # verdicts a family's cache keeps before it starts over


class ProbeMismatch(Exception):
    """Evaluating the subgraph did not reproduce the graph (a shape or dtype differs), or failed."""


# --------------------------------------------------------------------------- the subgraph


@dataclass(frozen=True)
class Literal:
    """A number operand of an elementwise node (``node.args[index]``), which a family may feed as a role."""

    node: Node
    index: int

    @property
    def value(self):
        return self.node.args[self.index]

    @property
    def name(self) -> str:
        return f"{self.value!r} (in {self.node.name})"


def _is_size(v) -> bool:
    return isinstance(v, (int, torch.SymInt)) and not isinstance(v, bool)


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
        node reading the same attribute; a ``Literal`` for its node)."""
        targets = {n.target for n in leaves if isinstance(n, Node) and n.op == "get_attr"}
        dep: set[Node] = {n for n in leaves if isinstance(n, Node)} | {n for n in self.constants if n.target in targets}
        literal_nodes = {lit.node for lit in leaves if isinstance(lit, Literal)}
        interior = set()
        for n in self.nodes:
            if n in literal_nodes or any(a in dep for a in n.all_input_nodes):
                dep.add(n)
                interior.add(n)
        return interior

    @functools.cached_property
    def dependent(self) -> set[Node]:
        """Interior nodes whose value depends on an input (the others are constants)."""
        return self.depending_on(self.inputs)

    @property
    def tensor_inputs(self) -> list[Node]:
        """The inputs that are tensors: the others are sizes (symbols of dynamic shapes), which
        ``evaluate`` gives their small values itself."""
        return [n for n in self.inputs if not _is_size(n.meta.get("val"))]

    def targets(self) -> set:
        return {n.target for n in self.nodes}

    def literals(self, nodes=None) -> list[Literal]:
        """The float number operands of the elementwise ops among ``nodes`` (default: all)."""
        return [Literal(n, i) for n in (self.nodes if nodes is None else nodes) if n.target in ELEMENTWISE
                for i, a in enumerate(n.args) if type(a) is float]

    def int_literals(self) -> set[int]:
        found: set[int] = set()

        def visit(a):
            if type(a) is int:
                found.add(a)
            return a

        for n in self.nodes:
            torch.fx.node.map_aggregate((n.args, dict(n.kwargs)), visit)
        return found

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


def collect(root: Node, max_nodes: int = MAX_NODES, leaf: Callable[[Node], bool] | None = None) -> Subgraph | str:
    """The subgraph computing ``root`` from its leaves through ``ALLOWED`` ops, or why there is none.

    ``leaf``: nodes to take as leaves although their op is allowed (``root`` itself never is one).
    """
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
        interior = node.op == "call_function" and node.target in ALLOWED
        if interior and (node is root or leaf is None or not leaf(node)):
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


def private_reason(sub: Subgraph, leaves, consumer: Node, index_leaves=()) -> str | None:
    """Why the nodes computing the weight from ``leaves`` are not the matmul's own, or None: each is used
    only by the subgraph and ``consumer`` (or a joint graph's backward), and gathers by constant
    indices only, or by ``index_leaves`` (leaves that are indices themselves, such as GPTQ's ``g_idx``,
    which the family's probes vary).  A forward user elsewhere would keep the dequantization alive next
    to the fused op."""
    lookup = sub.data_dependent_gather([n for n in leaves if n not in index_leaves])
    if lookup is not None:
        return f"{lookup.name} gathers by indices computed from the weight's inputs (a lookup, not a reorder)"
    inside = set(sub.nodes) | {consumer}
    for n in sub.depending_on(leaves):
        for user in n.users:
            if user not in inside and not is_backward(user):
                return f"the dequantized weight ({n.name}) is also used by {user.name} outside the matmul"
    return None


# --------------------------------------------------------------------------- small sizes


def _monomials(values: Mapping[str, int]) -> list[tuple[str, ...]]:
    names = sorted(values)
    return [tuple(n for n, e in zip(names, exps) if e) for exps in itertools.product((0, 1), repeat=len(names))]


def _product(mono, values) -> int:
    return functools.reduce(operator.mul, (values[n] for n in mono), 1)


def _equalities(monos, values) -> tuple:
    prods = [_product(m, values) for m in monos]
    return tuple(prods.index(p) for p in prods)


def _symbol(v):
    """The sympy symbol a symbolic size is, or None (a compound expression)."""
    expr = v.node.expr
    return expr if expr.is_Symbol else None


class SizeMap:
    """Real size -> small size, for shapes made of products of named quantities (see the module doc).

    Static quantities map as literal ints; symbolic ones (``torch.SymInt``) through their symbols.
    """

    def __init__(self, real: Mapping[str, int | torch.SymInt], small: Mapping[str, int]):
        self.real, self.small = dict(real), dict(small)
        static = {n: v for n, v in self.real.items() if type(v) is int}
        self._map = {}
        for m in _monomials(static):
            self._map.setdefault(_product(m, static), _product(m, self.small))
        self._subs = {_symbol(v): sympy.Integer(self.small[n]) for n, v in self.real.items() if type(v) is not int}

    def __call__(self, v):
        if type(v) is int:
            return self._map.get(v, v)
        if isinstance(v, torch.SymInt):
            expr = v.node.expr.xreplace(self._subs)
            if not expr.is_Integer:
                raise ProbeMismatch(f"the size {v} is not made of the weight's sizes")
            return int(expr)
        return v

    def shape(self, shape) -> tuple:
        return tuple(self(s) if isinstance(s, torch.SymInt) else self(int(s)) for s in shape)

    @property
    def identity(self) -> bool:
        return self.real == self.small

    @staticmethod
    def real_sizes(real: Mapping[str, int]) -> SizeMap:
        return SizeMap(real, real)

    @staticmethod
    def shrink(real: Mapping[str, int | torch.SymInt], fixed: Mapping[str, int] = (), avoid=(),
               at_least: int = 1) -> SizeMap | None:
        """Small values for the names of ``real`` (``fixed`` ones keep theirs) that keep every
        equality between products of the static names, the smallest product (of all names, at least
        ``at_least`` when there is one) first; a symbolic name gets a value of its own, none of the
        static values or products, of the other symbols' or of ``avoid`` (the subgraph's int
        literals).  None if there is none."""
        static = {n: v for n, v in real.items() if type(v) is int}
        symbolic = {n: v for n, v in real.items() if type(v) is not int}
        if any(_symbol(v) is None for v in symbolic.values()):
            return None
        small: dict[str, int] = {}
        if static:
            found = _shrink(tuple(sorted(static.items())), tuple(sorted(dict(fixed).items())),
                            1 if symbolic else at_least)
            if found is None:
                return None
            small = dict(found.small)
        taken = set(avoid) | {_product(m, static) for m in _monomials(static)} | \
            {_product(m, small) for m in _monomials(small)}
        start = max(2, math.ceil(at_least ** (1 / len(real))))
        by_symbol: dict = {}
        for name, v in sorted(symbolic.items()):
            if _symbol(v) not in by_symbol:
                by_symbol[_symbol(v)] = next(c for c in itertools.count(start) if c not in taken)
                taken.add(by_symbol[_symbol(v)])
            small[name] = by_symbol[_symbol(v)]
        return SizeMap(real, small)


@functools.lru_cache(maxsize=256)
def _shrink(real_items, fixed_items, at_least=1, bounds=(4, 8, 16, 32, 64)) -> SizeMap | None:
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
            if size >= at_least and (best is None or size < best[0]) and _equalities(monos, small) == want:
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
        length = node.meta["val"].shape[0]
        small = sizes(length)
        if type(length) is int and small == length:
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


def evaluate(sub: Subgraph, feeds: Mapping[Node | Literal, torch.Tensor | float], sizes: SizeMap,
             map_values: bool = False) -> torch.Tensor:
    """``sub.root`` computed from ``feeds`` (a value for every tensor input, for any constant to replace
    and for any ``Literal`` to replace by a number) on CPU, with the size arguments mapped by ``sizes``.
    Inputs that are sizes (symbols) get their small values.  ``map_values``: integer operands of the
    elementwise ops of index computations (nodes that depend on no fed value, e.g. the ``// G`` of
    ``arange(K) // G``) are mapped too.

    Raises ``ProbeMismatch`` when a node's result does not have the dtype and (mapped) shape of the
    node in the graph, or an op fails.
    """
    from torch._subclasses.fake_tensor import unset_fake_temporarily

    env: dict[Node, torch.Tensor] = {}
    variable = sub.depending_on(list(feeds)) if map_values else set()
    literals: dict[tuple[Node, int], float] = {(k.node, k.index): v for k, v in feeds.items()
                                               if isinstance(k, Literal)}
    for n in sub.inputs:
        v = n.meta.get("val")
        if n in feeds:
            env[n] = feeds[n]
        elif _is_size(v):
            env[n] = sizes(v)
        else:
            raise ProbeMismatch(f"no probe value for {n.name}")
    # A constant fed as a role is fed wherever the graph reads it (get_attr nodes of one target).
    fed = {n.target: v for n, v in feeds.items() if isinstance(n, Node) and n.op == "get_attr"}
    for n, c in sub.constants.items():
        if n.target not in fed and sizes.shape(c.shape) != tuple(c.shape):
            raise ProbeMismatch(f"the constant {n.name} has a size of the weight")
        env[n] = fed.get(n.target, c)

    def arg(a):
        return env[a] if isinstance(a, Node) else _cpu(a)

    with unset_fake_temporarily(), torch.no_grad():
        env.update({n: v.cpu() for n, v in env.items() if isinstance(v, torch.Tensor)})
        for n in sub.nodes:
            expected = n.meta.get("val")
            if not isinstance(expected, torch.Tensor):
                raise ProbeMismatch(f"{n.name} has no tensor metadata")
            want_shape = sizes.shape(expected.shape)
            args = list(torch.fx.node.map_aggregate(n.args, arg))
            kwargs = dict(torch.fx.node.map_aggregate(dict(n.kwargs), arg))
            if not sizes.identity:
                args, kwargs = _resize_args(n, args, kwargs, sizes)
                if map_values and n.target in ELEMENTWISE and n not in variable:
                    args = [sizes(a) for a in args]
            for (node, index), value in literals.items():
                if node is n:
                    args[index] = value
            try:
                out = n.target(*args, **kwargs)
            except Exception as exc:  # an op that cannot run on the probe's sizes
                raise ProbeMismatch(f"{n.name}: {type(exc).__name__}: {exc}") from None
            if not isinstance(out, torch.Tensor):
                raise ProbeMismatch(f"{n.name} does not compute a tensor")
            if out.dtype != expected.dtype or tuple(out.shape) != want_shape:
                raise ProbeMismatch(f"{n.name} computes {out.dtype}{list(out.shape)} at the probe's sizes, "
                                    f"not {expected.dtype}{list(want_shape)}")
            env[n] = out
    return env[sub.root]


@dataclass(frozen=True)
class Probe:
    """One probe: the inputs by role, and what a mismatch on it says."""

    name: str
    inputs: Mapping[str, torch.Tensor | float]
    explain: Callable[[torch.Tensor, torch.Tensor], str]  # (got, expected) -> reason


def run_probes(sub: Subgraph, roles: Mapping[str, Node | Literal], probes, reference: Callable[..., torch.Tensor],
               sizes: SizeMap, map_values: bool = False) -> str | None:
    """Evaluate ``sub`` on each probe (``roles``: role name -> leaf node or literal); None if every result
    equals ``reference(**probe.inputs)`` exactly, else the first failing probe's explanation.

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


def prove(sub: Subgraph, roles: Mapping[str, Node | Literal], real: Mapping[str, int | torch.SymInt],
          probes_at: Callable[[SizeMap], tuple[list[Probe], Callable[..., torch.Tensor]]],
          fixed: Mapping[str, int] = (), at_least: int = 1) -> str | None:
    """None when ``sub`` passes every probe of ``probes_at(sizes)`` (the probes and their reference at
    ``sizes``), else why not.  ``real``: the quantities the weight's shapes are made of (their product is
    the weight's size).  Tried at small sizes first (a weight of at least ``at_least`` elements where the
    real one has as many; integer literals of index arithmetic read as sizes, then as values), then at
    the real sizes when the weight is static and at most ``REAL_SIZE_LIMIT`` elements."""
    small = SizeMap.shrink(real, fixed, avoid=sub.int_literals(), at_least=at_least)
    static = all(type(v) is int for v in real.values())
    tried = [] if small is not None or not static else ["its sizes have no small image"]
    attempts = ([small] if small is not None else []) + ([SizeMap.real_sizes(real)] if static else [])
    for sizes in attempts:
        if sizes.identity and math.prod(real.values()) > REAL_SIZE_LIMIT:
            tried.append(f"and the weight has more than {REAL_SIZE_LIMIT} elements")
            break
        probes, reference = probes_at(sizes)
        verdicts = []
        # Index arithmetic such as ``arange(K) // G`` is read with its literals as sizes, or as values.
        for map_values in ((False, True) if not sizes.identity else (False,)):
            try:
                verdicts.append(run_probes(sub, roles, probes, reference, sizes, map_values))
            except ProbeMismatch as exc:
                tried.append(str(exc))
            if verdicts and verdicts[-1] is None:
                return None
        if verdicts:
            return verdicts[0]
    return f"the weight cannot be evaluated on probes: {'; '.join(tried) or 'its sizes are symbolic expressions'}"


def cached(cache: dict, key, decide: Callable[[], str | None]) -> str | None:
    """``decide()`` once per ``key`` (a family's verdict cache: a model's layers of one shape share a
    subgraph signature and are probed once), run outside any fake mode: the probes are real CPU
    tensors, also inside a compile."""
    from torch._subclasses.fake_tensor import unset_fake_temporarily

    if key not in cache:
        if len(cache) >= VERDICT_LIMIT:
            cache.clear()
        with unset_fake_temporarily():
            cache[key] = decide()
    return cache[key]


def _names(roles) -> str:
    names = list(roles)
    return names[0] if len(names) == 1 else f"{', '.join(names[:-1])} and {names[-1]}"


def check_constants(sub: Subgraph, roles: Mapping[str, Node | Literal], reference: Callable[..., torch.Tensor],
                    sizes: SizeMap, what: str) -> str | None:
    """When every role is a graph constant (a ``get_attr`` with a real value, or a number): None if the
    subgraph computes ``reference`` exactly on their real values at the real ``sizes``, else why not.
    None also when some role is not a constant (nothing to check)."""
    from torch._subclasses.fake_tensor import unset_fake_temporarily

    values = {r: (n.value if isinstance(n, Literal) else sub.constants.get(n)) for r, n in roles.items()}
    if any(v is None for v in values.values()):
        return None
    with unset_fake_temporarily():
        values = {r: (v.cpu() if isinstance(v, torch.Tensor) else v) for r, v in values.items()}
        try:
            got = evaluate(sub, {roles[r]: v for r, v in values.items()}, sizes)
        except ProbeMismatch as exc:
            return f"the weight cannot be evaluated on its constant values ({exc})"
        if not torch.equal(got, reference(**values)):
            return f"on the constant {_names(roles)} the weight differs from {what}"
    return None


def _hashable(v):
    if isinstance(v, (list, tuple)):
        return tuple(_hashable(x) for x in v)
    if isinstance(v, dict):
        return tuple(sorted((k, _hashable(x)) for k, x in v.items()))
    return v if isinstance(v, (int, float, bool, str, type(None), torch.dtype, torch.device)) else str(v)


def _dims(v) -> tuple:
    return tuple(s if type(s) is int else str(s) for s in getattr(v, "shape", ()))


def _content(t: torch.Tensor):
    from torch._subclasses.fake_tensor import unset_fake_temporarily

    with unset_fake_temporarily():
        flat = t.detach().cpu().contiguous().reshape(-1)
        return tuple(flat.tolist()) if flat.numel() <= 64 else hash(bytes(flat.view(torch.uint8).numpy()))


def signature(sub: Subgraph, roles: Mapping[str, Node | Literal]) -> tuple:
    """What evaluating ``sub`` on probes for ``roles`` depends on: its ops with their arguments, dtypes and
    shapes, which leaf (or literal) plays which role, and the values of its other constants.  Subgraphs with
    equal signatures compute equal results on equal probes (a model's layers of one shape share one)."""
    role_of = {n: r for r, n in roles.items() if isinstance(n, Node)}
    role_of_target = {n.target: r for n, r in role_of.items() if n.op == "get_attr"}
    role_of_literal = {(lit.node, lit.index): r for r, lit in roles.items() if isinstance(lit, Literal)}
    index: dict[Node, tuple] = {}
    for i, n in enumerate(sub.inputs):
        index[n] = ("input", role_of.get(n, i))
    for n, c in sub.constants.items():
        role = role_of_target.get(n.target)
        index[n] = ("input", role) if role else ("constant", c.dtype, tuple(c.shape), _content(c))
    parts = []
    for i, n in enumerate(sub.nodes):
        node_args = [("input", role_of_literal[(n, j)]) if (n, j) in role_of_literal else a
                     for j, a in enumerate(n.args)]
        args = torch.fx.node.map_aggregate((node_args, dict(n.kwargs)),
                                           lambda a: index[a] if isinstance(a, Node) else a)
        v = n.meta.get("val")
        parts.append((str(n.target), _hashable(args), getattr(v, "dtype", None), _dims(v)))
        index[n] = ("node", i)
    leaves = tuple(("literal", r) if isinstance(n, Literal) else
                   (index[n], getattr(n.meta.get("val"), "dtype", None), _dims(n.meta.get("val")))
                   for r, n in [*((None, n) for n in sub.inputs), *roles.items()])
    return tuple(parts), leaves


def first_difference(got: torch.Tensor, want: torch.Tensor) -> tuple[int, ...]:
    """The first index (row-major) where two equally shaped tensors differ."""
    diff = (got != want).reshape(-1).nonzero()
    flat = int(diff[0]) if len(diff) else 0
    return tuple(int(i) for i in torch.unravel_index(torch.tensor(flat), got.shape))
