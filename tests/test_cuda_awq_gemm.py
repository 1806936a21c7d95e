"""GPU tests of the AWQ W4A16 CUDA kernels (csrc/awq_gemm/) behind quantfuse.awq_gemm /
awq_dequantize, and their C++ dispatch (csrc/awq_gemm/awq_gemm_dispatch.cpp).

Skipped as a whole without CUDA.  Every check draws fresh random data (zeros and scales
at their extremes, large activations, never all zeros), poisons the memory the output
will be allocated from with NaN, and compares with a float64 reference computed from
the packed integers.
"""

from __future__ import annotations

import logging

import pytest
import torch
from awq_data import check_close, folds, make_awq, make_x, op_exact, reference64
from conftest import (
    AWQ_DECODE_MAX_M,
    AWQ_KERNEL_MAX_M,
    DEV,
    HOPPER,
    assert_pdl_on_off_equal,
    awq_kernel_reason,
    kernel_names,
    poison,
)

import compile_backend
from compile_backend.ops import AWQ_SHIFTS
from compile_backend.ops.awq_gemm import awq_from_fragments, awq_to_fragments, fragment_layout_takes
from compile_backend.quantize import awq_pack

pytestmark = pytest.mark.gpu
GROUPS = (32, 64, 128, -1)  # -1: per-channel (group = K)
M_ALL = (1, 2, 3, 7, 8, 15, 16, 17, 31, 32, 64, 100, 256, 1024, 4096)
LLAMA = ((6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336))


def repacked(qweight):
    """The streaming kernel's layout of ``qweight`` (the dispatch keeps one per weight)."""
    return torch.ops.quantfuse._awq_repack_cuda(qweight)


def names_of(fn) -> str:
    return " ".join(kernel_names(fn))


def run_case(M, N, K, group, dtype, seed, bias=False):
    gen = torch.Generator(device=DEV).manual_seed(seed)
    qw, s, qz, G, q, z = make_awq(K, N, group, dtype, gen)
    x = make_x(M, K, dtype, gen)
    b = (torch.randn(N, generator=gen, device=DEV) * 10).to(dtype) if bias else None
    poison(M * N, dtype)
    out = torch.ops.quantfuse.awq_gemm(x, qw, s, qz, G, b)
    torch.cuda.synchronize()
    ref, mag = reference64(x, q, z, s, G, b, exact=op_exact(M, N))
    check_close(out, ref, mag, dtype, f"M={M} N={N} K={K} G={G} {dtype} bias={bias}")
    if fragment_layout_takes(K, N):
        # The layout AWQLinear holds: the same kernels on the same values, so the same bits.
        poison(M * N, dtype)
        held = torch.ops.quantfuse.awq_gemm(x, repacked(qw), s, qz, G, b)
        assert torch.equal(held, out), f"fragment layout differs: M={M} N={N} K={K} G={G} {dtype}"


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("M", M_ALL)
def test_small_shape_all_groups(M, dtype):
    for i, group in enumerate(GROUPS):
        run_case(M, 320, 512, group, dtype, seed=1000 * M + i, bias=(i % 2 == 1))


@pytest.mark.parametrize("N,K", LLAMA)
@pytest.mark.parametrize("M", (1, 8, 16, 31, 64, 100, 256, 1024))
def test_llama_shapes(M, N, K):
    i = M + N // 64
    dtype = (torch.float16, torch.bfloat16)[i % 2]
    group = GROUPS[i % 4]
    run_case(M, N, K, group, dtype, seed=i, bias=(i % 3 == 0))


