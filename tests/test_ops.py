"""The four quantfuse ops on CPU: opcheck, reference math against float64, validation errors."""

from __future__ import annotations

import pytest
import torch

import compile_backend.ops as ops
from compile_backend.quantize import awq_pack

OUT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def _rand_int8(*shape, gen):
    return torch.randint(-128, 128, shape, dtype=torch.int8, generator=gen)


def _w8a8_inputs(M, K, N, dtype=torch.int8, per_token=True, per_channel=True, bias=True, out_dtype=torch.bfloat16,
                 seed=0):
    gen = torch.Generator().manual_seed(seed)
    if dtype == torch.int8:
        a, w = _rand_int8(M, K, gen=gen), _rand_int8(N, K, gen=gen)
    else:
        a = (torch.randn(M, K, generator=gen) * 50).to(dtype)
        w = (torch.randn(N, K, generator=gen) * 50).to(dtype)
    scale_a = torch.rand(M if per_token else 1, 1, generator=gen) * 0.01 + 1e-3
    scale_b = torch.rand(N if per_channel else 1, generator=gen) * 0.01 + 1e-3
    b = w.t()  # [K, N] column-major, as docs/DESIGN.md's contract
    bias_t = (torch.randn(N, generator=gen)).to(out_dtype) if bias else None
    return a, b, scale_a, scale_b, out_dtype, bias_t


def _w8a8_float64(a, b, scale_a, scale_b, bias, azp=None, azp_adj=None):
    acc = a.double() @ b.double()
    if azp_adj is not None:
        acc = acc - (azp_adj.double().reshape(1, -1) if azp is None
                     else azp.double().reshape(-1, 1) * azp_adj.double().reshape(1, -1))
    out = acc * scale_a.double().reshape(-1, 1) * scale_b.double().reshape(1, -1)
    return out if bias is None else out + bias.double()


def _close(out, ref, out_dtype):
    # One rounding to the output dtype: relative error of about its epsilon.
    tol = {torch.float16: 2e-3, torch.bfloat16: 1.6e-2, torch.float32: 1e-5}[out_dtype]
    err = (out.double() - ref).norm() / ref.norm()
    assert torch.isfinite(out).all()
    assert err < tol, f"relative error {err:.2e} >= {tol:.0e}"


# --------------------------------------------------------------------------- reference math


@pytest.mark.parametrize("out_dtype", OUT_DTYPES)
@pytest.mark.parametrize("per_token", [True, False])
@pytest.mark.parametrize("per_channel", [True, False])
@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("dtype", [torch.int8, torch.float8_e4m3fn])
def test_scaled_mm_matches_float64(out_dtype, per_token, per_channel, bias, dtype):
    a, b, sa, sb, od, bias_t = _w8a8_inputs(33, 96, 40, dtype, per_token, per_channel, bias, out_dtype)
    out = torch.ops.quantfuse.scaled_mm(a, b, sa, sb, od, bias_t)
    assert out.shape == (33, 40) and out.dtype == out_dtype
    _close(out, _w8a8_float64(a, b, sa, sb, bias_t), out_dtype)


def test_scaled_mm_int8_accumulation_is_exact_for_long_k():
    # K = 14336 of +-127 products overflows float32's exact range: only exact accumulation gives 0 error.
    K = 14336
    a = torch.full((2, K), 127, dtype=torch.int8)
    a[1, ::2] = -127
    b = torch.full((K, 3), 127, dtype=torch.int8)
    b[::3, 1] = -128
    ones = torch.ones(1)
    out = torch.ops.quantfuse.scaled_mm(a, b, ones, ones, torch.float32)
    ref = (a.to(torch.int64) @ b.to(torch.int64)).to(torch.float32)
    assert torch.equal(out, ref)


