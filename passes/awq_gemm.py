"""AWQ (W4A16): the unpack → − zeros → × scales → matmul (+ bias) chain into ``quantfuse.awq_gemm``.

What is matched (docs/DESIGN.md pass form 3), on the aten graph Inductor hands to
its custom passes::

    w   = unpack(qweight)                # [K, N]   4-bit values in logical column order
    z   = expand_groups(unpack(qzeros))  # [K/G, N] -> [K, N]
    s   = expand_groups(scales)          # [K/G, N] -> [K, N]
    W   = (w - z) [.to(dtype)] * s       # either operand order of the product
    y   = mm(x, W) [+ bias]              # bias [N]; 3-D x: view -> mm -> view (+ bias)

``unpack`` is any chain ``unsqueeze(p, -1) >> shifts`` followed by (in any
order) one ``& 15``, reshapes, casts (integer before the mask) and at most one column gather
``t[:, perm]``.  That covers ``AWQLinear`` (shifts in AWQ order, mask,
reshape) and AutoAWQ's formulation (``bitwise_right_shift`` by
``arange(0, 32, 4)``, view to ``[K, N]``, index with the reverse order, then
``bitwise_and``; also gathering on a ``[K*N/8, 8]`` view).  ``expand_groups``
is what ``repeat_interleave(G, dim=0)`` decomposes to (``unsqueeze(1)`` →
``expand([K/G, G, N])`` → ``clone`` → view), the same written by hand with
view/expand (with or without the clone), or plain broadcasting of a
``[1, N]`` operand (per-channel, G = K).  ``torch.matmul`` of a 3-D activation
is already decomposed to ``view([M, K])`` → ``mm`` → ``view([B, S, N])`` in
these graphs, so the pass replaces the ``mm`` (whose input is the 2-D view)
and leaves the views around it; a bias add after the output view is folded
into the op with the view re-applied to its result.

How it is written: the matmul side — product order, cast, the two group
expansions, ``mm`` — is a set of declarative ``PatternExpr`` trees generated
by looping over the variants and registered with ``fx_helpers.register_checked``
(the shared check → plan → replace → report path of every family);
the unpack chains are a second set of generated declarative patterns (one per
sequence of steps), matched inside the check against the nodes the first
pattern bound as "unpacked weight" and "unpacked zeros" (registering their
cross product instead would mean thousands of patterns on every ``mm``).  A
second, small pattern family folds a ``+ bias`` into an ``awq_gemm`` the first
one produced (the pass runs to a fixed point).

Nothing is trusted from the structure alone; every candidate is checked
(``_analyze``) and left alone when a check fails:

* the bit layout: the shift tensor and gather permutation must be graph
  constants (a lifted ``_tensor_constant``, ``arange``/``iota`` and views or
  indexing of them) which are evaluated, and the column each output reads must
  be word ``n // 8`` at bit ``AWQ_SHIFTS[n % 8]`` — docs/DESIGN.md's order.  So a
  chain with another bit order (e.g. sequential shifts 0..28 with no reorder)
  is not matched, while any formulation that provably computes the AWQ order
  is; the mask must be 15 and casts before it integer;
* a zero point must be subtracted, and it must itself be an unpacked AWQ
  tensor (a scalar or a float tensor zero point does not match);
* dtypes: ``qweight``/``qzeros`` int32, activations, scales, the dequantized
  weight and bias all float16 or bfloat16 and equal;
* shapes: ``qweight [K, N/8]``, ``qzeros [K/G, N/8]``, ``scales [K/G, N]``,
  bias ``[N]``, one group size ``G`` for zeros and scales recovered from the
  expand shape (or K for broadcasting), ``G · K/G = K``; all of them static
  integers (a symbolic weight shape is left alone);
* the subtraction in a signed or float dtype (unsigned wraps around below
  zero); no ``alpha`` on the ``sub``/``add``; intermediate nodes used only inside the
  chain (the pattern matcher's single-user rule), so e.g. a dequantized weight
  that is also used elsewhere stays.

Slot: ``joint_custom_pre_pass`` only.  The joint-graph slot runs before
``freezing`` constant-folds weight chains (which would turn the whole
dequantization into a dense fp16 weight and leave nothing to match) and before
Inductor's own joint/post-grad rewrites (mm + add -> addmm, pointless view and
cast removal), so the graph is still what the user wrote; Inductor runs it for
inference and for ``freezing``, in ``torch.compile`` and AOT compiles alike.
The patterns nevertheless accept ``aten.view``, ``aten.reshape`` and
``aten._unsafe_view`` wherever a view occurs, so they also match the graph the
post-grad slots see (after ``view_to_reshape``; tested): moving them or adding
``post_grad_custom_pre_pass`` as a second chance (only useful with
``use_joint_graph_passes=False``) is a change of ``PASS_SLOTS``.
"""

