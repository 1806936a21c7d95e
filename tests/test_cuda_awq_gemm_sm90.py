"""GPU tests of the Hopper AWQ prefill kernel (csrc/awq_gemm/awq_gemm_sm90*) through its private
ops (``_awq_prepare_sm90_cuda`` once per weight, ``_awq_gemm_sm90_cuda``) and through
quantfuse.awq_gemm, whose C++ dispatch sends it M > AWQ_DECODE_MAX_M where it takes the shape.

Skipped without CUDA; on a GPU other than sm_90 only the other kernels' answer is checked.
Every case draws fresh random data (zeros include 0 and 15, scales span ~1.6 decades,
activations ~100 with a few near fp16's top), and compares with a float64 reference of
x @ ((q - z) * s) computed from the integers.

Tolerance (derived, not tuned).  The kernel computes w = q*s + zero' in the activation
dtype with zero' = -z*s rounded once (prepare), the product q*s and the sum each rounded
(or fused), then an fp32-accumulated wgmma and one rounding of the output.  With u the
unit roundoff (2^-11 fp16, 2^-8 bf16) each weight's error is at most
e = u * (|z s| + |q s| + |w|) (1 + u), so
  |out - ref| <= u |ref| + |x| @ e + K * 2^-23 * (|x| @ |w|)          (elementwise, hard)
and, the rounding errors being independent with random signs,
  ||out - ref|| <= u ||ref|| + || sqrt(x^2 @ e^2) ||                   (norm, expected)
(the norm of the error if every term reached its bound with a random sign; the actual
errors are uniformly distributed below their bounds, so this has ~1.7x headroom).
"""

from __future__ import annotations

import functools
import gc

import pytest
import torch
from awq_data import check_sm90, make_awq, make_x
from conftest import AWQ_DECODE_MAX_M, AWQ_SM90_NUM_CONFIGS, DEV, HOPPER, awq_kernel_reason, kernel_names

import compile_backend  # noqa: F401  (registers the ops)
from compile_backend.quantize import awq_pack

pytestmark = pytest.mark.gpu
IS_SM90 = HOPPER
needs_sm90 = pytest.mark.skipif(not IS_SM90, reason="the kernel is sm_90a only")
GROUPS = (64, 128, -1)  # -1: per-channel (group = K); 32 is unsupported (see test below)
DTYPES = (torch.float16, torch.bfloat16)


check = check_sm90


def sm90_gemm(x, qweight, scales, qzeros, G, bias=None, config=-1, pad=-1):
    """x @ W + bias through the private ops: the weight prepared, then the SM90 kernel
    (``config`` 0..AWQ_SM90_NUM_CONFIGS-1 forces a tile configuration, -1 lets it choose;
    ``pad`` 1 forces the padded copy of x where the last token tile is mostly empty, 0 the
    zero-filled tile, -1 lets the rule choose)."""
    wq, s, z = torch.ops.quantfuse._awq_prepare_sm90_cuda(qweight, scales, qzeros, G)
    return torch.ops.quantfuse._awq_gemm_sm90_cuda(x, wq, s, z, G, bias, config, pad)


def routed_to_sm90(names) -> bool:
    """The profiled kernels are the SM90 kernel's (the CUTLASS mixed-input GEMM), not the
    streaming or the dequantize kernel."""
    text = " ".join(names)
    return ("cutlass" in text.lower() or "device_kernel" in text) and "awq_gemm_kernel" not in text \
        and "awq_dequantize_kernel" not in text


