"""GPU tests of the W8A16 CUDA kernels (csrc/w8a16_gemm/) behind quantfuse.w8a16_gemm and its C++
dispatch (csrc/w8a16_gemm/w8a16_gemm_dispatch.cpp).

Skipped as a whole without CUDA.  Every check draws fresh random data (int8 weights over their
whole range, activations of mixed magnitudes, scales of both signs' magnitudes), poisons the
memory the output will be allocated from with NaN, and compares with a float64 reference
computed from the int8 weight: one rounding to the output dtype plus float32 accumulation.
"""

from __future__ import annotations

import itertools

import pytest
import torch
from conftest import DEV, HOPPER, assert_pdl_on_off_equal, kernel_names, poison

import compile_backend
from compile_backend.ops import QuantfuseInputError

pytestmark = pytest.mark.gpu

DTYPES = (torch.float16, torch.bfloat16, torch.float32)
DT_IDS = ("f16", "bf16", "f32")
DECODE_MAX_M = 64  # the dispatch's decode kernel up to this M: w8a16_gemm_dispatch.cpp, kDecodeMaxM
DECODE_F32_MAX_M = 16  # ... float32: w8a16_gemm.h, w8a16::kMaxM (one slice)
M_ALL = (1, 2, 7, 16, 17, 64, 65, 300)
# Half an ulp of each output dtype (relative): the one rounding of the result.
ROUND = {torch.float16: 2.0**-11, torch.bfloat16: 2.0**-8, torch.float32: 2.0**-24}
# float32 accumulation of K products, relative to sum |x * w| * |s| (typical error ~ sqrt(K) ulp).
ACC = 2e-5


def make(M, N, K, dtype, seed, *, bias=True, scale="channel", scale_f32=True):
    gen = torch.Generator(device=DEV).manual_seed(seed)
    x = torch.randn(M, K, generator=gen, device=DEV) * torch.rand(M, 1, generator=gen, device=DEV).add(0.1) * 3
    w = torch.randint(-128, 128, (N, K), generator=gen, device=DEV, dtype=torch.int8)
    n = N if scale == "channel" else 1
    s = torch.rand(n, generator=gen, device=DEV).add(0.05) * 2e-3
    b = torch.randn(N, generator=gen, device=DEV).to(dtype) if bias else None
    return x.to(dtype), w, s if scale_f32 else s.to(dtype), b


def reference64(x, w, s, b):
    acc = x.double() @ w.double().t()
    out = acc * s.double().reshape(1, -1)
    mag = (x.double().abs() @ w.double().abs().t()) * s.double().abs().reshape(1, -1)
    if b is not None:
        out = out + b.double()
    return out, mag


def check(out, x, w, s, b, what):
    ref, mag = reference64(x, w, s, b)
    assert out.dtype == x.dtype and out.shape == ref.shape, (what, out.dtype, tuple(out.shape))
    o = out.double()
    assert torch.isfinite(o).all(), f"{what}: non-finite output (unwritten?)"
    err = (o - ref).abs()
    bound = ROUND[x.dtype] * ref.abs() + ACC * mag + 1e-6
    bad = err > bound
    assert not bad.any(), (f"{what}: {int(bad.sum())} of {bad.numel()} off; max err {err.max().item():.3g}; "
                           f"first at {bad.nonzero()[0].tolist()}")


def run_op(M, N, K, dtype, seed, **kw):
    x, w, s, b = make(M, N, K, dtype, seed, **kw)
    poison(M * N, dtype)
    out = torch.ops.quantfuse.w8a16_gemm(x, w, s, b)
    torch.cuda.synchronize()
    check(out, x, w, s, b, f"M={M} N={N} K={K} {dtype} {kw}")


@pytest.mark.parametrize("dtype", DTYPES, ids=DT_IDS)
@pytest.mark.parametrize("M", M_ALL)
def test_public_op_small_shapes(M, dtype):
    """Odd N, K a multiple of 16 (decode kernel up to M = 16) and odd K (the cuBLAS path), bias or
    not, per-channel and per-tensor scales in float32 or the activation dtype."""
    cases = ((40, 64, {}), (33, 48, dict(bias=False)), (17, 50, dict(scale="tensor")),
             (72, 528, dict(scale_f32=False)), (1, 16, dict(scale="tensor", scale_f32=False)))
    for i, (N, K, kw) in enumerate(cases):
        run_op(M, N, K, dtype, seed=100 * M + i, **kw)


