"""GPU tests of the CUTLASS 2.x (SM80) kernels behind quantfuse.scaled_mm / scaled_mm_azp.

Skipped without CUDA.  The SM80 kernels (mma.sync, cp.async, 2.x epilogue visitor
trees) also run on Hopper, so every test forces them with
``torch.ops.quantfuse._scaled_mm_cutlass(..., arch=80)``.  Checked against a float64
reference (ops.py's exact product, epilogue in float64) on fresh random data: every
epilogue x scale granularity x bias x output dtype, the M sweep on LLM-sized (N, K), every
tile configuration on edge tiles, sliced inputs, CUDA-graph capture and replay, bitwise
reproducibility at long K, and fp8 on arch 80 (a clear error from the op;
the Python dispatch sends fp8 on non-Hopper GPUs to the reference).
"""

from __future__ import annotations

import itertools

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

if torch.cuda.is_available():
    import compile_backend.cuda  # noqa: F401  (registers the kernel families)
    from compile_backend import kernels, ops
    from compile_backend.cuda import scaled_mm as qsm

ARCH = 80
M_ALL = (1, 2, 15, 16, 17, 33, 64, 100, 128, 256, 512, 4096)
OUTS = (torch.float16, torch.bfloat16, torch.float32)
OUT_IDS = ("f16", "bf16", "f32")
ZPS = ("none", "tensor", "token")  # no zero point / per-tensor (folded into azp_adj) / per-token
RTOL = {torch.float16: 2e-3, torch.bfloat16: 1.6e-2, torch.float32: 2e-5}
SMALL_NK = ((64, 128), (192, 320))
LLM_NK = ((4096, 4096), (6144, 4096))


@pytest.fixture(scope="module", autouse=True)
def _built():
    if torch.cuda.is_available():
        assert kernels.ensure_loaded(), kernels.status()
        if torch.cuda.get_device_capability() < (8, 0):
            pytest.skip("the SM80 kernels need compute capability 8.0 or later")
    yield


def rand_i8(shape):
    return torch.randint(-128, 128, shape, dtype=torch.int8, device="cuda")


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
        poison(M, N, self.out_dtype)
        return torch.ops.quantfuse._scaled_mm_cutlass(
            self.a, self.b, self.sa, self.sb, self.out_dtype, self.bias, self.azp_adj, self.azp, arch, config)

    def reference(self):
        acc = ops._exact_float64_product(self.a, self.b)
        if self.azp_adj is not None:
            adj = self.azp_adj.double().reshape(1, -1)
            acc = acc - (adj if self.azp is None else self.azp.double().reshape(-1, 1) * adj)
        out = acc * self.sb.double().reshape(1, -1) * self.sa.double().reshape(-1, 1)
        if self.bias is not None:
            out = out + self.bias.double()
        return out

    def ops_reference(self):
        if self.azp_adj is None:
            return ops.scaled_mm_reference(self.a, self.b, self.sa, self.sb, self.out_dtype, self.bias)
        return ops.scaled_mm_azp_reference(
            self.a, self.b, self.sa, self.sb, self.out_dtype, self.azp_adj, self.azp, self.bias)

    def check(self, out, what=""):
        check(out, self.reference(), self.out_dtype, what)


def check(out, ref64, out_dtype, what=""):
    assert out.dtype == out_dtype and out.shape == ref64.shape, (what, out.dtype, out.shape)
    o = out.double()
    assert torch.isfinite(o).all(), f"{what}: non-finite output (unwritten or overflow)"
    rtol = RTOL[out_dtype]
    err = (o - ref64).abs()
    bound = rtol * ref64.abs() + rtol * 1e-2 * ref64.abs().max() + 1e-6
    bad = err > bound
    assert not bad.any(), (
        f"{what}: {int(bad.sum())} of {bad.numel()} elements off; max err {err.max().item():.4g}, "
        f"max |ref| {ref64.abs().max().item():.4g}"
    )


def poison(M, N, out_dtype):
    """Fill the caching allocator's next block of this size with NaN, so that an output the
    kernel fails to write shows up as NaN."""
    t = torch.full((M, N), float("nan"), dtype=out_dtype, device="cuda")
    del t


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
        check(out, case.ops_reference().double(), out_dtype, f"M={M} vs ops reference")


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

def test_sliced_and_offset_inputs():
    """a and b as views with row pitches larger than K and offset (16-byte aligned) starts;
    scales and bias realigned by the dispatch's _prep, as launch does."""
    M, N, K = 40, 256, 512
    d = torch.device("cuda")
    a = rand_i8((M + 3, K + 64))[2 : 2 + M, 32 : 32 + K]
    b = rand_i8((N + 5, K + 48))[3 : 3 + N, 16 : 16 + K].t()
    assert a.stride() == (K + 64, 1) and b.stride() == (1, K + 48)
    for zp in ZPS:
        case = Case(M, N, K, torch.bfloat16, True, True, True, zp, a=a, b=b)
        case.sa = qsm._prep((torch.rand(M + 1, device=d) + 0.5)[1:], d)  # offset start
        case.sb = qsm._prep((torch.rand(2 * N, device=d) + 0.5)[::2], d)  # strided
        case.bias = qsm._prep(torch.randn(N + 1, device=d, dtype=torch.bfloat16)[1:], d)
        if zp == "token":
            case.azp = qsm._prep(torch.randint(-60, 60, (M + 1,), dtype=torch.int32, device=d)[1:], d)
        assert qsm.supports(a, b, case.sa, case.sb, torch.bfloat16, case.bias) is None
        case.check(case.run(), f"sliced zp={zp}")


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
    from torch.profiler import ProfilerActivity, profile

    case = Case(64, 1024, 1024, torch.bfloat16, True, True, True)
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        case.run()
        torch.cuda.synchronize()
    names = [e.name for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
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


def test_dispatch_on_non_hopper_gpus(monkeypatch):
    """As on an A100/L40 (capability faked): int8 is taken by the kernels (the op then picks
    the SM80 ones), fp8 runs the reference with a reason, and the result is the reference's."""
    index = torch.cuda.current_device()
    a8 = rand_i8((16, 128))
    b8 = rand_i8((64, 128)).t()
    af = torch.randn(16, 128, device="cuda").to(torch.float8_e4m3fn)
    bf = torch.randn(64, 128, device="cuda").to(torch.float8_e4m3fn).t()
    sa, sb = torch.rand(16, device="cuda") + 0.5, torch.rand(64, device="cuda") + 0.5
    for cap in ((8, 0), (8, 6), (8, 9)):
        monkeypatch.setitem(kernels._capabilities, index, cap)
        assert qsm.supports(a8, b8, sa, sb, torch.bfloat16) is None
        reason = qsm.supports(af, bf, sa, sb, torch.bfloat16)
        assert reason is not None and "fp8" in reason, reason
        out = ops.scaled_mm(af, bf, sa, sb, torch.bfloat16)
        assert torch.equal(out, ops.scaled_mm_reference(af, bf, sa, sb, torch.bfloat16))
    monkeypatch.setitem(kernels._capabilities, index, (7, 5))
    assert "sm_80" in qsm.supports(a8, b8, sa, sb, torch.bfloat16)


def test_arch_zero_picks_by_capability():
    """arch=0 gives the SM90 kernels on Hopper and the SM80 ones elsewhere; both agree."""
    case = Case(33, 256, 512, torch.float16, True, True, True, "token")
    out0 = case.run(arch=0)
    case.check(out0, "arch 0")
    case.check(case.run(arch=ARCH), "arch 80")
    with pytest.raises(RuntimeError, match="arch must be"):
        case.run(arch=75)
