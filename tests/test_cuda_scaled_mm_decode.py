"""GPU tests of the W8A8 decode kernel (M <= 16) behind quantfuse.scaled_mm / scaled_mm_azp:
quantfuse::_scaled_mm_decode_cuda (csrc/scaled_mm/scaled_mm_decode*).

Skipped without CUDA.  Every M up to 16 x int8/fp8 x every epilogue x scale granularity x
bias x output dtype against a float64 reference on fresh random data; LLM-sized (N, K);
sliced / offset inputs; N not a multiple of the 32-channel tile; forced cluster splits
(int8 results bitwise equal for every split); CUDA-graph capture and replay; routing of the
public ops (profiler) and the fallbacks.
"""

from __future__ import annotations

import functools
import itertools

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

if torch.cuda.is_available():
    import compile_backend.cuda  # noqa: F401  (registers the kernel families)
    from compile_backend import kernels, ops
    from compile_backend.cuda import scaled_mm as qsm

CAP = torch.cuda.get_device_capability() if torch.cuda.is_available() else (0, 0)
M_ALL = (1, 2, 3, 7, 8, 9, 15, 16)
OUTS = (torch.float16, torch.bfloat16, torch.float32)
INS = (torch.int8, torch.float8_e4m3fn)
RTOL = {torch.float16: 2e-3, torch.bfloat16: 1.6e-2, torch.float32: 2e-5}
LLM_NK = ((4096, 4096), (6144, 4096), (28672, 4096), (4096, 14336))
SMALL_NK = ((64, 128), (192, 320), (72, 528))  # 72: not a multiple of the 16-channel tile
# epilogue kinds: symmetric, per-tensor zero point (folded into azp_adj), per-token zero points
EPIS = ("sym", "azp", "azptok")


def _cap_ok(in_dtype):
    return CAP >= ((8, 9) if in_dtype == torch.float8_e4m3fn else (8, 0))


@pytest.fixture
def route_decode(monkeypatch):
    """Route the public ops' M <= 16 calls to the decode kernel (off by default, see
    compile_backend/cuda/scaled_mm.py DECODE_MAX_M)."""
    monkeypatch.setattr(qsm, "DECODE_MAX_M", 16)


@pytest.fixture(scope="module", autouse=True)
def _built():
    if torch.cuda.is_available():
        assert kernels.ensure_loaded(), kernels.status()
        if not hasattr(torch.ops.quantfuse, "_scaled_mm_decode_cuda"):
            pytest.skip("decode kernel not built (QUANTFUSE_CSRC_ONLY)")
    yield


def rand_q(shape, dtype):
    if dtype == torch.int8:
        return torch.randint(-128, 128, shape, dtype=torch.int8, device="cuda")
    return (torch.randn(shape, device="cuda") * 3).clamp(-448, 448).to(dtype)


def make(M, N, K, in_dtype, out_dtype, sa_tok, sb_ch, with_bias, epi="sym"):
    a = rand_q((M, K), in_dtype)
    b = rand_q((N, K), in_dtype).t()  # column-major: a row-major weight transposed
    sa = (torch.rand(M if sa_tok else 1, device="cuda") + 0.5) * 1e-2
    sb = (torch.rand(N if sb_ch else 1, device="cuda") + 0.5) * 1e-2
    bias = torch.randn(N, device="cuda").to(out_dtype) if with_bias else None
    azp_adj = azp = None
    colsum = b.to(torch.int32).sum(0, dtype=torch.int32)
    if epi == "azp":
        za = int(torch.randint(-60, 60, ()).item()) or 5
        azp_adj = (za * colsum).to(torch.int32)
    elif epi == "azptok":
        azp_adj = colsum
        azp = torch.randint(-60, 60, (M,), dtype=torch.int32, device="cuda")
    return a, b, sa, sb, bias, azp_adj, azp


def reference(a, b, sa, sb, bias, azp_adj=None, azp=None):
    """float64: exact products and sums, the zero-point term, scales, bias."""
    acc = torch.matmul(a.to(torch.float64), b.to(torch.float64))
    if azp_adj is not None:
        adj = azp_adj.double().reshape(1, -1)
        acc = acc - (adj if azp is None else azp.double().reshape(-1, 1) * adj)
    out = acc * sb.double().reshape(1, -1) * sa.double().reshape(-1, 1)
    return out + bias.double() if bias is not None else out


