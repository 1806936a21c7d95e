# ruff: noqa: E501  (expected graph printouts are long lines)
"""FX-level tests of the ``scaled_mm`` pattern family (forms 2a, 2b, 2e; near-misses).

Graphs are traced as Inductor's joint slot sees them and the passes run on
them directly (tests/pass_helpers.py); no Inductor code generation.
"""

from __future__ import annotations

import itertools

import pytest
import torch
import torch.nn.functional as F
from expecttest import TestCase
from pass_helpers import MATMULS, apply_passes, compile_and_run, count_calls, graph_str

from compile_backend.quantize import W8A8Linear

aten = torch.ops.aten
SCALED_MM = torch.ops.quantfuse.scaled_mm.default
M, K, N = 6, 32, 16


def _rand_q(shape, dtype, gen):
    if dtype == torch.int8:
        return torch.randint(-128, 128, shape, dtype=torch.int8, generator=gen)
    return (torch.randn(shape, generator=gen) * 40).clamp(-448, 448).to(dtype)


def _inputs(*, qdtype=torch.int8, lead=(M,), per_token=True, per_channel=True, bias_dtype=None, seed=0):
    gen = torch.Generator().manual_seed(seed)
    a = _rand_q((*lead, K), qdtype, gen)
    w = _rand_q((N, K), qdtype, gen)
    sa = torch.rand((*lead, 1) if per_token else (), generator=gen) * 0.01 + 1e-3
    sb = torch.rand(N if per_channel else (), generator=gen) * 0.01 + 1e-3
    bias = None if bias_dtype is None else torch.randn(N, generator=gen).to(bias_dtype)
    return a, w, sa, sb, bias


def _close(test, out, expected, dequant_dtype):
    """float32 dequantization: the fused op's exact integer accumulation differs from
    float32 accumulation by a few float32 ulps.  bf16/fp16 dequantization: the unfused
    graph rounds the operands and the product to 8 (11) mantissa bits; the fused op
    does not, so they agree to that precision only.  Either way the final rounding to
    the output dtype may then differ by one ulp of that dtype."""
    assert out.dtype == expected.dtype and out.shape == expected.shape
    rtol = {torch.float32: 1e-5, torch.bfloat16: 2e-2, torch.float16: 2e-3}[dequant_dtype]
    rtol += torch.finfo(out.dtype).eps
    scale = expected.float().abs().max().item()
    err = (out.float() - expected.float()).abs().max().item()
    test.assertLessEqual(err, rtol * scale + 1e-6, f"max error {err} vs scale {scale}")


# --------------------------------------------------------------------------- expected graphs


