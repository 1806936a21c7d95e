"""The probe machinery of passes/dequant_probe.py: subgraph collection, small sizes (symbolic ones too),
evaluation, number roles, signatures; and the AWQ and W8A8 families' use of it on graph constants
(passes/awq_gemm.py, passes/scaled_weight.py) and its verdict cache.

Graphs are made with ``make_fx`` and Inductor's decompositions (the aten ops the passes see), with
fake placeholders for tensors passed as arguments and real ``get_attr`` constants for tensors a
function closes over.
"""

from __future__ import annotations

import functools
import itertools

import pytest
import torch
from torch._inductor.decomposition import select_decomp_table
from torch.fx.experimental.proxy_tensor import make_fx

from compile_backend.ops import AWQ_ORDER, awq_dequantize_reference, awq_unpack
from compile_backend.passes import awq_gemm, dequant_probe
from compile_backend.passes.dequant_probe import ProbeMismatch, SizeMap
from compile_backend.quantize import AWQLinear

aten = torch.ops.aten
K, N, G = 128, 32, 32
AWQ_REVERSE_ORDER = (0, 4, 1, 5, 2, 6, 3, 7)  # AutoAWQ's gather that undoes the packing


def fx(fn, *args) -> torch.fx.GraphModule:
    """The aten graph of ``fn(*args)`` (node values are fake tensors; closed-over tensors are constants),
    without dead nodes, as the graphs the passes see."""
    gm = make_fx(fn, decomposition_table=select_decomp_table())(*args)
    gm.graph.eliminate_dead_code()
    return gm


def result(gm):
    out = node(gm, "output").args[0]
    return out[0] if isinstance(out, (tuple, list)) else out


def node(gm, target):
    return next(n for n in gm.graph.nodes if n.target == target)


def awq_tensors(k=K, n=N, g=G, dtype=torch.float16, seed=0):
    torch.manual_seed(seed)
    layer = AWQLinear.from_linear(torch.nn.Linear(k, n), group_size=g, dtype=dtype)
    return layer.qweight, layer.qzeros, layer.scales


def autoawq_weight(qweight, qzeros, scales, order=AWQ_REVERSE_ORDER):
    """AutoAWQ's dequantization: shifts by arange, a length-N reorder index from arange, repeat_interleave."""
    def unpack(p):
        v = torch.bitwise_right_shift(p[:, :, None], torch.arange(0, 32, 4)[None, None, :]).to(torch.int8)
        v = v.view(p.shape[0], -1)
        index = torch.arange(v.shape[-1], dtype=torch.int32).view(-1, 8)[:, list(order)].view(-1)
        return torch.bitwise_and(v[:, index], 15)

    g = qweight.shape[0] // scales.shape[0]
    return (unpack(qweight) - unpack(qzeros).repeat_interleave(g, 0)) * scales.repeat_interleave(g, 0)


# --------------------------------------------------------------------------- small sizes


def _products(values):
    names = sorted(values)
    for exps in itertools.product((0, 1), repeat=len(names)):
        yield functools.reduce(lambda a, b: a * b, (values[n] for n, e in zip(names, exps) if e), 1)


