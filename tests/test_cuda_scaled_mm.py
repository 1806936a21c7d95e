"""GPU tests of the CUTLASS kernels behind quantfuse.scaled_mm / scaled_mm_azp.

Skipped without CUDA.  Every epilogue x scale granularity x bias x output dtype x input
dtype against a float64 reference on fresh random data, all tile configurations, the
M sweep on LLM-sized (N, K), sliced / offset / strided / row-major layouts (copied by the
C++ dispatch to the layout a kernel reads), the inputs no kernel takes (the reference runs,
with the reason), CUDA-graph capture and replay, and the profiler's proof of which kernel
runs.
"""

from __future__ import annotations

import functools
import itertools
import logging
import os

import pytest
import torch
from conftest import (
    DECODE_MAX_M,
    FP8_CUBLASLT_MIN_M,
    INS,
    OUTS,
    check_w8a8,
    epilogue64,
    exact_acc,
    kernel_names,
    load_cuda_kernels,
    needs_hopper,
    poison,
    ran_quantfuse_kernel,
    rand_q,
    w8a8_kernel_reason,
    w8a8_reference64,
)

from compile_backend import ops

pytestmark = pytest.mark.gpu

M_ALL = (1, 2, 15, 16, 17, 33, 64, 100, 128, 256, 512, 4096)


def make_inputs(M, N, K, in_dtype, out_dtype, sa_tok, sb_ch, with_bias):
    a = rand_q((M, K), in_dtype)
    w = rand_q((N, K), in_dtype)  # row-major weight; b is its transpose (column-major)
    b = w.t()
    sa = (torch.rand(M if sa_tok else 1, device="cuda") + 0.5) * 1e-2
    sb = (torch.rand(N if sb_ch else 1, device="cuda") + 0.5) * 1e-2
    bias = torch.randn(N, device="cuda").to(out_dtype) if with_bias else None
    return a, b, sa, sb, bias


def run_kernel(a, b, sa, sb, out_dtype, bias=None, azp_adj=None, azp=None, config=-1, swizzle=0, raster=0):
    poison((a.shape[0], b.shape[1]), out_dtype)
    return torch.ops.quantfuse._scaled_mm_cutlass(a, b, sa, sb, out_dtype, bias, azp_adj, azp, 90, config,
                                                  swizzle, raster)


# ----------------------------------------------------------------------------- scaled_mm

@needs_hopper
@pytest.mark.parametrize("in_dtype", INS, ids=["int8", "fp8"])
@pytest.mark.parametrize("out_dtype", OUTS, ids=["f16", "bf16", "f32"])
def test_scaled_mm_epilogue_matrix(in_dtype, out_dtype):
    """Scaled / ScaledBias x scale granularities, through the public op, M cycling."""
    ms = itertools.cycle(M_ALL[:-1])
    for sa_tok, sb_ch, with_bias in itertools.product((False, True), repeat=3):
        M, N, K = next(ms), 272, 528
        a, b, sa, sb, bias = make_inputs(M, N, K, in_dtype, out_dtype, sa_tok, sb_ch, with_bias)
        assert w8a8_kernel_reason(a, b, sa, sb, out_dtype, bias) == ""
        poison((M, N), out_dtype)
        out = torch.ops.quantfuse.scaled_mm(a, b, sa, sb, out_dtype, bias)
        check_w8a8(out, w8a8_reference64(a, b, sa, sb, bias), out_dtype, in_dtype)


@needs_hopper
@pytest.mark.parametrize("config", (0, 1, 2, 3, 4))
@pytest.mark.parametrize("in_dtype", INS, ids=["int8", "fp8"])
def test_every_tile_config(config, in_dtype):
    """Each tile configuration on M values it would not be chosen for (edge tiles).  Config 4
    (large tiles without a cluster) exists for fp8 only."""
    for M, N, K in ((1, 64, 256), (17, 144, 272), (100, 400, 1040), (300, 528, 512)):
        a, b, sa, sb, bias = make_inputs(M, N, K, in_dtype, torch.bfloat16, True, True, True)
        if config == 4 and in_dtype == torch.int8:
            with pytest.raises(RuntimeError, match="no kernel instantiated"):
                run_kernel(a, b, sa, sb, torch.bfloat16, bias, config=config)
            continue
        out = run_kernel(a, b, sa, sb, torch.bfloat16, bias, config=config)
        check_w8a8(out, w8a8_reference64(a, b, sa, sb, bias), torch.bfloat16, in_dtype)