class TestScaledMMGraphs(TestCase):
    def test_linear_dequant_f32_graph(self):
        def fn(a, w, sa, sb, bias):
            return F.linear(a.float() * sa, w.float() * sb.unsqueeze(-1), bias.float()).to(torch.bfloat16)

        r = apply_passes(fn, *_inputs(bias_dtype=torch.bfloat16))
        self.assertExpectedInline(graph_str(r.before), """\
input arg0_1: int8[6, 32]
input arg1_1: float32[6, 1]
input arg2_1: int8[16, 32]
input arg3_1: float32[16]
input arg4_1: bfloat16[16]
convert_element_type: float32[6, 32] = prims.convert_element_type(arg0_1, float32)
mul: float32[6, 32] = aten.mul.Tensor(convert_element_type, arg1_1)
convert_element_type_1: float32[16, 32] = prims.convert_element_type(arg2_1, float32)
unsqueeze: float32[16, 1] = aten.unsqueeze(arg3_1, -1)
mul_1: float32[16, 32] = aten.mul.Tensor(convert_element_type_1, unsqueeze)
convert_element_type_2: float32[16] = prims.convert_element_type(arg4_1, float32)
permute: float32[32, 16] = aten.permute(mul_1, [1, 0])
addmm: float32[6, 16] = aten.addmm(convert_element_type_2, mul, permute)
convert_element_type_3: bfloat16[6, 16] = prims.convert_element_type(addmm, bfloat16)
return [convert_element_type_3]""")
        self.assertExpectedInline(graph_str(r.after), """\
input arg0_1: int8[6, 32]
input arg1_1: float32[6, 1]
input arg2_1: int8[16, 32]
input arg3_1: float32[16]
input arg4_1: bfloat16[16]
unsqueeze: float32[16, 1] = aten.unsqueeze(arg3_1, -1)
permute_default: int8[32, 16] = aten.permute(arg2_1, [1, 0])
view_default: float32[6] = aten.view(arg1_1, [-1])
view_default_1: float32[16] = aten.view(unsqueeze, [-1])
scaled_mm_default_1: bfloat16[6, 16] = quantfuse.scaled_mm(arg0_1, permute_default, view_default, view_default_1, bfloat16, arg4_1)
return [scaled_mm_default_1]""")
        self.assertEqual(r.report.counts()["scaled_mm"], 1)
        _close(self, r.output, r.expected, torch.float32)

    def test_int_mm_graph(self):
        def fn(a, w, sa, sb, bias):
            return (torch._int_mm(a, w.t()).float() * sa * sb + bias).to(torch.float16)

        r = apply_passes(fn, *_inputs(bias_dtype=torch.float16))
        self.assertExpectedInline(graph_str(r.before), """\
input arg0_1: int8[16, 32]
input arg1_1: int8[6, 32]
input arg2_1: float32[6, 1]
input arg3_1: float32[16]
input arg4_1: float16[16]
permute: int8[32, 16] = aten.permute(arg0_1, [1, 0])
_int_mm: int32[6, 16] = aten._int_mm(arg1_1, permute)
convert_element_type: float32[6, 16] = prims.convert_element_type(_int_mm, float32)
mul: float32[6, 16] = aten.mul.Tensor(convert_element_type, arg2_1)
mul_1: float32[6, 16] = aten.mul.Tensor(mul, arg3_1)
add: float32[6, 16] = aten.add.Tensor(mul_1, arg4_1)
convert_element_type_1: float16[6, 16] = prims.convert_element_type(add, float16)
return [convert_element_type_1]""")
        self.assertExpectedInline(graph_str(r.after), """\
input arg0_1: int8[16, 32]
input arg1_1: int8[6, 32]
input arg2_1: float32[6, 1]
input arg3_1: float32[16]
input arg4_1: float16[16]
permute_default: int8[32, 16] = aten.permute(arg0_1, [1, 0])
view_default: float32[6] = aten.view(arg2_1, [-1])
view_default_1: float32[16] = aten.view(arg3_1, [-1])
scaled_mm_default_2: float16[6, 16] = quantfuse.scaled_mm(arg1_1, permute_default, view_default, view_default_1, float16, arg4_1)
return [scaled_mm_default_2]""")
        _close(self, r.output, r.expected, torch.float32)

    def test_w8a8linear_keeps_dynamic_quantization(self):
        """Form 2e: amax/scale/round/clamp/cast stay in the graph, feeding the op."""
        lin = torch.nn.Linear(K, N)
        mod = W8A8Linear.from_linear(lin, out_dtype=torch.float32)
        x = torch.randn(2, 3, K, generator=torch.Generator().manual_seed(1))
        r = apply_passes(mod, x)
        before_quant = {t: count_calls(r.before, t) for t in (aten.amax.default, aten.round.default)}
        self.assertEqual(before_quant, {aten.amax.default: 1, aten.round.default: 1})
        for t, n in before_quant.items():
            self.assertEqual(count_calls(r.after, t), n)
        (op,) = [n for n in r.after.graph.nodes if n.target is SCALED_MM]
        a = op.args[0]
        self.assertIs(a.target, torch.ops.prims.convert_element_type.default)
        self.assertEqual(a.args[1], torch.int8)
        self.assertIs(a.args[0].target, aten.clamp_max.default)
        self.assertEqual(count_calls(r.after, *MATMULS), 0)
        self.assertEqual(r.report.unfused, [])
        _close(self, r.output, r.expected, torch.float32)


# --------------------------------------------------------------------------- variants

DEQUANT = (torch.float32, torch.bfloat16, torch.float16)
FORMS = ("linear", "matmul_t", "mm", "addmm")