@pytest.mark.parametrize("warps", (4, 8))
@pytest.mark.parametrize("M", (1, 5, 16, 17, 33, 64, 130))
def test_kernel_block_variants(M, warps):
    """The fused kernel itself (both block sizes, any M) on the repacked weight."""
    for i, (N, K, group) in enumerate(((4096, 4096, 128), (640, 14336, 32), (28672, 512, -1))):
        gen = torch.Generator(device=DEV).manual_seed(97 * M + warps + i)
        dtype = (torch.float16, torch.bfloat16)[(M + i) % 2]
        qw, s, qz, G, q, z = make_awq(K, N, group, dtype, gen)
        x = make_x(M, K, dtype, gen)
        b = (torch.randn(N, generator=gen, device=DEV) * 10).to(dtype)
        poison(M * N, dtype)
        out = torch.ops.quantfuse._awq_gemm_cuda(x, repacked(qw), s, qz, G, b, warps)
        torch.cuda.synchronize()
        ref, mag = reference64(x, q, z, s, G, b, exact=folds(M, N, warps))
        check_close(out, ref, mag, dtype, f"warps={warps} M={M} N={N} K={K}")


@pytest.mark.parametrize("splits", (0, 1, 2, 3, 8))
@pytest.mark.parametrize("M", (1, 3, 8))
def test_kernel_sixteen_warps(M, splits):
    """One-token-tile blocks of 16 warps (the automatic choice for narrow weights at M <= 8):
    automatic and forced K splits, reduced in a cluster and through the workspace, warps whose
    K range starts inside a quantization group or is empty."""
    for i, (N, K, group) in enumerate(((4096, 4096, 128), (640, 14336, 32), (256, 272, -1), (6144, 4096, 64))):
        gen = torch.Generator(device=DEV).manual_seed(13 * M + 5 * splits + i)
        dtype = (torch.float16, torch.bfloat16)[(M + splits + i) % 2]
        qw, s, qz, G, q, z = make_awq(K, N, group, dtype, gen)
        x = make_x(M, K, dtype, gen)
        b = (torch.randn(N, generator=gen, device=DEV) * 10).to(dtype) if i % 2 == 0 else None
        ref, mag = reference64(x, q, z, s, G, b, exact=folds(M, N, 16))
        for cluster in (True, False):
            poison(M * N, dtype)
            out = torch.ops.quantfuse._awq_gemm_cuda(x, repacked(qw), s, qz, G, b, 16, splits, cluster)
            torch.cuda.synchronize()
            check_close(out, ref, mag, dtype, f"warps=16 splits={splits} cluster={cluster} M={M} N={N} K={K}")


