"""GPU tests of the CUTLASS 2.x (SM80) kernels behind quantfuse.scaled_mm / scaled_mm_azp.

Skipped without CUDA.  The SM80 kernels (mma.sync, cp.async, 2.x epilogue visitor
trees) also run on Hopper, so every test forces them with
``torch.ops.quantfuse._scaled_mm_cutlass(..., arch=80)``.  Checked against a float64
reference (ops/scaled_mm.py's exact product, epilogue in float64) on fresh random data: every
epilogue x scale granularity x bias x output dtype, the M sweep on LLM-sized (N, K), every
tile configuration on edge tiles, sliced inputs, CUDA-graph capture and replay, bitwise
reproducibility at long K, fp8 on arch 80 (a clear error from the op), and the public op's
kernel choice on this GPU (the SM80 kernels where it is not a Hopper; on a Hopper they are
reached only by forcing arch=80).
"""

from __future__ import annotations

import functools
import itertools

import pytest
import torch
from conftest import (
    CAP,
    DECODE_MAX_M,
    HOPPER,
    OUT_IDS,
    OUTS,
    check_w8a8,
    epilogue64,
    kernel_names,
    poison,
    ran_quantfuse_kernel,
    rand_q,
    w8a8_kernel_reason,
    w8a8_reference64,
)

from compile_backend import ops

pytestmark = pytest.mark.gpu

ARCH = 80
M_ALL = (1, 2, 15, 16, 17, 33, 64, 100, 128, 256, 512, 4096)
ZPS = ("none", "tensor", "token")  # no zero point / per-tensor (folded into azp_adj) / per-token
SMALL_NK = ((64, 128), (192, 320))
LLM_NK = ((4096, 4096), (6144, 4096))


@pytest.fixture(scope="module", autouse=True)
def _sm80_or_later(cuda_kernels):
    if CAP < (8, 0):
        pytest.skip("the SM80 kernels need compute capability 8.0 or later")


def rand_i8(shape):
    return rand_q(shape, torch.int8)


class Case:
    """Random inputs of one call and their float64 reference."""

    def __init__(self, M, N, K, out_dtype, sa_tok, sb_ch, with_bias, zp="none", a=None, b=None):
        self.out_dtype = out_dtype
        self.a = rand_i8((M, K)) if a is None else a
        self.b = rand_i8((N, K)).t() if b is None else b  # column-major: a row-major weight, transposed
        self.sa = (torch.rand(M if sa_tok else 1, device="cuda") + 0.5) * 1e-2
        self.sb = (torch.rand(N if sb_ch else 1, device="cuda") + 0.5) * 1e-2
        self.bias = torch.randn(N, device="cuda").to(out_dtype) if with_bias else None
        self.azp_adj = self.azp = None
        colsum = self.b.to(torch.int32).sum(0, dtype=torch.int32)
        if zp == "tensor":
            za = int(torch.randint(-60, 60, ()).item()) or 7
            self.azp_adj = (za * colsum).to(torch.int32)
        elif zp == "token":
            self.azp = torch.randint(-60, 60, (M,), dtype=torch.int32, device="cuda")
            self.azp_adj = colsum

    def run(self, config=-1, arch=ARCH):
        M, N = self.a.shape[0], self.b.shape[1]
        poison((M, N), self.out_dtype)
        return torch.ops.quantfuse._scaled_mm_cutlass(
            self.a, self.b, self.sa, self.sb, self.out_dtype, self.bias, self.azp_adj, self.azp, arch, config)

    def reference(self):
        acc = ops.scaled_mm.exact_float64_product(self.a, self.b)
        return epilogue64(acc, self.sa, self.sb, self.bias, self.azp_adj, self.azp)

    def ops_reference(self):
        if self.azp_adj is None:
            return ops.scaled_mm_reference(self.a, self.b, self.sa, self.sb, self.out_dtype, self.bias)
        return ops.scaled_mm_azp_reference(
            self.a, self.b, self.sa, self.sb, self.out_dtype, self.azp_adj, self.azp, self.bias)

    def check(self, out, what=""):
        check_w8a8(out, self.reference(), self.out_dtype, what=what)