def run_case(M, N, K, group, dtype, seed, bias=False, config=-1, pad=-1):
    """The private ops (``config`` forced or chosen); with the chosen config and M above
    AWQ_DECODE_MAX_M also the public op, which the dispatch sends to this kernel."""
    gen = torch.Generator(device=DEV).manual_seed(seed)
    qw, s, qz, G, q, z = make_awq(K, N, group, dtype, gen)
    x = make_x(M, K, dtype, gen)
    b = (torch.randn(N, generator=gen, device=DEV) * 10).to(dtype) if bias else None
    assert awq_kernel_reason(x, qw, s, qz, G, b) == ""
    what = f"M={M} N={N} K={K} G={G} {dtype} bias={bias} config={config} pad={pad}"
    out = sm90_gemm(x, qw, s, qz, G, b, config, pad)
    torch.cuda.synchronize()
    check(out, x, q, z, s, G, b, what)
    if config == -1 and pad == -1 and M > AWQ_DECODE_MAX_M:
        out = torch.ops.quantfuse.awq_gemm(x, qw, s, qz, G, b)
        check(out, x, q, z, s, G, b, what + ", public op")


@pytest.fixture(scope="module", autouse=True)
def _sm90_built(cuda_kernels):
    if IS_SM90:
        assert hasattr(torch.ops.quantfuse, "_awq_gemm_sm90_cuda"), "SM90 AWQ kernels not in the extension"


@needs_sm90
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("M", (65, 100, 128, 256, 1024, 4096))
def test_all_groups(M, dtype):
    for i, group in enumerate(GROUPS):
        run_case(M, 768, 1024, group, dtype, seed=1000 * M + 10 * i + (dtype == torch.bfloat16),
                 bias=(i % 2 == 0))
        run_case(M, 256, 512, group, dtype, seed=1000 * M + 10 * i + 5, bias=(i % 2 == 1))


@needs_sm90
@pytest.mark.parametrize("N,K,M,dtype,group", [
    (28672, 4096, 256, torch.float16, 128),
    (4096, 14336, 1024, torch.bfloat16, 128),
    (6144, 4096, 100, torch.bfloat16, 64),
    (4096, 4096, 4096, torch.float16, -1),
])
def test_llama_shapes(N, K, M, dtype, group):
    run_case(M, N, K, group, dtype, seed=N + K + M, bias=(group == 128))


@needs_sm90
@pytest.mark.parametrize("config", range(AWQ_SM90_NUM_CONFIGS))
@pytest.mark.parametrize("dtype", DTYPES)
def test_each_config(config, dtype):
    """Every tile configuration at small and large M (partial tiles included), with an
    odd number of 128-row weight tiles (N = 384: the 2x1 cluster's second CTA is idle;
    configs 4, 11 and 12: stream-K splits the K loop of some tiles over several CTAs;
    configs 5-10: token tiles of 160-224; config 13: 64-token tiles, several per call)."""
    for M in (65, 300, 1500):
        run_case(M, 1024, 2048, 128, dtype, seed=M + config, bias=True, config=config)
        run_case(M, 384, 1024, -1, dtype, seed=M + config + 7, config=config)


@needs_sm90
def test_token_padding_rule():
    """x is copied into a buffer padded to whole token tiles when at least 45% of the last one
    would be past its end and the call is long enough for the copy to pay
    (awq_gemm_sm90_choice.h: padded_tokens), and only then."""
    def rows(m, c, n=28672, k=4096):
        return torch.ops.quantfuse._awq_sm90_rows(m, n, k, c, 132)

    assert [rows(m, 1) for m in (1, 33, 70, 71, 100, 128, 129, 200)] == [128, 128, 128, 71, 100, 128, 256, 200]
    assert [rows(m, c) for m, c in ((129, 3), (140, 3), (141, 2), (300, 2), (1000, 3), (1024, 3))] == [
        256, 256, 141, 512, 1000, 1024]
    assert [rows(m, 4) for m in (1, 70, 71, 300, 330)] == [128, 128, 71, 384, 330]
    assert [rows(m, 5) for m in (1, 88, 89, 161, 300, 320)] == [160, 160, 89, 320, 300, 320]
    assert [rows(m, 10) for m in (123, 124, 225, 448)] == [224, 124, 448, 448]
    assert [rows(m, 13) for m in (1, 33, 35, 36, 48, 64)] == [64, 64, 64, 36, 48, 64]
    assert rows(33, 13, 4096, 4096) == 64
    # calls too short for the copy to pay run on the zero-filled tile
    assert [rows(192, 1, 256, 256), rows(33, 13, 1024, 1024), rows(300, 2, 640, 1024)] == [192, 33, 300]
    with pytest.raises(RuntimeError, match="config in 0..13"):
        rows(1, AWQ_SM90_NUM_CONFIGS)
    assert rows(0, 0) == 0