@pytest.mark.parametrize("per_token_zp", [True, False])
@pytest.mark.parametrize("bias", [True, False])
def test_scaled_mm_azp_matches_float64(per_token_zp, bias):
    gen = torch.Generator().manual_seed(1)
    a, b, sa, sb, od, bias_t = _w8a8_inputs(17, 64, 24, bias=bias, out_dtype=torch.float16, seed=1)
    colsum = b.to(torch.int32).sum(0, dtype=torch.int32)
    if per_token_zp:
        azp = torch.randint(-20, 20, (17,), dtype=torch.int32, generator=gen)
        azp_adj = colsum
    else:
        azp, azp_adj = None, 7 * colsum
    out = torch.ops.quantfuse.scaled_mm_azp(a, b, sa, sb, od, azp_adj, azp, bias_t)
    _close(out, _w8a8_float64(a, b, sa, sb, bias_t, azp, azp_adj), od)


def test_scaled_mm_azp_equals_dequantized_asymmetric_product():
    # D = s_a s_b (A - z_a) B: the op with azp_adj = colsum(B) reproduces the asymmetric dequantization.
    gen = torch.Generator().manual_seed(2)
    a, b, sa, sb, _, _ = _w8a8_inputs(9, 32, 16, bias=False, out_dtype=torch.float32, seed=2)
    azp = torch.randint(-5, 5, (9,), dtype=torch.int32, generator=gen)
    colsum = b.to(torch.int32).sum(0, dtype=torch.int32)
    out = torch.ops.quantfuse.scaled_mm_azp(a, b, sa, sb, torch.float32, colsum, azp)
    x = (a.double() - azp.double().unsqueeze(1)) * sa.double()
    ref = x @ (b.double() * sb.double().reshape(1, -1))
    torch.testing.assert_close(out.double(), ref, rtol=1e-5, atol=1e-5)