@pytest.mark.parametrize("N,K", ((4096, 4096), (14336, 4096), (4096, 14336), (1024, 4096)))
@pytest.mark.parametrize("M", (1, 4, 16, 17, 300))
def test_llama_shapes(M, N, K):
    dtype = (torch.float16, torch.bfloat16)[(M + N // 1024) % 2]
    run_op(M, N, K, dtype, seed=M + N + K, bias=M % 2 == 0)


@pytest.mark.parametrize("dtype", DTYPES, ids=DT_IDS)
@pytest.mark.parametrize("batch", (-1, 2, 4))
@pytest.mark.parametrize("warps", (1, 4, 8))
@pytest.mark.parametrize("splits", (1, 2, 8))
def test_decode_kernel_work_splits(splits, warps, batch, dtype):
    """The decode kernel itself with every forced work split and load batching (clusters on sm_90
    only), M past one slice of 16 tokens for float16 / bfloat16."""
    ms = (1, 3, 8, 9, 16) if dtype == torch.float32 else (1, 3, 9, 16, 17, 40, 100)
    for i, M in enumerate(ms):
        x, w, s, b = make(M, 48, 4096 + 64 * i + 16, dtype, seed=splits * 100 + warps * 10 + i)
        poison(M * 48, dtype)
        out = torch.ops.quantfuse._w8a16_decode_cuda(x, w, s, b, splits, warps, batch)
        torch.cuda.synchronize()
        check(out, x, w, s, b, f"splits={splits} warps={warps} batch={batch} M={M}")


@pytest.mark.parametrize("dtype", DTYPES, ids=DT_IDS)
def test_prefill_path_any_m(dtype):
    for M in (1, 16, 129):
        x, w, s, b = make(M, 200, 336, dtype, seed=M)
        out = torch.ops.quantfuse._w8a16_prefill_cuda(x, w, s, b)
        check(out, x, w, s, b, f"prefill M={M}")


def test_kernel_choice():
    x, w, s, b = make(DECODE_MAX_M, 256, 512, torch.float16, seed=1)
    names = " ".join(kernel_names(lambda: torch.ops.quantfuse.w8a16_gemm(x, w, s, b)))
    assert "w8a16_decode_mma_kernel" in names, names
    x_big = make(DECODE_MAX_M + 1, 256, 512, torch.float16, seed=2)[0]
    names = " ".join(kernel_names(lambda: torch.ops.quantfuse.w8a16_gemm(x_big, w, s, b)))
    assert "w8a16_cast_kernel" in names and "w8a16_epilogue_kernel" in names and "w8a16_decode" not in names, names
    xf = x[:DECODE_F32_MAX_M].float()
    names = " ".join(kernel_names(lambda: torch.ops.quantfuse.w8a16_gemm(xf, w, s, b.float())))
    assert "w8a16_decode_f32_kernel" in names, names
    xf = x_big[:DECODE_F32_MAX_M + 1].float()
    names = " ".join(kernel_names(lambda: torch.ops.quantfuse.w8a16_gemm(xf, w, s, b.float())))
    assert "w8a16_epilogue_kernel" in names and "w8a16_decode" not in names, names


@pytest.mark.parametrize("M", (1, 16, 40))
def test_layouts_the_kernels_do_not_read(M):
    """A misaligned / strided activation and a transposed weight are copied to the kernels' layout."""
    dtype = torch.bfloat16
    x, w, s, b = make(M, 96, 256, dtype, seed=M)
    x_big = torch.zeros(M, 256 + 3, dtype=dtype, device=DEV)
    x_big[:, 1:257] = x
    x_odd = x_big[:, 1:257]  # 2-byte offset: not 16-byte aligned
    w_t = w.t().contiguous().t()  # column-major [N, K]
    s_strided = torch.stack([s, s], 1)[:, 0]
    for xs, ws, ss in ((x_odd, w, s), (x, w_t, s), (x, w, s_strided)):
        out = torch.ops.quantfuse.w8a16_gemm(xs, ws, ss, b)
        check(out, x, w, s, b, f"layout M={M} x{tuple(xs.stride())} w{tuple(ws.stride())}")
        names = kernel_names(lambda xs=xs, ws=ws, ss=ss: torch.ops.quantfuse.w8a16_gemm(xs, ws, ss, b))
        assert any("quantfuse" in n for n in names), names


def test_malformed_and_untaken_inputs():
    x, w, s, b = make(4, 32, 64, torch.float16, seed=3)
    reason = torch.ops.quantfuse._w8a16_gemm_kernel_reason
    assert reason(x, w, s, b) == ""
    assert "device" in reason(x, w, s.cpu(), b)
    with pytest.raises(QuantfuseInputError, match="w_scale"):
        torch.ops.quantfuse.w8a16_gemm(x, w, s.cpu(), b)
    with pytest.raises(QuantfuseInputError, match="w_q"):
        torch.ops.quantfuse.w8a16_gemm(x, w[:, :32], s, b)
    with pytest.raises(QuantfuseInputError, match="bias"):
        torch.ops.quantfuse.w8a16_gemm(x, w, s, b.float())
    assert torch.ops.quantfuse.w8a16_gemm(x[:0], w, s, b).shape == (0, 32)


@pytest.mark.parametrize("M", (1, 64))
def test_cuda_graph_capture(M):
    x, w, s, b = make(M, 128, 1024, torch.float16, seed=M)
    static_x = x.clone()
    torch.ops.quantfuse.w8a16_gemm(static_x, w, s, b)  # warm-up (loads, cuBLAS handles)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = torch.ops.quantfuse.w8a16_gemm(static_x, w, s, b)
    for seed in (5, 6):
        new_x = make(M, 128, 1024, torch.float16, seed=seed)[0]
        static_x.copy_(new_x)
        graph.replay()
        torch.cuda.synchronize()
        check(out, new_x, w, s, b, f"graph replay M={M}")


@pytest.mark.parametrize("M", [1, 16])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_pdl_on_and_off_equal(M, dtype):
    """The decode kernel with programmatic dependent launch and without: the same bits, eagerly and in
    CUDA graphs (``conftest.assert_pdl_on_off_equal``)."""
    x, w, s, b = make(M, 4096, 4096, dtype, seed=40 + M)
    seeds = itertools.count(50)
    assert_pdl_on_off_equal(lambda a, pdl: torch.ops.quantfuse._w8a16_decode_cuda(a, w, s, b, -1, -1, -1, pdl),
                            x, lambda: make(M, 4096, 4096, dtype, seed=next(seeds))[0])


def test_autograd_through_the_op():
    x, w, s, b = make(8, 64, 128, torch.float32, seed=9)
    x.requires_grad_()
    s = s.clone().requires_grad_()
    out = torch.ops.quantfuse.w8a16_gemm(x, w, s, b)
    g = torch.randn_like(out)
    dx, ds = torch.autograd.grad(out, (x, s), g)
    x64, s64 = x.detach().double().requires_grad_(), s.detach().double().requires_grad_()
    ref = torch.nn.functional.linear(x64, w.double() * s64[:, None], b.double())
    rx, rs = torch.autograd.grad(ref, (x64, s64), g.double())
    torch.testing.assert_close(dx.double(), rx, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(ds.double(), rs, rtol=1e-4, atol=1e-3)


def test_torchao_int8_weight_only_compiled_on_gpu():
    """torchao's Int8WeightOnlyConfig on CUDA: every linear fused (explain), the decode kernel runs,
    the result within the source's own bfloat16 roundings of torchao's eager output."""
    torchao = pytest.importorskip("torchao.quantization")
    torch._dynamo.reset()
    model = torch.nn.Sequential(torch.nn.Linear(256, 512), torch.nn.ReLU(), torch.nn.Linear(512, 128, bias=False))
    model = model.to(device=DEV, dtype=torch.bfloat16)
    torchao.quantize_(model, torchao.Int8WeightOnlyConfig())
    x = torch.randn(2, 3, 256, device=DEV, dtype=torch.bfloat16)
    with torch.no_grad():
        report = compile_backend.explain(model, x)
        assert report.counts()["w8a16_gemm"] == 2 and not report.unfused, str(report)
        eager = model(x)
        compiled_model = torch.compile(model, backend="quantfuse")
        out = compiled_model(x)
        err = (out.float() - eager.float()).abs().max().item()
        assert err <= 0.02 * eager.float().abs().max().item(), err
        names = " ".join(kernel_names(lambda: compiled_model(x)))
    assert "w8a16_decode_mma_kernel" in names, names


if HOPPER:
    def test_hopper_small_n_uses_clusters():
        """N = 256 fills a few SMs per CTA row: the chosen split uses clusters; results still exact."""
        run_op(1, 256, 8192, torch.bfloat16, seed=11)
