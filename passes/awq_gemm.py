"""AWQ (W4A16): a matmul whose weight is an AWQ (or GPTQ 4-bit) dequantization, into ``quantfuse.awq_gemm``.

What is fused (docs/DESIGN.md pass form 3): ``mm(x, W)`` (also ``addmm(bias, x, W)``)
where ``W [K, N]`` is computed from ``qweight [K, N/8]`` and ``qzeros [K/G, N/8]``
(int32, AWQ packing) and ``scales [K/G, N]``, and what it computes is::

    W[k, n] = (nibble(qweight[k, n // 8], n % 8) - nibble(qzeros[k // G, n // 8], n % 8)) * scales[k // G, n]

with the nibbles in AWQ order (``ops.AWQ_SHIFTS``) and the reference's one
rounding (``ops.awq_dequantize_reference``).  How ``W`` is written does not
matter: ``AWQLinear``'s shift table, AutoAWQ's and transformers' (gptqmodel
``AwqTorchLinear``) shifts by ``arange`` with a reorder gather and masks applied
once or twice, ``torch.stack`` of shifted nibbles, group expansion by
``repeat_interleave``, ``expand`` or plain broadcasting, a weight built as
``[N, K]`` and transposed.  ``torch.matmul`` of a 3-D activation is already
``view([M, K])`` -> ``mm`` -> ``view`` in these graphs; the pass replaces the
``mm`` and leaves the views, and a second, small pattern family folds a
``+ bias`` after them into the op (the pass runs to a fixed point).

``AWQLinear``, whose ``qweight`` is held in the kernels' fragment layout, writes ``W`` as
``quantfuse.awq_dequantize(qweight, scales, qzeros, G)`` (the op is the dequantization, by
definition): a matmul of that op's result is fused after the checks below, with no probe.

How a dequantization written in torch ops is decided (``passes/dequant_probe.py``): the subgraph from ``W`` back to
its leaves is collected through a closed set of ops (elementwise arithmetic,
shifts, masks, casts, views, permutes, expands, slices, stacks, gathers by
constant indices, ``arange``); its leaves must be exactly the three tensors
above, identified by dtype and shape (``G`` follows from them); then the
subgraph is re-run on CPU probe inputs at small sizes of the same
``K/G : G : N/8`` structure and must equal the reference dequantization exactly
on every probe (``_probes``): an all-ones word (the 4-bit mask), words whose
nibble in slot ``j`` is ``j`` (the bit order), ``0 - 1`` (the zero point's
sign), random words, random zero points, scales distinct per group and column
(group boundaries), and everything random at once.  The first probe that
differs says why the candidate is left alone.  When the three tensors are
graph constants, the subgraph is also evaluated once on their real values.

GPTQ, the same arithmetic packed another way (GPTQModel's ``TorchQuantLinear``, what transformers' GPTQ
gives with ``backend="torch"``, and AutoGPTQ's torch forms): when no leaf is AWQ's ``qweight``, the leaves
are read as ``qweight [K/8, N]`` (along K) and ``qzeros [K/G, N/8]`` (along N), both lowest nibble first,
``scales [K/G, N]`` and an optional int32/int64 ``g_idx [K]``, and what ``W`` computes must be::

    W[k, n] = (q[k, n] - z[g_idx[k], n]) * scales[g_idx[k], n]      (g_idx[k] = k // G without one)

with ``z`` the zero points as stored (v2) or plus one (v1), both readings tried
(``ops.gptq_dequantize_reference``).  The probes add the zero points' bit order and, with a ``g_idx``, one
probe per cyclic shift of the groups (every row reads every group), an act-order permutation and uneven
random groups: a gather by ``g_idx`` is an index the probes vary, not a lookup.  Integer graph inputs of 8
elements read by ``W`` (GPTQModel's ``wf_unsqueeze_*`` shift buffers, whose values the compile does not
see) are read as the shifts ``[0, 4, ..., 28]``.  The replacement is ``quantfuse.gptq_to_awq`` (the one
GPTQ -> AWQ conversion, ``ops.awq_gemm.awq_state``, a value derived from the GPTQ tensors: made once per
weight, served from the derived-value cache while none changed, which checks the shift buffers' values
and refuses groups of another size than ``G`` and a v1 stored zero point of 15) feeding ``awq_gemm`` with
the GPTQ scales as they are, its activation gathered by the conversion's ``perm`` (act-order) in the
graph, where Inductor computes the gather in the kernel that produces the activation; no gather where the groups
are known in order (no ``g_idx``, or a constant one equal to ``k // G``).  With the GPTQ tensors graph
constants those refusals leave the candidate unfused with the reason instead.

Checked besides (a failure leaves the graph as it was, with the reason):
activations, scales, ``W`` and the matmul all float16 or bfloat16 and equal;
static weight shapes; ``N % 8 == 0``; the nodes computing ``W`` from the three
tensors used only by the matmul (or a joint graph's backward).

Slot: ``joint_custom_pre_pass`` only.  It runs before ``freezing``
constant-folds weight chains (which would leave a dense weight and nothing to
match) and before Inductor's own rewrites, in ``torch.compile`` and AOT
compiles alike.  ``aten.view``, ``aten.reshape`` and ``aten._unsafe_view`` are
all evaluated alike, so the graph the post-grad slots see (after
``view_to_reshape``) is matched as well (tested).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch._inductor.pattern_matcher import (
    CallFunction,
    KeywordArg,
    Match,
    register_graph_pattern,
)
from torch.fx import Node

from compile_backend.ops.awq_gemm import (
    AWQ_ACT_DTYPES,
    AWQ_PACK,
    AWQ_SHIFTS,
    GPTQ_SHIFTS,
    awq_dequantize_reference,
    fragment_layout_takes,
    gptq_dequantize_reference,
    gptq_unpack,
    regroup,
)

from . import dequant_probe
from .dequant_probe import Probe, SizeMap, Subgraph
from .fx_helpers import (
    Plan,
    Reject,
    bias_add_patterns,
    is_backward,
    no_alpha,
    register_cached_output_lowering,
    register_checked,
    static_shape,
    tensor_val,
)

aten, prims = torch.ops.aten, torch.ops.prims

FAMILY = "awq_gemm"
GPTQ_TO_AWQ = torch.ops.quantfuse.gptq_to_awq.default
PASS_SLOTS = ("joint_custom_pre_pass",)
MASK = 2**4 - 1

# A subgraph reading an int32 tensor through one of these is an AWQ candidate (else not looked at).
_BIT_OPS = {
    aten.__rshift__.Tensor, aten.__rshift__.Scalar, aten.bitwise_right_shift.Tensor,
    aten.bitwise_right_shift.Tensor_Scalar, aten.bitwise_and.Scalar, aten.bitwise_and.Tensor,
    aten.__and__.Scalar, aten.__and__.Tensor, aten.floor_divide.default, aten.remainder.Scalar,
}
_MASKS = (aten.bitwise_and.Scalar, aten.__and__.Scalar)
_UNSIGNED = (torch.uint8, torch.uint16, torch.uint32, torch.uint64)


# --------------------------------------------------------------------------- the leaves' roles


@dataclass(frozen=True)
class _Roles:
    qweight: Node
    qzeros: Node
    scales: Node

    def by_name(self) -> dict[str, Node]:
        return {"qweight": self.qweight, "qzeros": self.qzeros, "scales": self.scales}


def _describe(n: Node) -> str:
    t = tensor_val(n)
    if t is None:
        return n.name
    return f"{n.name} ({str(t.dtype).removeprefix('torch.')}{list(t.shape)})"


def _leaf_shape(n: Node, dtype=None):
    t = tensor_val(n)
    if t is None or (dtype is not None and t.dtype != dtype):
        return None
    return static_shape(t)


def _assign_roles(sub: Subgraph, K: int, N: int, dtype) -> list[_Roles] | str:
    """Every way of reading the leaves as (qweight, qzeros, scales) of a [K, N] weight, or why there is none."""
    C = N // AWQ_PACK
    # One leaf per tensor: get_attr nodes reading the same attribute are one constant.
    targets = {}
    for n in sub.constants:
        targets.setdefault(n.target, n)
    leaves = [*sub.inputs, *targets.values()]
    ints = [n for n in leaves if (s := _leaf_shape(n, torch.int32)) is not None and len(s) == 2]
    qweights = [n for n in ints if _leaf_shape(n) == (K, C)]
    if not qweights:
        shapes = ", ".join(_describe(n) for n in ints)
        return _Unassigned(f"no int32 tensor among the weight's inputs ({shapes}) is qweight [K, N/8] = "
                           f"[{K}, {C}] of a [{K}, {N}] weight (8 values of 4 bits per int32)")
    options = []
    for qw in qweights:
        for qz in ints:
            zs = _leaf_shape(qz)
            if qz is qw or zs[1] != C or zs[0] == 0 or K % zs[0]:
                continue
            for s in leaves:
                if _leaf_shape(s, dtype) == (zs[0], N):
                    options.append(_Roles(qw, qz, s))
    if not options:
        if len(ints) == 1:
            return (f"the zero point is not a 4-bit unpack of an int32 tensor: the weight reads one int32 "
                    f"tensor ({_describe(ints[0])}) and no qzeros [K/G, N/8]")
        return (f"no qzeros [K/G, {C}] (int32) and scales [K/G, {N}] ({dtype}) with one group count among "
                f"the weight's inputs {', '.join(_describe(n) for n in leaves)}")
    return options


# --------------------------------------------------------------------------- probes


def _int32(value: int) -> int:
    return value - (1 << 32) if value >= 1 << 31 else value


def _static_masks(sub: Subgraph) -> list[int]:
    return [n.args[1] for n in sub.nodes if n.target in _MASKS and isinstance(n.args[1], int) and n.args[1] != MASK]


def _probe_scales(groups: int, N: int, dtype, gen: torch.Generator):
    """Probe scales [groups, N]: all ones, distinct per (group, column) and exact in float16 and bfloat16
    (8 significant bits), random."""
    unit = torch.ones(groups, N, dtype=dtype)
    i = torch.arange(groups * N, dtype=torch.float64).view(groups, N)
    distinct = ((i % 256 + 1) * torch.exp2((i // 256) % 16 - 8)).to(dtype)
    random_scales = (torch.rand(groups, N, generator=gen, dtype=torch.float32) * 0.1 + 1e-3).to(dtype)
    return unit, distinct, random_scales


def _mask_reason(sub: Subgraph, where):
    """Why the all-ones probe failed: the subgraph's static mask, else the value an all-ones word gave."""
    def mask(got, want):
        masks = _static_masks(sub)
        if masks:
            return f"the mask is {masks[0]}, not {MASK} (4-bit values)"
        k, n, _ = where(got, want)
        return f"an all-ones int32 unpacks to {got[k, n].item()}, not {MASK}: the values are not 4-bit fields"
    return mask