def _dequant_fn(form, dq, bias_kind, out_dtype):
    """A user's dequantize-then-matmul in one of the spellings ``form``.

    bias_kind: None, or "epilogue" (added after the matmul, in the dequant dtype).
    out_dtype: final cast (None: keep the dequant dtype)."""

    def fn(a, w, sa, sb, bias):
        x = a.to(dq) * sa.to(dq)
        wd = w.to(dq) * (sb.unsqueeze(-1) if sb.dim() else sb).to(dq)
        if form == "linear":
            y = F.linear(x, wd, None if bias_kind is None else bias.to(dq))
        elif form == "matmul_t":
            y = torch.matmul(x, wd.t())
        elif form == "mm":
            y = torch.mm(x.reshape(-1, x.shape[-1]), wd.t()).reshape(*x.shape[:-1], -1)
        else:  # addmm
            b = bias.to(dq) if bias_kind is not None else torch.zeros(wd.shape[0], dtype=dq)
            y = torch.addmm(b, x.reshape(-1, x.shape[-1]), wd.t()).reshape(*x.shape[:-1], -1)
        if bias_kind is not None and form in ("matmul_t", "mm"):
            y = y + bias.to(dq)
        return y if out_dtype is None else y.to(out_dtype)

    return fn


CASES = [
    # (form, qdtype, dequant dtype, bias, out_dtype, 3-D, per_token, per_channel, dynamic)
    *[(f, torch.int8, torch.float32, b, torch.bfloat16, d3, True, True, False)
      for f, b, d3 in itertools.product(FORMS, (None, "epilogue"), (False, True))],
    *[(f, torch.int8, dq, "epilogue", None, True, pt, pc, False)
      for f, dq, pt, pc in itertools.product(("linear", "matmul_t"), (torch.bfloat16, torch.float16),
                                             (True, False), (True, False))],
    *[(f, torch.float8_e4m3fn, torch.float32, b, out, True, pt, pc, False)
      for f, b, out, pt, pc in [("linear", "epilogue", torch.float16, False, False),
                                ("matmul_t", None, torch.bfloat16, True, True),
                                ("mm", "epilogue", None, True, False),
                                ("addmm", "epilogue", torch.bfloat16, False, True)]],
    *[(f, q, torch.float32, "epilogue", torch.bfloat16, True, True, True, True)
      for f, q in itertools.product(FORMS, (torch.int8, torch.float8_e4m3fn))],
]


@pytest.mark.parametrize("form,qdtype,dq,bias_kind,out_dtype,three_d,per_token,per_channel,dynamic", CASES)
def test_dequant_matmul_variants(form, qdtype, dq, bias_kind, out_dtype, three_d, per_token, per_channel, dynamic):
    lead = (2, 3) if three_d else (M,)
    a, w, sa, sb, bias = _inputs(qdtype=qdtype, lead=lead, per_token=per_token, per_channel=per_channel,
                                 bias_dtype=out_dtype or torch.bfloat16)
    r = apply_passes(_dequant_fn(form, dq, bias_kind, out_dtype), a, w, sa, sb, bias, dynamic=dynamic)
    assert r.fused == 1, graph_str(r.after)
    assert r.count(*MATMULS) == 0, graph_str(r.after)
    assert r.report.counts() == {"scaled_mm": 1}
    assert r.report.unfused == []
    (op,) = [n for n in r.after.graph.nodes if n.target is SCALED_MM]
    # The epilogue was absorbed: the op's output is the function's output dtype, and a
    # bias (when there is one) is the op's own argument.
    final = out_dtype or dq
    if form == "addmm" and bias_kind is None and out_dtype is not None:
        # addmm's zeros "bias" is a float32 tensor of its own, not ``bias_dt.to(float32)``:
        # folding the cast would round it, so the cast stays outside the op.
        final = dq
    assert op.meta["val"].dtype == final
    has_bias = bias_kind is not None or form == "addmm"
    assert (len(op.args) > 5 and op.args[5] is not None) == has_bias, graph_str(r.after)
    _close(TestCase(), r.output, r.expected, dq)


INT_MM_SCALES = {
    "a_then_b": lambda acc, sa, sb: acc * sa * sb,
    "b_then_a": lambda acc, sa, sb: acc * sb * sa,
    "scale_first": lambda acc, sa, sb: sb * (sa * acc),
    "premultiplied": lambda acc, sa, sb: acc * (sa * sb),
}
# The int32 result promoted by the scale multiplications, without an explicit .float().
INT_MM_PROMOTED = {
    "promoted_a_then_b": lambda acc, sa, sb: acc * sa * sb,
    "promoted_premultiplied": lambda acc, sa, sb: (sb * sa) * acc,
}


