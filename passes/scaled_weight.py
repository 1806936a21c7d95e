"""The weight operand of a W8A8 / W8A16 matmul: a quantized tensor times a scale, decided by probes.

``scaled_mm``, ``scaled_mm_azp`` and ``w8a16_gemm`` take an int8 (or float8_e4m3fn) weight
``q [N, K]`` and a float scale ``s`` with N elements (per-channel) or one (per-tensor); the
matmul's ``[K, N]`` weight operand must compute::

    W[k, n] = q[n, k] · s[n]        (· s for a per-tensor scale, · 1 without one)

the product in float32, rounded once to ``W``'s dtype (the dtype the matmul computes in).  That
is the op's contract: it multiplies exact integer sums by the float32 scales and rounds once,
so a source that rounds each weight element once to bfloat16 / float16 differs from it by
that rounding only (docs/DESIGN.md, "Rules": rounding).  A rounding to a narrower dtype on the
way (float16 inside a float32 weight), a division (by the scale, or by its reciprocal: the op
would need the reciprocal's reciprocal, which rounds), an offset or any other arithmetic is
another function, and the candidate stays unfused with the probe's reason.

How ``analyze`` decides (``dequant_probe`` does the evaluating, probing and caching):

1. the subgraph computing ``W`` is collected back to the nearest quantized tensors (any of
   ``QUANT_DTYPES``; a transpose of one is looked through, since the op reads the tensor under
   it without a copy).  Exactly one quantized leaf ``q``, of shape ``[N, K]``: a ``[K, N]`` one
   is a weight stored transposed, which the op would need copied per call (not a candidate,
   by design);
2. the scale is read from the node nearest the weight that does not depend on ``q``, is a
   float tensor and has 1 or N elements (``s.view(-1, 1)`` is taken as such; an ``expand`` of it
   to ``[N, K]`` is not, the node under it is), or from a float number in an op of the weight
   (``* 0.02``), or there is none; each candidate is cut out as a leaf, and one whose subgraph
   reads anything else is no candidate;
3. the subgraph is evaluated on probes (``_probes``) at small sizes of ``K`` and ``N`` (symbols
   of dynamic shapes included; ``_PROBE_ELEMENTS`` weight elements at least, so that four probes
   hold every quantized value) and must equal the reference exactly on each: a quantized zero
   (offsets), distinct quantized values with a unit scale (which element each ``W[k, n]`` reads:
   the transpose), ones with distinct scales (which scale each column takes, and that it is
   multiplied), every value of the quantized dtype with random full-precision scales (exact
   conversion; one rounding of the product: a division by a reciprocal or a narrower rounding
   differs on some of them), and random values.  Verdicts are cached by the subgraph's
   signature, so a model's layers of one shape are probed once;
4. when ``q`` and the scale are graph constants, the subgraph is also evaluated once on their
   real values; the nodes computing ``W`` from ``q`` must be used by the matmul only (or a joint
   graph's backward).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch.fx import Node

from . import dequant_probe
from .candidates import QUANT_DTYPES
from .dequant_probe import Literal, Probe, SizeMap, Subgraph
from .fx_helpers import known, shape_str, tensor_val

aten = torch.ops.aten

_TRANSPOSES = (aten.permute.default, aten.t.default, aten.transpose.int)
F32, F64 = torch.float32, torch.float64


@dataclass(frozen=True)
class ScaledWeight:
    """A matmul's weight operand proven to be ``q.t() · scale`` (see the module docstring)."""

    q: Node  # the quantized [N, K] weight
    scale: Node | float | None  # a node with 1 or N elements, a number, or none (a unit scale)
    kind: str  # "per-tensor" or "per-channel"


def _is_quantized(n: Node) -> bool:
    v = tensor_val(n)
    return v is not None and v.dtype in QUANT_DTYPES


def _quantized_leaf(n: Node) -> bool:
    """Where collection stops: a quantized tensor, unless it is a transpose of another (looked through)."""
    if not _is_quantized(n):
        return False
    return not (n.op == "call_function" and n.target in _TRANSPOSES and _is_quantized(n.args[0])
                and tensor_val(n.args[0]).dim() == 2)


def _describe(n: Node | Literal) -> str:
    if isinstance(n, Literal):
        return n.name
    t = tensor_val(n)
    return n.name if t is None else f"{n.name} ({str(t.dtype).removeprefix('torch.')}{shape_str(t)})"