# ----------------------------------------------------------------------------- epilogue matrix

@pytest.mark.parametrize("zp", ZPS)
@pytest.mark.parametrize("out_dtype", OUTS, ids=OUT_IDS)
def test_epilogue_matrix(out_dtype, zp):
    """Every epilogue (Scaled, ScaledBias, ScaledBiasAzp, ScaledBiasAzpToken, the azp ones
    also without bias) x s_a per-tensor/per-token x s_b per-tensor/per-channel, every M of
    the sweep, small aligned (N, K)."""
    for (sa_tok, sb_ch, with_bias), (N, K) in itertools.product(itertools.product((False, True), repeat=3), SMALL_NK):
        for M in M_ALL:
            case = Case(M, N, K, out_dtype, sa_tok, sb_ch, with_bias, zp)
            case.check(case.run(), f"M={M} N={N} K={K} sa_tok={sa_tok} sb_ch={sb_ch} bias={with_bias} zp={zp}")


@pytest.mark.parametrize("zp", ZPS)
@pytest.mark.parametrize("out_dtype", OUTS, ids=OUT_IDS)
def test_matches_ops_reference(out_dtype, zp):
    """Against the ops' own reference implementations (which round like a kernel would)."""
    for M in (1, 33, 256):
        case = Case(M, 192, 320, out_dtype, True, True, True, zp)
        out = case.run()
        check_w8a8(out, case.ops_reference().double(), out_dtype, what=f"M={M} vs ops reference")


# ----------------------------------------------------------------------------- LLM shapes

@pytest.mark.parametrize("NK", LLM_NK, ids=lambda nk: f"N{nk[0]}_K{nk[1]}")
@pytest.mark.parametrize("M", M_ALL)
def test_m_sweep_llm_shapes(M, NK):
    """The issue's case (int8, per-token x per-channel + bias, bf16 out) at every M, plus
    one rotating other epilogue / granularity / dtype per M."""
    N, K = NK
    case = Case(M, N, K, torch.bfloat16, True, True, True)
    case.check(case.run(), f"M={M} N={N} K={K}")
    i = M_ALL.index(M) + LLM_NK.index(NK)
    zp = ZPS[i % 3]
    other = Case(M, N, K, OUTS[i % 3], i % 2 == 0, i % 4 < 2, i % 5 != 0, zp, a=case.a, b=case.b)
    other.check(other.run(), f"M={M} N={N} K={K} variant {i}")


@pytest.mark.parametrize("M,N,K", ((16, 28672, 4096), (512, 4096, 14336)))
def test_large_llm_shapes(M, N, K):
    case = Case(M, N, K, torch.bfloat16, True, True, True)
    case.check(case.run(), f"M={M} N={N} K={K}")
    azp = Case(M, N, K, torch.float16, True, True, False, "token", a=case.a, b=case.b)
    azp.check(azp.run(), f"azp M={M} N={N} K={K}")


# ----------------------------------------------------------------------------- tile configs

@pytest.mark.parametrize("config", (0, 1, 2))
@pytest.mark.parametrize("out_dtype", OUTS, ids=OUT_IDS)
def test_every_tile_config(config, out_dtype):
    """Each tile configuration forced on shapes it would not be chosen for (edge tiles in M,
    N and K)."""
    for M, N, K in ((1, 64, 256), (17, 144, 272), (100, 400, 1040), (300, 528, 512), (129, 4112, 2064)):
        for zp in ZPS:
            case = Case(M, N, K, out_dtype, True, zp != "tensor", zp == "none", zp)
            case.check(case.run(config=config), f"config {config} M={M} N={N} K={K} zp={zp}")


def test_unknown_config_is_an_error():
    case = Case(8, 64, 128, torch.bfloat16, True, True, True)
    with pytest.raises(RuntimeError, match="no kernel instantiated"):
        case.run(config=7)