def test_sixteen_warps_chosen_for_narrow_weights():
    """At M <= 8 the automatic split keeps 16-warp blocks to one wave: strips times splits at
    most the SM count, and at least 16 k-steps per warp."""
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    dev = torch.cuda.current_device()
    for N, K in ((4096, 4096), (6144, 4096), (4096, 14336), (640, 14336)):
        s = torch.ops.quantfuse._awq_gemm_splits(1, N, K, False, dev, 0)
        assert s == torch.ops.quantfuse._awq_gemm_splits(1, N, K, False, dev, 16), (N, K)
        assert (N // 64) * s <= sms and (K // 16) // (s * 16) >= 16 or s == 1, (N, K, s)
    if sms >= 128:  # the H100's choices, measured fastest there (csrc: warps_for, splits_for)
        assert torch.ops.quantfuse._awq_gemm_splits(1, 4096, 4096, False, dev, 0) == 1
        assert torch.ops.quantfuse._awq_gemm_splits(1, 4096, 14336, False, dev, 0) == 2


@pytest.mark.parametrize("cluster", (True, False))
@pytest.mark.parametrize("splits", (1, 2, 3, 5, 8))
def test_kernel_forced_splits(splits, cluster):
    """Every K split count, reduced on chip (a thread block cluster on sm_90) or through the
    fp32 workspace and the reduce kernel (the path of GPUs without clusters); K ranges that
    start inside a quantization group and splits with empty warps included."""
    for i, (M, N, K, group) in enumerate(((1, 4096, 14336, 128), (9, 192, 4096, 32), (24, 128, 1024, 64),
                                          (3, 256, 272, -1))):
        gen = torch.Generator(device=DEV).manual_seed(31 * splits + i + 7 * cluster)
        dtype = (torch.float16, torch.bfloat16)[(splits + i) % 2]
        qw, s, qz, G, q, z = make_awq(K, N, group, dtype, gen)
        x = make_x(M, K, dtype, gen)
        b = (torch.randn(N, generator=gen, device=DEV) * 10).to(dtype) if i % 2 == 0 else None
        poison(M * N, dtype)
        out = torch.ops.quantfuse._awq_gemm_cuda(x, repacked(qw), s, qz, G, b, 4, splits, cluster)
        torch.cuda.synchronize()
        ref, mag = reference64(x, q, z, s, G, b, exact=folds(M, N, 4))
        check_close(out, ref, mag, dtype, f"splits={splits} cluster={cluster} M={M} N={N} K={K} G={G}")


@pytest.mark.parametrize("M,warps", [(M, w) for M in (1, 6, 13, 32) for w in (4, 8, 16) if w < 16 or M <= 8])
def test_decode_kernel_bitwise_reproducible(M, warps):
    """The warps' and the split blocks' partial sums meet in a fixed order (no atomics): the same
    call gives the same bits every time, in clusters and through the workspace."""
    gen = torch.Generator(device=DEV).manual_seed(41 * M + warps)
    N, K, group = 4096, 4096, 128
    qw, s, qz, G, q, z = make_awq(K, N, group, torch.float16, gen)
    x = make_x(M, K, torch.float16, gen)
    packed = repacked(qw)
    for splits, cluster in ((1, True), (4, True), (4, False)):
        outs = [torch.ops.quantfuse._awq_gemm_cuda(x, packed, s, qz, G, None, warps, splits, cluster)
                for _ in range(8)]
        for i, out in enumerate(outs[1:], 1):
            assert torch.equal(out, outs[0]), f"warps={warps} splits={splits} cluster={cluster} M={M}: call {i} differs"


def test_fold_path_by_shape():
    """The streaming kernel's two paths go where they measured faster on the H100 (csrc:
    fold_path): the fold path for one token tile and for two in 8-warp blocks, the scaled path
    for two in 4-warp blocks (N / 64 at least twice the SM count) and for four."""
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    wide = 64 * 2 * sms  # from here on the strips alone give two blocks per SM: 4-warp blocks
    assert folds(1, 4096) and folds(8, wide)
    assert folds(16, 4096) and not folds(16, wide)
    assert not folds(17, 4096) and not folds(32, wide)
    assert folds(16, 4096, 8) and not folds(16, 4096, 4)


def test_kernel_bad_arguments_raise():
    """The private op's own checks raise RuntimeError naming the argument (they must not
    crash the process: csrc/common/check.h)."""
    gen = torch.Generator(device=DEV).manual_seed(2)
    qw, s, qz, G, q, z = make_awq(256, 64, 64, torch.float16, gen)
    x = make_x(1, 256, torch.float16, gen)
    packed = repacked(qw)
    with pytest.raises(RuntimeError, match="splits must be 0 .automatic. or 1..8, got 9"):
        torch.ops.quantfuse._awq_gemm_cuda(x, packed, s, qz, G, None, 0, 9)
    with pytest.raises(RuntimeError, match="warps must be 0, 4, 8 or 16, got 2"):
        torch.ops.quantfuse._awq_gemm_cuda(x, packed, s, qz, G, None, 2)
    with pytest.raises(RuntimeError, match="warps=16 takes at most 8 rows of 'x' .one token tile., got 9"):
        torch.ops.quantfuse._awq_gemm_cuda(make_x(9, 256, torch.float16, gen), packed, s, qz, G, None, 16)
    with pytest.raises(RuntimeError, match="'qzeros' must be int32 of shape .4, 8."):
        torch.ops.quantfuse._awq_gemm_cuda(x, packed, s, qz[:2], G, None)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_llama_m4096(dtype):
    run_case(4096, 4096, 4096, 128, dtype, seed=7)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("group", GROUPS)
def test_dequantize_exact(dtype, group):
    gen = torch.Generator(device=DEV).manual_seed(group + 77)
    K, N = 1024, 6144
    qw, s, qz, G, q, z = make_awq(K, N, group, dtype, gen)
    poison(K * N, dtype)
    out = torch.ops.quantfuse.awq_dequantize(qw, s, qz, G)
    expect = (q - z.repeat_interleave(G, dim=0)).to(dtype) * s.repeat_interleave(G, dim=0)
    assert torch.equal(out, expect)


def test_dispatches_to_kernels():
    gen = torch.Generator(device=DEV).manual_seed(3)
    qw, s, qz, G, q, z = make_awq(1024, 512, 128, torch.float16, gen)
    x = make_x(AWQ_DECODE_MAX_M, 1024, torch.float16, gen)
    xl = make_x(AWQ_DECODE_MAX_M + 1, 1024, torch.float16, gen)
    xh = make_x(AWQ_KERNEL_MAX_M + 1, 1024, torch.float16, gen)
    names = names_of(lambda: torch.ops.quantfuse.awq_gemm(x, qw, s, qz, G))
    assert "awq_gemm_kernel" in names, names[:2000]
    names = names_of(lambda: torch.ops.quantfuse.awq_dequantize(qw, s, qz, G))
    assert "awq_dequantize_kernel" in names, names[:2000]
    for xm in (xl, xh):
        names = names_of(lambda xm=xm: torch.ops.quantfuse.awq_gemm(xm, qw, s, qz, G))
        if HOPPER:  # the CUTLASS mixed-input kernel, not the streaming or dequantize ones
            assert "awq_gemm_kernel" not in names and "awq_dequantize_kernel" not in names, names[:2000]
            assert "cutlass" in names.lower() or "device_kernel" in names, names[:2000]
        elif xm is xh:
            assert "awq_dequantize_kernel" in names, names[:2000]
        else:
            assert "awq_gemm_kernel" in names, names[:2000]
    # group size 32: the prefill kernel declines, the streaming kernel serves up to AWQ_KERNEL_MAX_M
    qw32, s32, qz32, G32, q32, z32 = make_awq(1024, 512, 32, torch.float16, gen)
    names = names_of(lambda: torch.ops.quantfuse.awq_gemm(xl, qw32, s32, qz32, G32))
    assert "awq_gemm_kernel" in names, names[:2000]
    names = names_of(lambda: torch.ops.quantfuse.awq_gemm(xh, qw32, s32, qz32, G32))
    assert "awq_dequantize_kernel" in names, names[:2000]


def test_repack_cached_and_invalidated():
    """The repacked weight is made once (derived-value cache: values made, served, live entries),
    and again after an in-place write to the weight."""
    stats = torch.ops.quantfuse._derived_cache_stats
    gen = torch.Generator(device=DEV).manual_seed(5)
    qw, s, qz, G, q, z = make_awq(512, 256, 64, torch.bfloat16, gen)
    x = make_x(2, 512, torch.bfloat16, gen)
    made, hits, _ = stats()
    torch.ops.quantfuse.awq_gemm(x, qw, s, qz, G)
    torch.ops.quantfuse.awq_gemm(x, qw, s, qz, G)
    assert stats()[:2] == [made + 1, hits + 1], (made, hits, stats())
    # modify the weight in place: the cache must notice
    q2 = torch.randint(0, 16, q.shape, generator=gen, device=DEV, dtype=torch.int32)
    qw.copy_(awq_pack(q2))
    out = torch.ops.quantfuse.awq_gemm(x, qw, s, qz, G)
    ref, mag = reference64(x, q2, z, s, G, exact=op_exact(2, 256))
    check_close(out, ref, mag, torch.bfloat16, "after in-place update")
    assert stats()[0] == made + 2, (made, stats())


def test_freed_weights_values_make_room_for_the_next():
    """The repack of a weight that has been freed goes before the next miss allocates its own:
    replacing one model's weights by another's of the same shapes does not hold both repacks."""
    gen = torch.Generator(device=DEV).manual_seed(6)
    K, N = 4096, 4096
    qw, s, qz, G, _, _ = make_awq(K, N, 128, torch.float16, gen)
    x = make_x(1, K, torch.float16, gen)
    torch.ops.quantfuse.awq_gemm(x, qw, s, qz, G)  # qw's repack, kept by the cache
    repack_bytes = qw.nbytes
    del qw, s, qz
    qw2, s2, qz2, _, q2, z2 = make_awq(K, N, 128, torch.float16, gen)
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    out = torch.ops.quantfuse.awq_gemm(x, qw2, s2, qz2, G)  # a miss: qw2's repack is made
    torch.cuda.synchronize()
    grew = torch.cuda.max_memory_allocated() - before
    assert grew < repack_bytes // 2, (grew, repack_bytes)  # the freed repack went before the new one came
    ref, mag = reference64(x, q2, z2, s2, G, exact=op_exact(1, N))
    check_close(out, ref, mag, torch.float16, "after the freed weight's repack was dropped")


@pytest.mark.parametrize("M", (1, 16, 100))
def test_cuda_graph_replay(M):
    gen = torch.Generator(device=DEV).manual_seed(11 + M)
    N, K = 1024, 2048
    qw, s, qz, G, q, z = make_awq(K, N, 128, torch.float16, gen)
    b = torch.randn(N, generator=gen, device=DEV).half()
    x = make_x(M, K, torch.float16, gen)
    torch.ops.quantfuse.awq_gemm(x, qw, s, qz, G, b)  # warm-up: derived values made and kept
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        torch.ops.quantfuse.awq_gemm(x, qw, s, qz, G, b)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = torch.ops.quantfuse.awq_gemm(x, qw, s, qz, G, b)
    for i in range(3):
        x.copy_(make_x(M, K, torch.float16, gen))
        out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        ref, mag = reference64(x, q, z, s, G, b, exact=op_exact(M, N))
        check_close(out, ref, mag, torch.float16, f"graph replay {i} M={M}")


def test_fallback_unsupported_n(caplog):
    gen = torch.Generator(device=DEV).manual_seed(13)
    K, N = 256, 40  # N not a multiple of 64
    qw, s, qz, G, q, z = make_awq(K, N, 64, torch.float16, gen)
    x = make_x(3, K, torch.float16, gen)
    reason = awq_kernel_reason(x, qw, s, qz, G)
    assert "not a multiple of 64" in reason, reason
    with caplog.at_level(logging.DEBUG, logger="quantfuse.ops"):
        out = torch.ops.quantfuse.awq_gemm(x, qw, s, qz, G)
    assert f"quantfuse.awq_gemm: reference runs: {reason}" in caplog.text, caplog.text
    ref, mag = reference64(x, q, z, s, G)  # the op's reference ran
    check_close(out, ref, mag, torch.float16, "fallback")
    names = names_of(lambda: torch.ops.quantfuse.awq_gemm(x, qw, s, qz, G))
    assert "quantfuse" not in names, names[:2000]


def test_noncontiguous_x_and_empty():
    """A strided x runs the kernel on a copy; M = 0 gives an empty [0, N] result."""
    gen = torch.Generator(device=DEV).manual_seed(17)
    qw, s, qz, G, q, z = make_awq(512, 128, 32, torch.float16, gen)
    xb = make_x(5, 1024, torch.float16, gen)
    x = xb[:, ::2]  # strided view
    assert awq_kernel_reason(x, qw, s, qz, G) == ""
    out = torch.ops.quantfuse.awq_gemm(x, qw, s, qz, G)
    ref, mag = reference64(x, q, z, s, G, exact=op_exact(5, 128))
    check_close(out, ref, mag, torch.float16, "strided x")
    assert "awq_gemm_kernel" in names_of(lambda: torch.ops.quantfuse.awq_gemm(x, qw, s, qz, G))
    empty = torch.ops.quantfuse.awq_gemm(xb[:0, :512], qw, s, qz, G)
    assert empty.shape == (0, 128) and empty.dtype == torch.float16


def test_unpack_matches_shifts():
    # the tests' packer and the op's bit order agree (guards the fixtures above)
    v = torch.arange(16, device=DEV, dtype=torch.int32).repeat(1, 1)[:, :8].repeat(2, 1)
    packed = awq_pack(v)
    for i, sh in enumerate(AWQ_SHIFTS):
        assert int((packed[0, 0] >> sh) & 0xF) == i


@pytest.mark.compile
def test_torch_compile_quantfuse_runs_kernel():
    """torch.compile(backend="quantfuse") of an AWQ model runs these kernels."""
    torch.manual_seed(0)
    lin1 = torch.nn.Linear(512, 1024, bias=True).to(DEV)
    lin2 = torch.nn.Linear(1024, 256, bias=False).to(DEV)
    model = torch.nn.Sequential(
        compile_backend.AWQLinear.from_linear(lin1, group_size=128, dtype=torch.float16),
        torch.nn.ReLU(),
        compile_backend.AWQLinear.from_linear(lin2, group_size=64, dtype=torch.float16),
    ).to(DEV)
    x = torch.randn(2, 3, 512, device=DEV, dtype=torch.float16)
    with torch.no_grad():
        eager = model(x)
        compiled = torch.compile(model, backend="quantfuse", fullgraph=True)
        compiled(x)
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
            out = compiled(x)
            torch.cuda.synchronize()
    names = " ".join(e.name for e in prof.events())
    assert "awq_gemm_kernel" in names, names[:2000]
    rel = (torch.linalg.norm(out.float() - eager.float()) / torch.linalg.norm(eager.float())).item()
    assert rel < 5e-3, rel


@pytest.mark.parametrize("N,K", ((320, 512), (4096, 4096), (6144, 128)))
def test_fragment_layout_conversions(N, K):
    """The GPU's repack and its inverse are the layout ``ops/awq_gemm.py`` defines (what AWQLinear
    holds and what state_dict converts), and the Hopper prefill layout made from fragments per call
    is the one made from the AWQ layout, bit for bit."""
    gen = torch.Generator(device=DEV).manual_seed(N + K)
    qw, s, qz, G, q, z = make_awq(K, N, 128, torch.float16, gen)
    fragments = repacked(qw)
    assert torch.equal(fragments.cpu(), awq_to_fragments(qw.cpu()))
    assert torch.equal(torch.ops.quantfuse._awq_unrepack_cuda(fragments), qw)
    assert torch.equal(awq_from_fragments(fragments.cpu()), qw.cpu())
    if HOPPER and N % 128 == 0 and K % 64 == 0:
        wq, _, zeros = torch.ops.quantfuse._awq_prepare_sm90_cuda(qw, s, qz, G)
        wq_f, zeros_f = torch.ops.quantfuse._awq_prepare_sm90_from_fragments_cuda(fragments, s, qz, G)
        assert torch.equal(wq_f, wq) and torch.equal(zeros_f, zeros)


@pytest.mark.parametrize("group", GROUPS)
def test_dequantize_fragment_layout(group):
    gen = torch.Generator(device=DEV).manual_seed(7 + group)
    qw, s, qz, G, q, z = make_awq(256, 384, group, torch.bfloat16, gen)
    want = torch.ops.quantfuse.awq_dequantize(qw, s, qz, G)
    assert torch.equal(torch.ops.quantfuse.awq_dequantize(repacked(qw), s, qz, G), want)


# --------------------------------------------------------------------------- act-order (perm)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("M", (1, 8, 16, 17, 32, 33, 64, 65, 256))
def test_act_order_reads_x_through_perm(M, dtype):
    """``awq_gemm(x, ..., perm)`` gives ``awq_gemm(x[:, perm], ...)`` bit for bit in every M bucket, in
    both weight layouts, with and without bias, and the streaming kernel's output within its bound of
    the float64 product (the prefill kernels' bounds are test_cuda_awq_gemm_sm90.py's)."""
    gen = torch.Generator(device=DEV).manual_seed(77 + M)
    N, K = 1024, 2048
    qw, s, qz, G, q, z = make_awq(K, N, 128, dtype, gen)
    x = make_x(M, K, dtype, gen)
    perm = torch.randperm(K, generator=gen, device=DEV).to(torch.int32)
    for b in (None, (torch.randn(N, generator=gen, device=DEV) * 10).to(dtype)):
        want = torch.ops.quantfuse.awq_gemm(x.index_select(1, perm), qw, s, qz, G, b)
        for w in (qw, repacked(qw)):
            poison(M * N, dtype)
            got = torch.ops.quantfuse.awq_gemm(x, w, s, qz, G, b, perm)
            torch.cuda.synchronize()
            assert torch.equal(got, want), f"M={M} {dtype} layout {tuple(w.shape)} bias={b is not None}"
    if M <= AWQ_DECODE_MAX_M:
        ref, mag = reference64(x.index_select(1, perm), q, z, s, G, b, exact=op_exact(M, N))
        check_close(got, ref, mag, dtype, f"act-order M={M} {dtype}")


def test_act_order_kernel_op_and_graph():
    """The op with ``perm`` equal to the kernel on the gathered activations, under a CUDA graph too, and an
    int64 order (not the kernels') running the reference with its reason."""
    gen = torch.Generator(device=DEV).manual_seed(5)
    N, K = 512, 1024
    qw, s, qz, G, q, z = make_awq(K, N, 64, torch.float16, gen)
    packed = repacked(qw)
    perm = torch.randperm(K, generator=gen, device=DEV).to(torch.int32)
    x = make_x(1, K, torch.float16, gen)
    want = torch.ops.quantfuse._awq_gemm_cuda(x.index_select(1, perm), packed, s, qz, G, None)
    assert torch.equal(torch.ops.quantfuse.awq_gemm(x, packed, s, qz, G, None, perm), want)
    graph = torch.cuda.CUDAGraph()
    torch.ops.quantfuse.awq_gemm(x, packed, s, qz, G, None, perm)
    with torch.cuda.graph(graph):
        out = torch.ops.quantfuse.awq_gemm(x, packed, s, qz, G, None, perm)
    x2 = make_x(1, K, torch.float16, gen)
    x.copy_(x2)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, torch.ops.quantfuse.awq_gemm(x2.index_select(1, perm), packed, s, qz, G, None))
    assert "perm is not int32" in awq_kernel_reason(x, packed, s, qz, G, None, perm.long())


