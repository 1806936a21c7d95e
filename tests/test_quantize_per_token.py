"""quantfuse.quantize_per_token: dynamic per-token activation quantization in one op.

CPU: the op is W8A8Linear's own quantization of dynamic per-token activations (its reference
is that form), its fake gives the shapes, malformed input raises naming the argument.
GPU: the kernel (csrc/quantize_per_token/) gives the form's values bit for bit, computed by the
same torch ops on CUDA, for every activation dtype and mode, any layout, rows of any content.
"""

from __future__ import annotations

import pytest
import torch
from conftest import DEV, kernel_names
from torch import nn

from compile_backend.ops import QuantfuseInputError
from compile_backend.ops.quantize_per_token import reference
from compile_backend.quantize import W8A8Linear

MODES = {"int8": (torch.int8, True), "int8-asym": (torch.int8, False), "fp8": (torch.float8_e4m3fn, True)}
DTYPES = {"f16": torch.float16, "bf16": torch.bfloat16, "f32": torch.float32}


def quantize(x, mode):
    qdtype, symmetric = MODES[mode]
    return torch.ops.quantfuse.quantize_per_token(x, qdtype, symmetric)


def assert_same(got, want, what=""):
    """Bit-identical q (compared as bytes), scale and zero point."""
    (q, s, z), (wq, ws, wz) = got, want
    assert q.dtype == wq.dtype and q.shape == wq.shape, (what, q.dtype, tuple(q.shape))
    assert s.shape == ws.shape == z.shape == wz.shape == (q.shape[0], 1), what
    assert s.dtype == z.dtype == torch.float32, what
    qb, wqb = q.view(torch.uint8), wq.view(torch.uint8)
    bad = qb != wqb
    assert not bad.any(), (f"{what}: {int(bad.sum())} of {bad.numel()} q differ; first at {bad.nonzero()[0].tolist()}: "
                           f"{qb[bad][0].item()} vs {wqb[bad][0].item()}")
    torch.testing.assert_close(s, ws, rtol=0, atol=0, equal_nan=True, msg=f"{what}: scale")
    torch.testing.assert_close(z, wz, rtol=0, atol=0, equal_nan=True, msg=f"{what}: zero point")


# --------------------------------------------------------------------------- CPU


@pytest.mark.parametrize("dtype", DTYPES.values(), ids=DTYPES.keys())
@pytest.mark.parametrize("mode", MODES)
def test_op_is_the_layers_quantization(mode, dtype):
    qdtype, symmetric = MODES[mode]
    layer = W8A8Linear(64, 16, weight_dtype=qdtype, symmetric=symmetric, out_dtype=dtype)
    x = (torch.randn(9, 64) * torch.rand(9, 1) * 4).to(dtype)
    q, scale, zp = layer.quantize_input(x)
    got = quantize(x, mode)
    assert_same(got, (q, scale, torch.zeros_like(scale) if zp is None else zp), mode)
    if not symmetric:  # a zero point a symmetric quantization would not have
        assert (got[2] != 0).any()


def test_zero_row_gets_the_smallest_scale():
    """An all-zero row divides by MIN_SCALE, not 0, and dequantizes to zeros (asymmetric: the
    range [0, 0] sits at the bottom of int8's, q = zero point = -128)."""
    for mode, code in (("int8", 0), ("int8-asym", -128)):
        q, scale, zp = quantize(torch.zeros(2, 8), mode)
        assert torch.equal(scale, torch.full((2, 1), 1e-8)) and (q.float() == code).all() and (zp == code).all(), mode


@pytest.mark.parametrize("dtype", DTYPES.values(), ids=DTYPES.keys())
@pytest.mark.parametrize("mode", MODES)
def test_opcheck(mode, dtype):
    """Schema, fake implementation, autograd registration and AOT dispatch (dynamic shapes) agree."""
    qdtype, symmetric = MODES[mode]
    torch.library.opcheck(torch.ops.quantfuse.quantize_per_token.default,
                          ((torch.randn(5, 32) * 3).to(dtype), qdtype, symmetric))


def test_fake_gives_shapes_and_dtypes():
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        x = torch.empty(5, 32, dtype=torch.bfloat16)
        q, scale, zp = quantize(x, "fp8")
    assert (q.dtype, tuple(q.shape)) == (torch.float8_e4m3fn, (5, 32))
    for t in (scale, zp):
        assert (t.dtype, tuple(t.shape)) == (torch.float32, (5, 1))


@pytest.mark.parametrize("case", [
    ("x", lambda: (torch.randn(2, 3, 8), torch.int8, True)),
    ("x", lambda: (torch.ones(2, 8, dtype=torch.int32), torch.int8, True)),
    ("x", lambda: (torch.randn(4, 0), torch.int8, True)),
    ("qdtype", lambda: (torch.randn(2, 8), torch.float16, True)),
    ("symmetric", lambda: (torch.randn(2, 8), torch.float8_e4m3fn, False)),
], ids=["3d", "int", "k0", "qdtype", "asym-fp8"])
def test_rejects_malformed_naming_the_argument(case):
    arg, make = case
    with pytest.raises(QuantfuseInputError, match=f"argument '{arg}'"):
        torch.ops.quantfuse.quantize_per_token(*make())


