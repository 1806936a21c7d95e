"""Shared setup of the GPU tests (test_cuda_*.py): markers, the kernels' loading, the
dispatch thresholds mirrored from csrc/, and the W8A8 helpers they all use.

* A test module marked ``gpu`` (``pytestmark = pytest.mark.gpu``) is skipped without a CUDA
  GPU; with one, its tests run only once the CUDA kernels are loaded (``cuda_kernels``),
  and fail if they cannot be: a GPU run must never quietly test the references instead.
* Plain helpers are imported with ``from conftest import ...`` (pytest puts tests/ on
  ``sys.path``; running a test file as a script, as the sanitizer drivers do, too).
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

CUDA = torch.cuda.is_available()
CAP = torch.cuda.get_device_capability() if CUDA else (0, 0)
HOPPER = CAP == (9, 0)
DEV = "cuda"

needs_hopper = pytest.mark.skipif(not HOPPER, reason="needs an sm_90 (Hopper) GPU: the SM90 kernels")
needs_triton = pytest.mark.skipif(importlib.util.find_spec("triton") is None,
                                  reason="needs Triton (its interpreter runs on a CPU)")

# The kernel choice of the public ops' CUDA dispatch (csrc/), for the tests that check which
# kernel runs.  Keep in step with the C++ constants named.
DECODE_MAX_M = 16  # W8A8 decode kernel up to this M: scaled_mm/scaled_mm_decode.h, decode::kMaxM
FP8_CUBLASLT_MIN_M = 256  # fp8 per-token x per-channel via cuBLASLt from this M: scaled_mm_dispatch.cpp
AWQ_DECODE_MAX_M = 32  # AWQ streaming kernel up to this M: awq_gemm/awq_gemm_dispatch.cpp, kDecodeMaxM
AWQ_KERNEL_MAX_M = 64  # ... and up to this M where the SM90 kernel declines (kKernelMaxM)
AWQ_SM90_NUM_CONFIGS = 14  # SM90 AWQ tile configurations 0..13: awq_gemm/awq_gemm_sm90_choice.h, kNumConfigs


# --------------------------------------------------------------------------- markers, loading


def pytest_collection_modifyitems(config, items):
    if CUDA:
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if item.get_closest_marker("gpu") is not None:
            item.add_marker(skip)


def load_cuda_kernels() -> None:
    """Loads the CUDA kernels as a program's first CUDA call of a public op does (compile_backend.ops'
    bootstrap, after which the C++ implementations serve every call); asserts they loaded."""
    import compile_backend  # noqa: F401  (registers the ops)
    from compile_backend.kernels import loader as kernels

    qweight = torch.zeros(16, 8, dtype=torch.int32, device=DEV)
    scales = torch.ones(1, 64, dtype=torch.float16, device=DEV)
    qzeros = torch.zeros(1, 8, dtype=torch.int32, device=DEV)
    torch.ops.quantfuse.awq_dequantize(qweight, scales, qzeros, 16)
    assert kernels.ensure_loaded(), f"the CUDA kernels did not load: {kernels.status()}"
    assert kernels.status()["status"] == "loaded", kernels.status()


@pytest.fixture(scope="session")
def cuda_kernels():
    load_cuda_kernels()


@pytest.fixture(autouse=True)
def _kernels_for_gpu_tests(request):
    if request.node.get_closest_marker("gpu") is not None:
        request.getfixturevalue("cuda_kernels")


@pytest.fixture
def isolated_loader(monkeypatch):
    """The kernels' loader as in a process that has not loaded them yet, for tests that simulate a
    load (a prebuilt library, a failed build).  Its load hooks are emptied: a simulated load must
    not remove or reinstall the ops' CUDA registrations of this process, where on a GPU machine the
    real kernels are loaded (a reinstalled bootstrap would take every CUDA call from then on)."""
    from compile_backend.kernels import loader as kernels

    monkeypatch.setattr(kernels, "_state", {"status": "unloaded", "error": None, "kernels": None, "library": None})
    monkeypatch.setattr(kernels, "_before_load", [])
    monkeypatch.setattr(kernels, "_after_failed_load", [])
    return kernels


# --------------------------------------------------------------------------- GPU helpers


def awq_layout_held(layer):
    """``layer`` (an ``AWQLinear``) holding ``qweight`` in the AWQ layout, as other libraries' modules
    do: the kernels then derive their layouts from it and keep them (the derived-value tests)."""
    from compile_backend.quantize import set_tensors

    return set_tensors(layer, qweight=layer.awq_qweight())


def poison(shape, dtype) -> None:
    """Fills the caching allocator's next block of this many ``dtype`` elements with NaN, so that
    an output a kernel fails to write shows up as NaN."""
    t = torch.full(shape if isinstance(shape, tuple) else (shape,), float("nan"), dtype=dtype, device=DEV)
    del t


def _written_by_a_kernel(src: torch.Tensor) -> torch.Tensor:
    """A copy of ``src`` that an elementwise kernel writes (an xor with 0 on its bits)."""
    ints = {1: torch.uint8, 2: torch.int16, 4: torch.int32}[src.element_size()]
    return torch.bitwise_xor(src.view(ints), 0).view(src.dtype)


def assert_pdl_on_off_equal(run, src: torch.Tensor, refresh) -> None:
    """``run(a, pdl)`` (a decode kernel's private op) launched with programmatic dependent launch
    (``pdl=1``; where the GPU has it) and without (``pdl=0``) gives the same bits: eagerly, and in a
    CUDA graph where the kernel just before writes its activation ``a`` (it must wait for it) and one
    after reads its output, over three replays with ``src`` refreshed by ``refresh()``.  With PDL, each of
    what a kernel may do before it waits (``QUANTFUSE_PDL_PREFETCH``: its first weights into registers,
    its weights into L2, nothing)."""
    import os

    assert torch.equal(run(src, 1), run(src, 0)), "pdl on and off differ"
    for pdl, prefetch in ((0, "regs"), (1, "regs"), (1, "l2"), (1, "0")):
        previous = os.environ.get("QUANTFUSE_PDL_PREFETCH")
        os.environ["QUANTFUSE_PDL_PREFETCH"] = prefetch
        try:
            run(_written_by_a_kernel(src), pdl)  # warm-up outside the graph
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                after = _written_by_a_kernel(run(_written_by_a_kernel(src), pdl))
        finally:
            if previous is None:
                os.environ.pop("QUANTFUSE_PDL_PREFETCH")
            else:
                os.environ["QUANTFUSE_PDL_PREFETCH"] = previous
        for _ in range(3):
            src.copy_(refresh())
            graph.replay()
            torch.cuda.synchronize()
            assert torch.equal(after, run(src, 0)), f"pdl={pdl}, prefetch {prefetch}: the graph's result differs"


def kernel_names(fn) -> list[str]:
    """Names of the CUDA kernels ``fn()`` launches (torch.profiler)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    return [e.name for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]


def w8a8_kernel_reason(a, b, sa, sb, out_dtype, bias=None, azp_adj=None, azp=None) -> str:
    """Why the C++ dispatch of scaled_mm (scaled_mm_azp with ``azp_adj``) runs the reference for
    these operands; "" when a kernel takes them."""
    return torch.ops.quantfuse._scaled_mm_kernel_reason(a, b, sa, sb, out_dtype, bias, azp_adj, azp)


def awq_kernel_reason(x, qweight, scales, qzeros, group_size, bias=None, perm=None) -> str:
    """Why the C++ dispatch of awq_gemm runs the reference for these operands; "" when a kernel
    takes them."""
    return torch.ops.quantfuse._awq_gemm_kernel_reason(x, qweight, scales, qzeros, group_size, bias, perm)


def ran_quantfuse_kernel(names) -> bool:
    """Whether one of the profiled kernels is ours (every kernel in csrc/ is in namespace quantfuse;
    the references and cuBLAS(Lt) run torch's kernels)."""
    return any("quantfuse" in n for n in names)


# --------------------------------------------------------------------------- W8A8


OUTS = (torch.float16, torch.bfloat16, torch.float32)
OUT_IDS = ("f16", "bf16", "f32")
INS = (torch.int8, torch.float8_e4m3fn)
IN_IDS = ("int8", "fp8")
RTOL = {torch.float16: 2e-3, torch.bfloat16: 1.6e-2, torch.float32: 2e-5}


def rand_q(shape, dtype=torch.int8) -> torch.Tensor:
    """int8 over its whole range, or fp8 e4m3 values of a normal distribution (std 3)."""
    if dtype == torch.int8:
        return torch.randint(-128, 128, shape, dtype=torch.int8, device=DEV)
    return (torch.randn(shape, device=DEV) * 3).clamp(-448, 448).to(dtype)


def exact_acc(a, b) -> torch.Tensor:
    """a @ b accumulated exactly in float64 (int8: exact integers; fp8: exact products)."""
    return torch.matmul(a.to(torch.float64), b.to(torch.float64))


def epilogue64(acc64, sa, sb, bias=None, azp_adj=None, azp=None) -> torch.Tensor:
    """float64: the zero-point term (``azp_adj`` per column, times ``azp`` per row if given),
    the scales and the bias applied to an exact accumulator."""
    if azp_adj is not None:
        adj = azp_adj.double().reshape(1, -1)
        acc64 = acc64 - (adj if azp is None else azp.double().reshape(-1, 1) * adj)
    out = acc64 * sb.double().reshape(1, -1) * sa.double().reshape(-1, 1)
    return out + bias.double() if bias is not None else out


def w8a8_reference64(a, b, sa, sb, bias=None, azp_adj=None, azp=None) -> torch.Tensor:
    """float64 result of scaled_mm / scaled_mm_azp: exact products and sums, then the epilogue."""
    return epilogue64(exact_acc(a, b), sa, sb, bias, azp_adj, azp)


def check_w8a8(out, ref64, out_dtype, in_dtype=torch.int8, what=""):
    """``out`` against the float64 reference: one rounding to ``out_dtype`` (int8: exact
    accumulation), and for fp8 the tensor cores' fp32 partial sums (Hopper's fp8 wgmma keeps
    reduced precision before each k-tile's promotion; measured up to ~3e-4 of max|ref| at K=528)."""
    assert out.dtype == out_dtype and out.shape == ref64.shape, (what, out.dtype, tuple(out.shape))
    if ref64.numel() == 0:
        return
    o = out.double()
    assert torch.isfinite(o).all(), f"{what}: non-finite output (unwritten or overflow)"
    rtol = RTOL[out_dtype]
    atol_rel = 2e-3 if in_dtype == torch.float8_e4m3fn else rtol * 1e-2
    err = (o - ref64).abs()
    bound = rtol * ref64.abs() + atol_rel * ref64.abs().max() + 1e-6
    bad = err > bound
    assert not bad.any(), (
        f"{what}: {int(bad.sum())} of {bad.numel()} elements off; max err {err.max().item():.4g}, "
        f"max |ref| {ref64.abs().max().item():.4g}; first bad at {bad.nonzero()[0].tolist()}"
    )


# --------------------------------------------------------------------------- Triton's interpreter


def assert_interpreted_ok(cases: str, timeout: int) -> None:
    """``tests/<cases>.py``'s ``interpret()`` in a subprocess with ``TRITON_INTERPRET=1`` (read when
    Triton is imported, so not in this process): it must exit 0 having printed ok."""
    root = Path(__file__).resolve().parents[1]
    env = {**os.environ, "TRITON_INTERPRET": "1",
           "PYTHONPATH": os.pathsep.join([str(root), os.environ.get("PYTHONPATH", "")])}
    code = f"import sys; sys.path.insert(0, {str(root / 'tests')!r}); import {cases}; {cases}.interpret()"
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=timeout)
    assert done.returncode == 0 and done.stdout.strip().endswith("ok"), done.stderr[-3000:]