def check(out, ref64, out_dtype, in_dtype):
    assert out.dtype == out_dtype and out.shape == ref64.shape
    o = out.double()
    assert torch.isfinite(o).all(), "non-finite output (unwritten or overflow)"
    rtol = RTOL[out_dtype]
    # int8: exact accumulation, the only error is the final rounding; fp8: fp32 partial sums
    # of the tensor cores, summed in another order than the reference (same bound as the
    # CUTLASS fp8 tests).
    atol_rel = 2e-3 if in_dtype == torch.float8_e4m3fn else rtol * 1e-2
    err = (o - ref64).abs()
    bound = rtol * ref64.abs() + atol_rel * ref64.abs().max() + 1e-6
    bad = err > bound
    assert not bad.any(), (
        f"{int(bad.sum())} of {bad.numel()} elements off; max err {err.max().item():.4g}, "
        f"max |ref| {ref64.abs().max().item():.4g}; first bad at {bad.nonzero()[0].tolist()}"
    )


def poison(M, N, out_dtype):
    """Fill the caching allocator's next block of this size with NaN (unwritten -> NaN)."""
    t = torch.full((M, N), float("nan"), dtype=out_dtype, device="cuda")
    del t


def decode(a, b, sa, sb, out_dtype, bias=None, azp_adj=None, azp=None, splits=-1):
    poison(a.shape[0], b.shape[1], out_dtype)
    return torch.ops.quantfuse._scaled_mm_decode_cuda(a, b, sa, sb, out_dtype, bias, azp_adj, azp, splits)


# ----------------------------------------------------------------------------- epilogue matrix

@pytest.mark.parametrize("in_dtype", INS, ids=["int8", "fp8"])
@pytest.mark.parametrize("out_dtype", OUTS, ids=["f16", "bf16", "f32"])
def test_epilogue_matrix(in_dtype, out_dtype):
    """Every M x epilogue x scale granularity x bias, small shapes (cycled)."""
    if not _cap_ok(in_dtype):
        pytest.skip(f"{in_dtype} needs a newer GPU")
    epis = EPIS if in_dtype == torch.int8 else EPIS[:1]
    shapes = itertools.cycle(SMALL_NK)
    n = 0
    for M, epi, sa_tok, sb_ch, with_bias in itertools.product(M_ALL, epis, (False, True), (False, True),
                                                              (False, True)):
        N, K = next(shapes)
        a, b, sa, sb, bias, azp_adj, azp = make(M, N, K, in_dtype, out_dtype, sa_tok, sb_ch, with_bias, epi)
        out = decode(a, b, sa, sb, out_dtype, bias, azp_adj, azp)
        check(out, reference(a, b, sa, sb, bias, azp_adj, azp), out_dtype, in_dtype)
        n += 1
    assert n == len(M_ALL) * len(epis) * 8


@pytest.mark.parametrize("in_dtype", INS, ids=["int8", "fp8"])
@pytest.mark.parametrize("NK", LLM_NK, ids=[f"{n}x{k}" for n, k in LLM_NK])
def test_llm_shapes(in_dtype, NK):
    """LLM layer shapes, every M, cycling output dtype, epilogue and scale granularity."""
    if not _cap_ok(in_dtype):
        pytest.skip(f"{in_dtype} needs a newer GPU")
    N, K = NK
    w = rand_q((N, K), in_dtype)
    b = w.t()
    epis = itertools.cycle(EPIS if in_dtype == torch.int8 else EPIS[:1])
    outs = itertools.cycle(OUTS)
    for i, M in enumerate(M_ALL):
        out_dtype, epi = next(outs), next(epis)
        a = rand_q((M, K), in_dtype)
        sa = (torch.rand(M if i % 2 else 1, device="cuda") + 0.5) * 1e-2
        sb = (torch.rand(N if i % 4 < 2 else 1, device="cuda") + 0.5) * 1e-2
        bias = torch.randn(N, device="cuda").to(out_dtype) if i % 3 else None
        azp_adj = azp = None
        if epi != "sym":
            colsum = b.to(torch.int32).sum(0, dtype=torch.int32)
            azp_adj = colsum if epi == "azptok" else (7 * colsum).to(torch.int32)
            azp = torch.randint(-60, 60, (M,), dtype=torch.int32, device="cuda") if epi == "azptok" else None
        out = decode(a, b, sa, sb, out_dtype, bias, azp_adj, azp)
        check(out, reference(a, b, sa, sb, bias, azp_adj, azp), out_dtype, in_dtype)


# ----------------------------------------------------------------------------- work split