@needs_hopper
@pytest.mark.parametrize("in_dtype", INS, ids=["int8", "fp8"])
def test_tile_scheduler_swizzle_and_raster(in_dtype):
    """Every raster swizzle and order of the persistent tile scheduler covers every output tile
    (the output is poisoned first): grids of 5 x 9, 12 x 14 and 24 x 9 tiles, not multiples of
    the swizzle."""
    cases = [((300, 1104, 512), 1), ((1500, 1680, 256), 2), ((3000, 1040, 128), 2)]
    if in_dtype != torch.int8:
        cases.append(((1500, 1680, 256), 4))
    for (M, N, K), config in cases:
        a, b, sa, sb, bias = make_inputs(M, N, K, in_dtype, torch.bfloat16, True, True, True)
        ref = w8a8_reference64(a, b, sa, sb, bias)
        for swizzle, raster in itertools.product((1, 2, 4, 8), (0, 1, 2)):
            out = run_kernel(a, b, sa, sb, torch.bfloat16, bias, config=config, swizzle=swizzle, raster=raster)
            check_w8a8(out, ref, torch.bfloat16, in_dtype)


@needs_hopper
def test_tile_scheduler_arguments_are_checked():
    a, b, sa, sb, bias = make_inputs(64, 64, 64, torch.int8, torch.bfloat16, True, True, True)
    with pytest.raises(RuntimeError, match="swizzle must be 0"):
        run_kernel(a, b, sa, sb, torch.bfloat16, bias, swizzle=3)
    with pytest.raises(RuntimeError, match="raster must be 0"):
        run_kernel(a, b, sa, sb, torch.bfloat16, bias, raster=3)


@needs_hopper
@pytest.mark.parametrize("in_dtype", INS, ids=["int8", "fp8"])
@pytest.mark.parametrize("out_dtype", OUTS, ids=["f16", "bf16", "f32"])
def test_decode_config_long_k(in_dtype, out_dtype):
    """The decode config (3) on few output tiles, long K not a multiple of the k-tile,
    M up to 32, every output dtype; two calls give bitwise equal results (also the check
    that a split-K / stream-K variant of this config reduces deterministically)."""
    for M, N, K in ((1, 128, 4112), (3, 256, 8208), (16, 4096, 4096), (32, 6144, 4096), (7, 1152, 14336)):
        a, b, sa, sb, bias = make_inputs(M, N, K, in_dtype, out_dtype, True, True, True)
        out = run_kernel(a, b, sa, sb, out_dtype, bias, config=3)
        check_w8a8(out, w8a8_reference64(a, b, sa, sb, bias), out_dtype, in_dtype)
        again = run_kernel(a, b, sa, sb, out_dtype, bias, config=3)
        assert torch.equal(out, again), f"decode result not reproducible at {M}x{N}x{K}"


LLM_NK = ((4096, 4096), (6144, 4096), (4096, 14336), (28672, 4096))


@needs_hopper
@pytest.mark.parametrize("M", M_ALL)
def test_m_sweep_llm_shapes(M):
    """int8 per-token x per-channel + bias, bf16 out, (N, K) of LLM layers (sampled per M)."""
    i = M_ALL.index(M)
    N, K = LLM_NK[i % len(LLM_NK)]
    if M == 4096:
        N, K = 4096, 4096  # keep the float64 reference affordable
    fp8_ok = os.environ.get("QF_TEST_FP8", "1") == "1"
    in_dtype = torch.float8_e4m3fn if i % 3 == 2 and fp8_ok else torch.int8
    a, b, sa, sb, bias = make_inputs(M, N, K, in_dtype, torch.bfloat16, True, True, True)
    poison((M, N), torch.bfloat16)
    out = torch.ops.quantfuse.scaled_mm(a, b, sa, sb, torch.bfloat16, bias)
    if in_dtype == torch.int8 and M > 16:
        acc = torch._int_mm(a, b).double()  # exact int32 accumulation, fast
    else:
        acc = exact_acc(a, b)
    check_w8a8(out, epilogue64(acc, sa, sb, bias), torch.bfloat16, in_dtype)


# ----------------------------------------------------------------------------- scaled_mm_azp