@needs_sm90
def test_config_choice():
    """The wave cost model (awq_gemm_sm90_choice.h: choose_config; tests/test_awq_sm90_choice.py
    checks it on the CPU) as the op exposes it: above 128 tokens the token
    tile is sized to M, the 128-deep K tiles only where the group size allows them, and
    stream-K where a long K loop has few tiles."""
    choose = torch.ops.quantfuse._awq_sm90_config
    tokens = torch.ops.quantfuse._awq_sm90_rows
    # 4096 x 4096: 160-, 192- and 224-token tiles at M = 320, 384, 448 (128 tiles: one wave)
    assert [choose(m, 4096, 4096, 128, 132) for m in (320, 384, 448, 640, 768)] == [5, 6, 7, 8, 9]
    assert [tokens(m, 4096, 4096, choose(m, 4096, 4096, 128, 132)) for m in (320, 384, 448)] == [320, 384, 448]
    assert choose(320, 4096, 4096, 64, 132) not in (1, 5, 6, 7)  # group 64: no 128-deep K tiles
    assert choose(128, 4096, 14336, 128, 132) == 4
    assert choose(128, 4096, 4096, 128, 132) == 1
    # at most 64 tokens: 64-token tiles (a 128-token one would be half padding); up to 128:
    # 128-token tiles (a wider tile would be padding, a narrower one read the weight twice)
    assert all(choose(m, n, 4096, 128, 132) == 13 for m in (33, 48, 64) for n in (4096, 6144, 28672))
    assert all(tokens(1, n, 4096, choose(m, n, 4096, 128, 132)) == 128
               for m in (65, 100, 128) for n in (4096, 6144, 28672))
    assert choose(64, 4096, 4096, 64, 132) not in (1, 5, 6, 7, 13)  # group 64: no 128-deep K tiles
    assert all(choose(m, 4096, 14336, 128, 132) == 4 for m in (33, 64))  # long K, few tiles: stream-K
    # 4096 x 14336 at M = 1152: stream-K over 128 x 192 tiles rather than 128 x 256 data-parallel
    # ones (160 tiles, 1.2 waves); configs 0-10 alone chose 64 x 192 (2.9 waves)
    assert choose(1152, 4096, 14336, 128, 132) == 12
    # many waves: 128 x 256 tiles, data-parallel (3) or stream-K (11)
    assert all(choose(8192, n, 4096, 128, 132) in (3, 11) for n in (4096, 6144, 28672))
    assert choose(4096, 4096, 4096, 128, 132) == 3


@needs_sm90
@pytest.mark.parametrize("dtype", DTYPES)
def test_padded_calls(dtype):
    """Calls whose last token tile is mostly empty, run on a padded copy of x (forced: these
    shapes are short enough for the rule to choose the zero-filled tile) and on the
    zero-filled tile, give the first M rows, contiguous, with the same bound as every other
    call; auto and forced configs."""
    for i, M in enumerate((1, 33, 129, 300)):
        for pad in (-1, 0, 1):
            run_case(M, 640, 1024, 128, dtype, seed=70 + i, bias=(i % 2 == 0), pad=pad)
            run_case(M, 256, 512, -1, dtype, seed=80 + i, config=i % 5, pad=pad)