@pytest.mark.parametrize("in_dtype", INS, ids=["int8", "fp8"])
def test_forced_splits(in_dtype):
    """Every cluster split gives the right answer; int8 bitwise equal across splits (exact
    integer sums), and every split bitwise reproducible."""
    if not _cap_ok(in_dtype):
        pytest.skip(f"{in_dtype} needs a newer GPU")
    for M, N, K in ((1, 4096, 4096), (16, 192, 320), (9, 4096, 14336), (3, 72, 4112), (16, 64, 16)):
        a, b, sa, sb, bias, _, _ = make(M, N, K, in_dtype, torch.float32, True, True, True)
        ref = reference(a, b, sa, sb, bias)
        first = None
        for splits in (-1, 1, 2, 3, 5, 8):
            out = decode(a, b, sa, sb, torch.float32, bias, splits=splits)
            check(out, ref, torch.float32, in_dtype)
            assert torch.equal(out, decode(a, b, sa, sb, torch.float32, bias, splits=splits)), (M, N, K, splits)
            if in_dtype == torch.int8:
                if first is None:
                    first = out
                assert torch.equal(out, first), f"int8 result depends on splits={splits} at {M}x{N}x{K}"
        # forced warp counts with and without clusters (benchmark knobs of the tuning op)
        for splits, warps, batch in ((-1, 1, 4), (2, 1, 2), (1, 8, 4), (3, 2, 2), (8, 8, -1)):
            poison(M, N, torch.float32)
            out = torch.ops.quantfuse._scaled_mm_decode_tune(a, b, sa, sb, torch.float32, bias, splits, warps, batch)
            check(out, ref, torch.float32, in_dtype)
            if in_dtype == torch.int8:
                assert torch.equal(out, first), f"int8 result depends on {(splits, warps, batch)} at {M}x{N}x{K}"


def test_config_choice():
    """The work split the op reports: one cluster of at most 8 CTAs, at most 8 warps, and the
    partitions cover K."""
    sm90 = CAP >= (9, 0)
    for N, K in LLM_NK + SMALL_NK + ((32, 16),):
        splits, warps, per_part, batch = torch.ops.quantfuse._scaled_mm_decode_config(N, K)
        chunks = (K + 63) // 64
        assert 1 <= splits <= (8 if sm90 else 1) and 1 <= warps <= 8 and per_part >= 1 and batch == 0
        assert splits * warps * per_part >= chunks, (N, K, splits, warps, per_part)
        forced = torch.ops.quantfuse._scaled_mm_decode_config(N, K, 3)
        assert forced[0] == (min(3, chunks) if sm90 else 1)


# ----------------------------------------------------------------------------- layouts

@pytest.mark.parametrize("in_dtype", INS, ids=["int8", "fp8"])
def test_sliced_and_offset_inputs(in_dtype, route_decode):
    """a with a larger row pitch and an offset start; b from a wider, offset weight."""
    if not _cap_ok(in_dtype):
        pytest.skip(f"{in_dtype} needs a newer GPU")
    for M, N, K in ((5, 256, 512), (16, 4096, 4096), (1, 96, 1040)):
        big_a = rand_q((M + 3, K + 64), in_dtype)
        a = big_a[2 : 2 + M, 32 : 32 + K]  # row pitch K+64, start offset 16-byte aligned
        big_w = rand_q((N + 5, K + 48), in_dtype)
        b = big_w[3 : 3 + N, 16 : 16 + K].t()  # column-major with pitch K+48
        sa = torch.rand(M, device="cuda") + 0.5
        sb = (torch.rand(2 * N, device="cuda") + 0.5)[::2]  # strided: the public op realigns it
        bias = torch.randn(N + 1, device="cuda", dtype=torch.bfloat16)[1:]
        assert qsm.supports(a, b, sa, sb, torch.bfloat16, bias) is None
        assert qsm._decode_reason(a, b) is None
        poison(M, N, torch.bfloat16)
        out = ops.scaled_mm(a, b, sa, sb, torch.bfloat16, bias)
        check(out, reference(a, b, sa, sb, bias), torch.bfloat16, in_dtype)
        out = decode(a, b, sa, sb.contiguous(), torch.bfloat16, bias.clone())
        check(out, reference(a, b, sa, sb, bias), torch.bfloat16, in_dtype)