from __future__ import annotations

import functools
import itertools
from collections import Counter
from dataclasses import dataclass

import torch
from torch._inductor.pattern_matcher import (
    MULTIPLE,
    CallFunction,
    Ignored,
    KeywordArg,
    Match,
    PatternExpr,
    is_match,
    register_graph_pattern,
)

from compile_backend.ops import AWQ_ACT_DTYPES, AWQ_PACK, AWQ_SHIFTS

from .fx_helpers import (
    CONVERT,
    VIEWS,
    Plan,
    Reject,
    check_private,
    no_alpha,
    register_checked,
    static_shape,
    tensor_val,
)

aten, prims = torch.ops.aten, torch.ops.prims

FAMILY = "awq_gemm"
PASS_SLOTS = ("joint_custom_pre_pass",)
MASK = 2**4 - 1

RSHIFTS = (aten.__rshift__.Tensor, aten.bitwise_right_shift.Tensor)
_INT_DTYPES = (torch.int8, torch.uint8, torch.int16, torch.int32, torch.int64)
_EXACT_FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


# --------------------------------------------------------------------------- unpack sub-patterns

_UNPACK_STEPS = {
    "view": lambda p: CallFunction(VIEWS, p, Ignored()),
    "mask": lambda p: CallFunction(aten.bitwise_and.Scalar, p, KeywordArg("mask")),
    "cast": lambda p: CallFunction(CONVERT, p, Ignored()),
    "gather": lambda p: CallFunction(aten.index.Tensor, p, [None, KeywordArg("perm")]),
}


def _unpack_sequences(max_len: int = 6):
    """Step sequences from the shifted ``[R, N/8, 8]`` tensor to the unpacked ``[R, N]`` one."""
    for n in range(1, max_len + 1):
        for seq in itertools.product(_UNPACK_STEPS, repeat=n):
            c = Counter(seq)
            if c["mask"] != 1 or c["gather"] > 1 or c["cast"] > 2 or c["view"] > 3:
                continue
            if any(a == b and a != "view" for a, b in zip(seq, seq[1:])):
                continue
            yield seq


def _unpack_pattern(seq) -> PatternExpr:
    p = CallFunction(RSHIFTS, CallFunction(aten.unsqueeze.default, KeywordArg("packed"), Ignored()),
                     KeywordArg("shifts"))
    for step in seq:
        p = _UNPACK_STEPS[step](p)
    return p


def _build_unpack_patterns():
    """Last step's target -> [(steps, pattern)]: the candidates for one unpacked node."""
    by_target: dict = {}
    for seq in _unpack_sequences():
        pattern = _unpack_pattern(seq)
        for fn in pattern.fns:
            by_target.setdefault(fn, []).append((seq, pattern))
    return by_target


_UNPACK_PATTERNS = _build_unpack_patterns()


# --------------------------------------------------------------------------- static values of nodes


