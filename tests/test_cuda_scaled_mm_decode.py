"""GPU tests of the W8A8 decode kernel (M <= 16) behind quantfuse.scaled_mm / scaled_mm_azp:
quantfuse::_scaled_mm_decode_cuda (csrc/scaled_mm/scaled_mm_decode*).

Skipped without CUDA.  Every M up to 16 x int8/fp8 x every epilogue x scale granularity x
bias x output dtype against a float64 reference on fresh random data; LLM-sized (N, K);
sliced / offset inputs, and layouts the kernel does not read (copied by the dispatch);
N not a multiple of the 32-channel tile; forced cluster splits (int8 results bitwise equal
for every split); CUDA-graph capture and replay; routing of the public ops (profiler).
"""

from __future__ import annotations

import functools
import itertools

import pytest
import torch
from conftest import (
    CAP,
    DECODE_MAX_M,
    INS,
    OUTS,
    assert_pdl_on_off_equal,
    check_w8a8,
    kernel_names,
    load_cuda_kernels,
    poison,
    ran_quantfuse_kernel,
    rand_q,
    w8a8_kernel_reason,
    w8a8_reference64,
)

pytestmark = pytest.mark.gpu

M_ALL = (1, 2, 3, 7, 8, 9, 15, 16)
LLM_NK = ((4096, 4096), (6144, 4096), (28672, 4096), (4096, 14336))
SMALL_NK = ((64, 128), (192, 320), (72, 528))  # 72: not a multiple of the 16-channel tile
# epilogue kinds: symmetric, per-tensor zero point (folded into azp_adj), per-token zero points
EPIS = ("sym", "azp", "azptok")


def _cap_ok(in_dtype):
    return CAP >= ((8, 9) if in_dtype == torch.float8_e4m3fn else (8, 0))


@pytest.fixture(scope="module", autouse=True)
def _decode_built(cuda_kernels):
    if not hasattr(torch.ops.quantfuse, "_scaled_mm_decode_cuda"):
        pytest.skip("decode kernel not built (QUANTFUSE_CSRC_ONLY)")


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


def decode(a, b, sa, sb, out_dtype, bias=None, azp_adj=None, azp=None, splits=-1):
    poison((a.shape[0], b.shape[1]), out_dtype)
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
        check_w8a8(out, w8a8_reference64(a, b, sa, sb, bias, azp_adj, azp), out_dtype, in_dtype)
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
        check_w8a8(out, w8a8_reference64(a, b, sa, sb, bias, azp_adj, azp), out_dtype, in_dtype)


# ----------------------------------------------------------------------------- work split

@pytest.mark.parametrize("in_dtype", INS, ids=["int8", "fp8"])
def test_forced_splits(in_dtype):
    """Every cluster split gives the right answer; int8 bitwise equal across splits (exact
    integer sums), and every split bitwise reproducible."""
    if not _cap_ok(in_dtype):
        pytest.skip(f"{in_dtype} needs a newer GPU")
    for M, N, K in ((1, 4096, 4096), (16, 192, 320), (9, 4096, 14336), (3, 72, 4112), (16, 64, 16)):
        a, b, sa, sb, bias, _, _ = make(M, N, K, in_dtype, torch.float32, True, True, True)
        ref = w8a8_reference64(a, b, sa, sb, bias)
        first = None
        for splits in (-1, 1, 2, 3, 5, 8):
            out = decode(a, b, sa, sb, torch.float32, bias, splits=splits)
            check_w8a8(out, ref, torch.float32, in_dtype)
            assert torch.equal(out, decode(a, b, sa, sb, torch.float32, bias, splits=splits)), (M, N, K, splits)
            if in_dtype == torch.int8:
                if first is None:
                    first = out
                assert torch.equal(out, first), f"int8 result depends on splits={splits} at {M}x{N}x{K}"
        # forced warp counts with and without clusters (benchmark knobs of the tuning op)
        for splits, warps, batch in ((-1, 1, 4), (2, 1, 2), (1, 8, 4), (3, 2, 2), (8, 8, -1)):
            poison((M, N), torch.float32)
            out = torch.ops.quantfuse._scaled_mm_decode_tune(a, b, sa, sb, torch.float32, bias, splits, warps, batch)
            check_w8a8(out, ref, torch.float32, in_dtype)
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
def test_sliced_and_offset_inputs(in_dtype):
    """a with a larger row pitch and an offset start; b from a wider, offset weight: the public
    op runs the decode kernel on them in place (a strided scale and an offset bias it copies)."""
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
        assert w8a8_kernel_reason(a, b, sa, sb, torch.bfloat16, bias) == ""
        names = kernel_names(functools.partial(torch.ops.quantfuse.scaled_mm, a, b, sa, sb, torch.bfloat16, bias))
        assert any("scaled_mm_decode" in n for n in names), names
        poison((M, N), torch.bfloat16)
        out = torch.ops.quantfuse.scaled_mm(a, b, sa, sb, torch.bfloat16, bias)
        check_w8a8(out, w8a8_reference64(a, b, sa, sb, bias), torch.bfloat16, in_dtype)
        out = decode(a, b, sa, sb.contiguous(), torch.bfloat16, bias.clone())
        check_w8a8(out, w8a8_reference64(a, b, sa, sb, bias), torch.bfloat16, in_dtype)