@pytest.mark.parametrize("M", [1, 16])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_pdl_on_and_off_equal(M, dtype):
    """The streaming kernel with programmatic dependent launch and without: the same bits, eagerly and
    in CUDA graphs (``conftest.assert_pdl_on_off_equal``)."""
    gen = torch.Generator(device=DEV).manual_seed(31 + M)
    N, K = 4096, 4096
    qw, s, qz, G, q, z = make_awq(K, N, 128, dtype, gen)
    packed = repacked(qw)

    def gemm(a, pdl):
        return torch.ops.quantfuse._awq_gemm_cuda(a, packed, s, qz, G, None, 0, 0, True, pdl)

    assert_pdl_on_off_equal(gemm, make_x(M, K, dtype, gen), lambda: make_x(M, K, dtype, gen))


def test_pdl_env_read_as_the_backend_reads_it(monkeypatch):
    """``QUANTFUSE_PDL`` at an eager launch (``pdl=-1``, the default): '0' (spaces around it ignored) launches
    without PDL, giving the bits of ``pdl=0``; a value other than 0 / 1 is refused naming the variable, as the
    backend's check refuses it (``compile_backend/kernels/pdl.py``), not read as 'on'."""
    gen = torch.Generator(device=DEV).manual_seed(5)
    N, K = 256, 512
    qw, s, qz, G, q, z = make_awq(K, N, 128, torch.float16, gen)
    packed = repacked(qw)
    x = make_x(1, K, torch.float16, gen)

    def gemm(pdl):
        return torch.ops.quantfuse._awq_gemm_cuda(x, packed, s, qz, G, None, 0, 0, True, pdl)

    monkeypatch.setenv("QUANTFUSE_PDL", " 0 ")
    assert torch.equal(gemm(-1), gemm(0))
    monkeypatch.setenv("QUANTFUSE_PDL", "off")
    with pytest.raises((RuntimeError, ValueError), match="QUANTFUSE_PDL='off'; expected '0'"):
        gemm(-1)
    assert torch.equal(gemm(1), gemm(0))  # an explicit argument does not read the variable