_CONST_OPS = {
    aten.lift_fresh_copy.default, aten.clone.default, aten.alias.default, prims.iota.default,
    aten.arange.default, aten.arange.start, aten.arange.start_step,
    aten.view.default, aten.reshape.default, aten._unsafe_view.default, aten.unsqueeze.default,
    aten.squeeze.dim, aten.squeeze.default, aten.expand.default, aten.permute.default,
    aten.index.Tensor, aten.slice.Tensor, aten.select.int, CONVERT, aten._to_copy.default,
}
_CONST_MAX_NUMEL = 1 << 22


def _constant(node) -> torch.Tensor | None:
    """The value of a node computed only from graph constants (on CPU, real tensors), else None."""
    from torch._subclasses.fake_tensor import unset_fake_temporarily

    with unset_fake_temporarily():
        return _evaluate(node, 0)


def _evaluate(node, _depth: int) -> torch.Tensor | None:
    from torch._subclasses.fake_tensor import FakeTensor

    if _depth > 16 or not isinstance(node, torch.fx.Node):
        return None
    if node.op == "get_attr":
        obj = node.graph.owning_module
        for part in str(node.target).split("."):
            obj = getattr(obj, part, None)
        if not isinstance(obj, torch.Tensor) or isinstance(obj, FakeTensor) or obj.numel() > _CONST_MAX_NUMEL:
            return None
        return obj.detach().cpu()
    if node.op != "call_function" or node.target not in _CONST_OPS:
        return None

    ok = True

    def resolve(a):
        nonlocal ok
        if isinstance(a, torch.fx.Node):
            v = _evaluate(a, _depth + 1)
            ok = ok and v is not None
            return v
        if isinstance(a, (torch.SymInt, torch.SymFloat, torch.SymBool)):
            ok = False
        if isinstance(a, torch.device):
            return torch.device("cpu")
        return a

    args = torch.fx.node.map_aggregate(node.args, resolve)
    kwargs = torch.fx.node.map_aggregate(dict(node.kwargs), resolve)
    if not ok:
        return None
    try:
        out = node.target(*args, **kwargs)
    except Exception:
        return None
    return out if isinstance(out, torch.Tensor) and out.numel() <= _CONST_MAX_NUMEL else None


# --------------------------------------------------------------------------- unpack analysis


@dataclass(frozen=True)
class _Unpacked:
    packed: torch.fx.Node  # the int32 [R, N/8] tensor
    rows: int
    cols: int  # N
    gathered: bool  # a reorder index was used (AutoAWQ style)


def _analyze_unpack(node, what: str) -> _Unpacked | str:
    """Is ``node`` an AWQ-order unpack of an int32 ``[R, N/8]`` tensor into ``[R, N]``?  Else why not."""
    from torch._subclasses.fake_tensor import unset_fake_temporarily

    reason = f"{what} is not a 4-bit unpack (shift, & 15, reshape/reorder) of an int32 tensor"
    if not isinstance(node, torch.fx.Node) or node.op != "call_function":
        return reason
    for seq, pattern in _UNPACK_PATTERNS.get(node.target, ()):
        m = pattern.match(node)
        if is_match(m):
            # The layout check computes on small real tensors, also inside a compile's fake mode.
            with unset_fake_temporarily():
                found = _check_unpack(node, seq, m)
            if isinstance(found, _Unpacked):
                return found
            reason = f"{what}: {found}"
    return reason


