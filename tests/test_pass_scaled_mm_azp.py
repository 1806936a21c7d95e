# ruff: noqa: E501  (expected graph printouts are long lines)
"""FX-level tests of the ``scaled_mm_azp`` pattern family (form 2c) and the weight column-sum cache."""

from __future__ import annotations

import itertools

import pytest
import torch
import torch.nn.functional as F
from expecttest import TestCase
from pass_helpers import MATMULS, apply_passes, compile_and_run, count_calls, graph_str

from compile_backend.ops import scaled_mm_azp as azp_op
from compile_backend.quantize import W8A8Linear

AZP = torch.ops.quantfuse.scaled_mm_azp.default
COLSUM = torch.ops.quantfuse.weight_colsum.default
M, K, N = 6, 32, 16


def _inputs(*, lead=(M,), per_token_scale=True, per_token_zp=True, per_channel=True, seed=0):
    gen = torch.Generator().manual_seed(seed)
    a = torch.randint(-128, 128, (*lead, K), dtype=torch.int8, generator=gen)
    w = torch.randint(-128, 128, (N, K), dtype=torch.int8, generator=gen)
    sa = torch.rand((*lead, 1) if per_token_scale else (), generator=gen) * 0.01 + 1e-3
    za = torch.randint(-20, 20, (*lead, 1) if per_token_zp else (), dtype=torch.int32, generator=gen)
    sb = torch.rand(N if per_channel else (), generator=gen) * 0.01 + 1e-3
    bias = torch.randn(N, generator=gen).to(torch.bfloat16)
    return a, w, sa, za, sb, bias


def _close(out, expected, dq=torch.float32):
    """float32 dequant: equal up to float32 accumulation order (plus one ulp of the
    output dtype); bf16 dequant: the unfused graph rounds to 8 mantissa bits."""
    assert out.dtype == expected.dtype and out.shape == expected.shape
    rtol = (1e-5 if dq == torch.float32 else 2e-2) + torch.finfo(out.dtype).eps
    scale = expected.float().abs().max().item()
    err = (out.float() - expected.float()).abs().max().item()
    assert err <= rtol * scale + 1e-6, f"max error {err} vs scale {scale}"


class TestScaledMMAzpGraphs(TestCase):
    def test_per_token_zero_point_graph(self):
        def fn(a, w, sa, za, sb, bias):
            x = (a.float() - za.float()) * sa
            return F.linear(x, w.float() * sb.unsqueeze(-1), bias.float()).to(torch.bfloat16)

        r = apply_passes(fn, *_inputs())
        self.assertExpectedInline(graph_str(r.after), """\
input arg0_1: int8[6, 32]
input arg1_1: int32[6, 1]
input arg2_1: float32[6, 1]
input arg3_1: int8[16, 32]
input arg4_1: float32[16]
input arg5_1: bfloat16[16]
convert_element_type_1: float32[6, 1] = prims.convert_element_type(arg1_1, float32)
unsqueeze: float32[16, 1] = aten.unsqueeze(arg4_1, -1)
weight_colsum_default: int32[16] = quantfuse.weight_colsum(arg3_1)
convert_element_type_default: int32[6, 1] = prims.convert_element_type(convert_element_type_1, int32)
view_default: int32[6] = aten.view(convert_element_type_default, [-1])
permute_default: int8[32, 16] = aten.permute(arg3_1, [1, 0])
view_default_1: float32[6] = aten.view(arg2_1, [-1])
view_default_2: float32[16] = aten.view(unsqueeze, [-1])
scaled_mm_azp_default_1: bfloat16[6, 16] = quantfuse.scaled_mm_azp(arg0_1, permute_default, view_default_1, view_default_2, bfloat16, weight_colsum_default, view_default, arg5_1)
return [scaled_mm_azp_default_1]""")
        self.assertEqual(r.report.counts()["scaled_mm_azp"], 1)
        _close(r.output, r.expected)

    def test_per_tensor_zero_point_graph(self):
        def fn(a, w, sa, za, sb, bias):
            x = (a.float() - za) * sa
            return (x @ (w.float() * sb).t()).to(torch.float16)

        r = apply_passes(fn, *_inputs(per_token_scale=False, per_token_zp=False, per_channel=False))
        self.assertExpectedInline(graph_str(r.after), """\
input arg0_1: int8[6, 32]
input arg1_1: int32[]
input arg2_1: float32[]
input arg3_1: int8[16, 32]
input arg4_1: float32[]
weight_colsum_default: int32[16] = quantfuse.weight_colsum(arg3_1)
mul_tensor: int32[16] = aten.mul.Tensor(weight_colsum_default, arg1_1)
permute_default: int8[32, 16] = aten.permute(arg3_1, [1, 0])
view_default: float32[1] = aten.view(arg2_1, [-1])
view_default_1: float32[1] = aten.view(arg4_1, [-1])
scaled_mm_azp_default_1: float16[6, 16] = quantfuse.scaled_mm_azp(arg0_1, permute_default, view_default, view_default_1, float16, mul_tensor, None, None)
return [scaled_mm_azp_default_1]""")
        _close(r.output, r.expected)


