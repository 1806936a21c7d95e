"""The W8A16 pattern family (passes/w8a16_gemm.py) and the op's contract on CPU.

The pass tests run the passes on the graph Inductor's custom slots receive (Dynamo + AOTAutograd
with Inductor's decompositions, no code generation; ``pass_helpers.apply_passes``) and run the
rewritten graph eagerly; the torchao tests quantize with torchao's own ``Int8WeightOnlyConfig``
and go through ``torch.compile(backend="quantfuse")`` and ``explain``.

Numerics: the op accumulates in float32 and rounds once; the sources round in between (the
matmul's result, or each dequantized weight element, to the activation dtype), so a fused result
is compared with a float64 reference within one rounding of the output plus float32 accumulation,
and with the source within the source's own roundings.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from pass_helpers import apply_passes, count_calls

import compile_backend
from compile_backend.ops import QuantfuseInputError

aten = torch.ops.aten
W8A16 = torch.ops.quantfuse.w8a16_gemm.default
K, N = 64, 48
DTYPES = (torch.bfloat16, torch.float16, torch.float32)
DT_IDS = ("bf16", "f16", "f32")
# Half an ulp (relative) of each dtype: one rounding.
ROUND = {torch.float16: 2.0**-11, torch.bfloat16: 2.0**-8, torch.float32: 2.0**-24}


def data(dtype, *, lead=(5,), seed=0, scale_dtype=torch.float32):
    gen = torch.Generator().manual_seed(seed)
    x = (torch.randn(*lead, K, generator=gen) * 2).to(dtype)
    w = torch.randint(-128, 128, (N, K), generator=gen, dtype=torch.int8)
    s = (torch.rand(N, generator=gen) * 1e-2 + 1e-3).to(scale_dtype)
    b = torch.randn(N, generator=gen).to(dtype)
    return x, w, s, b


def reference64(x, w, s, b=None):
    out = x.double() @ w.double().t() * s.double().reshape(-1)
    mag = x.double().abs() @ w.double().abs().t() * s.double().abs().reshape(-1)
    return (out if b is None else out + b.double()), mag


def assert_close_to_reference(out, x, w, s, b, *, source_roundings=0):
    """``out`` within one rounding of its dtype (plus ``source_roundings`` more, for a source that
    rounds in between) of the float64 result, and float32 accumulation."""
    ref, mag = reference64(x, w, s, b)
    err = (out.double() - ref).abs()
    eps = ROUND[out.dtype]
    bound = (1 + source_roundings) * eps * (ref.abs() + mag) + 1e-5 * mag + 1e-6
    assert out.dtype == x.dtype
    assert (err <= bound).all(), f"max err {err.max().item():.3g}, max bound {bound.max().item():.3g}"


# --------------------------------------------------------------------------- the op


def test_op_contract_and_errors():
    x, w, s, b = data(torch.bfloat16)
    out = torch.ops.quantfuse.w8a16_gemm(x, w, s, b)
    assert_close_to_reference(out, x, w, s, b)
    assert torch.ops.quantfuse.w8a16_gemm(x, w, s[:1]).shape == (5, N)  # per-tensor scale
    assert torch.ops.quantfuse.w8a16_gemm(x, w, s.to(x.dtype)).dtype == x.dtype
    assert torch.ops.quantfuse.w8a16_gemm(x[:0], w, s).shape == (0, N)
    bad = {
        "'x'": (x.to(torch.int8), w, s, b),
        "'w_q'": (x, w.float(), s, b),
        "K = 64 columns": (x, w[:, :32], s, b),
        "'w_scale'": (x, w, s.half(), b),
        "N = 48 \\(per-channel\\)": (x, w, s[:5], b),
        "'bias'": (x, w, s, b.float()),
    }
    for msg, args in bad.items():
        with pytest.raises(QuantfuseInputError, match=msg):
            torch.ops.quantfuse.w8a16_gemm(*args)


def test_op_autograd_formula():
    x, w, s, b = data(torch.float32)
    x.requires_grad_()
    s.requires_grad_()
    b.requires_grad_()
    out = torch.ops.quantfuse.w8a16_gemm(x, w, s, b)
    g = torch.randn_like(out)
    got = torch.autograd.grad(out, (x, s, b), g)
    x64, s64, b64 = (t.detach().double().requires_grad_() for t in (x, s, b))
    want = torch.autograd.grad(F.linear(x64, w.double() * s64[:, None], b64), (x64, s64, b64), g.double())
    for a, e in zip(got, want):
        torch.testing.assert_close(a.double(), e, rtol=1e-4, atol=1e-4)


# --------------------------------------------------------------------------- forms that fuse


def torchao_form(x, w, s, b):
    """What torchao's Int8WeightOnlyConfig linear runs (Int8Tensor, per-row): scale after the matmul."""
    m = torch.mm(x.reshape(-1, x.shape[-1]), w.t().to(x.dtype))
    y = m * s.reshape(-1, 1).to(m.dtype).flatten()
    y = y.reshape(*x.shape[:-1], w.shape[0])
    return (y + b).to(x.dtype)