@needs_hopper
@pytest.mark.parametrize("out_dtype", OUTS, ids=["f16", "bf16", "f32"])
@pytest.mark.parametrize("per_token_azp", (False, True), ids=["azp", "azp_token"])
def test_scaled_mm_azp_matrix(out_dtype, per_token_azp):
    ms = itertools.cycle(M_ALL[:-1][::-1])
    for sa_tok, sb_ch, with_bias in itertools.product((False, True), repeat=3):
        M, N, K = next(ms), 208, 400
        a, b, sa, sb, bias = make_inputs(M, N, K, torch.int8, out_dtype, sa_tok, sb_ch, with_bias)
        colsum = b.to(torch.int32).sum(0, dtype=torch.int32)
        if per_token_azp:
            azp = torch.randint(-60, 60, (M,), dtype=torch.int32, device="cuda")
            azp_adj = colsum
        else:
            za = int(torch.randint(-60, 60, ()).item()) or 7
            azp, azp_adj = None, (za * colsum).to(torch.int32)
        assert w8a8_kernel_reason(a, b, sa, sb, out_dtype, bias, azp_adj, azp) == ""
        poison((M, N), out_dtype)
        out = torch.ops.quantfuse.scaled_mm_azp(a, b, sa, sb, out_dtype, azp_adj, azp, bias)
        check_w8a8(out, w8a8_reference64(a, b, sa, sb, bias, azp_adj, azp), out_dtype)
        # and against the op's own reference implementation
        ref = ops.scaled_mm_azp_reference(a, b, sa, sb, out_dtype, azp_adj, azp, bias)
        check_w8a8(out, ref.double(), out_dtype)


@needs_hopper
@pytest.mark.parametrize("M", (1, 33, 512))
def test_azp_llm_shape(M):
    N, K = 4096, 4096
    a, b, sa, sb, bias = make_inputs(M, N, K, torch.int8, torch.float16, True, True, True)
    azp = torch.randint(-100, 100, (M,), dtype=torch.int32, device="cuda")
    colsum = b.to(torch.int32).sum(0, dtype=torch.int32)
    out = torch.ops.quantfuse.scaled_mm_azp(a, b, sa, sb, torch.float16, colsum, azp, bias)
    check_w8a8(out, w8a8_reference64(a, b, sa, sb, bias, colsum, azp), torch.float16)


# ----------------------------------------------------------------------------- layouts, fallback

@needs_hopper
def test_sliced_and_offset_inputs():
    """Views the kernels read in place (row pitch K+64, column pitch K+48, 16-byte aligned
    starts) with an offset and a strided scale and an offset bias, which the dispatch copies."""
    M, N, K = 40, 256, 512
    big_a = rand_q((M + 3, K + 64), torch.int8)
    a = big_a[2 : 2 + M, 32 : 32 + K]  # row pitch K+64, start offset 16-byte aligned
    big_w = rand_q((N + 5, K + 48), torch.int8)
    b = big_w[3 : 3 + N, 16 : 16 + K].t()  # column-major with pitch K+48
    sa_big = torch.rand(M + 1, device="cuda") + 0.5
    sa = sa_big[1:]  # offset (unaligned) per-token scale: the dispatch realigns it
    sb = (torch.rand(2 * N, device="cuda") + 0.5)[::2]  # strided per-channel scale
    bias = torch.randn(N + 1, device="cuda", dtype=torch.bfloat16)[1:]
    assert w8a8_kernel_reason(a, b, sa, sb, torch.bfloat16, bias) == ""
    out = torch.ops.quantfuse.scaled_mm(a, b, sa, sb, torch.bfloat16, bias)
    check_w8a8(out, w8a8_reference64(a, b, sa, sb, bias), torch.bfloat16)
    names = kernel_names(lambda: torch.ops.quantfuse.scaled_mm(a, b, sa, sb, torch.bfloat16, bias))
    assert any("cutlass" in n and "quantfuse" in n for n in names), names