@pytest.mark.parametrize("M,N,K", ((1, 128, 16384), (3, 256, 8208), (32, 6144, 4096), (200, 384, 8192)))
def test_long_k_reproducible(M, N, K):
    """Few output tiles with long K (deep multistage k-loops, int32 accumulators near 2**28);
    two calls must agree bitwise."""
    case = Case(M, N, K, torch.float32, True, True, True, "token")
    out = case.run()
    case.check(out, f"M={M} N={N} K={K}")
    assert torch.equal(out, case.run()), f"result not reproducible at {M}x{N}x{K}"


# ----------------------------------------------------------------------------- layouts

def realigned(t):
    """A contiguous copy at a fresh (aligned) allocation, as the C++ dispatch makes of scales,
    bias and zero points that are strided or misaligned before it calls the private op."""
    return None if t is None else t.clone(memory_format=torch.contiguous_format)


def test_sliced_and_offset_inputs():
    """a and b as views with row pitches larger than K and offset (16-byte aligned) starts;
    scales, bias and zero points offset or strided: the private op takes them realigned, the
    public op as they are (its dispatch realigns them)."""
    M, N, K = 40, 256, 512
    d = torch.device("cuda")
    a = rand_i8((M + 3, K + 64))[2 : 2 + M, 32 : 32 + K]
    b = rand_i8((N + 5, K + 48))[3 : 3 + N, 16 : 16 + K].t()
    assert a.stride() == (K + 64, 1) and b.stride() == (1, K + 48)
    for zp in ZPS:
        case = Case(M, N, K, torch.bfloat16, True, True, True, zp, a=a, b=b)
        sa = (torch.rand(M + 1, device=d) + 0.5)[1:]  # offset start
        sb = (torch.rand(2 * N, device=d) + 0.5)[::2]  # strided
        bias = torch.randn(N + 1, device=d, dtype=torch.bfloat16)[1:]
        azp = torch.randint(-60, 60, (M + 1,), dtype=torch.int32, device=d)[1:] if zp == "token" else None
        case.sa, case.sb, case.bias, case.azp = realigned(sa), realigned(sb), realigned(bias), realigned(azp)
        assert w8a8_kernel_reason(a, b, sa, sb, torch.bfloat16, bias, case.azp_adj, azp) == ""
        case.check(case.run(), f"sliced zp={zp}")
        if case.azp_adj is None:
            public = torch.ops.quantfuse.scaled_mm(a, b, sa, sb, torch.bfloat16, bias)
        else:
            public = torch.ops.quantfuse.scaled_mm_azp(a, b, sa, sb, torch.bfloat16, case.azp_adj, azp, bias)
        case.check(public, f"sliced zp={zp}, public op")


# ----------------------------------------------------------------------------- graphs, profiler

@pytest.mark.parametrize("M", (16, 300))
def test_cuda_graph_capture_and_replay(M):
    """Captured with the per-token zero point; replayed on new activations, scales and azp."""
    N, K = 512, 1024
    case = Case(M, N, K, torch.bfloat16, True, True, True, "token")
    case.run()  # warm up outside the graph
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        with torch.cuda.graph(g):
            out = case.run()
    torch.cuda.current_stream().wait_stream(s)
    for _ in range(3):
        case.a.copy_(rand_i8((M, K)))
        case.sa.copy_(torch.rand(M, device="cuda") + 0.5)
        case.azp.copy_(torch.randint(-60, 60, (M,), dtype=torch.int32, device="cuda"))
        g.replay()
        torch.cuda.synchronize()
        case.check(out, f"graph replay M={M}")


def test_runs_the_cutlass_2x_kernel():
    case = Case(64, 1024, 1024, torch.bfloat16, True, True, True)
    names = kernel_names(case.run)
    # the 2.x kernels launch as cutlass::Kernel2<...DefaultGemmWithVisitor...>, the SM90 ones
    # as cutlass::device_kernel<...>
    assert any("cutlass" in n and ("Kernel2" in n or "Visitor" in n) for n in names), names