FORMS = {
    "torchao": (torchao_form, 1),
    "linear": (lambda x, w, s, b: F.linear(x, w.to(x.dtype) * s.to(x.dtype)[:, None], b), 1),
    "matmul-t": (lambda x, w, s, b: x @ (s.to(x.dtype).view(-1, 1) * w.to(x.dtype)).t() + b, 1),
    "linear-then-scale": (lambda x, w, s, b: F.linear(x, w.to(x.dtype)) * s.to(x.dtype) + b, 1),
    "no-bias": (lambda x, w, s, b: F.linear(x, w.to(x.dtype) * s.to(x.dtype)[:, None]), 1),
}


@pytest.mark.parametrize("lead", ((5,), (2, 3)), ids=("2d", "3d"))
@pytest.mark.parametrize("form", FORMS)
def test_forms_fuse(form, lead):
    """Each form in 2-D and 3-D, the activation dtypes taken in turn (every form sees two)."""
    fn, roundings = FORMS[form]
    dtype = DTYPES[(list(FORMS).index(form) + len(lead)) % len(DTYPES)]
    x, w, s, b = data(dtype, lead=lead, seed=len(form))
    r = apply_passes(fn, x, w, s, b)
    assert r.count(W8A16) == 1 and r.count(aten.mm.default, aten.addmm.default) == 0, r.report
    assert r.report.counts()["w8a16_gemm"] == 1 and not r.report.unfused, str(r.report)
    assert r.output.dtype == r.expected.dtype and r.output.shape == r.expected.shape
    s_used = s.to(dtype)
    assert_close_to_reference(r.output.reshape(-1, N), x.reshape(-1, K), w, s_used, None if form == "no-bias" else b)
    # And the source within its own roundings of the fused result.
    ref, mag = reference64(x.reshape(-1, K), w, s_used)
    diff = (r.output.double() - r.expected.double()).reshape(-1, N).abs()
    assert (diff <= (2 + roundings) * ROUND[dtype] * (ref.abs() + mag) + 1e-4 * mag + 1e-5).all()


def test_per_tensor_scale_and_scale_in_activation_dtype():
    x, w, s, b = data(torch.bfloat16)
    r = apply_passes(lambda x, w, s, b: torchao_form(x, w, s[:1], b), x, w, s, b)
    assert r.count(W8A16) == 1, r.report
    assert "per-tensor" in r.report.fused[0].detail
    x16, w16, s16, b16 = data(torch.float16, scale_dtype=torch.float16)
    r = apply_passes(lambda x, w, s, b: F.linear(x, w.to(x.dtype) * s[:, None], b), x16, w16, s16, b16)
    assert r.count(W8A16) == 1, r.report


def test_dynamic_batch_and_post_grad_slot():
    x, w, s, b = data(torch.bfloat16, lead=(4, 7))
    r = apply_passes(torchao_form, x, w, s, b, dynamic=True)
    assert r.count(W8A16) == 1, r.report
    x2 = data(torch.bfloat16, lead=(3, 5), seed=9)[0]
    assert torch.equal(r.compiled(x2, w, s, b), r.compiled(x2, w, s, b))
    r = apply_passes(FORMS["linear"][0], x, w, s, b, stage="post_grad", skip_joint=True)
    assert r.count(W8A16) == 1, r.report


def test_grad_mode_fuses_the_forward_and_keeps_eager_gradients():
    x, w, s, b = data(torch.float32, lead=(2, 3))
    x.requires_grad_()
    r = apply_passes(FORMS["linear"][0], x, w, s, b, grad=True)
    assert count_calls(r.forward, W8A16) == 1, r.report
    g = torch.randn_like(r.expected)
    (gx,) = torch.autograd.grad(r.output, x, g)
    (ex,) = torch.autograd.grad(r.expected, x, g)
    torch.testing.assert_close(gx, ex, rtol=1e-5, atol=1e-5)


def test_weight_int8pack_mm_is_replaced():
    """``aten._weight_int8pack_mm`` (gpt-fast, older torchao layouts) computes the op's math."""
    x, w, s, b = data(torch.bfloat16, scale_dtype=torch.bfloat16)
    r = apply_passes(lambda x, w, s, b: torch.ops.aten._weight_int8pack_mm(x, w, s) + b, x, w, s, b)
    assert r.count(W8A16) == 1 and r.count(aten._weight_int8pack_mm.default) == 0, r.report
    assert r.report.fused[0].form == "weight_int8pack_mm"
    assert_close_to_reference(r.output, x, w, s, b)