def _awq_inputs(M, K, N, G, dtype=torch.float16, bias=True, seed=0):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randint(0, 16, (K, N), dtype=torch.int32, generator=gen)
    z = torch.randint(0, 16, (K // G, N), dtype=torch.int32, generator=gen)
    s = (torch.rand(K // G, N, generator=gen) * 0.02 + 0.001).to(dtype)
    x = torch.randn(M, K, generator=gen).to(dtype)
    bias_t = torch.randn(N, generator=gen).to(dtype) if bias else None
    return x, awq_pack(q), s, awq_pack(z), G, bias_t, q, z


@pytest.mark.parametrize("G", [32, 64, 128, 256])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("bias", [True, False])
def test_awq_ops_match_float64(G, dtype, bias):
    K = 256
    x, qw, s, qz, G, bias_t, q, z = _awq_inputs(5, K, 64, G, dtype, bias)
    w64 = (q.double() - z.double().repeat_interleave(G, 0)) * s.double().repeat_interleave(G, 0)
    deq = torch.ops.quantfuse.awq_dequantize(qw, s, qz, G)
    assert deq.dtype == dtype and deq.shape == (K, 64)
    # One rounding of (q - z) * s to the activation dtype.
    eps = torch.finfo(dtype).eps
    assert ((deq.double() - w64).abs() <= w64.abs() * eps).all()
    out = torch.ops.quantfuse.awq_gemm(x, qw, s, qz, G, bias_t)
    ref = x.double() @ w64 + (0 if bias_t is None else bias_t.double())
    _close(out, ref, dtype)


def test_awq_bit_order_is_designs():
    # Logical column 8c+i sits at bits 4*ORDER[i]: build one int32 by hand and unpack it.
    values = torch.arange(8, dtype=torch.int32).reshape(1, 8) + 3
    packed = awq_pack(values)
    expected = sum(int(v) << (4 * o) for v, o in zip(values[0].tolist(), ops.AWQ_ORDER))
    assert packed.item() == expected - (1 << 32 if expected >= 1 << 31 else 0)
    assert torch.equal(ops.awq_unpack(packed), values)


def test_empty_m_returns_empty():
    a, b, sa, sb, od, bias_t = _w8a8_inputs(0, 32, 16, per_token=False)
    assert torch.ops.quantfuse.scaled_mm(a, b, sa, sb, od, bias_t).shape == (0, 16)
    colsum = b.to(torch.int32).sum(0, dtype=torch.int32)
    assert torch.ops.quantfuse.scaled_mm_azp(a, b, sa, sb, od, colsum, None, bias_t).shape == (0, 16)
    x, qw, s, qz, G, bias_t, *_ = _awq_inputs(0, 64, 16, 32)
    assert torch.ops.quantfuse.awq_gemm(x, qw, s, qz, G, bias_t).shape == (0, 16)


# --------------------------------------------------------------------------- opcheck


def _opcheck_cases():
    a, b, sa, sb, od, bias_t = _w8a8_inputs(8, 32, 16)
    yield "scaled_mm", (a, b, sa, sb, od, bias_t)
    yield "scaled_mm", (a, b, sa[:1], sb[:1], torch.float16, None)
    fa, fb, fsa, fsb, fod, fbias = _w8a8_inputs(8, 32, 16, dtype=torch.float8_e4m3fn, out_dtype=torch.float32)
    yield "scaled_mm", (fa, fb, fsa, fsb, fod, fbias)
    colsum = b.to(torch.int32).sum(0, dtype=torch.int32)
    yield "scaled_mm_azp", (a, b, sa, sb, od, colsum, torch.arange(8, dtype=torch.int32), bias_t)
    yield "scaled_mm_azp", (a, b, sa, sb, od, 3 * colsum, None, None)
    x, qw, s, qz, G, bias_t, *_ = _awq_inputs(4, 64, 16, 32)
    yield "awq_gemm", (x, qw, s, qz, G, bias_t)
    yield "awq_dequantize", (qw, s, qz, G)


@pytest.mark.parametrize("case", list(_opcheck_cases()), ids=lambda c: c[0])
def test_opcheck(case):
    name, args = case
    utils = None
    if any(isinstance(t, torch.Tensor) and t.dtype == torch.float8_e4m3fn for t in args):
        # opcheck's schema test compares inputs with arithmetic that CPU torch lacks for fp8;
        # every other check still runs.
        utils = ("test_autograd_registration", "test_faketensor", "test_aot_dispatch_dynamic")
    kwargs = {} if utils is None else {"test_utils": utils}
    torch.library.opcheck(getattr(torch.ops.quantfuse, name).default, args, **kwargs)


GEMM_OPS = ("scaled_mm", "scaled_mm_azp", "awq_gemm", "awq_dequantize", "w8a16_gemm", "concat_weights")


def test_ops_are_tagged_for_fixed_strides():
    for name in GEMM_OPS:
        assert torch.Tag.needs_fixed_stride_order in getattr(torch.ops.quantfuse, name).default.tags


# --------------------------------------------------------------------------- validation


def _bad_w8a8_cases():
    a, b, sa, sb, od, bias_t = _w8a8_inputs(8, 32, 16)
    yield "a", (a.float(), b, sa, sb, od, bias_t)
    yield "b", (a, b.to(torch.int32), sa, sb, od, bias_t)
    yield "b", (a, b[:16], sa, sb, od, bias_t)  # K mismatch
    yield "scale_a", (a, b, torch.ones(3), sb, od, bias_t)
    yield "scale_b", (a, b, sa, torch.ones(5), od, bias_t)
    yield "scale_a", (a, b, sa.double(), sb, od, bias_t)
    yield "bias", (a, b, sa, sb, od, bias_t[:8])
    yield "bias", (a, b, sa, sb, od, bias_t.float())
    yield "out_dtype", (a, b, sa, sb, torch.int32, None)


@pytest.mark.parametrize("case", list(_bad_w8a8_cases()), ids=lambda c: c[0])
def test_scaled_mm_rejects_malformed(case):
    arg, args = case
    with pytest.raises(ops.QuantfuseInputError, match=f"argument '{arg}' has .*expected"):
        torch.ops.quantfuse.scaled_mm(*args)
    # The fake implementation validates too, so errors surface at compile time.
    with torch._subclasses.FakeTensorMode() as mode:
        fake_args = [mode.from_tensor(t) if isinstance(t, torch.Tensor) else t for t in args]
        with pytest.raises(ops.QuantfuseInputError, match=f"argument '{arg}'"):
            torch.ops.quantfuse.scaled_mm(*fake_args)


def test_scaled_mm_azp_rejects_malformed():
    a, b, sa, sb, od, bias_t = _w8a8_inputs(8, 32, 16)
    colsum = b.to(torch.int32).sum(0, dtype=torch.int32)
    fa, fb, *_ = _w8a8_inputs(8, 32, 16, dtype=torch.float8_e4m3fn)
    with pytest.raises(ops.QuantfuseInputError, match="argument 'a'.*int8"):
        torch.ops.quantfuse.scaled_mm_azp(fa, fb, sa, sb, od, colsum)
    with pytest.raises(ops.QuantfuseInputError, match="argument 'azp_adj'.*\\(16,\\)"):
        torch.ops.quantfuse.scaled_mm_azp(a, b, sa, sb, od, colsum[:8])
    with pytest.raises(ops.QuantfuseInputError, match="argument 'azp_adj'.*int32"):
        torch.ops.quantfuse.scaled_mm_azp(a, b, sa, sb, od, colsum.float())
    with pytest.raises(ops.QuantfuseInputError, match="argument 'azp'.*M = 8"):
        torch.ops.quantfuse.scaled_mm_azp(a, b, sa, sb, od, colsum, torch.zeros(3, dtype=torch.int32))


def _bad_awq_cases():
    x, qw, s, qz, G, bias_t, *_ = _awq_inputs(4, 128, 64, 32)
    yield "group_size", (x, qw, s, qz, 48, bias_t)
    yield "group_size", (x, qw, s, qz, 0, bias_t)
    yield "qweight", (x, qw.float(), s, qz, G, bias_t)
    yield "scales", (x, qw, s[:2], qz, G, bias_t)
    yield "scales", (x, qw, s.float(), qz, G, bias_t)
    yield "scales", (x, qw[:, :7], s[:, :60], qz[:, :7], G, bias_t)  # N not a multiple of 8
    yield "qzeros", (x, qw, s, qz[:, :4], G, bias_t)
    yield "x", (x[:, :64], qw, s, qz, G, bias_t)  # K mismatch
    yield "x", (x.float(), qw, s, qz, G, bias_t)
    yield "bias", (x, qw, s, qz, G, bias_t[:32])


@pytest.mark.parametrize("case", list(_bad_awq_cases()), ids=lambda c: c[0])
def test_awq_gemm_rejects_malformed(case):
    arg, args = case
    with pytest.raises(ops.QuantfuseInputError, match=f"argument '{arg}' has .*expected"):
        torch.ops.quantfuse.awq_gemm(*args)


def test_awq_dequantize_rejects_malformed():
    _, qw, s, qz, G, *_ = _awq_inputs(1, 128, 64, 32)
    with pytest.raises(ops.QuantfuseInputError, match="argument 'qzeros'"):
        torch.ops.quantfuse.awq_dequantize(qw, s, qz[:1], G)
    with pytest.raises(ops.QuantfuseInputError, match="argument 'group_size'.*divisor of K = 128"):
        torch.ops.quantfuse.awq_dequantize(qw, s, qz, 100)


# --------------------------------------------------------------------------- layouts


def _odd_activations(M, K, gen):
    """(name, a [M, K]) with row strides below K: what no BLAS leading dimension describes."""
    row = _rand_int8(1, K, gen=gen)
    yield "expanded (0, 1)", row.expand(M, K)
    yield "expanded M=1 (0, 1)", row.as_strided((1, K), (0, 1))
    yield "sliding window (1, 1)", _rand_int8(M + K, gen=gen).as_strided((M, K), (1, 1))
    yield "overlapping rows (K/2, 1)", _rand_int8(M * K, gen=gen).as_strided((M, K), (K // 2, 1))
    yield "every other column", _rand_int8(M, 2 * K, gen=gen)[:, ::2]
    yield "column-major", _rand_int8(K, M, gen=gen).t()


def _odd_weights(K, N, gen):
    """(name, b [K, N]) with layouts other than the column-major transpose of [N, K]."""
    yield "expanded weight (1, 0)", _rand_int8(1, K, gen=gen).expand(N, K).t()
    yield "expanded columns (0, 1)", _rand_int8(1, N, gen=gen).expand(K, N)
    yield "sliding window (1, 1)", _rand_int8(N + K, gen=gen).as_strided((K, N), (1, 1))
    yield "row-major", _rand_int8(K, N, gen=gen)


def _layout_cases():
    gen = torch.Generator().manual_seed(3)
    M, K, N = 6, 64, 24
    plain_a, plain_b = _rand_int8(M, K, gen=gen), _rand_int8(N, K, gen=gen).t()
    for name, a in _odd_activations(M, K, gen):
        yield f"a {name}", a, plain_b
    for name, b in _odd_weights(K, N, gen):
        yield f"b {name}", plain_a, b
    yield "both expanded", _rand_int8(1, K, gen=gen).expand(M, K), _rand_int8(1, K, gen=gen).expand(N, K).t()


@pytest.mark.parametrize("case", list(_layout_cases()), ids=lambda c: c[0])
def test_int8_ops_are_exact_for_any_strides(case):
    # The reference's fast path (CPU torch._int_mm) misreads operands whose strides no
    # leading dimension describes; the op must copy them first, and the product stays exact.
    _, a, b = case
    M, N = a.shape[0], b.shape[1]
    exact = a.double() @ b.double()
    ones = torch.ones(1)
    assert torch.equal(torch.ops.quantfuse.scaled_mm(a, b, ones, ones, torch.float32).double(), exact)
    colsum = b.to(torch.int32).sum(0, dtype=torch.int32)
    azp = torch.arange(M, dtype=torch.int32) - 2
    out = torch.ops.quantfuse.scaled_mm_azp(a, b, ones, ones, torch.float32, colsum, azp)
    assert torch.equal(out.double(), exact - azp.double().reshape(-1, 1) * colsum.double())
    assert torch.equal(ops.exact_product(a, b).double(), exact)
    assert out.shape == (M, N)


def test_blas_layout_rule():
    t = torch.zeros(4, 8, dtype=torch.int8)
    assert ops.is_blas_layout(t) and ops.is_blas_layout(t.t())
    assert ops.is_blas_layout(torch.zeros(4, 16, dtype=torch.int8)[:, 3:11])  # padded rows
    assert not ops.is_blas_layout(t[:1].expand(4, 8))
    assert not ops.is_blas_layout(t[:1].as_strided((1, 8), (0, 1)))  # "contiguous" to torch, stride 0
    assert not ops.is_blas_layout(t.reshape(-1).as_strided((4, 8), (1, 1)))
    assert not ops.is_blas_layout(t[:, ::2])


# --------------------------------------------------------------------------- devices


def _device_cases():
    a, b, sa, sb, od, bias_t = _w8a8_inputs(8, 32, 16)
    meta = {k: v.to("meta") for k, v in dict(a=a, b=b, sa=sa, sb=sb, bias=bias_t).items()}
    yield "scaled_mm", "b", (a, meta["b"], sa, sb, od, bias_t)
    yield "scaled_mm", "scale_a", (meta["a"], meta["b"], sa, meta["sb"], od, meta["bias"])
    yield "scaled_mm", "scale_b", (a, b, sa, meta["sb"], od, bias_t)
    yield "scaled_mm", "bias", (a, b, sa, sb, od, meta["bias"])
    colsum = b.to(torch.int32).sum(0, dtype=torch.int32)
    yield "scaled_mm_azp", "azp_adj", (a, b, sa, sb, od, colsum.to("meta"), None, None)
    yield "scaled_mm_azp", "azp", (a, b, sa, sb, od, colsum, torch.zeros(8, dtype=torch.int32, device="meta"))
    x, qw, s, qz, G, abias, *_ = _awq_inputs(4, 64, 16, 32)
    yield "awq_gemm", "qweight", (x, qw.to("meta"), s, qz, G, abias)
    yield "awq_gemm", "scales", (x.to("meta"), qw.to("meta"), s, qz.to("meta"), G, None)
    yield "awq_gemm", "bias", (x, qw, s, qz, G, abias.to("meta"))
    yield "awq_dequantize", "qzeros", (qw, s, qz.to("meta"), G)


@pytest.mark.parametrize("case", list(_device_cases()), ids=lambda c: f"{c[0]}-{c[1]}")
def test_mixed_devices_are_rejected_naming_the_argument(case):
    # One device for every tensor argument, 1-element scales included (ops/library.py, check_devices).
    name, arg, args = case
    with pytest.raises(ops.QuantfuseInputError, match=f"argument '{arg}' has .*device (cpu|meta); expected device"):
        getattr(torch.ops.quantfuse, name)(*args)


# --------------------------------------------------------------------------- documented limits


def test_int8_sums_beyond_int32_are_exact():
    # K = INT8_EXACT_MAX_K products of (-128) * (-128) sum to 2**31: one past int32's range.
    # An int32 accumulator wraps to -2**31; the reference routes such K to float64 and is exact.
    K = ops.INT8_EXACT_MAX_K
    assert 128 * 128 * (K - 1) < 2**31 <= 128 * 128 * K
    a = torch.full((2, K), -128, dtype=torch.int8)
    a[1, 0] = 127  # second row: 2**31 - 128 * 255, exact in float32 only after exact accumulation
    b = torch.full((K, 1), -128, dtype=torch.int8)
    ones = torch.ones(1)
    out = torch.ops.quantfuse.scaled_mm(a, b, ones, ones, torch.float32)
    expected = (a.to(torch.int64) @ b.to(torch.int64)).to(torch.float32)
    assert torch.equal(out, expected) and out[0, 0].item() == 2.0**31
    colsum = b.to(torch.int32).sum(0, dtype=torch.int32)
    out = torch.ops.quantfuse.scaled_mm_azp(a, b, ones, ones, torch.float32, colsum, torch.zeros(2, dtype=torch.int32))
    assert torch.equal(out, expected)


def test_infinite_activation_scale_is_non_finite_like_eager():
    # The op scales the integer accumulator (the kernels' epilogue); eager scales each element
    # first.  Both rows with an infinite scale are non-finite, not necessarily the same one.
    a, b, sa, sb, od, _ = _w8a8_inputs(4, 32, 8, out_dtype=torch.float32)
    sa[1, 0] = float("inf")
    out = torch.ops.quantfuse.scaled_mm(a, b, sa, sb, od)
    eager = (a.float() * sa) @ (b.float() * sb.reshape(1, -1))
    assert not torch.isfinite(out[1]).any() and not torch.isfinite(eager[1]).any()
    assert torch.isfinite(out[[0, 2, 3]]).all()
    sa[1, 0] = float("nan")
    assert torch.isnan(torch.ops.quantfuse.scaled_mm(a, b, sa, sb, od)[1]).all()


@pytest.mark.parametrize("M", [1, ops.scaled_mm.INT_MM_MAX_ROWS, ops.scaled_mm.INT_MM_MAX_ROWS + 1, 64])
def test_cpu_int8_product_is_the_same_on_either_path(monkeypatch, M):
    """The CPU reference multiplies int8 operands with torch._int_mm for a few rows and in float64
    above ``INT_MM_MAX_ROWS``; both are exact, so the two paths give identical sums."""
    gen = torch.Generator().manual_seed(M)
    a, b = _rand_int8(M, 96, gen=gen), _rand_int8(40, 96, gen=gen).t()
    a[0] = -128  # extreme values: the largest partial sums
    b[:, 0] = -128
    sums = {}
    for rows in (0, 10**6):  # float64 always; torch._int_mm always
        monkeypatch.setattr(ops.scaled_mm, "INT_MM_MAX_ROWS", rows)
        sums[rows] = ops.exact_product(a, b)
    assert torch.equal(sums[0], sums[10**6])
    assert torch.equal(sums[0].double(), a.double() @ b.double())