def _scale_candidates(full: Subgraph, q: Node, N) -> list[Node | Literal | None]:
    """Where the scale may be read from, the nearest to the weight first (module docstring, step 2)."""
    on_q = full.depending_on([q])
    nodes = [*reversed(full.nodes), *full.inputs, *full.constants]
    found: list[Node | Literal | None] = []
    for n in nodes:
        t = tensor_val(n)
        if n is q or n in on_q or t is None or not t.dtype.is_floating_point:
            continue
        numel = math.prod(t.shape)
        if known(numel == 1) or known(numel == N):
            found.append(n)
    found += full.literals([n for n in full.nodes if n in on_q])
    found.append(None)
    return found


def _frontier(full: Subgraph, q: Node) -> list[Node]:
    """The float tensors that do not depend on ``q`` and enter an op that does: what multiplies it."""
    on_q = full.depending_on([q]) | {q}
    front = []
    for n in full.nodes:
        if n in on_q:
            for a in n.all_input_nodes:
                t = tensor_val(a)
                if a not in on_q and a not in front and t is not None and t.dtype.is_floating_point:
                    front.append(a)
    return front


def analyze(w: Node, matmul: Node, dtypes) -> ScaledWeight | str | None:
    """What the ``[K, N]`` weight operand ``w`` of ``matmul`` computes: a ``ScaledWeight`` of a quantized
    tensor of one of ``dtypes``, why it is not one (a reason for the report), or None when ``w`` is no
    dequantization of a quantized tensor at all (or of one stored ``[K, N]``, which the ops do not take)."""
    W = tensor_val(w)
    if not isinstance(w, Node) or W is None or W.dim() != 2 or not W.dtype.is_floating_point:
        return None
    full = dequant_probe.collect(w, leaf=_quantized_leaf)
    if isinstance(full, str):
        return None
    leaves = [*full.inputs, *{n.target: n for n in full.constants}.values()]
    quantized = [n for n in leaves if _is_quantized(n)]
    if not quantized:
        return None
    if len(quantized) > 1:
        return f"the weight reads several quantized tensors ({', '.join(_describe(n) for n in quantized)})"
    q = quantized[0]
    qv = tensor_val(q)
    K, N = W.shape
    if qv.dim() == 2 and known(qv.shape[0] == K) and known(qv.shape[1] == N) and not known(K == N):
        return None  # stored [K, N]: not taken (a per-call copy), see the module docstring
    if qv.dtype not in dtypes:
        return (f"the quantized weight {_describe(q)} is {str(qv.dtype).removeprefix('torch.')}; expected "
                f"{' or '.join(str(d).removeprefix('torch.') for d in dtypes)}")
    if not (qv.dim() == 2 and known(qv.shape[0] == N) and known(qv.shape[1] == K)):
        return f"the quantized weight {_describe(q)} is not the [N, K] = [{N}, {K}] weight of a {shape_str(W)} operand"

    structural, probed = [], []
    for scale in _scale_candidates(full, q, N):
        sub = full if not isinstance(scale, Node) else dequant_probe.collect(
            w, leaf=lambda n, scale=scale: n is scale or _quantized_leaf(n))
        extra = [n for n in sub.tensor_inputs if n is not q and n is not scale]
        if extra:
            structural.append(f"the weight also reads {', '.join(_describe(n) for n in extra)}, not only the "
                              f"quantized weight {_describe(q)} and its scale")
            continue
        why = dequant_probe.private_reason(sub, [q], matmul)
        if why is not None:
            return why
        roles = {"weight": q} if scale is None else {"weight": q, "scale": scale}
        why = _prove(sub, roles, K, N, W.dtype) or dequant_probe.check_constants(
            sub, roles, _reference(W.dtype), SizeMap.real_sizes({"K": K, "N": N}), "the dequantization")
        if why is None:
            per_tensor = not isinstance(scale, Node) or known(math.prod(tensor_val(scale).shape) == 1)
            return ScaledWeight(q, scale.value if isinstance(scale, Literal) else scale,
                                "per-tensor" if per_tensor else "per-channel")
        probed.append(why)
    if probed:
        return probed[0]
    front = _frontier(full, q)
    if len(front) == 1 and not any(known(math.prod(tensor_val(front[0]).shape) == n) for n in (1, N)):
        return (f"weight scale of shape {shape_str(tensor_val(front[0]))} is neither per-tensor nor per-channel "
                f"([N, 1]) for a weight of shape {shape_str(qv)}")
    return structural[0]