def test_tinygemm_int4_is_reported_with_its_reason():
    """torchao's Int4WeightOnlyConfig (tinygemm layout) calls an opaque packed-int4 matmul: it stays,
    and explain() says why."""
    x = torch.randn(3, K, dtype=torch.bfloat16)
    packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(torch.randint(0, 16, (N, K), dtype=torch.int32), 2)
    scale_zeros = torch.rand(K // 32, N, 2, dtype=torch.bfloat16)
    r = apply_passes(lambda x, p, sz: torch.ops.aten._weight_int4pack_mm_for_cpu(x, p, 32, sz), x, packed, scale_zeros)
    assert r.fused == 0
    assert [u.target for u in r.report.unfused] == ["_weight_int4pack_mm_for_cpu.default"], str(r.report)
    assert "tinygemm int4" in r.report.unfused[0].reason and "float zero" in r.report.unfused[0].reason


# --------------------------------------------------------------------------- weight spellings decided by probes

# Spellings of the weight side with the same meaning (passes/scaled_weight.py decides): 4b's
# ``(w.to(dt) * s[:, None]).t()`` and 4a's ``w.t().to(dt)`` written otherwise.
WEIGHT_SPELLINGS = {
    "transpose-then-scale": lambda x, w, s, b: x @ (w.to(x.dtype).t() * s.to(x.dtype)) + b,
    "expanded-scale": lambda x, w, s, b: F.linear(x, s.to(x.dtype).unsqueeze(1).expand(N, K) * w.to(x.dtype), b),
    # the product in float32 (type promotion of an int32 weight) rounded once to the activation dtype
    "cast-after-product": lambda x, w, s, b: F.linear(x, (w.to(torch.int32) * s[:, None]).to(x.dtype), b),
    # 4a with the int8 weight widened exactly on its way to the activation dtype
    "scale-after-widened-weight": lambda x, w, s, b: x @ w.t().to(torch.int16).to(x.dtype) * s.to(x.dtype) + b,
}


@pytest.mark.parametrize("form", WEIGHT_SPELLINGS)
@pytest.mark.parametrize("dtype", (torch.bfloat16, torch.float32), ids=("bf16", "f32"))
def test_weight_spellings_fuse(form, dtype):
    x, w, s, b = data(dtype)
    fn = WEIGHT_SPELLINGS[form]
    r = apply_passes(fn, x, w, s, b)
    assert r.count(W8A16) == 1 and r.count(aten.mm.default, aten.addmm.default) == 0, str(r.report)
    assert r.report.counts()["w8a16_gemm"] == 1 and not r.report.unfused, str(r.report)
    # The op reads the stored int8 weight itself.
    (op,) = [n for n in r.after.graph.nodes if n.target is W8A16]
    assert op.args[1].op == "placeholder"
    assert_close_to_reference(r.output, x, w, s.to(dtype), b, source_roundings=1)


@pytest.mark.compile
@pytest.mark.parametrize("form", WEIGHT_SPELLINGS)
def test_compiled_weight_spellings(form):
    from compile_backend.passes import collecting_report

    x, w, s, b = data(torch.bfloat16, lead=(2, 3))
    fn = WEIGHT_SPELLINGS[form]
    torch._dynamo.reset()
    compiled = torch.compile(fn, backend="quantfuse", options={"fx_graph_cache": False})
    with torch.no_grad(), collecting_report() as report:
        out = compiled(x, w, s, b)
        expected = fn(x, w, s, b)
    torch._dynamo.reset()
    assert report.counts() == {"w8a16_gemm": 1} and not report.unfused, str(report)
    assert out.dtype == expected.dtype and out.shape == expected.shape
    # Within one rounding of the result and the source's rounding of the weight (or product).
    assert_close_to_reference(out.reshape(-1, N), x.reshape(-1, K), w, s.to(x.dtype), b, source_roundings=1)


def test_weight_near_misses_carry_the_probe_reason():
    x, _, s, b = data(torch.float32)
    w = torch.randint(-128, 128, (K, K), dtype=torch.int8)
    s = torch.rand(K) * 1e-2 + 1e-3
    # K == N: a missing transpose has the right shapes.
    _unfused(lambda x, w, s: x @ (w.to(x.dtype) * s[:, None]), x, w, s, reason="the weight is not transposed")
    _unfused(lambda x, w, s: F.linear(x, w.to(x.dtype) / s[:, None]), x, w, s, reason="divided by its scale")
    _unfused(lambda x, w, s: F.linear(x, (w.to(x.dtype) - 1) * s[:, None]), x, w, s, reason="an offset")
    # A number scaling the weight before the scale after the matmul: 4a's weight has no scale of its own,
    # and 4b takes a scale tensor.
    _unfused(lambda x, w, s: torch.mm(x, (w.to(x.dtype) * 0.5).t()) * s, x, w, s,
             reason="the scale is 0.5; expected a tensor")


# --------------------------------------------------------------------------- near-misses stay unfused


def _unfused(fn, *args, reason=None):
    r = apply_passes(fn, *args)
    assert r.count(W8A16) == 0, r.report
    if reason is not None:
        assert any(reason in u.reason for u in r.report.unfused), str(r.report)
    torch.testing.assert_close(r.output, r.expected)
    return r


def test_near_misses():
    x, w, s, b = data(torch.float32)
    # A weight stored already transposed ([K, N]): the op reads an [N, K] weight.
    _unfused(lambda x, w, s, b: torch.mm(x, w.t().contiguous().to(x.dtype)) * s, x, w, s, b)
    # A per-input-channel scale on the weight ([1, K]) is not per output channel.
    sk = torch.rand(1, K) + 0.5
    _unfused(lambda x, w, s, b: F.linear(x, w.to(x.dtype) * s, b), x, w, sk, b, reason="neither per-tensor")
    # A scale of another shape after the matmul (per row of the output).
    sm = torch.rand(5, 1) + 0.5
    _unfused(lambda x, w, s: torch.mm(x, w.t().to(x.dtype)) * s, x, w, sm, reason="neither per-tensor")
    # uint8 weight (no such op), and a weight that is not quantized at all.
    _unfused(lambda x, w, s: F.linear(x, w.to(x.dtype) * s[:, None]), x, w.to(torch.uint8), s)
    _unfused(lambda x, w, s: F.linear(x, w * s[:, None]), x, w.float(), s)
    # The dequantized weight also returned: fusing would keep it alive next to the op.
    _unfused(lambda x, w, s: (lambda d: (F.linear(x, d), d))(w.to(x.dtype) * s[:, None]), x, w, s,
             reason="also used")


def test_w8a8_activation_is_left_to_scaled_mm():
    """A dequantized int8 activation with a scale scaled_mm does not take (per-group) is a W8A8
    near-miss: it stays unfused with scaled_mm's reason, not fused as a weight-only product."""
    x, w, s, b = data(torch.float32)
    a = torch.randint(-128, 128, (5, K), dtype=torch.int8)
    sa = torch.rand(5, K // 16).repeat_interleave(16, dim=1)  # per-group activation scale

    def w8a8(a, sa, w, s):
        return F.linear(a.to(torch.float32) * sa, w.to(torch.float32) * s[:, None])

    r = _unfused(w8a8, a, sa, w, s)
    assert any("W8A8" in u.reason or "scaled_mm" in u.reason for u in r.report.unfused), str(r.report)


# --------------------------------------------------------------------------- torchao end to end


def _torchao_model(dtype, granularity=None):
    quant = pytest.importorskip("torchao.quantization")
    from torchao.quantization.granularity import PerRow

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(K, 96), torch.nn.GELU(), torch.nn.Linear(96, N, bias=False)).to(dtype)
    # set_inductor_config=False: torchao would otherwise change Inductor's global config.
    config = quant.Int8WeightOnlyConfig(granularity=granularity or PerRow(), set_inductor_config=False)
    quant.quantize_(model, config)
    return model


@pytest.mark.compile
@pytest.mark.parametrize("dtype", (torch.bfloat16, torch.float32), ids=("bf16", "f32"))
def test_torchao_int8_weight_only_compiles_fused(dtype):
    model = _torchao_model(dtype)
    x = torch.randn(2, 3, K, dtype=dtype)
    with torch.no_grad():
        report = compile_backend.explain(model, x)
        assert report.counts()["w8a16_gemm"] == 2 and not report.unfused, str(report)
        eager = model(x)
        torch._dynamo.reset()
        compiled = torch.compile(model, backend="quantfuse")(x)
    # Within the source's own roundings (bfloat16: the matmul result and the scale product).
    tol = 4 * ROUND[dtype] * eager.float().abs().max().item() + 1e-5
    assert (compiled.float() - eager.float()).abs().max().item() <= tol


@pytest.mark.compile
def test_torchao_per_tensor_granularity():
    from torchao.quantization.granularity import PerTensor

    model = _torchao_model(torch.float32, PerTensor())
    x = torch.randn(4, K)
    with torch.no_grad():
        report = compile_backend.explain(model, x)
    assert report.counts()["w8a16_gemm"] == 2 and not report.unfused, str(report)
    assert all("per-tensor" in f.detail for f in report.fused)