def _check_unpack(root: torch.fx.Node, seq, m: Match) -> _Unpacked | str:
    chain, node = [], root
    for step in reversed(seq):
        chain.append((step, node))
        node = node.args[0]
    chain.reverse()
    shifted, unsqueezed = node, node.args[0]
    packed = m.kwargs["packed"]

    p = tensor_val(packed)
    if p is None or p.dtype != torch.int32 or p.dim() != 2 or static_shape(p) is None:
        return "the packed tensor is not a 2-D int32 tensor of static shape"
    R, C = p.shape
    N = C * AWQ_PACK
    if static_shape(tensor_val(unsqueezed)) != (R, C, 1) or static_shape(tensor_val(shifted)) != (R, C, AWQ_PACK):
        return "the shift does not spread each int32 over 8 values along a new last dimension"
    shifts = _constant(m.kwargs["shifts"])
    if (shifts is None or shifts.dtype not in _INT_DTYPES or shifts.dim() > 3 or shifts.shape[-1] != AWQ_PACK
            or any(s != 1 for s in shifts.shape[:-1])):
        return "the shift amounts are not a constant integer tensor of 8 values"
    shifts = shifts.reshape(AWQ_PACK).to(torch.int64)
    if m.kwargs.get("mask") != MASK:
        return f"the mask is {m.kwargs.get('mask')!r}, not {MASK} (4-bit values)"

    # src[n]: which element (8 * word + slot of the shift) of a [R, N/8, 8] row column n reads.
    src = torch.arange(N)
    flat_shapes = {(R, C, AWQ_PACK), (R, N), (R * C, AWQ_PACK)}
    shape, masked = (R, C, AWQ_PACK), False
    for step, n in chain:
        out = tensor_val(n)
        if out is None:
            return "a node in the unpack chain has no tensor metadata"
        if step == "view":
            shape = static_shape(out)
            if shape not in flat_shapes:
                return f"a reshape to {tuple(out.shape)} mixes rows of the packed tensor"
        elif step == "mask":
            masked = True
        elif step == "cast":
            ok = out.dtype in _INT_DTYPES or (masked and out.dtype in _EXACT_FLOAT_DTYPES)
            if not ok:
                return f"a cast to {out.dtype} in the unpack chain"
        elif step == "gather":
            perm = _constant(m.kwargs["perm"])
            if (perm is None or perm.dim() != 1 or perm.dtype not in _INT_DTYPES or len(shape) != 2
                    or perm.numel() != shape[1] or static_shape(out) != shape):
                return "the column reorder is not a constant 1-D permutation of the last dimension"
            perm = perm.to(torch.int64)
            if perm.numel() and (perm.min() < 0 or perm.max() >= shape[1]):
                return "the column reorder index is out of range"
            if shape == (R, N):
                src = src[perm]
            elif shape == (R * C, AWQ_PACK):
                src = src.view(C, AWQ_PACK)[:, perm].reshape(-1)
            else:
                return "the column reorder is applied to an unsupported shape"
    if shape != (R, N) or static_shape(tensor_val(root)) != (R, N) or not masked:
        return f"the unpacked tensor is not [{R}, {N}]"
    n = torch.arange(N)
    want_shift = torch.tensor(AWQ_SHIFTS, dtype=torch.int64)[n % AWQ_PACK]
    if not torch.equal(src // AWQ_PACK, n // AWQ_PACK):
        return "columns are taken from the wrong int32 words"
    if not torch.equal(shifts[src % AWQ_PACK], want_shift):
        got = shifts[src[:AWQ_PACK] % AWQ_PACK].tolist()
        return f"bit order: columns 0..7 read bits {got}, AWQ order reads {list(AWQ_SHIFTS)}"
    return _Unpacked(packed, R, N, "gather" in seq)


# --------------------------------------------------------------------------- the dequant-matmul patterns


@dataclass(frozen=True)
class _Variant:
    zeros: str  # group expansion of the zeros: "clone" | "noclone" | "broadcast"
    scales: str  # same, for the scales
    cast: bool  # (w - z).to(dtype) before the product
    scales_first: bool  # s * (w - z) instead of (w - z) * s


# The weight-side nodes may have other users in the pattern's eyes (``_users=MULTIPLE``):
# under grad mode the backward of ``mm(x, W)`` reads ``W`` (``grad_x = grad_y @ W.t()``).
# ``_plan`` then allows backward users only (``check_private``).
_ANY = MULTIPLE


def _group_expand(name: str, kind: str) -> PatternExpr:
    arg = KeywordArg(name)
    if kind == "broadcast":
        return arg
    unsqueezed = CallFunction(aten.unsqueeze.default, arg, Ignored(), _users=_ANY)
    e = CallFunction(aten.expand.default, unsqueezed, Ignored(), _users=_ANY)
    if kind == "clone":
        e = CallFunction(aten.clone.default, e, _users=_ANY)
    return CallFunction(VIEWS, e, Ignored(), _users=_ANY)


def _mm_pattern(v: _Variant) -> PatternExpr:
    diff = CallFunction(aten.sub.Tensor, KeywordArg("w_unpacked"), _group_expand("z_unpacked", v.zeros), _users=_ANY)
    if v.cast:
        diff = CallFunction(CONVERT, diff, Ignored(), _users=_ANY)
    s = _group_expand("scales", v.scales)
    weight = CallFunction(aten.mul.Tensor, *((s, diff) if v.scales_first else (diff, s)), _users=_ANY)
    return CallFunction(aten.mm.default, KeywordArg("x"), weight)


def _variants():
    kinds = ("clone", "noclone", "broadcast")
    for z, s, cast, first in itertools.product(kinds, kinds, (False, True), (False, True)):
        yield _Variant(z, s, cast, first)


@dataclass(frozen=True)
class _Fusion:
    qweight: torch.fx.Node
    qzeros: torch.fx.Node
    group_size: int
    form: str
    detail: str


def _expansion(node, kind: str, N: int):
    """(groups, group size or None for broadcasting) of a group-expanded ``[K, N]`` operand, else None."""
    if kind == "broadcast":
        return (1, None) if static_shape(tensor_val(node)) == (1, N) else None
    inner = node.args[0]
    expand = inner.args[0] if kind == "clone" else inner
    unsq = expand.args[0]
    e, u = static_shape(tensor_val(expand)), static_shape(tensor_val(unsq))
    if e is None or u is None or len(e) != 3 or u != (e[0], 1, e[2]) or e[2] != N:
        return None
    if static_shape(tensor_val(node)) != (e[0] * e[1], N):
        return None
    return e[0], e[1]


def _analyze(v: _Variant, match: Match) -> _Fusion | str:
    """The fusion for a structural match of ``_mm_pattern(v)``, or why it must not be fused."""
    kw = match.kwargs
    mm = match.output_node()
    weight = mm.args[1]
    diff_side, s_side = weight.args[::-1] if v.scales_first else weight.args
    sub = diff_side.args[0] if v.cast else diff_side
    if not no_alpha(sub):
        return "the zero point is subtracted with an alpha"
    diff = tensor_val(sub)
    if diff is None or not (diff.dtype.is_floating_point or diff.dtype.is_signed):
        # e.g. uint8: 3 - 5 wraps around to 254 in the graph; awq_gemm computes -2.
        return f"the zero point is subtracted in {getattr(diff, 'dtype', None)}, which wraps around"

    x, scales, W, y = tensor_val(kw["x"]), tensor_val(kw["scales"]), tensor_val(weight), tensor_val(mm)
    if x is None or scales is None or W is None or y is None:
        return "missing tensor metadata"
    dtype = x.dtype
    if dtype not in AWQ_ACT_DTYPES:
        return f"activations are {dtype}; awq_gemm takes float16 or bfloat16"
    if scales.dtype != dtype or W.dtype != dtype or y.dtype != dtype:
        return f"scales ({scales.dtype}) / dequantized weight ({W.dtype}) not in the activation dtype {dtype}"
    w_shape, s_shape = static_shape(W), static_shape(scales)
    if w_shape is None or s_shape is None:
        return "symbolic weight or scale shape"
    K, N = w_shape

    qw = _analyze_unpack(kw["w_unpacked"], "weight")
    if isinstance(qw, str):
        return qw
    if (qw.rows, qw.cols) != (K, N):
        return f"unpacked weight is [{qw.rows}, {qw.cols}], not [K, N] = [{K}, {N}]"
    qz = _analyze_unpack(kw["z_unpacked"], "zero point")
    if isinstance(qz, str):
        return qz
    z_exp, s_exp = _expansion(sub.args[1], v.zeros, N), _expansion(s_side, v.scales, N)
    if z_exp is None or s_exp is None:
        return "zeros or scales are not expanded by groups of rows to [K, N]"
    groups = z_exp[0]
    # Broadcasting a [1, N] operand is per-channel: one group of K rows.
    g_z = K if z_exp[1] is None else z_exp[1]
    g_s = K if s_exp[1] is None else s_exp[1]
    if g_z != g_s or s_exp[0] != groups:
        return f"zeros (group size {g_z}) and scales (group size {g_s}) are grouped differently"
    if groups * g_z != K:
        return f"{groups} groups of {g_z} rows do not cover K = {K}"
    if (qz.rows, qz.cols) != (groups, N):
        return f"qzeros unpacks to [{qz.rows}, {qz.cols}], expected [K/G, N] = [{groups}, {N}]"
    if s_shape != (groups, N):
        return f"scales have shape {list(s_shape)}, expected [K/G, N] = [{groups}, {N}]"
    form = "autoawq_reorder" if qw.gathered or qz.gathered else "awq_shift_table"
    per = "per-channel" if g_z == K else f"group_size={g_z}"
    return _Fusion(qw.packed, qz.packed, g_z, form, f"{per} K={K} N={N} {str(dtype).removeprefix('torch.')}")


def _plan(v: _Variant, match: Match) -> Plan:
    fusion = _analyze(v, match)
    if isinstance(fusion, str):
        raise Reject(fusion)
    check_private(match, [n for n in match.nodes if n is not match.output_node()], "the dequantized weight")
    group_size = fusion.group_size

    def build(x, qweight, scales, qzeros):
        return torch.ops.quantfuse.awq_gemm(x, qweight, scales, qzeros, group_size)

    inputs = {"x": match.kwargs["x"], "qweight": fusion.qweight, "scales": match.kwargs["scales"],
              "qzeros": fusion.qzeros}
    return Plan(inputs, build, fusion.detail, tensor_val(match.kwargs["x"]).dtype, form=fusion.form)


# --------------------------------------------------------------------------- bias folding


def _awq_call(with_none: bool) -> PatternExpr:
    args = [KeywordArg(n) for n in ("x", "qweight", "scales", "qzeros", "group_size")]
    return CallFunction(torch.ops.quantfuse.awq_gemm.default, *args, *([None] if with_none else []))


def _bias_patterns():
    """(pattern, 3-D) pairs: ``awq_gemm(...) + bias`` with the bias on either side, with or without a view."""
    for with_none, view, bias_first in itertools.product((False, True), repeat=3):
        y = _awq_call(with_none)
        if view:
            y = CallFunction(VIEWS, y, KeywordArg("out_shape"))
        bias = KeywordArg("bias")
        yield CallFunction(aten.add.Tensor, *((bias, y) if bias_first else (y, bias))), view


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

        def repl(x, qweight, scales, qzeros, bias, *sym_sizes):
            y = torch.ops.quantfuse.awq_gemm(x, qweight, scales, qzeros, group_size, bias)
            if not view:
                return y
            sizes = iter(sym_sizes)
            return y.reshape([next(sizes) if isinstance(s, torch.fx.Node) else s for s in shape])

        match.replace_by_example(repl, [kw["x"], kw["qweight"], kw["scales"], kw["qzeros"], kw["bias"], *nodes])

    return handler


# --------------------------------------------------------------------------- registration


def register(passes: dict) -> None:
    """Add the AWQ patterns to the PatternMatcherPass of each slot in ``PASS_SLOTS``."""
    for slot in PASS_SLOTS:
        target = passes[slot]
        for v in _variants():
            register_checked(_mm_pattern(v), target, FAMILY, None, functools.partial(_plan, v))
        for pattern, view in _bias_patterns():
            register_graph_pattern(pattern, extra_check=_bias_check, pass_dict=target)(_make_bias_handler(view))