def test_routing_layout_copies_and_errors():
    """The public op runs the decode kernel up to DECODE_MAX_M rows, also on layouts the kernel
    does not read (a misaligned, b row-major: it runs on a copy), and another kernel from
    DECODE_MAX_M + 1 rows; every result matches the float64 reference.  The private op names
    the argument it refuses."""
    M, N, K = 4, 64, 128
    a, b, sa, sb, bias, _, _ = make(M, N, K, torch.int8, torch.float16, True, True, True)
    cases = {
        "in place": (a, b),
        "a misaligned": (rand_q((M, K + 8), torch.int8)[:, 8:], b),
        "b row-major": (a, b.contiguous()),
    }
    for name, (aa, bb) in cases.items():
        assert w8a8_kernel_reason(aa, bb, sa, sb, torch.float16, bias) == "", name
        names = kernel_names(functools.partial(torch.ops.quantfuse.scaled_mm, aa, bb, sa, sb, torch.float16, bias))
        assert any("scaled_mm_decode" in n for n in names), (name, names)
        out = torch.ops.quantfuse.scaled_mm(aa, bb, sa, sb, torch.float16, bias)
        check_w8a8(out, w8a8_reference64(aa, bb, sa, sb, bias), torch.float16, torch.int8, what=name)
    if hasattr(torch.ops.quantfuse, "_scaled_mm_cutlass"):  # else a decode-only build (QUANTFUSE_CSRC_ONLY)
        a17, sa17 = rand_q((DECODE_MAX_M + 1, K), torch.int8), torch.rand(DECODE_MAX_M + 1, device="cuda") + 0.5
        names = kernel_names(functools.partial(torch.ops.quantfuse.scaled_mm, a17, b, sa17, sb, torch.float16, bias))
        assert not any("scaled_mm_decode" in n for n in names) and ran_quantfuse_kernel(names), names
        out = torch.ops.quantfuse.scaled_mm(a17, b, sa17, sb, torch.float16, bias)
        check_w8a8(out, w8a8_reference64(a17, b, sa17, sb, bias), torch.float16, torch.int8, what="M = 17")
    with pytest.raises(RuntimeError, match="M = 17"):
        torch.ops.quantfuse._scaled_mm_decode_cuda(rand_q((17, K), torch.int8), b, sa[:1], sb, torch.float16)
    with pytest.raises(RuntimeError, match="column-major"):
        torch.ops.quantfuse._scaled_mm_decode_cuda(a, b.contiguous(), sa, sb, torch.float16)
    with pytest.raises(RuntimeError, match="scale_b"):
        torch.ops.quantfuse._scaled_mm_decode_cuda(a, b, sa, sb[:3], torch.float16)


# ----------------------------------------------------------------------------- graphs, routing