CASES = [
    # (3-D, per-token scale, per-token zero point, per-channel, bias, out dtype, dequant dtype, dynamic)
    *[(d3, pts, ptz, pc, b, torch.bfloat16, torch.float32, False)
      for d3, pts, ptz, pc, b in itertools.product((False, True), (True, False), (True, False), (True, False),
                                                   (True, False)) if not (pc and not b and d3)],
    *[(True, True, ptz, True, True, out, torch.float32, True) for ptz, out in
      itertools.product((True, False), (torch.float16, torch.float32))],
    (True, True, True, True, True, None, torch.bfloat16, False),
    (False, False, False, False, False, None, torch.float16, False),
]


@pytest.mark.parametrize("three_d,pt_scale,pt_zp,per_channel,bias_on,out_dtype,dq,dynamic", CASES)
def test_azp_variants(three_d, pt_scale, pt_zp, per_channel, bias_on, out_dtype, dq, dynamic):
    lead = (2, 3) if three_d else (M,)
    a, w, sa, za, sb, bias = _inputs(lead=lead, per_token_scale=pt_scale, per_token_zp=pt_zp,
                                     per_channel=per_channel)
    if out_dtype is not None:
        bias = bias.to(out_dtype)

    def fn(a, w, sa, za, sb, bias):
        x = (a.to(dq) - za.to(dq)) * sa.to(dq)
        wd = w.to(dq) * (sb.unsqueeze(-1) if sb.dim() else sb).to(dq)
        y = F.linear(x, wd, bias.to(dq) if bias_on else None)
        return y if out_dtype is None else y.to(out_dtype)

    r = apply_passes(fn, a, w, sa, za, sb, bias, dynamic=dynamic)
    assert r.count(AZP) == 1 and r.count(*MATMULS) == 0, graph_str(r.after)
    assert r.report.counts() == {"scaled_mm_azp": 1} and r.report.unfused == []
    (op,) = [n for n in r.after.graph.nodes if n.target is AZP]
    azp_arg = op.args[6] if len(op.args) > 6 else op.kwargs.get("azp")
    assert (azp_arg is None) == (not pt_zp)  # per-tensor: folded into azp_adj, azp=None
    assert op.meta["val"].dtype == (out_dtype or dq)
    _close(r.output, r.expected, dq)


@pytest.mark.parametrize("kw", [dict(), dict(per_token=False), dict(per_token=False, dynamic=False)],
                         ids=["dynamic-per-token", "dynamic-per-tensor", "static-per-tensor"])