# --------------------------------------------------------------------------- probes


def _prove(sub: Subgraph, roles: dict, K, N, dtype) -> str | None:
    """None when ``sub`` computes the dequantization of ``roles`` (module docstring), else why not."""
    key = (dequant_probe.signature(sub, roles), dtype)

    def probes_at(sizes: SizeMap):
        return _probes(roles, sizes, dtype), _reference(dtype)

    return dequant_probe.cached(_VERDICTS, key, lambda: dequant_probe.prove(sub, roles, {"K": K, "N": N}, probes_at,
                                                                            at_least=_PROBE_ELEMENTS))


# signature -> verdict of ``_prove``: a model's layers of one shape are probed once.
_VERDICTS: dict = {}
# The probes' weight size: every value of an 8-bit dtype in four probes, and still a distinct
# nonzero value per element (255 of them) for the probe that tells which element W[k, n] reads.
_PROBE_ELEMENTS = 64


def _reference(dtype):
    """The dequantization the ops compute: ``q.t() · s``, the product in float32 rounded once to ``dtype``."""

    def ref(weight, scale=None):
        s = 1.0 if scale is None else scale
        if isinstance(s, torch.Tensor):
            s = s.to(F64).reshape(()) if s.numel() == 1 else s.to(F64).reshape(1, -1)
        return (weight.to(F64).t() * s).to(F32).to(dtype)

    return ref


def _values(dtype) -> torch.Tensor:
    """Every finite value of a quantized dtype, as that dtype."""
    if dtype.is_floating_point:
        every = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(dtype)
        return every[every.float().isfinite()]
    info = torch.iinfo(dtype)
    return torch.arange(info.min, info.max + 1, dtype=torch.int32).to(dtype)


def _distinct(dtype, count: int) -> torch.Tensor:
    """``count`` nonzero values of ``dtype``, distinct while there are enough: 1, -1, 2, -2, ... by magnitude."""
    values = _values(dtype)
    as_float = values.to(F64)
    positive, negative = values[as_float > 0], values[as_float < 0]
    positive = positive[torch.argsort(positive.to(F64))]
    negative = negative[torch.argsort(-negative.to(F64))]
    pairs = min(len(positive), len(negative))
    values = torch.cat([torch.stack([positive[:pairs], negative[:pairs]], 1).reshape(-1),
                        positive[pairs:], negative[pairs:]])
    return values[torch.arange(count) % len(values)]


# Scale exponents: distinct per element up to this many elements, the products in float16's range.
_EXPONENTS = 12


def _scales(shape, dtype, gen) -> torch.Tensor:
    """Distinct full-precision scales in ``dtype`` (per element: ``(1 + u) · 2^e``)."""
    count = math.prod(shape)
    e = torch.arange(count, dtype=F64) % _EXPONENTS - 8
    u = torch.rand(count, generator=gen, dtype=F64)
    return ((1 + u) * torch.exp2(e)).to(dtype).reshape(shape)


def _rounding_hint(got: float, exact: float, dtype) -> str:
    """Where ``got`` is ``exact`` rounded to another float dtype on its way to ``dtype``: that rounding."""
    for other in (torch.float16, torch.bfloat16):
        if other != dtype and torch.tensor(exact, dtype=F64).to(other).to(dtype).item() == got:
            return (f"; it is rounded to {str(other).removeprefix('torch.')} on the way, where the op's contract is "
                    f"the product rounded once to {str(dtype).removeprefix('torch.')}")
    return ""