@pytest.mark.parametrize(("k", "n", "g"), [
    (4096, 4096, 128),   # K == N
    (4096, 4096, 4096),  # per-channel: one group, G == K == N
    (256, 64, 64),       # N/8 == 8 == the pack factor, G == N
    (14336, 4096, 128),
    (64, 16, 8),         # G == 8
])
def test_shrink_keeps_every_equality(k, n, g):
    real = {"pack": 8, "C": n // 8, "groups": k // g, "G": g}
    sizes = SizeMap.shrink(real, fixed={"pack": 8})
    assert sizes is not None and sizes.small["pack"] == 8
    small = sizes.small
    real_p, small_p = list(_products(real)), list(_products(small))
    for (a, b), (c, d) in zip(itertools.combinations(real_p, 2), itertools.combinations(small_p, 2)):
        assert (a == b) == (c == d)
    assert all(small[name] <= real[name] for name in real)
    assert small["G"] * small["groups"] * small["C"] <= 1024  # a probe of at most a few thousand elements
    # A literal size is mapped by value: K and N to their small values, anything else kept.
    assert sizes(k) == small["G"] * small["groups"] and sizes(n) == 8 * small["C"]
    assert sizes(-1) == -1 and sizes(k - 1) == k - 1 and sizes.shape([k, n // 8, 8]) == (sizes(k), small["C"], 8)


# --------------------------------------------------------------------------- collect and evaluate


def test_collect_classifies_leaves_and_stops_outside_the_op_set():
    qw, qz, s = awq_tensors()
    gm = fx(lambda x, qw, qz, s: x @ autoawq_weight(qw, qz, torch.sin(s)), torch.randn(2, K, dtype=torch.float16),
            qw, qz, s)
    mm = node(gm, aten.mm.default)
    sub = dequant_probe.collect(mm.args[1])
    assert {n.name for n in sub.inputs} == {"qw_1", "qz_1", "sin"}  # sin is outside the op set: a leaf
    assert all(n.op == "get_attr" for n in sub.constants) and len(sub.constants) >= 1  # the reorder
    assert mm.args[1] in sub.nodes and sub.nodes.index(mm.args[1]) == len(sub.nodes) - 1
    assert sub.data_dependent_gather() is None
    assert isinstance(dequant_probe.collect(mm.args[1], max_nodes=5), str)


def test_a_gather_by_computed_values_is_a_lookup():
    qw, qz, s = awq_tensors()
    table = torch.arange(16, dtype=torch.int32)
    gm = fx(lambda qw: table[awq_unpack(qw)], qw)
    sub = dequant_probe.collect(result(gm))
    assert sub.data_dependent_gather() is not None and sub.data_dependent_gather().target == aten.index.Tensor


def test_evaluate_at_small_sizes_is_the_same_function_at_those_sizes():
    """A shape-generic subgraph re-run at small sizes equals the function run eagerly at them."""
    qw, qz, s = awq_tensors()
    gm = fx(lambda qw, qz, s: autoawq_weight(qw, qz, s), qw, qz, s)
    sub = dequant_probe.collect(result(gm))
    inputs = [n for n in gm.graph.nodes if n.op == "placeholder"]
    real = {"pack": 8, "C": N // 8, "groups": K // G, "G": G}

    got = dequant_probe.evaluate(sub, dict(zip(inputs, (qw, qz, s))), SizeMap.real_sizes(real))
    assert torch.equal(got, autoawq_weight(qw, qz, s))

    sizes = SizeMap.shrink(real, fixed={"pack": 8})
    k, n, g = sizes(K), sizes(N), sizes(G)
    assert (k, n) != (K, N)
    sq, sz, ss = awq_tensors(k, n, g, seed=3)
    got = dequant_probe.evaluate(sub, dict(zip(inputs, (sq, sz, ss))), sizes)
    assert got.shape == (k, n) and torch.equal(got, autoawq_weight(sq, sz, ss))
    assert torch.equal(got, awq_dequantize_reference(sq, ss, sz, g))


def test_a_size_that_is_no_product_of_the_quantities_cannot_be_shrunk():
    qw, qz, s = awq_tensors()

    def shifted(qw, qz, s):
        w = autoawq_weight(qw, qz, s)
        return torch.cat([w[:1], w[:-1]])  # K - 1 rows appear in the graph

    gm = fx(shifted, qw, qz, s)
    sub = dequant_probe.collect(result(gm))
    inputs = [n for n in gm.graph.nodes if n.op == "placeholder"]
    real = {"pack": 8, "C": N // 8, "groups": K // G, "G": G}
    sizes = SizeMap.shrink(real, fixed={"pack": 8})
    small = awq_tensors(sizes(K), sizes(N), sizes(G))
    with pytest.raises(ProbeMismatch, match="at the probe's sizes"):
        dequant_probe.evaluate(sub, dict(zip(inputs, small)), sizes)
    real_out = dequant_probe.evaluate(sub, dict(zip(inputs, (qw, qz, s))), SizeMap.real_sizes(real))
    assert torch.equal(real_out, shifted(qw, qz, s))


def test_signature_is_shared_by_equal_subgraphs_only():
    qw, qz, s = awq_tensors()
    roles = ("qweight", "qzeros", "scales")

    def sig(fn):
        gm = fx(lambda qw, qz, s: fn(qw, qz, s), qw, qz, s)
        sub = dequant_probe.collect(result(gm))
        return dequant_probe.signature(sub, dict(zip(roles, [n for n in gm.graph.nodes if n.op == "placeholder"])))

    assert sig(autoawq_weight) == sig(autoawq_weight)
    assert sig(autoawq_weight) != sig(functools.partial(autoawq_weight, order=range(8)))  # another constant
    assert sig(autoawq_weight) != sig(lambda qw, qz, s: autoawq_weight(qw, qz, s).t())


# --------------------------------------------------------------------------- the AWQ family on graph constants


def _constant_graph(order=AWQ_ORDER):
    """``x @ W`` with qweight, qzeros and scales closed over: real get_attr constants in the graph."""
    qw, qz, s = awq_tensors()

    def f(x):
        def unpack(p):
            return torch.stack([(p >> (4 * r)) & 15 for r in order], -1).reshape(p.shape[0], -1)

        w = (unpack(qw) - unpack(qz).repeat_interleave(G, 0)) * s.repeat_interleave(G, 0)
        return x @ w

    gm = fx(f, torch.randn(2, K, dtype=torch.float16))
    mm = node(gm, aten.mm.default)
    return gm, mm


def test_constants_as_qweight_qzeros_scales():
    gm, mm = _constant_graph()
    fusion = awq_gemm._analyze(mm, mm.args[0], mm.args[1])
    assert isinstance(fusion, awq_gemm._Fusion), fusion
    assert fusion.group_size == G and fusion.form == "nibble_stack"
    assert {n.op for n in fusion.roles.by_name().values()} == {"get_attr"}
    sub = dequant_probe.collect(mm.args[1])
    assert awq_gemm._check_real_values(sub, fusion.roles, K, K // G) is None


def test_constants_are_checked_on_their_real_values(monkeypatch):
    """A wrong bit order on constants: the probes say so, and so does the evaluation on the real values
    when the probes are taken out of the way."""
    gm, mm = _constant_graph(order=range(8))
    reason = awq_gemm._analyze(mm, mm.args[0], mm.args[1])
    assert isinstance(reason, str) and reason.startswith("bit order")
    monkeypatch.setattr(awq_gemm, "_prove", lambda *args: None)
    assert awq_gemm._analyze(mm, mm.args[0], mm.args[1]) == (
        "on the constant qweight, qzeros and scales the weight differs from the AWQ dequantization")


# --------------------------------------------------------------------------- W8A8's weight side (scaled_weight.py)


def _w8a8_weight(w, s):
    return (w.float() * s.view(-1, 1)).t()


def test_collect_stops_at_the_leaves_a_family_names():
    w, s = torch.randint(-128, 128, (N, K), dtype=torch.int8), torch.rand(N)
    gm = fx(_w8a8_weight, w, s)
    view = node(gm, aten.view.default)
    whole = dequant_probe.collect(result(gm))
    cut = dequant_probe.collect(result(gm), leaf=lambda n: n is view)
    assert view in whole.nodes and view not in cut.nodes and view in cut.inputs
    assert {n.name for n in cut.inputs} == {"w_1", "view"}


def test_symbolic_sizes_get_small_values_unlike_any_literal():
    """Under dynamic shapes K and N are symbols: each gets a small value of its own, none of the subgraph's
    int literals, and the subgraph evaluated there is the function at those sizes."""
    w, s = torch.randint(-128, 128, (N, K), dtype=torch.int8), torch.rand(N)
    gm = make_fx(lambda w, s: (w.float() * s.view(-1, 1).expand(w.shape[0], w.shape[1])).t(),
                 decomposition_table=select_decomp_table(), tracing_mode="symbolic")(w, s)
    sub = dequant_probe.collect(result(gm))
    n_sym, k_sym = next(n for n in gm.graph.nodes if n.op == "placeholder").meta["val"].shape
    assert all(isinstance(v, torch.SymInt) for v in (n_sym, k_sym))
    literals = sub.int_literals()
    sizes = SizeMap.shrink({"K": k_sym, "N": n_sym}, avoid=literals)
    k, n = sizes.small["K"], sizes.small["N"]
    assert k != n and not {k, n} & literals and sizes(k_sym * n_sym) == k * n
    inputs = [p for p in gm.graph.nodes if p.op == "placeholder"]
    sw, ss = torch.randint(-128, 128, (n, k), dtype=torch.int8), torch.rand(n)
    got = dequant_probe.evaluate(sub, dict(zip(inputs, (sw, ss))), sizes)
    assert torch.equal(got, _w8a8_weight(sw, ss))


def test_a_number_plays_a_role():
    """A float operand of an elementwise op (``* 0.02``) is fed like a leaf, and equal graphs with other
    numbers in that role share one signature."""
    w = torch.randint(-128, 128, (N, K), dtype=torch.int8)

    def sub_of(scale):
        gm = fx(lambda w: w.float().t() * scale, w)
        return gm, dequant_probe.collect(result(gm))

    gm, sub = sub_of(0.02)
    (lit,) = sub.literals()
    assert lit.value == 0.02
    q = next(n for n in gm.graph.nodes if n.op == "placeholder")
    got = dequant_probe.evaluate(sub, {q: w, lit: 0.5}, SizeMap.real_sizes({"K": K, "N": N}))
    assert torch.equal(got, w.float().t() * 0.5)
    gm2, sub2 = sub_of(0.03)
    (lit2,) = sub2.literals()
    q2 = next(n for n in gm2.graph.nodes if n.op == "placeholder")
    assert dequant_probe.signature(sub, {"weight": q, "scale": lit}) == \
        dequant_probe.signature(sub2, {"weight": q2, "scale": lit2})
    assert dequant_probe.signature(sub, {"weight": q}) != dequant_probe.signature(sub2, {"weight": q2})


def _w8a8_constant_graph(weight):
    """``x @ weight(w, s)`` with an int8 ``w`` and its scale closed over: get_attr constants."""
    gen = torch.Generator().manual_seed(0)
    w = torch.randint(-128, 128, (N, K), dtype=torch.int8, generator=gen)
    s = torch.rand(N, generator=gen) * 0.01 + 1e-3
    gm = fx(lambda x: x @ weight(w, s), torch.randn(2, K))
    return gm, node(gm, aten.mm.default)


def test_w8a8_constants_are_checked_on_their_real_values(monkeypatch):
    from compile_backend.passes import scaled_weight

    gm, mm = _w8a8_constant_graph(lambda w, s: w.float().t() * s)
    found = scaled_weight.analyze(mm.args[1], mm, (torch.int8,))
    assert isinstance(found, scaled_weight.ScaledWeight), found
    assert found.kind == "per-channel" and {found.q.op, found.scale.op} == {"get_attr"}
    # An offset on constants: the probes say so, and so does the evaluation on the real values when the
    # probes are taken out of the way.
    gm, mm = _w8a8_constant_graph(lambda w, s: (w.float().t() + 1) * s)
    assert "an offset" in scaled_weight.analyze(mm.args[1], mm, (torch.int8,))
    monkeypatch.setattr(scaled_weight, "_prove", lambda *args: None)
    assert scaled_weight.analyze(mm.args[1], mm, (torch.int8,)) == (
        "on the constant weight and scale the weight differs from the dequantization")


def test_w8a8_probes_run_once_per_signature(monkeypatch):
    """Two layers of one shape (other weights and scales) share a subgraph signature: probed once."""
    from pass_helpers import apply_passes

    from compile_backend.passes import scaled_weight

    monkeypatch.setattr(scaled_weight, "_VERDICTS", {})
    runs = []
    prove = dequant_probe.prove
    monkeypatch.setattr(dequant_probe, "prove", lambda *args, **kw: runs.append(1) or prove(*args, **kw))
    gen = torch.Generator().manual_seed(0)
    a = torch.randint(-128, 128, (4, K), dtype=torch.int8, generator=gen)
    weights = [torch.randint(-128, 128, (K, K), dtype=torch.int8, generator=gen) for _ in range(2)]
    scales = [torch.rand(K, generator=gen) * 0.01 + 1e-3 for _ in range(2)]

    def two_layers(a, w1, s1, w2, s2):
        h = (a.float() * 0.01) @ (w1.float() * s1[:, None]).t()
        q = h.round().clamp(-128, 127).to(torch.int8)
        return (q.float() * 0.01) @ (w2.float() * s2[:, None]).t()

    r = apply_passes(two_layers, a, weights[0], scales[0], weights[1], scales[1])
    assert r.fused == 2, r.report
    assert len(runs) == 1 and len(scaled_weight._VERDICTS) == 1