# ----------------------------------------------------------------------------- fp8, dispatch

def test_fp8_on_arch80_is_a_clear_error():
    a = torch.randn(16, 128, device="cuda").to(torch.float8_e4m3fn)
    b = torch.randn(64, 128, device="cuda").to(torch.float8_e4m3fn).t()
    sa = torch.ones(1, device="cuda")
    with pytest.raises(RuntimeError, match="SM80 kernels take int8 inputs only"):
        torch.ops.quantfuse._scaled_mm_cutlass(a, b, sa, sa, torch.bfloat16, None, None, None, ARCH, -1)


def _sm80_kernel(names) -> bool:
    # the 2.x kernels launch as cutlass::Kernel2<...>, the SM90 ones as cutlass::device_kernel<...>
    return any("cutlass" in n and "Kernel2" in n for n in names)


def test_kernel_choice_on_this_gpu():
    """The C++ dispatch reads the GPU's capability itself, so the choice is checked on the GPU
    present.  int8: a kernel takes every M; forced onto the SM80 kernels (arch=80, which also
    run on a Hopper) and through the public op (the decode kernel up to DECODE_MAX_M rows, above
    it the SM90 kernels on a Hopper and the SM80 ones elsewhere) the result matches the float64
    reference.  fp8: a kernel takes it on a Hopper at any M and from sm_89 up to DECODE_MAX_M
    rows (the decode kernel); elsewhere the reason names fp8 and the public op returns the
    reference's result, bitwise."""
    N, K = 64, 128
    bf16, fp8 = torch.bfloat16, torch.float8_e4m3fn
    for M in (DECODE_MAX_M, DECODE_MAX_M + 1, 300):
        case = Case(M, N, K, bf16, True, True, True)
        assert w8a8_kernel_reason(case.a, case.b, case.sa, case.sb, bf16, case.bias) == ""
        names = kernel_names(case.run)
        assert _sm80_kernel(names), names
        case.check(case.run(), f"arch=80, M={M}")
        public = functools.partial(torch.ops.quantfuse.scaled_mm, case.a, case.b, case.sa, case.sb, bf16, case.bias)
        case.check(public(), f"public op, M={M}")
        names = kernel_names(public)
        if M <= DECODE_MAX_M:
            assert any("scaled_mm_decode" in n for n in names), names
        elif HOPPER:
            assert ran_quantfuse_kernel(names) and not _sm80_kernel(names), names
        else:
            assert _sm80_kernel(names), names
    for M in (DECODE_MAX_M, DECODE_MAX_M + 1):
        af, bf = rand_q((M, K), fp8), rand_q((N, K), fp8).t()
        sa, sb = torch.rand(M, device="cuda") + 0.5, torch.rand(N, device="cuda") + 0.5
        reason = w8a8_kernel_reason(af, bf, sa, sb, bf16)
        out = torch.ops.quantfuse.scaled_mm(af, bf, sa, sb, bf16)
        if HOPPER or (CAP >= (8, 9) and M <= DECODE_MAX_M):
            assert reason == "", (M, reason)
            check_w8a8(out, w8a8_reference64(af, bf, sa, sb), bf16, fp8, what=f"fp8 M={M}")
            assert ran_quantfuse_kernel(kernel_names(lambda af=af, bf=bf, sa=sa, sb=sb: torch.ops.quantfuse.scaled_mm(
                af, bf, sa, sb, bf16)))
        else:
            assert reason != "" and "fp8" in reason, (M, reason)
            assert torch.equal(out, ops.scaled_mm_reference(af, bf, sa, sb, bf16))


def test_arch_zero_picks_by_capability():
    """arch=0 gives the SM90 kernels on Hopper and the SM80 ones elsewhere; both agree."""
    case = Case(33, 256, 512, torch.float16, True, True, True, "token")
    out0 = case.run(arch=0)
    case.check(out0, "arch 0")
    case.check(case.run(arch=ARCH), "arch 80")
    with pytest.raises(RuntimeError, match="arch must be"):
        case.run(arch=75)