# Every scale order x granularity statically; dynamic shapes with per-token x per-channel.
INT_MM_CASES = [
    *[(o, pt, pc, False) for o, pt, pc in itertools.product(sorted(INT_MM_SCALES), (True, False), (True, False))],
    *[(o, True, True, True) for o in sorted(INT_MM_SCALES)],
]


INT_MM_CASES += [(o, pt, pc, dyn) for o, (pt, pc, dyn) in itertools.product(
    sorted(INT_MM_PROMOTED), [(True, True, False), (False, True, False), (True, True, True)])]


@pytest.mark.parametrize("order,per_token,per_channel,dynamic", INT_MM_CASES)
def test_int_mm_variants(order, per_token, per_channel, dynamic):
    a, w, sa, sb, bias = _inputs(per_token=per_token, per_channel=per_channel, bias_dtype=torch.bfloat16)

    def fn(a, w, sa, sb, bias):
        acc = torch._int_mm(a, w.t())
        scaled = INT_MM_PROMOTED[order](acc, sa, sb) if order in INT_MM_PROMOTED else INT_MM_SCALES[order](
            acc.float(), sa, sb)
        return (scaled + bias).to(torch.bfloat16)

    r = apply_passes(fn, a, w, sa, sb, bias, dynamic=dynamic)
    assert r.fused == 1 and r.count(*MATMULS) == 0, graph_str(r.after)
    assert r.report.counts() == {"scaled_mm": 1}
    _close(TestCase(), r.output, r.expected, torch.float32)


@pytest.mark.parametrize("kw", [
    dict(),
    dict(per_channel=False, per_token=False, dynamic=False),
    dict(weight_dtype=torch.float8_e4m3fn, per_channel=False, per_token=False),
    dict(weight_dtype=torch.float8_e4m3fn, out_dtype=torch.float16),
], ids=["int8-dynamic", "int8-static", "fp8-per-tensor", "fp8-rowwise-fp16"])
@pytest.mark.parametrize("dynamic", [False, True])
def test_w8a8linear_variants(kw, dynamic):
    gen = torch.Generator().manual_seed(2)
    lin = torch.nn.Linear(K, N)
    mod = W8A8Linear.from_linear(lin, calibration=torch.randn(8, K, generator=gen), **kw)
    r = apply_passes(mod, torch.randn(2, 5, K, generator=gen), dynamic=dynamic)
    assert r.fused == 1 and r.count(*MATMULS) == 0, graph_str(r.after)
    assert r.report.counts() == {"scaled_mm": 1}
    # Same math as the module (float32 dequant, one rounding): equal up to float32 accumulation order.
    _close(TestCase(), r.output, r.expected, torch.float32)


# --------------------------------------------------------------------------- near-misses