@pytest.mark.parametrize("dynamic", [False, True])
def test_w8a8linear_asymmetric(kw, dynamic):
    gen = torch.Generator().manual_seed(3)
    lin = torch.nn.Linear(K, N)
    mod = W8A8Linear.from_linear(lin, symmetric=False, calibration=torch.randn(8, K, generator=gen) + 0.5, **kw)
    r = apply_passes(mod, torch.randn(2, 5, K, generator=gen) + 0.5, dynamic=dynamic)
    assert r.count(AZP) == 1 and r.count(*MATMULS) == 0, graph_str(r.after)
    assert r.count(COLSUM) == 1
    # Form 2e: the activation quantization (round, clamp, cast) stays in the graph.
    assert r.count(torch.ops.aten.round.default) == count_calls(r.before, torch.ops.aten.round.default) >= 1
    _close(r.output, r.expected)


# --------------------------------------------------------------------------- near-misses


def _fractional_zero_point(a, w, sa, za, sb, bias):
    # A float zero point of unknown origin may be fractional: not provably an integer.
    return F.linear((a.float() - za.float() * 0.37) * sa, w.float() * sb.unsqueeze(-1))


def _per_group_zero_point(a, w, sa, za, sb, bias):
    zg = za.float().expand(M, K).round()
    return F.linear((a.float() - zg) * sa, w.float() * sb.unsqueeze(-1))


def _fp8_zero_point(a, w, sa, za, sb, bias):
    a8, w8 = (a.float() * 0.5).to(torch.float8_e4m3fn), (w.float() * 0.5).to(torch.float8_e4m3fn)
    return F.linear((a8.float() - za.float()) * sa, w8.float() * sb.unsqueeze(-1))


NEAR_MISSES = {
    "fractional_zero_point": (_fractional_zero_point, "not provably integer-valued"),
    "per_group_zero_point": (_per_group_zero_point, "zero point of shape [6, 32]"),
    "fp8_zero_point": (_fp8_zero_point, "a zero point needs int8 activations"),
}


@pytest.mark.parametrize("name", sorted(NEAR_MISSES))
def test_near_misses_are_left_alone(name):
    fn, reason = NEAR_MISSES[name]
    r = apply_passes(fn, *_inputs())
    assert r.count(AZP) == 0 and r.count(*MATMULS) == 1, graph_str(r.after)
    torch.testing.assert_close(r.output, r.expected, rtol=0, atol=0)
    (unfused,) = r.report.unfused
    assert reason in unfused.reason, unfused.reason


# --------------------------------------------------------------------------- weight column sums


def test_weight_colsum_computed_once_per_weight():
    azp_op.clear_colsum_cache()
    w = torch.randint(-100, 100, (N, K), dtype=torch.int8)
    expected = w.to(torch.int32).sum(1, dtype=torch.int32)
    for _ in range(3):
        out = torch.ops.quantfuse.weight_colsum(w)
        torch.testing.assert_close(out, expected)
        out.zero_()  # a caller owning (and overwriting) its result must not corrupt the cache
    assert azp_op.colsum_stats == {"computed": 1, "hits": 2}
    w.add_(1)  # in-place update: the version counter invalidates the cached sums
    torch.testing.assert_close(torch.ops.quantfuse.weight_colsum(w), expected + K)
    assert azp_op.colsum_stats["computed"] == 2


def test_compiled_azp_module_computes_colsum_once():
    """The transformed graph, run three times, computes the column sums once."""
    azp_op.clear_colsum_cache()
    mod = W8A8Linear.from_linear(torch.nn.Linear(K, N), symmetric=False)
    gen = torch.Generator().manual_seed(4)
    r = apply_passes(mod, torch.randn(4, K, generator=gen))
    assert r.count(COLSUM) == 1
    for _ in range(2):
        x = torch.randn(4, K, generator=gen)
        with torch.no_grad():
            _close(r.compiled(x), mod(x))
    assert azp_op.colsum_stats["computed"] == 1, azp_op.colsum_stats
    assert azp_op.colsum_stats["hits"] == 2, azp_op.colsum_stats