@needs_hopper
def test_layouts_are_copied_and_unsupported_shapes_fall_back(caplog):
    """a or b in a layout no kernel reads (b row-major, a column-major, misaligned starts or
    pitches) runs the kernel (decode and CUTLASS) on a copy; K or N not a multiple of 16 runs
    the reference, with the reason logged on quantfuse.ops, and no kernel of ours.  Every
    result matches the float64 reference."""
    M, N, K = 8, 64, 128
    a, b, sa, sb, bias = make_inputs(M, N, K, torch.int8, torch.float16, True, True, True)
    copied = {  # name: (a of M rows, b)
        "b row-major": (lambda m: rand_q((m, K)), b.contiguous()),
        "a misaligned": (lambda m: rand_q((m, K + 1))[:, 1:], b),
        "a column-major": (lambda m: rand_q((K, m)).t(), b),
        "a and b misaligned": (lambda m: rand_q((m, K + 1))[:, 1:], rand_q((N, K + 8))[:, 8:].t()),
    }
    for name, (make_a, bb) in copied.items():
        for m in (M, 40):  # the decode kernel, CUTLASS
            aa, sa_m = make_a(m), torch.rand(m, device="cuda") + 0.5
            assert w8a8_kernel_reason(aa, bb, sa_m, sb, torch.float16, bias) == "", name
            out = torch.ops.quantfuse.scaled_mm(aa, bb, sa_m, sb, torch.float16, bias)
            check_w8a8(out, w8a8_reference64(aa, bb, sa_m, sb, bias), torch.float16, what=f"{name}, M={m}")
            names = kernel_names(
                functools.partial(torch.ops.quantfuse.scaled_mm, aa, bb, sa_m, sb, torch.float16, bias))
            kernel = "scaled_mm_decode" if m <= DECODE_MAX_M else "cutlass"
            assert any(kernel in n and "quantfuse" in n for n in names), (name, m, names)
    unsupported = {
        "K not multiple of 16": (a[:, :120], b[:120]),
        "N not multiple of 16": (a, b[:, :56]),
    }
    for name, (aa, bb) in unsupported.items():
        sb_n, bias_n = sb[: bb.shape[1]], bias[: bb.shape[1]]
        reason = w8a8_kernel_reason(aa, bb, sa, sb_n, torch.float16, bias_n)
        assert "multiples of 16" in reason, (name, reason)
        caplog.clear()
        with caplog.at_level(logging.DEBUG, logger="quantfuse.ops"):
            out = torch.ops.quantfuse.scaled_mm(aa, bb, sa, sb_n, torch.float16, bias_n)
        assert f"quantfuse.scaled_mm: reference runs: {reason}" in caplog.text, (name, caplog.text)
        check_w8a8(out, w8a8_reference64(aa, bb, sa, sb_n, bias_n), torch.float16, what=name)
        names = kernel_names(functools.partial(torch.ops.quantfuse.scaled_mm, aa, bb, sa, sb_n, torch.float16, bias_n))
        assert not ran_quantfuse_kernel(names), (name, names)
    # malformed input still raises the op's error, not a kernel error
    with pytest.raises(ops.QuantfuseInputError, match="scale_a"):
        torch.ops.quantfuse.scaled_mm(a, b, sa[:3], sb, torch.float16, bias)


# ----------------------------------------------------------------------------- graphs, profiler

@needs_hopper
def test_cuda_graph_capture_and_replay():
    M, N, K = 16, 512, 1024
    a, b, sa, sb, bias = make_inputs(M, N, K, torch.int8, torch.bfloat16, True, True, True)
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
        a.copy_(rand_q((M, K), torch.int8))
        sa.copy_(torch.rand(M, device="cuda") + 0.5)
        g.replay()
        torch.cuda.synchronize()
        check_w8a8(out, w8a8_reference64(a, b, sa, sb, bias), torch.bfloat16)


@needs_hopper
def test_fp8_prefill_routes_to_cublaslt_where_measured_faster():
    """fp8 with per-token x per-channel scales from FP8_CUBLASLT_MIN_M rows runs torch._scaled_mm
    (no quantfuse kernel); fewer rows, a per-tensor scale or float32 output with a bias run our
    CUTLASS kernels.  Every path matches the float64 reference."""
    N, K, fp8, m0 = 1024, 512, torch.float8_e4m3fn, FP8_CUBLASLT_MIN_M
    assert m0 > 16  # above the decode kernel's rows
    cases = ((m0, True, torch.bfloat16, False), (m0 + 300, True, torch.float16, False),
             (m0 - 1, True, torch.bfloat16, True), (m0 + 256, False, torch.bfloat16, True),
             (m0 + 256, True, torch.float32, True))
    for M, per_token, out_dtype, ours in cases:
        args = (*make_inputs(M, N, K, fp8, out_dtype, per_token, True, True)[:4], out_dtype)
        bias = torch.randn(N, device="cuda").to(out_dtype)
        assert w8a8_kernel_reason(*args, bias) == ""
        poison((M, N), out_dtype)
        out = torch.ops.quantfuse.scaled_mm(*args, bias)
        check_w8a8(out, w8a8_reference64(*args[:4], bias), out_dtype, fp8)
        names = kernel_names(functools.partial(torch.ops.quantfuse.scaled_mm, *args, bias))
        assert ran_quantfuse_kernel(names) == ours, (M, per_token, out_dtype, names)