def test_layer_forward_op_quantizes_through_the_op(monkeypatch):
    """W8A8Linear.forward_op (what eager CUDA inference runs) hands dynamic per-token activations
    to the op; per-tensor and static ones keep the layer's own form."""
    import compile_backend.quantize.modules as quantize_module

    seen = []
    op = quantize_module.quantize_per_token
    monkeypatch.setattr(quantize_module, "quantize_per_token", lambda *a: seen.append(a[1:]) or op(*a))
    x = torch.randn(3, 32)
    for kw, calls in ((dict(symmetric=False), [(torch.int8, False)]),
                      (dict(weight_dtype=torch.float8_e4m3fn), [(torch.float8_e4m3fn, True)]),
                      (dict(per_token=False), [])):
        seen.clear()
        layer = W8A8Linear.from_linear(nn.Linear(32, 8), **kw)
        torch.testing.assert_close(layer.forward_op(x), layer(x), rtol=1.6e-2, atol=1e-2)
        assert seen == calls, (kw, seen)
    seen.clear()  # float64 activations, a dtype the op does not take: the form
    layer = W8A8Linear.from_linear(nn.Linear(32, 8), out_dtype=torch.float32)
    torch.testing.assert_close(layer.forward_op(x.double()), layer(x.double()), rtol=1e-5, atol=1e-5)
    assert seen == []


# --------------------------------------------------------------------------- GPU


def activations(M, K, dtype, seed):
    """Rows of mixed magnitudes and signs, with rows the rules treat specially: all zero, one
    value, constant, all negative, all positive, subnormal-sized."""
    gen = torch.Generator(device=DEV).manual_seed(seed)
    x = torch.randn(M, K, generator=gen, device=DEV) * torch.rand(M, 1, generator=gen, device=DEV).add(0.01) * 8
    special = [torch.zeros(K), torch.zeros(K).index_fill_(0, torch.tensor([K // 2]), -3.0), torch.full((K,), 0.7),
               -torch.rand(K, generator=torch.Generator().manual_seed(seed)) - 0.5,
               torch.rand(K, generator=torch.Generator().manual_seed(seed + 1)) + 2.0, torch.full((K,), 1e-9)]
    for i, row in enumerate(special[:M]):
        x[(i * 7) % M] = row.to(DEV)
    return x.to(dtype)


def layouts(x):
    """x as given, a column slice (row pitch above K, start off 16-byte alignment when K > 1), a
    transposed copy (column stride != 1) and one row expanded to all (row pitch 0)."""
    M, K = x.shape
    wide = torch.empty(M, K + 3, dtype=x.dtype, device=x.device)
    wide[:, 1:K + 1] = x
    return {"dense": x, "slice": wide[:, 1:K + 1], "transposed": x.t().contiguous().t(), "expanded": x[:1].expand(M, K)}


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES.values(), ids=DTYPES.keys())
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("MK", [(1, 4096), (7, 1), (13, 7), (64, 4104), (300, 4096), (33, 14336)],
                         ids=lambda mk: f"{mk[0]}x{mk[1]}")
def test_kernel_is_the_form_bit_for_bit(MK, mode, dtype):
    M, K = MK
    qdtype, symmetric = MODES[mode]
    x = activations(M, K, dtype, seed=M * 31 + K)
    for name, xl in layouts(x).items():
        want = reference(xl, qdtype, symmetric)  # the torch ops of the form, on CUDA
        got = quantize(xl, mode)
        assert_same(got, want, f"{name} {M}x{K}")


@pytest.mark.gpu
def test_kernel_runs_not_the_reference():
    x = activations(16, 256, torch.float16, seed=3)
    names = kernel_names(lambda: quantize(x, "int8"))
    assert any("quantize_per_token_kernel" in n for n in names), names


@pytest.mark.gpu
@pytest.mark.parametrize("mode", MODES)
def test_non_finite_rows_are_the_forms(mode):
    """inf and NaN in a row: the scale becomes inf or NaN as torch's reductions and clamps make
    it (NaN propagates), and the elements follow the same arithmetic."""
    qdtype, symmetric = MODES[mode]
    x = activations(6, 64, torch.float16, seed=5)
    x[1, 3], x[2, 9], x[3, 0], x[4, 5], x[4, 6] = float("inf"), float("-inf"), float("nan"), float("inf"), float("-inf")
    assert_same(quantize(x, mode), reference(x, qdtype, symmetric), mode)


@pytest.mark.gpu
def test_empty_m_and_cuda_graph_replay():
    q, scale, zp = quantize(torch.empty(0, 64, device=DEV, dtype=torch.bfloat16), "int8-asym")
    assert q.shape == (0, 64) and scale.shape == zp.shape == (0, 1)
    x = activations(8, 512, torch.bfloat16, seed=7)
    static = x.clone()
    quantize(static, "fp8")  # warm-up outside capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = quantize(static, "fp8")
    fresh = activations(8, 512, torch.bfloat16, seed=8)
    static.copy_(fresh)
    graph.replay()
    assert_same(out, reference(fresh, torch.float8_e4m3fn, True), "replay")



@pytest.mark.gpu
@pytest.mark.parametrize("case", [
    ("x", lambda: (torch.randn(2, 8, device=DEV, dtype=torch.float64), torch.int8, True)),
    ("qdtype", lambda: (torch.randn(2, 8, device=DEV), torch.float16, True)),
    ("symmetric", lambda: (torch.randn(2, 8, device=DEV), torch.float8_e4m3fn, False)),
], ids=["float64", "qdtype", "asym-fp8"])
def test_cuda_dispatch_sends_malformed_input_to_the_reference(case):
    """On CUDA the C++ dispatch hands what its kernel does not take to the reference, which raises
    naming the argument."""
    arg, make = case
    with pytest.raises(QuantfuseInputError, match=f"argument '{arg}'"):
        torch.ops.quantfuse.quantize_per_token(*make())