@pytest.mark.parametrize("dq", [torch.float16, torch.bfloat16], ids=str)
def test_output_dtype_follows_type_promotion(dq):
    """``(a.to(fp16) - z) * scale_f32``: float32 in eager, so the fused op returns float32."""
    a, w, sa, za, sb, bias = _inputs()
    sa, sb = sa * 200.0, sb * 200.0

    def fn(a, w, sa, za, sb, bias):
        return F.linear((a.to(dq) - za.to(dq)) * sa, w.to(dq) * sb[:, None])

    r = apply_passes(fn, a, w, sa, za, sb, bias)
    assert r.expected.dtype == torch.float32
    assert r.expected.abs().max() > torch.finfo(torch.float16).max and r.expected.isfinite().all()
    (op,) = [n for n in r.after.graph.nodes if n.target is AZP]
    assert op.args[4] == torch.float32 and r.output.dtype == torch.float32
    _close(r.output, r.expected)


# --------------------------------------------------------------------------- weight spellings decided by probes

# Spellings of ``(w.float() * sb[:, None]).t()`` with the same meaning (passes/scaled_weight.py).
WEIGHT_SPELLINGS = {
    "transpose_then_scale": lambda w, sb: w.float().t() * sb,
    "int8_transposed_then_cast": lambda w, sb: w.t().float() * sb.reshape(1, N),
    "expanded_scale": lambda w, sb: (sb.view(-1, 1).expand(N, K) * w.float()).permute(1, 0),
    "type_promotion": lambda w, sb: (sb[:, None] * w).t(),
}


def _spelled(weight):
    def fn(a, w, sa, za, sb, bias):
        x = (a.float() - za.float()) * sa
        return (x @ weight(w, sb) + bias.float()).to(torch.bfloat16)

    return fn


@pytest.mark.parametrize("name", sorted(WEIGHT_SPELLINGS))
@pytest.mark.parametrize("dynamic", [False, True])
def test_weight_spellings_fuse(name, dynamic):
    r = apply_passes(_spelled(WEIGHT_SPELLINGS[name]), *_inputs(lead=(2, 3)), dynamic=dynamic)
    assert r.count(AZP) == 1 and r.count(*MATMULS) == 0, graph_str(r.after)
    assert r.report.counts() == {"scaled_mm_azp": 1} and r.report.unfused == [], str(r.report)
    # The column sums are those of the stored [N, K] weight.
    (colsum,) = [n for n in r.after.graph.nodes if n.target is COLSUM]
    assert colsum.args[0].op == "placeholder", graph_str(r.after)
    _close(r.output, r.expected)


@pytest.mark.compile
@pytest.mark.parametrize("name", sorted(WEIGHT_SPELLINGS))
def test_compiled_weight_spellings(name):
    report, out, expected = compile_and_run(_spelled(WEIGHT_SPELLINGS[name]), *_inputs(lead=(2, 3)))
    assert report.counts() == {"scaled_mm_azp": 1} and report.unfused == [], str(report)
    _close(out, expected)


def test_weight_near_miss_keeps_its_reason():
    """A weight transposed twice (K == N, so the shapes match) is no dequantization of the stored weight."""
    a, w, sa, za, sb, bias = _inputs()
    w = torch.randint(-128, 128, (K, K), dtype=torch.int8)
    sb = torch.rand(K) * 0.01 + 1e-3

    def fn(a, w, sa, za, sb, bias):
        return ((a.float() - za.float()) * sa) @ (w.float() * sb[:, None]).t().t()

    r = apply_passes(fn, a, w, sa, za, sb, bias)
    assert r.count(AZP) == 0 and r.count(*MATMULS) == 1, graph_str(r.after)
    (unfused,) = r.report.unfused
    assert "the weight is not transposed" in unfused.reason, unfused.reason
    torch.testing.assert_close(r.output, r.expected, rtol=0, atol=0)