@needs_sm90
@pytest.mark.parametrize("dtype", DTYPES)
def test_padded_rows_do_not_reach_the_output(dtype):
    """A padded call copies x into a buffer of whole token tiles and leaves the rows past M as
    the allocator hands them out.  Here the block it gets held NaN: none may reach the M rows
    returned (each output row reads its own row of x only)."""
    gen = torch.Generator(device=DEV).manual_seed(91)
    N, K = 384, 1024
    qw, s, qz, G, q, z = make_awq(K, N, 128, dtype, gen)
    wq, sp, zp = torch.ops.quantfuse._awq_prepare_sm90_cuda(qw, s, qz, G)
    for M, config in ((33, 13), (33, 1), (60, 0), (129, 3)):
        tile = torch.ops.quantfuse._awq_sm90_rows(1, 28672, 4096, config)  # one whole tile
        rows = -(-M // tile) * tile
        assert rows > M
        x = make_x(M, K, dtype, gen)
        # the caching allocator hands a freed block of the same size out first
        junk = torch.full((rows, K), float("nan"), dtype=dtype, device=DEV)
        del junk
        out = torch.ops.quantfuse._awq_gemm_sm90_cuda(x, wq, sp, zp, G, None, config, 1)
        torch.cuda.synchronize()
        check(out, x, q, z, s, G, None, f"M={M} config={config} {dtype}, NaN in the padded rows' block")


@needs_sm90
def test_prepare_cache_hit_and_invalidation():
    """The public op prepares a weight once (derived-value cache: values made, served, live
    entries), again after an in-place write to any of qweight, scales, qzeros, and drops the
    entry with the weight."""
    stats = torch.ops.quantfuse._derived_cache_stats
    gemm = torch.ops.quantfuse.awq_gemm
    gen = torch.Generator(device=DEV).manual_seed(5)
    qw, s, qz, G, q, z = make_awq(512, 256, 128, torch.bfloat16, gen)
    x = make_x(70, 512, torch.bfloat16, gen)
    assert routed_to_sm90(kernel_names(functools.partial(gemm, x, qw, s, qz, G)))  # makes the value
    made, hits, _ = stats()
    check(gemm(x, qw, s, qz, G), x, q, z, s, G, None, "cached")
    check(gemm(x, qw, s, qz, G), x, q, z, s, G, None, "cached again")
    assert stats()[:2] == [made, hits + 2], (made, hits, stats())
    # in-place changes of any of the three tensors are noticed
    q2 = torch.randint(0, 16, q.shape, generator=gen, device=DEV, dtype=torch.int32)
    qw.copy_(awq_pack(q2))
    check(gemm(x, qw, s, qz, G), x, q2, z, s, G, None, "after qweight update")
    s.mul_(2)
    check(gemm(x, qw, s, qz, G), x, q2, z, s, G, None, "after scales update")
    z2 = torch.randint(0, 16, z.shape, generator=gen, device=DEV, dtype=torch.int32)
    qz.copy_(awq_pack(z2))
    check(gemm(x, qw, s, qz, G), x, q2, z2, s, G, None, "after qzeros update")
    assert stats()[0] == made + 3, (made, stats())
    # the entry goes with the weight (collect first: earlier tests' tensors may be garbage)
    gc.collect()
    entries = stats()[2]
    del qw
    gc.collect()
    assert stats()[2] == entries - 1


@needs_sm90
@pytest.mark.parametrize("M", (33, 100, 512))  # 33: padded x (the pad is captured too)
def test_cuda_graph_replay(M):
    """The kernel captured on its prepared weight, and the public op captured after a warm-up
    call; both replay on new activations."""
    gen = torch.Generator(device=DEV).manual_seed(11 + M)
    N, K = 1024, 2048
    qw, s, qz, G, q, z = make_awq(K, N, 128, torch.float16, gen)
    b = (torch.randn(N, generator=gen, device=DEV) * 10).to(torch.float16)
    x = make_x(M, K, torch.float16, gen)
    wq, s2, z2 = torch.ops.quantfuse._awq_prepare_sm90_cuda(qw, s, qz, G)
    torch.ops.quantfuse._awq_gemm_sm90_cuda(x, wq, s2, z2, G, b, -1)  # warm-up
    torch.ops.quantfuse.awq_gemm(x, qw, s, qz, G, b)  # warm-up: the dispatch prepares and keeps the weight
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = torch.ops.quantfuse._awq_gemm_sm90_cuda(x, wq, s2, z2, G, b, -1)
        out_op = torch.ops.quantfuse.awq_gemm(x, qw, s, qz, G, b)
    for _ in range(2):  # new activations each replay
        x.copy_(make_x(M, K, torch.float16, gen))
        out.fill_(float("nan"))
        out_op.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        check(out, x, q, z, s, G, b, f"graph replay M={M}")
        check(out_op, x, q, z, s, G, b, f"graph replay M={M}, public op")


@needs_sm90
def test_m_zero_and_other_kernels():
    """M = 0 gives an empty result; where the SM90 kernel does not take the shape (group 32,
    N not a multiple of 128) the public op runs the dequantize kernel + cuBLAS at M = 100; an x
    at a misaligned start runs the SM90 kernel on a copy.  Every result within the bound."""
    gen = torch.Generator(device=DEV).manual_seed(9)
    qw, s, qz, G, q, z = make_awq(512, 256, 128, torch.float16, gen)
    empty = torch.empty(0, 512, device=DEV, dtype=torch.float16)
    assert torch.ops.quantfuse.awq_gemm(empty, qw, s, qz, G).shape == (0, 256)
    assert sm90_gemm(empty, qw, s, qz, G).shape == (0, 256)
    x = make_x(100, 512, torch.float16, gen)
    qw32, s32, qz32, G32, q32, z32 = make_awq(512, 256, 32, torch.float16, gen)
    qwn, sn, qzn, Gn, qn, zn = make_awq(512, 320, 128, torch.float16, gen)
    for what, (qw_, s_, qz_, G_, q_, z_) in {"group 32": (qw32, s32, qz32, G32, q32, z32),
                                              "N = 320": (qwn, sn, qzn, Gn, qn, zn)}.items():
        assert awq_kernel_reason(x, qw_, s_, qz_, G_) == "", what
        names = " ".join(kernel_names(lambda qw_=qw_, s_=s_, qz_=qz_, G_=G_: torch.ops.quantfuse.awq_gemm(
            x, qw_, s_, qz_, G_)))
        assert "awq_dequantize_kernel" in names and not routed_to_sm90([names]), (what, names[:2000])
        check(torch.ops.quantfuse.awq_gemm(x, qw_, s_, qz_, G_), x, q_, z_, s_, G_, None, what)
    # x at an odd offset inside a larger buffer: not 16-byte aligned
    buf = torch.empty(100 * 512 + 1, device=DEV, dtype=torch.float16)
    xm = buf[1:].view(100, 512)
    xm.copy_(x)
    assert awq_kernel_reason(xm, qw, s, qz, G) == ""
    assert routed_to_sm90(kernel_names(lambda: torch.ops.quantfuse.awq_gemm(xm, qw, s, qz, G)))
    check(torch.ops.quantfuse.awq_gemm(xm, qw, s, qz, G), x, q, z, s, G, None, "misaligned x")


@pytest.mark.skipif(IS_SM90, reason="checks the answer on other GPUs")
def test_not_sm90_other_kernels():
    """Off sm_90 the public op runs the dequantize kernel + cuBLAS at M = 100 (above the
    streaming kernel's rows), never the SM90 kernel."""
    gen = torch.Generator(device=DEV).manual_seed(1)
    qw, s, qz, G, q, z = make_awq(512, 256, 128, torch.float16, gen)
    x = make_x(100, 512, torch.float16, gen)
    assert awq_kernel_reason(x, qw, s, qz, G) == ""
    names = " ".join(kernel_names(lambda: torch.ops.quantfuse.awq_gemm(x, qw, s, qz, G)))
    assert "awq_dequantize_kernel" in names, names[:2000]