def _scale_source(distinct: torch.Tensor, value: torch.Tensor) -> str:
    """Which of the distinct probe scales a dequantized value of weight 1 carries."""
    hits = (distinct == value).nonzero()
    return f"scales[{hits[0, 0]}, {hits[0, 1]}]" if len(hits) else f"{value.item()}"


def _words(rows: int, cols: int, value: int) -> torch.Tensor:
    """A probe of int32 words all equal to the 32-bit pattern ``value``."""
    return torch.full((rows, cols), _int32(value), dtype=torch.int32)


def _random_words(gen: torch.Generator, rows: int, cols: int) -> torch.Tensor:
    return torch.randint(-(2**31), 2**31, (rows, cols), generator=gen, dtype=torch.int32)


def _where(describe):
    """``(got, want) -> (k, n, text)``: the first element where a probe's output differs, and
    ``describe(k, n)`` of it."""
    def where(got, want):
        k, n = dequant_probe.first_difference(got, want)
        return k, n, describe(k, n)
    return where


def _other_reason(where, reading: str):
    """Why the all-random probe failed: the first element that differs from ``reading``'s dequantization."""
    def other(got, want):
        k, n, at = where(got, want)
        return f"{at} differs from the {reading} dequantization ({got[k, n].item()} vs {want[k, n].item()})"
    return other