def test_fallbacks_and_errors(route_decode):
    """Inputs the decode kernel does not take are routed elsewhere; the private op names
    the argument it refuses."""
    M, N, K = 4, 64, 128
    a, b, sa, sb, bias, _, _ = make(M, N, K, torch.int8, torch.float16, True, True, True)
    assert qsm._decode_reason(a, b) is None
    assert "M=" in qsm._decode_reason(rand_q((17, K), torch.int8), b)
    assert qsm._decode_reason(rand_q((M, K + 8), torch.int8)[:, 8:], b) is not None  # misaligned a
    assert qsm._decode_reason(a, b.contiguous()) is not None  # b row-major
    with pytest.raises(RuntimeError, match="M = 17"):
        torch.ops.quantfuse._scaled_mm_decode_cuda(rand_q((17, K), torch.int8), b, sa[:1], sb, torch.float16)
    with pytest.raises(RuntimeError, match="column-major"):
        torch.ops.quantfuse._scaled_mm_decode_cuda(a, b.contiguous(), sa, sb, torch.float16)
    with pytest.raises(RuntimeError, match="scale_b"):
        torch.ops.quantfuse._scaled_mm_decode_cuda(a, b, sa, sb[:3], torch.float16)
    # a misaligned a through the public op still gives the right answer (another path)
    aa = rand_q((M, K + 8), torch.int8)[:, 8:]
    out = ops.scaled_mm(aa, b, sa, sb, torch.float16, bias)
    check(out, reference(aa, b, sa, sb, bias), torch.float16, torch.int8)


# ----------------------------------------------------------------------------- graphs, routing

@pytest.mark.parametrize("in_dtype", INS, ids=["int8", "fp8"])
def test_cuda_graph_capture_and_replay(in_dtype, route_decode):
    if not _cap_ok(in_dtype):
        pytest.skip(f"{in_dtype} needs a newer GPU")
    M, N, K = 8, 4096, 4096
    a, b, sa, sb, bias, _, _ = make(M, N, K, in_dtype, torch.bfloat16, True, True, True)
    ops.scaled_mm(a, b, sa, sb, torch.bfloat16, bias)  # warm up outside the graph
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        with torch.cuda.graph(g):
            out = ops.scaled_mm(a, b, sa, sb, torch.bfloat16, bias)
    torch.cuda.current_stream().wait_stream(s)
    for _ in range(3):
        a.copy_(rand_q((M, K), in_dtype))
        sa.copy_(torch.rand(M, device="cuda") + 0.5)
        out.fill_(float("nan"))
        g.replay()
        torch.cuda.synchronize()
        check(out, reference(a, b, sa, sb, bias), torch.bfloat16, in_dtype)


def _kernel_names(fn):
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    return [e.name for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]


def test_public_ops_route_small_m_to_decode(route_decode):
    N, K = 1024, 1024
    for M in (1, 16):
        a, b, sa, sb, bias, azp_adj, azp = make(M, N, K, torch.int8, torch.bfloat16, True, True, True, "azptok")
        names = _kernel_names(functools.partial(ops.scaled_mm, a, b, sa, sb, torch.bfloat16, bias))
        assert any("scaled_mm_decode" in n for n in names), names
        names = _kernel_names(functools.partial(ops.scaled_mm_azp, a, b, sa, sb, torch.bfloat16, azp_adj, azp, bias))
        assert any("scaled_mm_decode" in n for n in names), names
        out = ops.scaled_mm_azp(a, b, sa, sb, torch.bfloat16, azp_adj, azp, bias)
        check(out, reference(a, b, sa, sb, bias, azp_adj, azp), torch.bfloat16, torch.int8)
    if not hasattr(torch.ops.quantfuse, "_scaled_mm_cutlass"):
        return  # a decode-only build (QUANTFUSE_CSRC_ONLY): nothing serves M = 17
    a, b, sa, sb, bias, _, _ = make(17, N, K, torch.int8, torch.bfloat16, True, True, True)
    names = _kernel_names(lambda: ops.scaled_mm(a, b, sa, sb, torch.bfloat16, bias))
    assert not any("scaled_mm_decode" in n for n in names), names


def _sanitize_driver():
    """``compute-sanitizer --tool memcheck|racecheck python tests/test_cuda_scaled_mm_decode.py``."""
    assert kernels.ensure_loaded(), kernels.status()
    n = 0
    for (M, N, K), splits, in_dtype in itertools.product(((1, 64, 128), (9, 72, 528), (16, 4096, 1024)),
                                                          (1, 3, 8), INS):
        if not _cap_ok(in_dtype):
            continue
        epi = "azptok" if in_dtype == torch.int8 and n % 2 else "sym"
        a, b, sa, sb, bias, azp_adj, azp = make(M, N, K, in_dtype, torch.float16, True, True, True, epi)
        out = decode(a, b, sa, sb, torch.float16, bias, azp_adj, azp, splits=splits)
        check(out, reference(a, b, sa, sb, bias, azp_adj, azp), torch.float16, in_dtype)
        n += 1
    torch.cuda.synchronize()
    print(f"sanitize driver: {n} decode kernel calls checked")


if __name__ == "__main__":
    _sanitize_driver()