@pytest.mark.parametrize("in_dtype", INS, ids=["int8", "fp8"])
def test_cuda_graph_capture_and_replay(in_dtype):
    if not _cap_ok(in_dtype):
        pytest.skip(f"{in_dtype} needs a newer GPU")
    M, N, K = 8, 4096, 4096
    a, b, sa, sb, bias, _, _ = make(M, N, K, in_dtype, torch.bfloat16, True, True, True)
    torch.ops.quantfuse.scaled_mm(a, b, sa, sb, torch.bfloat16, bias)  # warm up outside the graph
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        with torch.cuda.graph(g):
            out = torch.ops.quantfuse.scaled_mm(a, b, sa, sb, torch.bfloat16, bias)
    torch.cuda.current_stream().wait_stream(s)
    for _ in range(3):
        a.copy_(rand_q((M, K), in_dtype))
        sa.copy_(torch.rand(M, device="cuda") + 0.5)
        out.fill_(float("nan"))
        g.replay()
        torch.cuda.synchronize()
        check_w8a8(out, w8a8_reference64(a, b, sa, sb, bias), torch.bfloat16, in_dtype)


@pytest.mark.parametrize("in_dtype", INS, ids=["int8", "fp8"])
@pytest.mark.parametrize("M", [1, 16])
def test_pdl_on_and_off_equal(in_dtype, M):
    """The decode kernel with programmatic dependent launch and without: the same bits, eagerly and in
    CUDA graphs (``conftest.assert_pdl_on_off_equal``)."""
    if not _cap_ok(in_dtype):
        pytest.skip(f"{in_dtype} needs a newer GPU")
    N, K = 4096, 4096
    a, b, sa, sb, bias, _, _ = make(M, N, K, in_dtype, torch.bfloat16, True, True, True)
    assert_pdl_on_off_equal(
        lambda x, pdl: torch.ops.quantfuse._scaled_mm_decode_tune(x, b, sa, sb, torch.bfloat16, bias, -1, -1, -1, pdl),
        a, lambda: rand_q((M, K), in_dtype))


def test_public_ops_route_small_m_to_decode():
    N, K = 1024, 1024
    for M in (1, DECODE_MAX_M):
        a, b, sa, sb, bias, azp_adj, azp = make(M, N, K, torch.int8, torch.bfloat16, True, True, True, "azptok")
        names = kernel_names(functools.partial(torch.ops.quantfuse.scaled_mm, a, b, sa, sb, torch.bfloat16, bias))
        assert any("scaled_mm_decode" in n for n in names), names
        names = kernel_names(
            functools.partial(torch.ops.quantfuse.scaled_mm_azp, a, b, sa, sb, torch.bfloat16, azp_adj, azp, bias))
        assert any("scaled_mm_decode" in n for n in names), names
        out = torch.ops.quantfuse.scaled_mm_azp(a, b, sa, sb, torch.bfloat16, azp_adj, azp, bias)
        check_w8a8(out, w8a8_reference64(a, b, sa, sb, bias, azp_adj, azp), torch.bfloat16, torch.int8)
    if not hasattr(torch.ops.quantfuse, "_scaled_mm_cutlass"):
        return  # a decode-only build (QUANTFUSE_CSRC_ONLY): nothing serves M = 17
    a, b, sa, sb, bias, _, _ = make(DECODE_MAX_M + 1, N, K, torch.int8, torch.bfloat16, True, True, True)
    names = kernel_names(lambda: torch.ops.quantfuse.scaled_mm(a, b, sa, sb, torch.bfloat16, bias))
    assert not any("scaled_mm_decode" in n for n in names), names


def _sanitize_driver():
    """``compute-sanitizer --tool memcheck|racecheck python tests/test_cuda_scaled_mm_decode.py``."""
    load_cuda_kernels()
    n = 0
    for (M, N, K), splits, in_dtype in itertools.product(((1, 64, 128), (9, 72, 528), (16, 4096, 1024)),
                                                          (1, 3, 8), INS):
        if not _cap_ok(in_dtype):
            continue
        epi = "azptok" if in_dtype == torch.int8 and n % 2 else "sym"
        a, b, sa, sb, bias, azp_adj, azp = make(M, N, K, in_dtype, torch.float16, True, True, True, epi)
        out = decode(a, b, sa, sb, torch.float16, bias, azp_adj, azp, splits=splits)
        check_w8a8(out, w8a8_reference64(a, b, sa, sb, bias, azp_adj, azp), torch.float16, in_dtype)
        n += 1
    torch.cuda.synchronize()
    print(f"sanitize driver: {n} decode kernel calls checked")


if __name__ == "__main__":
    _sanitize_driver()