def _probes(roles: dict, sizes: SizeMap, dtype) -> list[Probe]:
    """The probe inputs at ``sizes``, each with what its failure means (module docstring, step 3)."""
    q = roles["weight"]
    qv = tensor_val(q)
    qdtype, qshape = qv.dtype, sizes.shape(qv.shape)
    n_small, k_small = qshape
    scale = roles.get("scale")
    gen = torch.Generator().manual_seed(0)

    def scale_like(values: torch.Tensor | None):
        """The scale role's input: ``values`` (one per column, or one) in its dtype and shape."""
        if scale is None:
            return {}
        if isinstance(scale, Literal):
            return {"scale": float(values.reshape(-1)[0].to(F32)) if values is not None else 1.0}
        t = tensor_val(scale)
        shape = sizes.shape(t.shape)
        if values is None:
            return {"scale": torch.ones(shape, dtype=t.dtype)}
        return {"scale": values.to(t.dtype).reshape(shape)}

    def scale_values():
        if scale is None:
            return None
        if isinstance(scale, Literal):
            return _scales((1,), F32, gen)
        t = tensor_val(scale)
        return _scales((math.prod(sizes.shape(t.shape)),), t.dtype, gen)

    def inputs(weight, values):
        return {"weight": weight, **scale_like(values)}

    def exact(weight, s):
        """The dequantized value, before the rounding to the weight's dtype."""
        return float(weight) * (1.0 if s is None else float(s))

    def column_scale(s, n):
        if s is None:
            return None
        return s.reshape(-1)[0 if s.numel() == 1 else n]

    def zero(got, want):
        k, n = dequant_probe.first_difference(got, want)
        return f"a quantized 0 dequantizes to {got[k, n].item():g} at W[{k}, {n}]: the weight has an offset"

    distinct = _distinct(qdtype, n_small * k_small).reshape(n_small, k_small)

    def weight(got, want):
        k, n = dequant_probe.first_difference(got, want)
        g = got[k, n].item()
        hits = (distinct.float() == g).nonzero()
        rearranged = torch.equal(got.float().reshape(-1).sort().values, distinct.float().reshape(-1).sort().values)
        if rearranged and len(hits):
            i, j = (int(x) for x in hits[0])
            hint = " (the weight is not transposed)" if (i, j) == (k, n) else ""
            return f"W[{k}, {n}] reads the quantized weight at [{i}, {j}], not at [{n}, {k}]{hint}"
        return (f"W[{k}, {n}] = {g:g} for a quantized {float(distinct[n, k]):g} and a unit scale: the weight is "
                f"not its quantized values times a per-channel or per-tensor scale (weight scale of shape "
                f"{shape_str(qv)} is neither per-tensor nor per-channel ([N, 1]) for a weight of shape "
                f"{shape_str(qv)})")

    ones = torch.ones(n_small, k_small, dtype=qdtype)
    unit_scales = scale_values()

    def per_column(got, want):
        k, n = dequant_probe.first_difference(got, want)
        g, s = got[k, n].item(), column_scale(unit_scales, n)
        if s is not None and g == torch.tensor(1 / float(s), dtype=F64).to(F32).to(dtype).item():
            return (f"W[{k}, {n}] = 1 / scale: the weight is divided by its scale ({_describe(scale)}), "
                    "not multiplied")
        rounded = unit_scales.reshape(-1).to(F32).to(dtype) if s is not None else None
        if rounded is not None and len(rounded) > 1 and (rounded == g).any():
            j = int((rounded == g).nonzero()[0])
            along_k = len(rounded) == got.shape[0] and torch.equal(got, rounded[:, None].expand(got.shape))
            hint = " (the scale runs along K)" if along_k else ""
            return f"column {n} of the weight is scaled by scale[{j}], not scale[{n}]{hint}"
        return (f"W[{k}, {n}] = {g:g} where a quantized 1 times its scale gives {want[k, n].item():g}"
                f"{_rounding_hint(g, exact(1, s), dtype)}")

    every = _values(qdtype)
    positions = n_small * k_small
    covering = []
    for first in range(0, len(every), positions):
        values = every[(torch.arange(positions) + first) % len(every)].reshape(n_small, k_small)
        covering.append((values, scale_values()))

    def converted(values, s):
        def explain(got, want):
            k, n = dequant_probe.first_difference(got, want)
            v, sn, g = float(values[n, k]), column_scale(s, n), got[k, n].item()
            return (f"a quantized {v:g} with scale {1.0 if sn is None else float(sn):g} dequantizes to {g:g}, not "
                    f"{want[k, n].item():g}: the values are not the product rounded once"
                    f"{_rounding_hint(g, exact(v, sn), dtype)}")

        return explain

    def other(got, want):
        k, n = dequant_probe.first_difference(got, want)
        return f"W[{k}, {n}] differs from the dequantization ({got[k, n].item():g} vs {want[k, n].item():g})"

    random_weight = every[torch.randint(0, len(every), (n_small, k_small), generator=gen)]
    return [
        Probe("zero", inputs(torch.zeros(n_small, k_small, dtype=qdtype), scale_values()), zero),
        Probe("weight", inputs(distinct, None), weight),
        Probe("scale", inputs(ones, unit_scales), per_column),
        *(Probe("values", inputs(values, s), converted(values, s)) for values, s in covering),
        Probe("random", inputs(random_weight, scale_values()), other),
    ]