def _per_group_act(a, w, sa, sb, bias):
    # A per-group activation scale [M, K/8] expanded over K: not per-token.
    sg = sa.expand(M, K // 8).repeat_interleave(8, dim=1) * torch.linspace(0.5, 1.5, K)
    return F.linear(a.float() * sg, w.float() * sb.unsqueeze(-1))


def _act_scale_mk(a, w, sa, sb, bias):
    return F.linear(a.float() * (sa * torch.linspace(0.5, 1.5, K)), w.float() * sb.unsqueeze(-1))


def _weight_scale_nk(a, w, sa, sb, bias):
    return F.linear(a.float() * sa, w.float() * (sb.unsqueeze(-1) * torch.linspace(0.5, 1.5, K)))


def _weight_scale_along_k(a, w, sa, sb, bias):
    # sb of shape [K] broadcasts along the input dimension: not a per-output-channel scale.
    return F.linear(a.float() * sa, w.float() * torch.linspace(0.5, 1.5, K))


def _weight_times_int_tensor(a, w, sa, sb, bias):
    # int8 weights multiplied by another int8 tensor's values: not a scale.
    return F.linear(a.float() * sa, w.float() * w.float())


def _int_mm_scale_mn(a, w, sa, sb, bias):
    return torch._int_mm(a, w.t()).float() * (sa * sb).exp2() * sb


def _int_mm_two_row_scales(a, w, sa, sb, bias):
    return torch._int_mm(a, w.t()).float() * sa * (sa + 1)


def _float_weights(a, w, sa, sb, bias):
    # Not quantized at all: must stay a plain matmul and not be reported.
    return F.linear(a.float() * sa, w.float().sin() * sb.unsqueeze(-1))


def _int_mm_promoted_to_bf16(a, w, sa, sb, bias):
    # int32 * bfloat16 scale promotes to bfloat16: the products are rounded to 8 bits.
    return torch._int_mm(a, w.t()) * sa.to(torch.bfloat16) * sb.to(torch.bfloat16)


def _weight_stored_transposed(a, w, sa, sb, bias):
    # A [K, N] row-major weight (not matched by design: see passes/scaled_mm.py).
    w_kn = w.t().contiguous()
    return (a.float() * sa) @ (w_kn.float() * sb)


NEAR_MISSES = {
    "per_group_activation_scale": (_per_group_act, "activation scale of shape [6, 32]"),
    "activation_scale_MK": (_act_scale_mk, "activation scale of shape [6, 32]"),
    "weight_scale_NK": (_weight_scale_nk, "weight scale of shape [16, 32]"),
    "weight_scale_along_K": (_weight_scale_along_k, "weight scale of shape [32]"),
    "weight_times_non_scale": (_weight_times_int_tensor, "weight scale of shape [16, 32]"),
    "int_mm_scale_MN": (_int_mm_scale_mn, "scale of shape [6, 16]"),
    "int_mm_two_row_scales": (_int_mm_two_row_scales, "expected one per-row and one per-column"),
    "weight_stored_transposed": (_weight_stored_transposed, "no quantfuse pattern matches"),
    "int_mm_promoted_to_bf16": (_int_mm_promoted_to_bf16, "promoted by its scales to torch.bfloat16"),
}


@pytest.mark.parametrize("name", sorted(NEAR_MISSES))
def test_near_misses_are_left_alone(name):
    fn, reason = NEAR_MISSES[name]
    a, w, sa, sb, bias = _inputs()
    r = apply_passes(fn, a, w, sa, sb, bias)
    assert r.fused == 0, graph_str(r.after)
    assert r.count(*MATMULS) == 1
    torch.testing.assert_close(r.output, r.expected, rtol=0, atol=0)
    assert r.report.fused == []
    (unfused,) = r.report.unfused
    assert reason in unfused.reason, unfused.reason


def test_float_matmul_is_not_a_candidate():
    r = apply_passes(_float_weights, *_inputs())
    # Activation side is int8-derived, so it is reported, but with a structural reason.
    assert r.fused == 0
    (unfused,) = r.report.unfused
    assert "no quantfuse pattern matches" in unfused.reason

    def plain(x, w):
        return F.linear(torch.relu(x), w)

    r = apply_passes(plain, torch.randn(4, 8), torch.randn(3, 8))
    assert r.fused == 0 and r.report.unfused == []


def test_bf16_bias_into_float32_output_is_not_rounded():
    """A float32 op output with a float32 bias that is not ``bias_dt.to(float32)`` keeps
    its cast outside the op (folding it would round the bias)."""
    a, w, sa, sb, _ = _inputs()
    bias = torch.randn(N, dtype=torch.float32) * 1e-3 + 1.0

    def fn(a, w, sa, sb, bias):
        return F.linear(a.float() * sa, w.float() * sb.unsqueeze(-1), bias).to(torch.bfloat16)

    r = apply_passes(fn, a, w, sa, sb, bias)
    (op,) = [n for n in r.after.graph.nodes if n.target is SCALED_MM]
    assert op.args[4] == torch.float32 and op.args[5] is not None
    assert count_calls(r.after, torch.ops.prims.convert_element_type.default) >= 1
    torch.testing.assert_close(r.output, r.expected, rtol=0, atol=0)


@pytest.mark.parametrize("form", ["matmul_t", "linear"])
@pytest.mark.parametrize("dynamic", [False, True])
def test_post_grad_slot_matches_reshape_graphs(form, dynamic):
    """Second chance in the post-grad pre slot: after view_to_reshape the graph holds
    aten.reshape, not aten.view (docs/DESIGN.md's pitfall); the patterns accept both."""
    a, w, sa, sb, bias = _inputs(lead=(2, 3), bias_dtype=torch.bfloat16)
    fn = _dequant_fn(form, torch.float32, "epilogue", torch.bfloat16)
    r = apply_passes(fn, a, w, sa, sb, bias, dynamic=dynamic, stage="post_grad", skip_joint=True)
    assert count_calls(r.before, aten.view.default) >= 1  # as traced; the post-grad graph has reshapes
    assert r.fused == 1 and r.count(*MATMULS) == 0, graph_str(r.after)
    # The output reshape [M, N] -> [2, 3, N] sat between the matmul and its bias/cast:
    # the epilogue rules sank an aten.reshape, as they sink an aten.view in the joint graph.
    assert r.count(aten.reshape.default) == 1, graph_str(r.after)
    assert r.report.counts() == {"scaled_mm": 1} and r.report.unfused == []
    _close(TestCase(), r.output, r.expected, torch.float32)


def test_python_number_scales():
    """A scale given as a Python number (``* 0.02``) is per-tensor; the op gets it as a tensor."""
    a, w, sa, sb, bias = _inputs()

    def fn(a, w, sa, sb, bias):
        return (torch._int_mm(a, w.t()).float() * 0.02 * sb).to(torch.bfloat16)

    def fn2(a, w, sa, sb, bias):
        return F.linear(a.float() * 0.015, w.float() * sb.unsqueeze(-1)).to(torch.float16)

    for f in (fn, fn2):
        r = apply_passes(f, a, w, sa, sb, bias)
        assert r.fused == 1 and r.count(*MATMULS) == 0, graph_str(r.after)
        _close(TestCase(), r.output, r.expected, torch.float32)


# --------------------------------------------------------------------------- output dtype = the source graph's


def _promoting_dequant(dq, per_token, per_channel, bias_kind):
    """Dequantization written in ``dq`` (fp16/bf16) with float32 scale tensors of per-token
    ``[M, 1]`` / per-channel ``[N, 1]`` shape: type promotion makes the products, the matmul
    and the result float32 in eager, although every cast in the graph says ``dq``."""

    def fn(a, w, sa, sb, bias):
        x = a.to(dq) * (sa if per_token else sa.reshape(()))
        wd = w.to(dq) * (sb[:, None] if per_channel else sb.reshape(()))
        b = None if bias_kind is None else bias.float() if bias_kind == "float32" else bias
        return F.linear(x, wd, b)

    return fn


PROMOTION_CASES = [
    # (dequant dtype, per-token f32 scale, per-channel f32 scale, bias)
    (torch.float16, True, True, None),
    (torch.bfloat16, True, True, None),
    (torch.float16, True, True, "float32"),
    (torch.bfloat16, True, True, "float32"),
]


@pytest.mark.parametrize("dq,per_token,per_channel,bias_kind", PROMOTION_CASES, ids=str)
@pytest.mark.parametrize("three_d", [False, True])
def test_output_dtype_follows_type_promotion(dq, per_token, per_channel, bias_kind, three_d):
    """``a.to(fp16) * scale_f32`` is float32 in eager: the fused op must return float32 (a float16
    output overflows to inf where eager is finite, and rounds everywhere else)."""
    lead = (2, 3) if three_d else (M,)
    a, w, sa, sb, bias = _inputs(lead=lead, bias_dtype=torch.float32)
    # Scales large enough that the float32 result exceeds float16's range (65504).
    sa, sb = sa * 200.0, sb * 200.0
    r = apply_passes(_promoting_dequant(dq, per_token, per_channel, bias_kind), a, w, sa, sb, bias)
    assert r.expected.dtype == torch.float32
    assert r.expected.abs().max() > torch.finfo(torch.float16).max and r.expected.isfinite().all()
    assert r.fused == 1 and r.count(*MATMULS) == 0, graph_str(r.after)
    (op,) = [n for n in r.after.graph.nodes if n.target is SCALED_MM]
    assert op.args[4] == torch.float32 and op.meta["val"].dtype == torch.float32
    assert r.output.dtype == torch.float32 and r.output.isfinite().all()
    # The products are exact in float32 here (integers times float32 scales): float32 dequant tolerance.
    _close(TestCase(), r.output, r.expected, torch.float32)


@pytest.mark.parametrize("dq", [torch.float16, torch.bfloat16], ids=str)
def test_output_dtype_without_promotion_stays(dq):
    """One-element (0-dim) float32 scales do not promote a ``dq`` tensor: the result stays ``dq``."""
    a, w, sa, sb, bias = _inputs(per_token=False, per_channel=False)
    r = apply_passes(_promoting_dequant(dq, False, False, None), a, w, sa, sb, bias)
    assert r.expected.dtype == dq
    (op,) = [n for n in r.after.graph.nodes if n.target is SCALED_MM]
    assert op.args[4] == dq and r.output.dtype == dq
    _close(TestCase(), r.output, r.expected, dq)


@pytest.mark.compile
@pytest.mark.parametrize("dq", [torch.float16, torch.bfloat16], ids=str)
def test_compiled_output_dtype_follows_type_promotion(dq):
    """Through ``torch.compile(backend="quantfuse")``: same dtype as eager, finite where eager is."""
    from compile_backend.passes import collecting_report

    a, w, sa, sb, bias = _inputs(lead=(2, 3))
    sa, sb = sa * 200.0, sb * 200.0
    fn = _promoting_dequant(dq, True, True, None)
    torch._dynamo.reset()
    compiled = torch.compile(fn, backend="quantfuse", options={"fx_graph_cache": False})
    with torch.no_grad(), collecting_report() as report:
        out = compiled(a, w, sa, sb, bias)
        expected = fn(a, w, sa, sb, bias)
    torch._dynamo.reset()
    assert report.counts() == {"scaled_mm": 1}
    assert out.dtype == expected.dtype == torch.float32
    assert torch.equal(out.isfinite(), expected.isfinite())
    _close(TestCase(), out, expected, torch.float32)


# --------------------------------------------------------------------------- weight spellings decided by probes
#
# The weight operand is accepted when evaluating it on probes shows that it computes
# W[k, n] = w[n, k] * s[n] (or * s), the product rounded once to the weight's dtype
# (passes/scaled_weight.py): how that is written does not matter.

BF16 = torch.bfloat16
WEIGHT_SPELLINGS = {
    # transposed first, then the scale along the last dimension
    "transpose_then_scale": lambda w, sb: w.to(torch.float32).t() * sb,
    # the int8 weight transposed before its cast, the scale as a [1, N] row
    "int8_transposed_then_cast": lambda w, sb: w.t().to(torch.float32) * sb.view(1, -1),
    # the scale expanded to the weight's shape, multiplied from the left, transposed by a function
    "expanded_scale": lambda w, sb: torch.transpose(sb.unsqueeze(1).expand(N, K) * w.float(), 0, 1),
    # a reshape round trip of the dequantized weight, the scale reshaped to [N, 1]
    "reshape_round_trip": lambda w, sb: (w.float().reshape(-1).reshape(N, K) * sb.reshape(N, 1)).permute(1, 0),
    # the int8 -> float conversion left to type promotion by the float32 scale
    "type_promotion": lambda w, sb: (w * sb[:, None]).t(),
    # a Python number as the per-tensor scale, after the transpose
    "number_scale": lambda w, sb: w.float().t() * 0.0123,
}


def _spelled_linear(weight, out_dtype=None):
    """``(a.to(dt) * sa) @ weight(w, sb)``, dt the weight's dtype (bfloat16 when it rounds to it)."""

    def fn(a, w, sa, sb, bias):
        wd = weight(w, sb)
        x = a.to(wd.dtype) * sa.to(wd.dtype)
        y = x @ wd
        return y if out_dtype is None else y.to(out_dtype)

    return fn


# The product in float32 rounded to bfloat16 once, as the weight: the source's own rounding.
WEIGHT_SPELLINGS_ROUNDED = {
    "cast_after_product": lambda w, sb: (w.float() * sb[:, None]).to(BF16).t(),
}


@pytest.mark.parametrize("name", sorted(WEIGHT_SPELLINGS))
def test_weight_spellings_fuse(name):
    """Spellings of ``w.to(f32) * s[:, None]`` then ``.t()`` with the same meaning fuse, on the joint
    graph (static and dynamic shapes) and the post-grad one."""
    a, w, sa, sb, bias = _inputs(lead=(2, 3))
    fn = _spelled_linear(WEIGHT_SPELLINGS[name], torch.bfloat16)
    for kw in (dict(), dict(dynamic=True), dict(stage="post_grad", skip_joint=True)):
        r = apply_passes(fn, a, w, sa, sb, bias, **kw)
        assert r.fused == 1 and r.count(*MATMULS) == 0, (kw, graph_str(r.after))
        assert r.report.counts() == {"scaled_mm": 1} and r.report.unfused == [], (kw, str(r.report))
        (op,) = [n for n in r.after.graph.nodes if n.target is SCALED_MM]
        # The op reads the stored [N, K] weight through a transposed view, not a copy.
        b = op.args[1]
        assert b.target is aten.permute.default and b.args[0].op == "placeholder", graph_str(r.after)
        _close(TestCase(), r.output, r.expected, torch.float32)


# torch promotes no float8 tensor to float32 by itself: type promotion is an int8 spelling only.
COMPILED_SPELLINGS = [(name, q) for name in sorted(WEIGHT_SPELLINGS) + sorted(WEIGHT_SPELLINGS_ROUNDED)
                      for q in (torch.int8, torch.float8_e4m3fn)
                      if not (name == "type_promotion" and q == torch.float8_e4m3fn)]


@pytest.mark.compile
@pytest.mark.parametrize("name,qdtype", COMPILED_SPELLINGS, ids=str)
def test_compiled_weight_spellings(name, qdtype):
    """Through ``torch.compile(backend="quantfuse")``: fused, and equal to eager within the tolerance of
    the dequantization dtype."""
    weight = {**WEIGHT_SPELLINGS, **WEIGHT_SPELLINGS_ROUNDED}[name]
    a, w, sa, sb, bias = _inputs(qdtype=qdtype, lead=(2, 3))
    report, out, expected = compile_and_run(_spelled_linear(weight, torch.float16), a, w, sa, sb, bias)
    assert report.counts() == {"scaled_mm": 1} and report.unfused == [], str(report)
    _close(TestCase(), out, expected, BF16 if name in WEIGHT_SPELLINGS_ROUNDED else torch.float32)


# Near-misses of the weight side, with K == N so that every operand has the shape of a right one.
def _square_inputs(**kw):
    a, w, sa, sb, bias = _inputs(**kw)
    gen = torch.Generator().manual_seed(5)
    w = torch.randint(-128, 128, (K, K), dtype=torch.int8, generator=gen)
    sb = torch.rand(K, generator=gen) * 0.01 + 1e-3
    return a, w, sa, sb, bias


def _act(a, sa):
    return a.float() * sa


WEIGHT_NEAR_MISSES = {
    # no transpose: W[k, n] = w[k, n] * s[k]
    "missing_transpose": (lambda a, w, sa, sb, b: _act(a, sa) @ (w.float() * sb[:, None]),
                          "the weight is not transposed"),
    # the scale multiplies the weight's columns, then the transpose: W[k, n] = w[n, k] * s[k]
    "scale_along_K": (lambda a, w, sa, sb, b: _act(a, sa) @ (w.float() * sb[None, :]).t(),
                      "the scale runs along K"),
    "offset": (lambda a, w, sa, sb, b: F.linear(_act(a, sa), (w.float() + 1) * sb[:, None]), "an offset"),
    "division": (lambda a, w, sa, sb, b: F.linear(_act(a, sa), w.float() / sb[:, None]),
                 "divided by its scale"),
    # dividing by a reciprocal is not multiplying by the scale: the op would need the reciprocal's
    # reciprocal, which rounds
    "reciprocal_division": (lambda a, w, sa, sb, b: F.linear(_act(a, sa), w.float() / (1 / sb)[:, None]),
                            "divided by its scale"),
    # a rounding to float16 inside a float32 weight
    "float16_rounding": (lambda a, w, sa, sb, b: F.linear(_act(a, sa), (w.float() * sb[:, None]).half().float()),
                         "rounded once"),
    # a clamp is not an op a dequantization is made of: the weight is no dequantization the probe evaluates
    "clamp": (lambda a, w, sa, sb, b: F.linear(_act(a, sa), w.float().clamp(-100, 100) * sb[:, None]),
              "no quantfuse pattern matches"),
}


@pytest.mark.parametrize("name", sorted(WEIGHT_NEAR_MISSES))
def test_weight_near_misses_are_left_alone(name):
    fn, reason = WEIGHT_NEAR_MISSES[name]
    r = apply_passes(fn, *_square_inputs())
    assert r.fused == 0 and r.count(*MATMULS) == 1, graph_str(r.after)
    torch.testing.assert_close(r.output, r.expected, rtol=0, atol=0)
    (unfused,) = r.report.unfused
    assert reason in unfused.reason, unfused.reason