@needs_hopper
def test_op_runs_cutlass_kernel_eager_and_compiled():
    M, N, K = 64, 1024, 1024
    a, b, sa, sb, bias = make_inputs(M, N, K, torch.int8, torch.bfloat16, True, True, True)
    names = kernel_names(lambda: torch.ops.quantfuse.scaled_mm(a, b, sa, sb, torch.bfloat16, bias))
    assert any("cutlass" in n for n in names), names

    def f(a, b, sa, sb, bias):
        return torch.ops.quantfuse.scaled_mm(a, b, sa, sb, torch.bfloat16, bias) * 2

    from compile_backend.backend import quantfuse

    cf = torch.compile(f, backend=quantfuse, fullgraph=True)
    out = cf(a, b, sa, sb, bias)
    names = kernel_names(lambda: cf(a, b, sa, sb, bias))
    assert any("cutlass" in n for n in names), names
    check_w8a8(out, 2 * w8a8_reference64(a, b, sa, sb, bias), torch.bfloat16)


def _sanitize_driver():
    """A few shapes of every kernel family and tile config, for compute-sanitizer:
    ``compute-sanitizer --tool memcheck python tests/test_cuda_scaled_mm.py``."""
    load_cuda_kernels()
    shapes = ((1, 64, 256), (33, 144, 272), (130, 400, 512))
    n = 0
    fp8 = os.environ.get("QF_SANITIZE_FP8", "1") == "1"
    for (M, N, K), config in itertools.product(shapes, (0, 1, 2, 3, 4)):
        for in_dtype in INS if fp8 else INS[:1]:
            if config == 4 and in_dtype == torch.int8:
                continue  # config 4 is fp8 only
            a, b, sa, sb, bias = make_inputs(M, N, K, in_dtype, torch.bfloat16, True, True, True)
            out = run_kernel(a, b, sa, sb, torch.bfloat16, bias, config=config)
            check_w8a8(out, w8a8_reference64(a, b, sa, sb, bias), torch.bfloat16, in_dtype)
            n += 1
        if config == 4:
            continue  # the azp epilogues are int8 only
        a, b, sa, sb, bias = make_inputs(M, N, K, torch.int8, torch.float16, False, True, False)
        colsum = b.to(torch.int32).sum(0, dtype=torch.int32)
        azp = torch.randint(-60, 60, (M,), dtype=torch.int32, device="cuda")
        out = run_kernel(a, b, sa, sb, torch.float16, None, colsum, azp, config=config)
        check_w8a8(out, w8a8_reference64(a, b, sa, sb, None, colsum, azp), torch.float16)
        out = run_kernel(a, b, sa, sb, torch.float32, None, 3 * colsum, None, config=config)
        check_w8a8(out, w8a8_reference64(a, b, sa, sb, None, 3 * colsum), torch.float32)
        n += 2
    torch.cuda.synchronize()
    print(f"sanitize driver: {n} kernel calls checked")


def _probe(in_name: str, config: int, out_name: str = "f16"):
    """One kernel call (debugging: run in a subprocess, or under cuda-gdb)."""
    load_cuda_kernels()
    in_dtype = {"int8": torch.int8, "fp8": torch.float8_e4m3fn}[in_name]
    out_dtype = dict(zip(("f16", "bf16", "f32"), OUTS))[out_name]
    M, N, K = 33, 144, 272
    a, b, sa, sb, bias = make_inputs(M, N, K, in_dtype, out_dtype, True, True, True)
    print(f"probe {in_name} {out_name} config {config}: calling", flush=True)
    out = run_kernel(a, b, sa, sb, out_dtype, bias, config=config)
    torch.cuda.synchronize()
    check_w8a8(out, w8a8_reference64(a, b, sa, sb, bias), out_dtype, in_dtype)
    print(f"probe {in_name} {out_name} config {config}: ok", flush=True)


if __name__ == "__main__":
    import sys

    if len(sys.argv) > 1 and sys.argv[1] == "probe":
        _probe(sys.argv[2], int(sys.argv[3]), sys.argv[4] if len(sys.argv) > 4 else "f16")
    else:
        _sanitize_driver()
