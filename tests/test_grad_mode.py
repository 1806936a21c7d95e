"""Grad mode: fusion does not depend on ``torch.no_grad()`` (docs/DESIGN.md "Grad mode").

* The ops' autograd formulas (the family modules of ``compile_backend/ops/``) against eager autograd
  of the unfused source in float64, and ``gradcheck``.
* The passes on a joint forward + backward graph (what Inductor compiles when an
  input requires grad): the forward is fused, the backward stays eager's own, and
  the gradients equal eager's.
* End to end: a model with trainable LayerNorms and quantized linears (weights are
  buffers without grad) compiled under default grad mode is fused, correct, and
  differentiable; ``explain`` reports what that compile does.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from pass_helpers import MATMULS, QUANTFUSE_OPS, apply_passes, count_calls, graph_str

import compile_backend
from compile_backend.ops import awq_unpack
from compile_backend.passes import collecting_report
from compile_backend.quantize import AWQLinear, W8A8Linear

aten = torch.ops.aten
F64 = torch.float64
M, K, N = 6, 64, 32


def _gen(seed):
    return torch.Generator().manual_seed(seed)


def _rel_err(got, want):
    return ((got.to(F64) - want.to(F64)).abs().max() / want.to(F64).abs().max().clamp_min(1e-30)).item()


# --------------------------------------------------------------------------- the ops' formulas


def _w8a8_operands(seed, per_tensor_a, per_tensor_b, bias_dtype):
    g = _gen(seed)
    a = torch.randint(-128, 128, (M, K), dtype=torch.int8, generator=g)
    w = torch.randint(-128, 128, (N, K), dtype=torch.int8, generator=g)
    sa = torch.rand(1 if per_tensor_a else M, generator=g) * 1e-2 + 1e-3
    sb = torch.rand(1 if per_tensor_b else N, generator=g) * 1e-2 + 1e-3
    bias = None if bias_dtype is None else torch.randn(N, generator=g).to(bias_dtype)
    return a, w, sa, sb, bias


def _leaves(*ts):
    return [None if t is None else t.detach().clone().requires_grad_() for t in ts]


@pytest.mark.parametrize("out_dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("per_tensor_a,per_tensor_b", [(False, False), (True, False), (False, True), (True, True)])
@pytest.mark.parametrize("with_bias", [False, True])
def test_scaled_mm_formula_matches_float64_source(out_dtype, per_tensor_a, per_tensor_b, with_bias):
    """d scale_a, d scale_b, d bias of ``scaled_mm`` equal autograd of ``(A·s_a) (B·s_b)ᵀ + C`` in float64."""
    a, w, sa, sb, bias = _w8a8_operands(0, per_tensor_a, per_tensor_b, out_dtype if with_bias else None)
    grad = torch.randn(M, N, generator=_gen(1)).to(out_dtype)
    sa1, sb1, b1 = _leaves(sa, sb, bias)
    out = torch.ops.quantfuse.scaled_mm(a, w.t(), sa1, sb1, out_dtype, b1)
    out.backward(grad)

    sa2, sb2, b2 = _leaves(*(None if t is None else t.to(F64) for t in (sa, sb, bias)))
    ref = (a.to(F64) * sa2.reshape(-1, 1)) @ (w.to(F64) * sb2.reshape(-1, 1)).t()
    if b2 is not None:
        ref = ref + b2
    ref.backward(grad.to(F64))
    assert sa1.grad.shape == sa.shape and sb1.grad.shape == sb.shape
    # The formula and the float64 source sum the same products in another order, in float32.
    assert _rel_err(sa1.grad, sa2.grad) < 1e-5
    assert _rel_err(sb1.grad, sb2.grad) < 1e-5
    if with_bias:
        assert b1.grad.dtype == out_dtype
        assert _rel_err(b1.grad, b2.grad) <= 2 * torch.finfo(out_dtype).eps


@pytest.mark.parametrize("per_token_zp", [False, True])
def test_scaled_mm_azp_formula_matches_float64_source(per_token_zp):
    a, w, sa, sb, bias = _w8a8_operands(2, False, False, torch.float32)
    g = _gen(3)
    z = torch.randint(-20, 20, (M,) if per_token_zp else (), dtype=torch.int32, generator=g)
    colsum = w.to(torch.int32).sum(1, dtype=torch.int32)
    azp_adj, azp = (colsum, z) if per_token_zp else (colsum * z, None)
    grad = torch.randn(M, N, generator=g)
    sa1, sb1, b1 = _leaves(sa, sb, bias)
    torch.ops.quantfuse.scaled_mm_azp(a, w.t(), sa1, sb1, torch.float32, azp_adj, azp, b1).backward(grad)

    sa2, sb2, b2 = _leaves(sa.to(F64), sb.to(F64), bias.to(F64))
    x = (a.to(F64) - z.to(F64).reshape(-1, 1)) * sa2.reshape(-1, 1)
    (x @ (w.to(F64) * sb2.reshape(-1, 1)).t() + b2).backward(grad.to(F64))
    for got, want in ((sa1, sa2), (sb1, sb2), (b1, b2)):
        assert _rel_err(got.grad, want.grad) < 1e-5


def test_scaled_mm_gradcheck():
    """Finite differences agree with the formula (the op is linear in each scale and the bias;
    float32 scales, so the tolerances are float32's)."""
    a, w, sa, sb, bias = _w8a8_operands(4, False, False, torch.float32)

    def fn(sa, sb, bias):
        return torch.ops.quantfuse.scaled_mm(a, w.t(), sa, sb, torch.float32, bias)

    assert torch.autograd.gradcheck(fn, _leaves(sa * 10, sb * 10, bias), eps=1e-3, atol=1e-2, rtol=1e-2,
                                    nondet_tol=1e-5)


def _awq_operands(dtype, group_size, seed=5, with_bias=True):
    g = _gen(seed)
    layer = AWQLinear.from_linear(torch.nn.Linear(K, N), group_size=group_size, dtype=dtype)
    x = torch.randn(M, K, generator=g).to(dtype)
    bias = torch.randn(N, generator=g).to(dtype) if with_bias else None
    return layer.qweight, layer.qzeros, layer.scales, x, bias


def _awq_source_f64(x, qweight, scales, qzeros, group_size, bias):
    q = awq_unpack(qweight).to(F64)
    z = awq_unpack(qzeros).to(F64).repeat_interleave(group_size, 0)
    y = x @ ((q - z) * scales.repeat_interleave(group_size, 0))
    return y if bias is None else y + bias


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("group_size", [32, K])
def test_awq_gemm_formula_matches_float64_source(dtype, group_size):
    """dX = dY · W_deqᵀ, d scales, d bias of ``awq_gemm`` against float64 autograd of the dequantize-matmul."""
    qweight, qzeros, scales, x, bias = _awq_operands(dtype, group_size)
    grad = torch.randn(M, N, generator=_gen(6)).to(dtype)
    x1, s1, b1 = _leaves(x, scales, bias)
    torch.ops.quantfuse.awq_gemm(x1, qweight, s1, qzeros, group_size, b1).backward(grad)

    x2, s2, b2 = _leaves(x.to(F64), scales.to(F64), bias.to(F64))
    _awq_source_f64(x2, qweight, s2, qzeros, group_size, b2).backward(grad.to(F64))
    eps = torch.finfo(dtype).eps
    for got, want, leaf in ((x1, x2, x), (s1, s2, scales), (b1, b2, bias)):
        assert got.grad.dtype == leaf.dtype and got.grad.shape == leaf.shape
        # float32 sums rounded once to the activation dtype; W_deq itself rounded to it.
        assert _rel_err(got.grad, want.grad) <= 4 * eps, (leaf.shape, _rel_err(got.grad, want.grad))


def test_awq_dequantize_formula():
    qweight, qzeros, scales, _, _ = _awq_operands(torch.float16, 32)
    grad = torch.randn(K, N, generator=_gen(7)).to(torch.float16)
    (s1,) = _leaves(scales)
    torch.ops.quantfuse.awq_dequantize(qweight, s1, qzeros, 32).backward(grad)
    offsets = (awq_unpack(qweight) - awq_unpack(qzeros).repeat_interleave(32, 0)).to(F64)
    want = (grad.to(F64) * offsets).reshape(-1, 32, N).sum(1)
    assert s1.grad.dtype == torch.float16
    assert _rel_err(s1.grad, want) <= 2 * torch.finfo(torch.float16).eps



@pytest.mark.gpu
def test_every_formula_has_the_cuda_autograd_step():
    """csrc/common/autograd_cuda.cpp lists the ops it serves; it must list every op that has a
    formula, or that op's CUDA calls would still pay for the Python autograd kernel."""
    from compile_backend.ops.library import WITH_AUTOGRAD

    assert {"scaled_mm", "scaled_mm_azp", "awq_gemm", "awq_dequantize", "w8a16_gemm"} <= set(WITH_AUTOGRAD)
    missing = [name for name in WITH_AUTOGRAD
               if not torch._C._dispatch_has_kernel_for_dispatch_key(f"quantfuse::{name}", "AutogradCUDA")]
    assert not missing, missing


@pytest.mark.gpu
@pytest.mark.parametrize("op", ["awq_gemm", "scaled_mm"])
def test_cuda_autograd_step(op):
    """On CUDA the ops' Autograd step is C++ (csrc/common/autograd_cuda.cpp): without a gradient
    wanted it goes straight to the kernel (no graph recorded), with one it reaches the Python
    formula, whose gradients equal the same formula's on CPU."""
    if op == "awq_gemm":
        qweight, qzeros, scales, x, bias = _awq_operands(torch.float16, 32)

        def run(dev, x, s, b):
            return torch.ops.quantfuse.awq_gemm(x, qweight.to(dev), s, qzeros.to(dev), 32, b)

        leaves = (x, scales, bias)
    else:
        a, w, sa, sb, bias = _w8a8_operands(8, False, False, torch.bfloat16)

        def run(dev, sa, sb, b):
            return torch.ops.quantfuse.scaled_mm(a.to(dev), w.to(dev).t(), sa, sb, torch.bfloat16, b)

        leaves = (sa, sb, bias)
    grads = {}
    for dev in ("cpu", "cuda"):
        ts = _leaves(*(t.to(dev) for t in leaves))
        with torch.no_grad():
            assert run(dev, *ts).grad_fn is None
        plain = run(dev, *(t.detach() for t in ts))
        assert plain.grad_fn is None and not plain.requires_grad
        out = run(dev, *ts)
        assert out.grad_fn is not None
        out.backward(torch.ones_like(out))
        grads[dev] = [t.grad.cpu() for t in ts]
    for got, want in zip(grads["cuda"], grads["cpu"]):
        assert got.dtype == want.dtype and got.shape == want.shape
        assert _rel_err(got, want) <= 1e-2, _rel_err(got, want)


@pytest.mark.compile
def test_compiled_model_calling_the_op_differentiates_through_it():
    """A model that calls ``quantfuse.awq_gemm`` itself: AOTAutograd traces the formula into the
    compiled backward, which gives the eager op's gradients."""
    qweight, qzeros, scales, x, bias = _awq_operands(torch.float16, 32)
    norm = torch.nn.LayerNorm(K).to(torch.float16)

    def fn(x):
        return torch.ops.quantfuse.awq_gemm(norm(x), qweight, scales, qzeros, 32, bias)

    grad = torch.randn(M, N, generator=_gen(8)).to(torch.float16)
    x1, x2 = _leaves(x, x)
    torch._dynamo.reset()
    torch.compile(fn, backend="quantfuse", options={"fx_graph_cache": False})(x1).backward(grad)
    w_grad = norm.weight.grad.clone()
    norm.weight.grad = None
    norm.bias.grad = None
    fn(x2).backward(grad)
    torch._dynamo.reset()
    assert x1.grad is not None and torch.isfinite(x1.grad).all()
    torch.testing.assert_close(x1.grad, x2.grad, rtol=2e-3, atol=2e-3)
    torch.testing.assert_close(w_grad, norm.weight.grad, rtol=2e-3, atol=2e-3)


# --------------------------------------------------------------------------- the passes on a joint graph


def _w8a8_source(a, w, sa, sb, bias):
    # A per-token activation scale that requires grad (computed from x in a real model).
    return F.linear(a.float() * sa, w.float() * sb.unsqueeze(-1), bias.float()).to(torch.bfloat16)


def _backward_matmuls(gm):
    from compile_backend.passes.fx_helpers import is_backward

    return sum(1 for n in gm.graph.nodes if n.target in MATMULS and is_backward(n))


@pytest.mark.parametrize("dynamic", [False, True])
def test_joint_graph_w8a8_forward_fused_backward_kept(dynamic):
    a, w, sa, sb, bias = _w8a8_operands(9, False, False, torch.bfloat16)
    sa = sa.reshape(M, 1).requires_grad_()
    r = apply_passes(_w8a8_source, a, w, sa, sb, bias, grad=True, dynamic=dynamic)
    assert r.fused == 1, graph_str(r.after)
    assert r.report.counts() == {"scaled_mm": 1} and r.report.unfused == []
    # The backward (grad_x = grad_y @ w_deq, then d scale) is eager's own, untouched.
    assert _backward_matmuls(r.before) == _backward_matmuls(r.after) == 1
    # The forward graph the partitioner made runs the fused op and no dequantized weight:
    # the dequantization is recomputed in the backward, from the int8 weight.
    assert count_calls(r.forward, *QUANTFUSE_OPS) == 1 and count_calls(r.forward, *MATMULS) == 0, \
        graph_str(r.forward)
    dequantized = [n.name for n in r.forward.graph.nodes if isinstance(n.meta.get("val"), torch.Tensor)
                   and n.meta["val"].is_floating_point() and sorted(n.meta["val"].shape) == sorted((N, K))]
    assert dequantized == [], graph_str(r.forward)
    assert r.output.dtype == r.expected.dtype == torch.bfloat16
    torch.testing.assert_close(r.output, r.expected, rtol=2e-2, atol=1e-2)
    grad = torch.randn(M, N, generator=_gen(10)).to(torch.bfloat16)
    (d_fused,) = torch.autograd.grad(r.output, sa, grad)
    (d_eager,) = torch.autograd.grad(r.expected, sa, grad)
    torch.testing.assert_close(d_fused, d_eager, rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("dynamic", [False, True])
def test_joint_graph_awq_forward_fused_backward_kept(dynamic):
    layer = AWQLinear.from_linear(torch.nn.Linear(K, N), group_size=32, dtype=torch.float16)
    x = torch.randn(2, 3, K, generator=_gen(11)).to(torch.float16).requires_grad_()
    r = apply_passes(layer, x, grad=True, families=("awq_gemm",), dynamic=dynamic)
    assert r.fused == 1 and r.report.counts() == {"awq_gemm": 1} and r.report.unfused == [], graph_str(r.after)
    assert _backward_matmuls(r.after) == 1
    # No unpacking left in the forward: it lives in the backward, which needs W_deq.
    assert count_calls(r.forward, aten.bitwise_and.Scalar, aten.mm.default) == 0, graph_str(r.forward)
    grad = torch.randn(2, 3, N, generator=_gen(12)).to(torch.float16)
    (d_fused,) = torch.autograd.grad(r.output, x, grad)
    (d_eager,) = torch.autograd.grad(r.expected, x, grad)
    torch.testing.assert_close(d_fused, d_eager, rtol=1e-3, atol=1e-3)


def test_joint_graph_weight_used_in_the_forward_stays_unfused():
    """A dequantized weight the forward also returns is not private to the matmul: left alone,
    with the reason, under grad mode as without it."""
    a, w, sa, sb, bias = _w8a8_operands(13, False, False, None)
    sa = sa.reshape(M, 1).requires_grad_()

    def fn(a, w, sa, sb):
        wd = w.float() * sb.unsqueeze(-1)
        return F.linear(a.float() * sa, wd), wd.t()

    r = apply_passes(fn, a, w, sa, sb, grad=True)
    assert r.fused == 0, graph_str(r.after)
    (unfused,) = r.report.unfused
    assert "the dequantized weight" in unfused.reason and "outside the matmul" in unfused.reason, unfused.reason


# --------------------------------------------------------------------------- end to end


class _Block(torch.nn.Module):
    """Trainable LayerNorms around quantized linears (their tensors are frozen parameters)."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.norm1 = torch.nn.LayerNorm(K)
        self.sym = W8A8Linear.from_linear(torch.nn.Linear(K, N), out_dtype=torch.float32)
        self.asym = W8A8Linear.from_linear(torch.nn.Linear(N, N), symmetric=False, out_dtype=torch.float32)
        self.norm2 = torch.nn.LayerNorm(N)
        self.awq = AWQLinear.from_linear(torch.nn.Linear(N, N), group_size=32, dtype=torch.float16)

    def forward(self, x):
        h = self.asym(self.sym(self.norm1(x)))
        return self.awq(self.norm2(h).half())


@pytest.mark.compile
def test_model_under_grad_mode_is_fused_correct_and_differentiable():
    model = _Block()
    ref_model = copy.deepcopy(model)
    assert all(p.requires_grad == name.startswith("norm") for name, p in model.named_parameters())
    assert torch.is_grad_enabled()
    x = torch.randn(2, 3, K, generator=_gen(14))
    x1, x2 = _leaves(x, x)
    torch._dynamo.reset()
    compiled = torch.compile(model, backend="quantfuse", options={"fx_graph_cache": False})
    with collecting_report() as report:
        out = compiled(x1)
    ref = ref_model(x2)
    assert report.counts() == {"scaled_mm": 1, "scaled_mm_azp": 1, "awq_gemm": 1}, str(report)
    assert report.unfused == [], str(report)
    assert out.dtype == ref.dtype and out.requires_grad
    torch.testing.assert_close(out, ref, rtol=0, atol=4 * torch.finfo(torch.float16).eps * ref.abs().max().item())

    grad = torch.randn(out.shape, generator=_gen(15)).to(out.dtype)
    out.backward(grad)
    ref.backward(grad)
    torch._dynamo.reset()
    assert _rel_err(x1.grad, x2.grad) < 1e-3
    for (name, p), p_ref in zip(model.named_parameters(), ref_model.parameters()):
        if p.requires_grad:
            assert _rel_err(p.grad, p_ref.grad) < 1e-3, name
        else:
            assert p.grad is None and p_ref.grad is None, name


class _RecordsGradMode(_Block):
    def forward(self, x):
        self.grad_mode_seen = torch.is_grad_enabled()
        return super().forward(x)


@pytest.mark.compile
def test_explain_reports_the_callers_grad_mode():
    model = _RecordsGradMode()
    x = torch.randn(2, 3, K, generator=_gen(16))
    torch._dynamo.reset()
    with_grad = compile_backend.explain(model, x)
    assert model.grad_mode_seen is True  # explain compiled and ran what the caller's compile would
    with torch.no_grad():
        without = compile_backend.explain(model, x)
    assert model.grad_mode_seen is False
    torch._dynamo.reset()
    expected = {"scaled_mm": 1, "scaled_mm_azp": 1, "awq_gemm": 1}
    assert with_grad.counts() == without.counts() == expected, (str(with_grad), str(without))
    # No backward matmul is reported as an unfused candidate.
    assert with_grad.unfused == [] and without.unfused == []