def _read_bits(values) -> list:
    """The bit offsets that unpacked probe values (nibble j holds j) say were read."""
    return [4 * int(v) if float(v).is_integer() and 0 <= v < AWQ_PACK else f"?({v})" for v in values]


def _probes(sub: Subgraph, K: int, C: int, groups: int, dtype) -> list[Probe]:
    """The probe inputs at sizes K, N/8 = C and K/G = groups, each with what its failure means."""
    N, G = C * AWQ_PACK, K // groups
    gen = torch.Generator().manual_seed(0)

    def words(rows, value):
        return _words(rows, C, value)

    def random_words(rows):
        return _random_words(gen, rows, C)

    unit, distinct, random_scales = _probe_scales(groups, N, dtype, gen)
    where = _where(lambda k, n: f"row {k % G} of group {k // G}, column {n}")
    mask = _mask_reason(sub, where)

    def order(got, want):
        k, n, _ = where(got, want)
        b = n // AWQ_PACK * AWQ_PACK
        return (f"bit order: columns {b}..{b + AWQ_PACK - 1} read bits {_read_bits(got[k, b:b + AWQ_PACK].tolist())}, "
                f"AWQ order reads {list(AWQ_SHIFTS)}")

    def sign(got, want):
        unsigned = [n for n in sub.nodes if n.target == aten.sub.Tensor
                    and getattr(tensor_val(n), "dtype", None) in _UNSIGNED]
        if unsigned:
            return f"the zero point is subtracted in {tensor_val(unsigned[0]).dtype}, which wraps around"
        k, n, _ = where(got, want)
        return f"a 4-bit weight 0 minus a zero point 1 gives {got[k, n].item()}, not -1"

    def word(got, want):
        k, n, at = where(got, want)
        s = AWQ_SHIFTS[n % AWQ_PACK]
        return (f"{at} is not bits {s}..{s + 3} of qweight[{k}, {n // AWQ_PACK}]: the weight reads other "
                f"int32 words or bits")

    def zero(got, want):
        k, n, at = where(got, want)
        return (f"{at} subtracts a zero point of {8 - got[k, n].item():g}, not qzeros' group {k // G} column "
                f"{n} ({8 - want[k, n].item():g}): the zero points are read from another column or group")

    def scale(got, want):
        k, n, at = where(got, want)
        source = _scale_source(distinct, got[k, n])
        return f"{at} is scaled by {source}, not scales[{k // G}, {n}]: another group or column of the scales"

    other = _other_reason(where, "AWQ")

    def probe(name, qweight, qzeros, scales, explain):
        return Probe(name, {"qweight": qweight, "qzeros": qzeros, "scales": scales}, explain)

    return [
        probe("mask", words(K, 0xFFFFFFFF), words(groups, 0), unit, mask),
        probe("order", words(K, 0x76543210), words(groups, 0), unit, order),
        probe("sign", words(K, 0), words(groups, 0x11111111), unit, sign),
        probe("words", random_words(K), words(groups, 0), unit, word),
        probe("zeros", words(K, 0x88888888), random_words(groups), unit, zero),
        probe("scales", words(K, 0x11111111), words(groups, 0), distinct, scale),
        probe("random", random_words(K), random_words(groups), random_scales, other),
    ]


def _reference(group_size: int):
    def ref(qweight, qzeros, scales):
        return awq_dequantize_reference(qweight, scales, qzeros, group_size)

    return ref


def _prove(sub: Subgraph, roles: _Roles, K: int, N: int, dtype) -> str | None:
    """None when the subgraph provably computes the AWQ dequantization of ``roles``, else why not."""
    key = (dequant_probe.signature(sub, roles.by_name()), K, N, dtype)
    return dequant_probe.cached(_VERDICTS, key, lambda: _prove_real(sub, roles, K, N, dtype))


# signature -> verdict of ``_prove``: a model's layers of one shape are probed once.
_VERDICTS: dict = {}


def _prove_real(sub: Subgraph, roles: _Roles, K: int, N: int, dtype) -> str | None:
    C, groups = N // AWQ_PACK, _leaf_shape(roles.qzeros)[0]
    real = {"pack": AWQ_PACK, "C": C, "groups": groups, "G": K // groups}

    def probes_at(sizes: SizeMap):
        k, c, g = sizes(K), sizes(C), sizes(groups)
        return _probes(sub, k, c, g, dtype), _reference(k // g)

    return dequant_probe.prove(sub, roles.by_name(), real, probes_at, fixed={"pack": AWQ_PACK})


def _check_real_values(sub: Subgraph, roles: _Roles, K: int, groups: int) -> str | None:
    """With qweight, qzeros and scales all graph constants: the subgraph on their real values."""
    return dequant_probe.check_constants(sub, roles.by_name(), _reference(K // groups),
                                         SizeMap.real_sizes({"K": K}), "the AWQ dequantization")


# --------------------------------------------------------------------------- the GPTQ reading
#
# GPTQ's torch dequantization (GPTQModel's ``TorchQuantLinear``, what transformers' GPTQ gives with
# ``backend="torch"``; AutoGPTQ's torch path) computes AWQ's arithmetic from another packing:
# ``qweight [K/8, N]`` (along K), ``qzeros [K/G, N/8]`` (along N, both lowest nibble first), ``scales
# [K/G, N]`` and ``g_idx [K]``.  The leaves are told apart by dtype and shape as AWQ's are; the probes
# compare with ``gptq_dequantize_reference``, reading the zero points as stored (v2) or plus one (v1).


@dataclass(frozen=True)
class _GPTQ:
    """How the GPTQ reading's op reads the leaves (``_GPTQRoles``) and what it proved."""

    g_idx: Node | None
    tables: tuple[Node, ...]  # graph inputs read as GPTQ's shifts; the op checks their values
    v1: bool
    perm: bool  # whether x is gathered by the conversion's perm before awq_gemm (False: groups known in order)


@dataclass(frozen=True)
class _GPTQRoles:
    qweight: Node
    qzeros: Node
    scales: Node
    g_idx: Node | None
    tables: tuple[Node, ...]

    def by_name(self) -> dict[str, Node]:
        roles = {"qweight": self.qweight, "qzeros": self.qzeros, "scales": self.scales}
        if self.g_idx is not None:
            roles["g_idx"] = self.g_idx
        roles.update({f"shift_table{i}": t for i, t in enumerate(self.tables)})
        return roles


_INDEX_DTYPES = (torch.int32, torch.int64)


def _shift_table(n: Node) -> bool:
    """A graph input that may be GPTQ's shift table (``wf``): 8 integers."""
    t = tensor_val(n)
    return t is not None and t.dtype in _INDEX_DTYPES and static_shape(t) is not None and t.numel() == AWQ_PACK


def _assign_gptq_roles(sub: Subgraph, K: int, N: int, dtype) -> list[_GPTQRoles] | str:
    """Every way of reading the leaves as GPTQ's (qweight, qzeros, scales[, g_idx]) of a [K, N] weight,
    or why there is none.  Other integer graph inputs of 8 elements are read as the shift table."""
    C = N // AWQ_PACK
    targets = {}
    for n in sub.constants:
        targets.setdefault(n.target, n)
    leaves = [*sub.inputs, *targets.values()]
    ints = [n for n in leaves if (s := _leaf_shape(n, torch.int32)) is not None and len(s) == 2]
    qweights = [n for n in ints if K % AWQ_PACK == 0 and _leaf_shape(n) == (K // AWQ_PACK, N)]
    if not qweights:
        return _Unassigned(f"no int32 tensor among the weight's inputs ({', '.join(_describe(n) for n in ints)}) "
                           f"is GPTQ's qweight [K/8, N] = [{K // AWQ_PACK}, {N}] either")
    g_idxs = [n for n in leaves if (t := tensor_val(n)) is not None and t.dtype in _INDEX_DTYPES
              and _leaf_shape(n) == (K,)]
    options = []
    for qw in qweights:
        for qz in ints:
            zs = _leaf_shape(qz)
            if qz is qw or zs[1] != C or zs[0] == 0 or K % zs[0]:
                continue
            for s in leaves:
                if _leaf_shape(s, dtype) != (zs[0], N):
                    continue
                for g in [*g_idxs, None]:
                    taken = {qw, qz, s, g}
                    tables = tuple(n for n in sub.inputs if n not in taken and _shift_table(n))
                    options.append(_GPTQRoles(qw, qz, s, g, tables))
    if not options:
        return (f"no qzeros [K/G, {C}] (int32) and scales [K/G, {N}] ({dtype}) with one group count beside "
                f"GPTQ's qweight among the weight's inputs {', '.join(_describe(n) for n in leaves)}")
    return options


def _gptq_probes(sub: Subgraph, roles: _GPTQRoles, K: int, C: int, groups: int, dtype, v1: bool) -> list[Probe]:
    """The GPTQ probe inputs at sizes K, N/8 = C and K/G = groups, each with what its failure means."""
    N, G, R = C * AWQ_PACK, K // groups, K // AWQ_PACK
    gen = torch.Generator().manual_seed(0)
    in_order = torch.arange(K) // G

    words = _words

    def random_words(rows, cols):
        return _random_words(gen, rows, cols)

    def zero_words():
        # v1 stores each zero point minus one, so its stored nibbles are 0..14 (a 15 is refused by the op).
        if not v1:
            return random_words(groups, C)
        nibbles = torch.randint(0, 15, (groups, C, AWQ_PACK), generator=gen, dtype=torch.int64)
        packed = (nibbles << torch.tensor(GPTQ_SHIFTS)).sum(-1)
        return (packed - ((packed >> 31) << 32)).to(torch.int32)

    unit, distinct, random_scales = _probe_scales(groups, N, dtype, gen)
    where = _where(lambda k, n: f"row {k}, column {n}")
    mask = _mask_reason(sub, where)

    def order(got, want):
        k, n, _ = where(got, want)
        b = k // AWQ_PACK * AWQ_PACK
        return (f"bit order: rows {b}..{b + AWQ_PACK - 1} read bits {_read_bits(got[b:b + AWQ_PACK, n].tolist())} "
                f"of their qweight word, GPTQ's order reads {list(GPTQ_SHIFTS)}")

    def zero_order(got, want):
        k, n, _ = where(got, want)
        b = n // AWQ_PACK * AWQ_PACK
        offset = 1 if v1 else 0
        read = _read_bits([-v - offset for v in got[k, b:b + AWQ_PACK].tolist()])
        return (f"zero-point bit order: columns {b}..{b + AWQ_PACK - 1} read bits {read} of their qzeros word, "
                f"GPTQ's order reads {list(GPTQ_SHIFTS)}")

    def sign(got, want):
        k, n, _ = where(got, want)
        return f"a 4-bit weight 0 minus a zero point {want[k, n].item():g} gives {got[k, n].item()}"

    def word(got, want):
        k, n, at = where(got, want)
        return (f"{at} is not bits {GPTQ_SHIFTS[k % AWQ_PACK]}.. of qweight[{k // AWQ_PACK}, {n}]: the weight "
                "reads other int32 words or bits")

    def zero(got, want):
        k, n, at = where(got, want)
        return f"{at} subtracts another zero point than qzeros' group {in_order[k].item()}, column {n}"

    def scale(got, want):
        k, n, at = where(got, want)
        source = _scale_source(distinct, got[k, n])
        return f"{at} is scaled by {source}, not scales[{in_order[k].item()}, {n}]"

    def group_index(g_idx):
        def explain(got, want):
            k, n, at = where(got, want)
            return f"{at} does not read group g_idx[{k}] = {g_idx[k].item()}: the groups are not gathered by g_idx"
        return explain

    other = _other_reason(where, "GPTQ")

    g_dtype = tensor_val(roles.g_idx).dtype if roles.g_idx is not None else None
    tables = {f"shift_table{i}": torch.tensor(GPTQ_SHIFTS, dtype=tensor_val(t).dtype).reshape(tensor_val(t).shape)
              for i, t in enumerate(roles.tables)}

    def probe(name, qweight, qzeros, scales, explain, g_idx=in_order):
        inputs = {"qweight": qweight, "qzeros": qzeros, "scales": scales, **tables}
        if g_dtype is not None:
            inputs["g_idx"] = g_idx.to(g_dtype)
        return Probe(name, inputs, explain)

    probes = [
        probe("mask", words(R, N, 0xFFFFFFFF), words(groups, C, 0), unit, mask),
        probe("order", words(R, N, 0x76543210), words(groups, C, 0), unit, order),
        probe("zero order", words(R, N, 0), words(groups, C, 0x76543210), unit, zero_order),
        probe("sign", words(R, N, 0), words(groups, C, 0x11111111), unit, sign),
        probe("words", random_words(R, N), words(groups, C, 0), unit, word),
        probe("zeros", words(R, N, 0x88888888), zero_words(), unit, zero),
        probe("scales", words(R, N, 0x11111111), words(groups, C, 0), distinct, scale),
    ]
    if g_dtype is not None:
        # Every row reads every group once (cyclic shifts), then act-order's permuted groups and
        # group indices that are not even a grouping (the gather by g_idx, not a regular pattern).
        shifted = [(in_order + s) % groups for s in range(groups)]
        orders = [*shifted, in_order[torch.randperm(K, generator=gen)],
                  torch.randint(0, groups, (K,), generator=gen)]
        probes += [probe(f"g_idx {j}", random_words(R, N), zero_words(), distinct, group_index(g), g)
                   for j, g in enumerate(orders)]
    probes.append(probe("random", random_words(R, N), zero_words(), random_scales, other))
    return probes


def _gptq_reference(v1: bool):
    def ref(qweight, qzeros, scales, g_idx=None, **tables):
        return gptq_dequantize_reference(qweight, qzeros, scales, g_idx, v1)

    return ref


def _prove_gptq(sub: Subgraph, roles: _GPTQRoles, K: int, N: int, dtype, v1: bool) -> str | None:
    """None when the subgraph provably computes the GPTQ dequantization of ``roles`` (v1: zero points
    plus one), else why not."""
    key = ("gptq", v1, dequant_probe.signature(sub, roles.by_name()), K, N, dtype)
    return dequant_probe.cached(_VERDICTS, key, lambda: _prove_gptq_real(sub, roles, K, N, dtype, v1))


def _prove_gptq_real(sub: Subgraph, roles: _GPTQRoles, K: int, N: int, dtype, v1: bool) -> str | None:
    C, groups = N // AWQ_PACK, _leaf_shape(roles.qzeros)[0]
    G = K // groups
    if G % AWQ_PACK:
        return f"group size {G} is not a multiple of {AWQ_PACK} (one GPTQ qweight word spans two groups)"
    real = {"pack": AWQ_PACK, "C": C, "groups": groups, "Gp": G // AWQ_PACK}

    def probes_at(sizes: SizeMap):
        k, c, g = sizes(K), sizes(C), sizes(groups)
        return _gptq_probes(sub, roles, k, c, g, dtype, v1), _gptq_reference(v1)

    return dequant_probe.prove(sub, roles.by_name(), real, probes_at, fixed={"pack": AWQ_PACK})


def _gptq_constants_reason(sub: Subgraph, roles: _GPTQRoles, K: int, group: int, v1: bool) -> str | None:
    """With the GPTQ tensors graph constants: the subgraph on their real values, and the values the
    conversion takes (``gptq_to_awq``'s rules: groups of ``group`` channels, v1 zero points 0..14)."""
    why = dequant_probe.check_constants(sub, roles.by_name(), _gptq_reference(v1), SizeMap.real_sizes({"K": K}),
                                        "the GPTQ dequantization")
    if why is not None:
        return why
    qzeros = sub.constants.get(roles.qzeros)
    if v1 and qzeros is not None and qzeros.numel() and int(gptq_unpack(qzeros).max()) == MASK:
        return "a v1 zero point is stored as 15 (a zero point of 0): no 4-bit AWQ zero point reads it the same"
    g_idx = sub.constants.get(roles.g_idx) if roles.g_idx is not None else None
    if g_idx is not None:
        try:
            regroup(g_idx, group)
        except ValueError as exc:
            return f"g_idx {exc}"
    return None


def _gptq_in_order(sub: Subgraph, roles: _GPTQRoles, group: int) -> bool:
    """Whether the groups are known to be in order (no ``g_idx``, or a constant one equal to ``k // G``):
    then the op reads x as it is, else x gathered by the conversion's ``perm``."""
    if roles.g_idx is None:
        return True
    g_idx = sub.constants.get(roles.g_idx)
    return g_idx is not None and regroup(g_idx, group) is None


def _analyze_gptq(sub: Subgraph, mm: Node, K: int, N: int, dtype) -> _Fusion | str:
    options = _assign_gptq_roles(sub, K, N, dtype)
    if isinstance(options, str):
        return options
    reasons = []
    for roles in options:
        extra = [n for n in sub.inputs if n not in roles.by_name().values()]
        if extra:
            reasons.append(f"the weight also reads {', '.join(_describe(n) for n in extra)}, "
                           "not only GPTQ's qweight, qzeros, scales and g_idx")
            continue
        index = [roles.g_idx] if roles.g_idx is not None else []
        why = dequant_probe.private_reason(sub, list(roles.by_name().values()), mm, index_leaves=index)
        if why is not None:
            return why
        groups = _leaf_shape(roles.qzeros)[0]
        G = K // groups
        tried = []
        for v1 in (False, True):
            why = _prove_gptq(sub, roles, K, N, dtype, v1) or _gptq_constants_reason(sub, roles, K, G, v1)
            if why is None:
                perm = not _gptq_in_order(sub, roles, G)
                per = "per-channel" if groups == 1 else f"group_size={G}"
                order = ", act-order (x gathered by perm)" if perm else ""
                detail = f"{per} K={K} N={N} {str(dtype).removeprefix('torch.')}{order} (GPTQ converted once)"
                gptq = _GPTQ(roles.g_idx, roles.tables, v1, perm)
                awq_roles = _Roles(roles.qweight, roles.qzeros, roles.scales)
                return _Fusion(awq_roles, G, "gptq_v1" if v1 else "gptq_v2", detail, gptq)
            tried.append(why)
        reasons.append(f"GPTQ: {tried[0]}" if tried[0] == tried[1] else f"GPTQ v2: {tried[0]}; v1: {tried[1]}")
    return reasons[0]


# --------------------------------------------------------------------------- the matmul pattern


@dataclass(frozen=True)
class _Fusion:
    roles: _Roles
    group_size: int
    form: str
    detail: str
    gptq: _GPTQ | None = None  # the GPTQ reading: the op reads the GPTQ tensors converted (``gptq_to_awq``)


def _gathered_dim(n: Node) -> int | None:
    """The dimension a gather node indexes (from the end: -1 is the last), if it says."""
    t = tensor_val(n.args[0])
    if t is None:
        return None
    if n.target is aten.index.Tensor:
        dim = next((i for i, a in enumerate(n.args[1]) if a is not None), None)
    else:
        dim = n.args[1]
    return None if dim is None else (dim % t.dim()) - t.dim()


def _form(sub: Subgraph) -> str:
    """The report's name for how the dequantization is written."""
    gathers = [n for n in sub.nodes if n.target in dequant_probe.GATHERS]
    if any(_gathered_dim(n) == -1 for n in gathers):
        return "autoawq_reorder"  # columns reordered by a gather
    if sub.targets() & {aten.stack.default, aten.cat.default}:
        return "nibble_stack"
    if gathers:
        return "group_index"  # rows gathered by a group index
    return "awq_shift_table"


def _copies_note(K: int, N: int) -> str:
    """What the kernels keep beside a ``qweight`` held in the AWQ layout (the form's leaves): its decode
    layout and, on Hopper after a prefill, its prepared layout, each the size of the weight.
    ``AWQLinear`` holds the one layout they read (``compile_backend.prepare`` converts a model)."""
    if not fragment_layout_takes(K, N):
        return ""
    return (f"; on CUDA the kernels keep up to {2 * K * N / 2**21:.1f} MB of layouts beside this AWQ-layout "
            "qweight (compile_backend.prepare(model) makes it an AWQLinear, which holds one)")


def _activation_reason(x: Node, w: Node, mm: Node) -> str | None:
    """Why the activations, the weight ``w`` and ``mm``'s result do not have the dtypes
    ``awq_gemm`` takes (one of float16 / bfloat16, the same for all), or None."""
    xv, W, y = tensor_val(x), tensor_val(w), tensor_val(mm)
    if xv is None or W is None or y is None:
        return "missing tensor metadata"
    if xv.dtype not in AWQ_ACT_DTYPES:
        return f"activations are {xv.dtype}; awq_gemm takes float16 or bfloat16"
    if W.dtype != xv.dtype or y.dtype != xv.dtype:
        return f"the dequantized weight ({W.dtype}) is not in the activation dtype {xv.dtype}"
    return None


def _analyze_op(mm: Node, x: Node, w: Node) -> _Fusion | str:
    """``mm(x, awq_dequantize(qweight, scales, qzeros, G))`` (see the module doc)."""
    why = _activation_reason(x, w, mm)
    if why is not None:
        return why
    for user in w.users:
        if user is not mm and not is_backward(user):
            return f"the dequantized weight ({w.name}) is also used by {user.name} outside the matmul"
    qweight, scales, qzeros, group_size = w.args[:4]
    K, N = tensor_val(w).shape
    per = "per-channel" if group_size == K else f"group_size={group_size}"
    detail = f"{per} K={K} N={N} {str(tensor_val(x).dtype).removeprefix('torch.')}"
    return _Fusion(_Roles(qweight, qzeros, scales), group_size, "awq_dequantize_op", detail)


def _analyze(mm: Node, x: Node, w: Node) -> _Fusion | str | None:
    """The fusion for ``mm(x, w)``, why it must not be fused, or None when ``w`` is no AWQ candidate."""
    if not isinstance(w, Node):
        return None
    if w.target is torch.ops.quantfuse.awq_dequantize.default:
        return _analyze_op(mm, x, w)
    sub = dequant_probe.collect(w)
    if isinstance(sub, str):
        return None
    reads_int32 = any(getattr(tensor_val(n), "dtype", None) == torch.int32 for n in [*sub.inputs, *sub.constants])
    if not reads_int32 or not sub.targets() & _BIT_OPS:
        return None

    why = _activation_reason(x, w, mm)
    if why is not None:
        return why
    dtype, W = tensor_val(x).dtype, tensor_val(w)
    shape = static_shape(W)
    if shape is None or any(static_shape(tensor_val(n)) is None for n in sub.nodes):
        return "symbolic weight or scale shape"
    K, N = shape
    if N % AWQ_PACK:
        return f"N = {N} is not a multiple of {AWQ_PACK}"

    awq = _analyze_awq(sub, mm, K, N, dtype)
    if isinstance(awq, _Fusion):
        return awq
    gptq = _analyze_gptq(sub, mm, K, N, dtype)
    if isinstance(gptq, _Fusion):
        return gptq
    # The reading whose qweight is among the leaves gives the reason (AWQ's when both or neither are).
    return str(gptq) if isinstance(awq, _Unassigned) and not isinstance(gptq, _Unassigned) else str(awq)


class _Unassigned(str):
    """Why no leaf is a reading's qweight (the leaves are not that reading's tensors at all)."""


def _analyze_awq(sub: Subgraph, mm: Node, K: int, N: int, dtype) -> _Fusion | str:
    options = _assign_roles(sub, K, N, dtype)
    if isinstance(options, str):
        return options
    reasons = []
    for roles in options:
        extra = [n for n in sub.inputs if n not in roles.by_name().values()]
        if extra:
            reasons.append(f"the weight also reads {', '.join(_describe(n) for n in extra)}, "
                           "not only qweight, qzeros and scales")
            continue
        why = dequant_probe.private_reason(sub, list(roles.by_name().values()), mm)
        if why is not None:
            return why
        groups = _leaf_shape(roles.qzeros)[0]
        why = _prove(sub, roles, K, N, dtype) or _check_real_values(sub, roles, K, groups)
        if why is None:
            G = K // groups
            per = "per-channel" if groups == 1 else f"group_size={G}"
            detail = f"{per} K={K} N={N} {str(dtype).removeprefix('torch.')}{_copies_note(K, N)}"
            return _Fusion(roles, G, _form(sub), detail)
        reasons.append(why)
    return reasons[0]


def _plan(match: Match) -> Plan | None:
    mm = match.output_node()
    bias = match.kwargs.get("bias")
    fusion = _analyze(mm, match.kwargs["x"], match.kwargs["w"])
    if fusion is None:
        return None
    if isinstance(fusion, str):
        raise Reject(fusion)
    x = tensor_val(match.kwargs["x"])
    if bias is not None:
        b = tensor_val(bias)
        N = tensor_val(mm).shape[-1]
        if (mm.kwargs.get("beta", 1) != 1 or mm.kwargs.get("alpha", 1) != 1 or b is None or b.dim() != 1
                or b.shape[0] != N or b.dtype != x.dtype):
            raise Reject(f"addmm input is not a [{N}] {x.dtype} bias (or beta/alpha are not 1)")
    group_size, roles = fusion.group_size, fusion.roles
    inputs = {"x": match.kwargs["x"], "qweight": roles.qweight, "scales": roles.scales, "qzeros": roles.qzeros}
    if bias is not None:
        inputs["bias"] = bias
    if fusion.gptq is not None:
        return _gptq_plan(fusion, inputs, x.dtype)

    def build(x, qweight, scales, qzeros, bias=None):
        return torch.ops.quantfuse.awq_gemm(x, qweight, scales, qzeros, group_size, bias)

    return Plan(inputs, build, fusion.detail, x.dtype, form=fusion.form)


def _gptq_plan(fusion: _Fusion, inputs: dict, dtype) -> Plan:
    """``awq_gemm`` of the GPTQ tensors converted by ``gptq_to_awq``: a value derived from them, made once
    per weight and served from the derived-value cache (a graph constant under ``freezing``, where
    Inductor folds it).  Its outputs are the cache's tensors, so Inductor must never reuse their memory."""
    register_cached_output_lowering(GPTQ_TO_AWQ)
    gptq, group_size = fusion.gptq, fusion.group_size
    if gptq.g_idx is not None:
        inputs["g_idx"] = gptq.g_idx
    tables = [f"shift_table{i}" for i in range(len(gptq.tables))]
    inputs.update(zip(tables, gptq.tables))

    def build(x, qweight, scales, qzeros, bias=None, g_idx=None, **shift_tables):
        awq_qweight, awq_qzeros, perm = torch.ops.quantfuse.gptq_to_awq(
            qweight, qzeros, g_idx, group_size, gptq.v1, [shift_tables[t] for t in tables])
        if gptq.perm:  # a gather in the graph: Inductor computes it in the kernel that makes x
            x = x.index_select(-1, perm)
        return torch.ops.quantfuse.awq_gemm(x, awq_qweight, scales, awq_qzeros, group_size, bias)

    return Plan(inputs, build, fusion.detail, dtype, form=fusion.form)


def _matmul_patterns():
    yield CallFunction(aten.mm.default, KeywordArg("x"), KeywordArg("w"))
    yield CallFunction(aten.addmm.default, KeywordArg("bias"), KeywordArg("x"), KeywordArg("w"))


# --------------------------------------------------------------------------- bias folding


def _awq_calls():
    """The op without a bias: its five required arguments, a None bias, or a None bias and a ``perm``."""
    args = [KeywordArg(n) for n in ("x", "qweight", "scales", "qzeros", "group_size")]
    for tail in ([], [None], [None, KeywordArg("perm")]):
        yield CallFunction(torch.ops.quantfuse.awq_gemm.default, *args, *tail)


def _bias_check(match: Match) -> bool:
    add = match.output_node()
    b, y, x = tensor_val(match.kwargs["bias"]), tensor_val(add), tensor_val(match.kwargs["x"])
    if b is None or y is None or x is None or not no_alpha(add):
        return False
    N = tensor_val(match.kwargs["scales"]).shape[1]
    return b.dim() == 1 and b.shape[0] == N and b.dtype == x.dtype == y.dtype and tuple(y.shape)[-1] == N


def _make_bias_handler(view: bool):
    def handler(match: Match, **kw):
        group_size = kw["group_size"]
        shape = list(kw["out_shape"]) if view else []
        nodes = [s for s in shape if isinstance(s, torch.fx.Node)]

        perm = [kw["perm"]] if kw.get("perm") is not None else []

        def repl(x, qweight, scales, qzeros, bias, *rest):
            y = torch.ops.quantfuse.awq_gemm(x, qweight, scales, qzeros, group_size, bias, *rest[:len(perm)])
            if not view:
                return y
            sizes = iter(rest[len(perm):])
            return y.reshape([next(sizes) if isinstance(s, torch.fx.Node) else s for s in shape])

        match.replace_by_example(repl, [kw["x"], kw["qweight"], kw["scales"], kw["qzeros"], kw["bias"], *perm,
                                        *nodes])

    return handler


# --------------------------------------------------------------------------- registration


def register(passes: dict) -> None:
    """Add the AWQ patterns to the PatternMatcherPass of each slot in ``PASS_SLOTS``."""
    for slot in PASS_SLOTS:
        target = passes[slot]
        for pattern in _matmul_patterns():
            register_checked(pattern, target, FAMILY, None, _plan)
        for pattern, view in bias_add_patterns(_awq_calls()):
            register_graph_pattern(pattern, extra_check=_bias_check, pass_dict=target)(_make_bias_handler(view))
