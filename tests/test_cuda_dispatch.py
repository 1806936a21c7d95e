"""GPU tests of the public ops' C++ dispatch (csrc/*/*_dispatch.cpp) and of the values it
derives from weights (csrc/common/derived_cache.*).

* The C++ operand checks mirror the Python rules of compile_backend/ops/: on the same
  malformed inputs the Python check raises QuantfuseInputError, the C++ dispatch gives a
  reason (so the reference runs) and the public op raises QuantfuseInputError; on
  well-formed inputs a kernel takes them and the result matches the references.
* Values derived from weights (AWQ repack, SM90 prepared weight, azp column sums) are never
  allocated into a CUDA-graph pool: torch.compile(mode="reduce-overhead") works from its
  first call, also after the cache is cleared, and a plain CUDA-graph capture keeps none.
* They are fresh: an in-place write to a weight makes a new value.
"""

from __future__ import annotations

import functools
import gc

import pytest
import torch
from awq_data import check_op, check_sm90, make_awq, make_x, unpacked
from conftest import (
    AWQ_DECODE_MAX_M,
    CAP,
    DEV,
    HOPPER,
    awq_kernel_reason,
    awq_layout_held,
    check_w8a8,
    kernel_names,
    ran_quantfuse_kernel,
    rand_q,
    w8a8_kernel_reason,
    w8a8_reference64,
)

from compile_backend import ops
from compile_backend.ops import QuantfuseInputError
from compile_backend.quantize import AWQLinear, W8A8Linear

pytestmark = pytest.mark.gpu

FP8 = torch.float8_e4m3fn
derived_stats = lambda: torch.ops.quantfuse._derived_cache_stats()  # [values made, served, live entries]
derived_clear = lambda: torch.ops.quantfuse._derived_cache_clear()


# --------------------------------------------------------------------------- W8A8 operands

M, K, N = 8, 128, 64


def w8a8_args(**over) -> dict:
    """Well-formed int8 scaled_mm_azp operands on the GPU (M x K x N), with ``over`` replacing some."""
    b = rand_q((N, K)).t()
    args = dict(
        # K = 128 int8 products sum to ~1e5: scales of ~1e-3 keep float16 outputs finite
        a=rand_q((M, K)), b=b, scale_a=(torch.rand(M, device=DEV) + 0.5) * 1e-3,
        scale_b=torch.rand(N, device=DEV) + 0.5,
        out_dtype=torch.float16, bias=torch.randn(N, device=DEV).half(),
        azp_adj=b.to(torch.int32).sum(0, dtype=torch.int32), azp=torch.randint(-50, 50, (M,), dtype=torch.int32,
                                                                              device=DEV))
    args.update(over)
    return args


def scaled_mm_args(args):
    return args["a"], args["b"], args["scale_a"], args["scale_b"], args["out_dtype"], args["bias"]


def azp_args(args):
    return (args["a"], args["b"], args["scale_a"], args["scale_b"], args["out_dtype"], args["azp_adj"], args["azp"],
            args["bias"])


# name -> operands replaced (built on the GPU when the test runs)
W8A8_MALFORMED = {
    "a float16": lambda: dict(a=torch.randn(M, K, device=DEV).half()),
    "a int32": lambda: dict(a=torch.randint(-5, 5, (M, K), dtype=torch.int32, device=DEV)),
    "a 3-D": lambda: dict(a=rand_q((2, M, K))),
    "a 1-D": lambda: dict(a=rand_q((K,))),
    "b 3-D": lambda: dict(b=rand_q((2, K, N))),
    "b dtype differs from a's": lambda: dict(b=rand_q((N, K), FP8).t()),
    "b rows != K": lambda: dict(b=rand_q((N, K + 16)).t()),
    "out_dtype int32": lambda: dict(out_dtype=torch.int32),
    "out_dtype float64": lambda: dict(out_dtype=torch.float64, bias=None),
    "scale_a float16": lambda: dict(scale_a=torch.rand(M, device=DEV).half()),
    "scale_a 3 elements": lambda: dict(scale_a=torch.rand(3, device=DEV)),
    "scale_a M + 1 elements": lambda: dict(scale_a=torch.rand(M + 1, device=DEV)),
    "scale_b float64": lambda: dict(scale_b=torch.rand(N, device=DEV, dtype=torch.float64)),
    "scale_b N + 1 elements": lambda: dict(scale_b=torch.rand(N + 1, device=DEV)),
    "bias N + 16 elements": lambda: dict(bias=torch.randn(N + 16, device=DEV).half()),
    "bias 2-D": lambda: dict(bias=torch.randn(1, N, device=DEV).half()),
    "bias bfloat16, out float16": lambda: dict(bias=torch.randn(N, device=DEV).bfloat16()),
    "a on the CPU": lambda: dict(a=torch.randint(-128, 128, (M, K), dtype=torch.int8)),
    "b on the CPU": lambda: dict(b=torch.randint(-128, 128, (N, K), dtype=torch.int8).t()),
    "scale_a on the CPU": lambda: dict(scale_a=torch.rand(M)),
    "scale_b a 0-dim CPU tensor": lambda: dict(scale_b=torch.tensor(0.5)),
    "bias on the CPU": lambda: dict(bias=torch.randn(N).half()),
}
AZP_MALFORMED = {
    "azp_adj int64": lambda: dict(azp_adj=torch.zeros(N, dtype=torch.int64, device=DEV)),
    "azp_adj N + 1 elements": lambda: dict(azp_adj=torch.zeros(N + 1, dtype=torch.int32, device=DEV)),
    "azp_adj 2-D": lambda: dict(azp_adj=torch.zeros(1, N, dtype=torch.int32, device=DEV)),
    "azp float32": lambda: dict(azp=torch.zeros(M, device=DEV)),
    "azp M + 1 elements": lambda: dict(azp=torch.zeros(M + 1, dtype=torch.int32, device=DEV)),
    "zero points with fp8 a and b": lambda: dict(a=rand_q((M, K), FP8), b=rand_q((N, K), FP8).t()),
    "azp_adj on the CPU": lambda: dict(azp_adj=torch.zeros(N, dtype=torch.int32)),
    "azp on the CPU": lambda: dict(azp=torch.zeros(M, dtype=torch.int32)),
}


def _assert_malformed_everywhere(python_check, reason_of, public_op, what):
    with pytest.raises(QuantfuseInputError):
        python_check()
    reason = reason_of()
    assert isinstance(reason, str) and reason != "", f"{what}: the C++ dispatch takes what Python refuses"
    with pytest.raises(QuantfuseInputError):
        public_op()


@pytest.mark.parametrize("name", sorted(W8A8_MALFORMED))
def test_scaled_mm_checks_agree_on_malformed_inputs(name):
    """scaled_mm and scaled_mm_azp: the Python check raises, the C++ dispatch gives a reason,
    the public op raises QuantfuseInputError (from the reference the dispatch calls)."""
    args = w8a8_args(**W8A8_MALFORMED[name]())
    sm, azp = scaled_mm_args(args), azp_args(args)
    _assert_malformed_everywhere(
        lambda: ops.scaled_mm_reference(*sm),
        lambda: w8a8_kernel_reason(*sm),
        lambda: torch.ops.quantfuse.scaled_mm(*sm), f"scaled_mm, {name}")
    _assert_malformed_everywhere(
        lambda: ops.scaled_mm_azp_reference(*azp),
        lambda: w8a8_kernel_reason(*sm, args["azp_adj"], args["azp"]),
        lambda: torch.ops.quantfuse.scaled_mm_azp(*azp), f"scaled_mm_azp, {name}")


@pytest.mark.parametrize("name", sorted(AZP_MALFORMED))
def test_scaled_mm_azp_checks_agree_on_malformed_zero_points(name):
    args = w8a8_args(**AZP_MALFORMED[name]())
    sm, azp = scaled_mm_args(args), azp_args(args)
    _assert_malformed_everywhere(
        lambda: ops.scaled_mm_azp_reference(*azp),
        lambda: w8a8_kernel_reason(*sm, args["azp_adj"], args["azp"]),
        lambda: torch.ops.quantfuse.scaled_mm_azp(*azp), f"scaled_mm_azp, {name}")


def _misaligned(t):
    """A copy of ``t`` whose data starts one element past a fresh allocation's start."""
    flat = torch.empty(t.numel() + 1, dtype=t.dtype, device=t.device)
    out = flat[1:].view(t.shape)
    out.copy_(t)
    return out


# name -> (operands replaced, fp8 needs a Hopper)
W8A8_WELL_FORMED = {
    "int8 M=1, per-tensor scales": (lambda: dict(a=rand_q((1, K)), scale_a=(torch.rand(1, device=DEV) + 0.5) * 1e-3,
                                                 scale_b=torch.rand(1, device=DEV) + 0.5, azp=torch.ones(
                                                     1, dtype=torch.int32, device=DEV)), False),
    "int8 M=8, bfloat16 out": (lambda: dict(out_dtype=torch.bfloat16, bias=torch.randn(N, device=DEV).bfloat16()),
                               False),
    "int8 M=40, float32 out, no bias": (lambda: dict(
        a=rand_q((40, K)), scale_a=(torch.rand(40, device=DEV) + 0.5) * 1e-3, out_dtype=torch.float32, bias=None,
        azp=torch.randint(-50, 50, (40,), dtype=torch.int32, device=DEV)), False),
    "int8 M=300": (lambda: dict(a=rand_q((300, K)), scale_a=(torch.rand(300, device=DEV) + 0.5) * 1e-3,
                                azp=torch.randint(-50, 50, (300,), dtype=torch.int32, device=DEV)), False),
    "scales [M, 1] and [1, N]": (lambda: dict(scale_a=(torch.rand(M, 1, device=DEV) + 0.5) * 1e-3,
                                              scale_b=torch.rand(1, N, device=DEV) + 0.5), False),
    "0-dim scales": (lambda: dict(scale_a=torch.tensor(7e-4, device=DEV), scale_b=torch.tensor(1.3, device=DEV)),
                     False),
    "b row-major (copied)": (lambda: dict(b=rand_q((K, N))), False),
    "a misaligned (copied)": (lambda: dict(a=_misaligned(rand_q((M, K)))), False),
    "strided scales, offset bias (copied)": (lambda: dict(
        scale_a=((torch.rand(2 * M, device=DEV) + 0.5) * 1e-3)[::2],
        scale_b=_misaligned(torch.rand(N, device=DEV) + 0.5),
        bias=_misaligned(torch.randn(N, device=DEV).half())), False),
    "M = 0": (lambda: dict(a=rand_q((0, K)), scale_a=torch.rand(1, device=DEV),
                           azp=torch.zeros(0, dtype=torch.int32, device=DEV)), False),
    "fp8 M=1": (lambda: dict(a=rand_q((1, K), FP8), b=rand_q((N, K), FP8).t(), scale_a=torch.rand(1, device=DEV)),
                True),
    "fp8 M=300, per-token x per-channel": (lambda: dict(
        a=rand_q((300, K), FP8), b=rand_q((N, K), FP8).t(), scale_a=torch.rand(300, device=DEV) + 0.5,
        out_dtype=torch.bfloat16, bias=torch.randn(N, device=DEV).bfloat16()), True),
    "fp8 M=300, per-tensor": (lambda: dict(
        a=rand_q((300, K), FP8), b=rand_q((N, K), FP8).t(), scale_a=torch.rand(1, device=DEV) + 0.5,
        scale_b=torch.rand(1, device=DEV) + 0.5), True),
}


@pytest.mark.parametrize("name", list(W8A8_WELL_FORMED))
def test_scaled_mm_well_formed_inputs_run_a_kernel(name):
    """A kernel takes them ("" from the dispatch, one of our kernels or cuBLASLt's fp8 kernel
    runs) and the result matches the float64 reference and the op's own reference."""
    make, fp8 = W8A8_WELL_FORMED[name]
    if fp8 and not HOPPER:
        pytest.skip("fp8 at every M needs a Hopper")
    args = w8a8_args(**make())
    sm = scaled_mm_args(args)
    fp8_in = args["a"].dtype == FP8
    in_dtype, out_dtype = args["a"].dtype, args["out_dtype"]
    assert w8a8_kernel_reason(*sm) == "", name
    out = torch.ops.quantfuse.scaled_mm(*sm)
    check_w8a8(out, w8a8_reference64(*sm[:4], sm[5]), out_dtype, in_dtype, what=name)
    check_w8a8(out, ops.scaled_mm_reference(*sm).double(), out_dtype, in_dtype, what=f"{name} vs ops reference")
    if out.numel() and not (fp8_in and out.shape[0] >= 256 and args["scale_a"].numel() > 1):
        assert ran_quantfuse_kernel(kernel_names(functools.partial(torch.ops.quantfuse.scaled_mm, *sm))), name
    if fp8_in:
        return  # zero points are int8 only
    for azp in (args["azp"], None):  # per-token zero points, a per-tensor one folded into azp_adj
        azp_adj = args["azp_adj"] if azp is not None else (5 * args["azp_adj"]).to(torch.int32)
        assert w8a8_kernel_reason(*sm, azp_adj, azp) == "", name
        a, b, sa, sb, _, bias = sm
        out = torch.ops.quantfuse.scaled_mm_azp(a, b, sa, sb, out_dtype, azp_adj, azp, bias)
        check_w8a8(out, w8a8_reference64(a, b, sa, sb, bias, azp_adj, azp), out_dtype, what=f"{name}, azp")
        ref = ops.scaled_mm_azp_reference(a, b, sa, sb, out_dtype, azp_adj, azp, bias)
        check_w8a8(out, ref.double(), out_dtype, what=f"{name}, azp vs ops reference")


# --------------------------------------------------------------------------- AWQ operands

AK, AN, AG, AM = 256, 64, 128, 4


def awq_args(gen, **over) -> dict:
    qw, s, qz, G, _, _ = make_awq(AK, AN, AG, torch.float16, gen)
    args = dict(x=make_x(AM, AK, torch.float16, gen), qweight=qw, scales=s, qzeros=qz, group_size=G,
                bias=torch.randn(AN, device=DEV).half())
    args.update(over)
    return args


def _gemm(args):
    return args["x"], args["qweight"], args["scales"], args["qzeros"], args["group_size"], args["bias"]


def _dequant(args):
    return args["qweight"], args["scales"], args["qzeros"], args["group_size"]


# name -> (operands replaced given the well-formed ones, whether it concerns x or bias only)
AWQ_MALFORMED = {
    "qweight int64": (lambda a: dict(qweight=a["qweight"].long()), False),
    "qweight float32": (lambda a: dict(qweight=a["qweight"].float()), False),
    "qweight 1-D": (lambda a: dict(qweight=a["qweight"].reshape(-1)), False),
    "scales float32": (lambda a: dict(scales=a["scales"].float()), False),
    "scales 1-D": (lambda a: dict(scales=a["scales"].reshape(-1)), False),
    "scales one group too many": (lambda a: dict(scales=torch.ones(3, AN, device=DEV).half()), False),
    "scales N + 8 columns": (lambda a: dict(scales=torch.ones(2, AN + 8, device=DEV).half()), False),
    "group_size 0": (lambda a: dict(group_size=0), False),
    "group_size -1": (lambda a: dict(group_size=-1), False),
    "group_size not dividing K": (lambda a: dict(group_size=100), False),
    "qzeros float32": (lambda a: dict(qzeros=a["qzeros"].float()), False),
    "qzeros one column too many": (lambda a: dict(qzeros=torch.zeros(2, AN // 8 + 1, dtype=torch.int32,
                                                                      device=DEV)), False),
    "qweight on the CPU": (lambda a: dict(qweight=a["qweight"].cpu()), False),
    "scales on the CPU": (lambda a: dict(scales=a["scales"].cpu()), False),
    "qzeros on the CPU": (lambda a: dict(qzeros=a["qzeros"].cpu()), False),
    "x bfloat16, scales float16": (lambda a: dict(x=a["x"].bfloat16()), True),
    "x K - 16 columns": (lambda a: dict(x=a["x"][:, :-16]), True),
    "x 3-D": (lambda a: dict(x=a["x"][None]), True),
    "x on the CPU": (lambda a: dict(x=a["x"].cpu()), True),
    "bias N + 8 elements": (lambda a: dict(bias=torch.randn(AN + 8, device=DEV).half()), True),
    "bias bfloat16": (lambda a: dict(bias=a["bias"].bfloat16()), True),
    "bias 2-D": (lambda a: dict(bias=a["bias"][None]), True),
    "bias on the CPU": (lambda a: dict(bias=a["bias"].cpu()), True),
}


@pytest.mark.parametrize("name", sorted(AWQ_MALFORMED))
def test_awq_checks_agree_on_malformed_inputs(name):
    """awq_gemm (and awq_dequantize where the input concerns the weight): the Python check
    raises, the C++ dispatch gives a reason, the public op raises QuantfuseInputError."""
    gen = torch.Generator(device=DEV).manual_seed(len(name))
    well = awq_args(gen)
    replace, x_or_bias = AWQ_MALFORMED[name]
    args = {**well, **replace(well)}
    _assert_malformed_everywhere(
        lambda: ops.awq_gemm_reference(*_gemm(args)),
        lambda: awq_kernel_reason(*_gemm(args)),
        lambda: torch.ops.quantfuse.awq_gemm(*_gemm(args)), f"awq_gemm, {name}")
    if not x_or_bias:
        with pytest.raises(QuantfuseInputError):
            ops.awq_dequantize_reference(*_dequant(args))
        with pytest.raises(QuantfuseInputError):
            torch.ops.quantfuse.awq_dequantize(*_dequant(args))


# name -> (M, N, group, dtype, what else is replaced given the well-formed operands)
AWQ_WELL_FORMED = {
    "M=1": (1, 64, 128, torch.float16, None),
    "M=4, no bias": (4, 128, 64, torch.float16, lambda a: dict(bias=None)),
    "M=32, bfloat16": (32, 128, 128, torch.bfloat16, None),
    "M=33 (SM90 kernel on a Hopper)": (33, 256, 128, torch.float16, None),
    "M=64, per-channel": (64, 256, -1, torch.float16, None),
    "M=100, N=64 (dequantize + cuBLAS)": (100, 64, 128, torch.float16, None),
    "M=100 (SM90 kernel on a Hopper)": (100, 256, 64, torch.bfloat16, None),
    "strided x (copied)": (5, 128, 128, torch.float16,
                           lambda a: dict(x=torch.repeat_interleave(a["x"], 2, dim=1)[:, ::2])),
    "misaligned x (copied)": (5, 128, 128, torch.float16, lambda a: dict(x=_misaligned(a["x"]))),
    "misaligned x, M=100 (copied)": (100, 256, 128, torch.float16, lambda a: dict(x=_misaligned(a["x"]))),
    "strided scales (copied)": (8, 128, 128, torch.float16,
                                lambda a: dict(scales=torch.repeat_interleave(a["scales"], 2, dim=1)[:, ::2])),
    "M = 0": (0, 128, 128, torch.float16, None),
}


def check_public_awq(out, x, qw, s, qz, G, bias, what):
    """``out`` of the public awq_gemm with the bound of the kernel the dispatch picks: the SM90
    kernel's (awq_data.check_sm90) above AWQ_DECODE_MAX_M where it takes the shape."""
    K, N = qw.shape[0], qw.shape[1] * 8
    if HOPPER and x.shape[0] > AWQ_DECODE_MAX_M and K % 64 == 0 and N % 128 == 0 and (G == K or G % 64 == 0):
        q, z = unpacked(qw, qz)
        check_sm90(out, x, q, z, s, G, bias, what)
    else:
        check_op(out, x, qw, s, qz, G, bias, what=what)


@pytest.mark.parametrize("name", list(AWQ_WELL_FORMED))
def test_awq_well_formed_inputs_run_a_kernel(name):
    """A kernel takes them ("" from the dispatch, one of our kernels runs) and the result, and
    the op's own reference, are within the float64 reference's bound."""
    Mx, Nx, group, dtype, replace = AWQ_WELL_FORMED[name]
    gen = torch.Generator(device=DEV).manual_seed(Mx + Nx)
    qw, s, qz, G, _, _ = make_awq(AK, Nx, group, dtype, gen)
    args = dict(x=make_x(Mx, AK, dtype, gen) if Mx else torch.empty(0, AK, device=DEV, dtype=dtype),
                qweight=qw, scales=s, qzeros=qz, group_size=G,
                bias=(torch.randn(Nx, generator=gen, device=DEV) * 10).to(dtype))
    if replace is not None:
        args.update(replace(args))
    gemm = _gemm(args)
    assert awq_kernel_reason(*gemm) == "", name
    out = torch.ops.quantfuse.awq_gemm(*gemm)
    assert out.shape == (Mx, Nx) and out.dtype == dtype, name
    if Mx == 0:
        return
    check_public_awq(out, *gemm, what=name)
    check_op(ops.awq_gemm_reference(*gemm), *gemm, what=f"{name}, ops reference", exact=False)
    assert ran_quantfuse_kernel(kernel_names(functools.partial(torch.ops.quantfuse.awq_gemm, *gemm))), name


# --------------------------------------------------------------------------- CUDA graphs


def _rel(out, ref) -> float:
    return ((out.double() - ref.double()).norm() / ref.double().norm()).item()


def _poison_freed_blocks(like: list[torch.Tensor]) -> list[torch.Tensor]:
    """Allocations of the sizes of ``like``'s tensors with every byte 0xFF (NaN for floats), so
    that a graph still reading memory the derived-value cache freed reads garbage."""
    garbage = []
    for t in like:
        for _ in range(4):
            g = torch.empty(t.numel() * t.element_size(), dtype=torch.uint8, device=t.device)
            garbage.append(g.fill_(0xFF))
    return garbage


def _reduce_overhead_calls(model, xs, family, rel_bound):
    """Compiles ``model`` with mode="reduce-overhead" (CUDA graphs) and calls it on each of
    ``xs`` (warm-up, recording, replays): every call matches eager; one subgraph fused."""
    from torch._dynamo.utils import counters

    from compile_backend.passes import collecting_report

    fallbacks = dict(counters["quantfuse"])
    skips = counters["inductor"]["cudagraph_skips"]
    compiled = torch.compile(model, backend="quantfuse", mode="reduce-overhead")
    # Inductor's and AOTAutograd's caches would serve a graph compiled earlier (another test,
    # another worker) without running the passes, and so without a report.
    caches_off = (torch._inductor.config.patch(fx_graph_cache=False),
                  torch._functorch.config.patch(enable_autograd_cache=False))
    with torch.no_grad(), collecting_report() as report, caches_off[0], caches_off[1]:
        for i, x in enumerate(xs):
            torch.compiler.cudagraph_mark_step_begin()
            out = compiled(x)  # the first call: CUDA-graph trees' warm-up, in the graph's pool
            expected = model(x)
            assert out.dtype == expected.dtype and out.shape == expected.shape
            assert torch.isfinite(out).all(), f"call {i}: non-finite output"
            assert _rel(out, expected) < rel_bound, (i, _rel(out, expected))
    assert report.counts() == {family: 1}, str(report)
    assert dict(counters["quantfuse"]) == fallbacks, "the compile fell back"
    assert counters["inductor"]["cudagraph_skips"] == skips, "CUDA graphs were skipped"
    return compiled


def _graph_calls_after_clear(compiled, model, xs, rel_bound, like):
    """The recorded graphs keep working after the derived-value cache is cleared (with the
    memory it held reused by other tensors)."""
    derived_clear()
    garbage = _poison_freed_blocks(like)
    with torch.no_grad():
        for i, x in enumerate(xs):
            torch.compiler.cudagraph_mark_step_begin()
            out = compiled(x)
            assert _rel(out, model(x)) < rel_bound, (f"after clear, call {i}", _rel(out, model(x)))
    del garbage


@pytest.mark.compile
@pytest.mark.parametrize("Mx", (4, 64))
def test_reduce_overhead_awq_model(Mx):
    """An AWQLinear (K = N = 512, fp16, group 128) under mode="reduce-overhead": the first call
    works (its repacked / prepared weight is made outside the warm-up's graph pool, so CUDA-graph
    trees find no untracked allocation there), three calls match eager, and again after the
    derived-value cache is cleared, also through a fresh compile."""
    torch._dynamo.reset()
    derived_clear()
    torch.manual_seed(Mx)
    layer = awq_layout_held(AWQLinear.from_linear(torch.nn.Linear(512, 512, device=DEV), group_size=128,
                                                  dtype=torch.float16))
    xs = [torch.randn(Mx, 512, device=DEV, dtype=torch.float16) for _ in range(3)]
    like = [torch.ops.quantfuse._awq_repack_cuda(layer.qweight)]
    if HOPPER:
        like += list(torch.ops.quantfuse._awq_prepare_sm90_cuda(layer.qweight, layer.scales, layer.qzeros, 128))
    try:
        compiled = _reduce_overhead_calls(layer, xs, "awq_gemm", 5e-3)
        assert derived_stats()[0] >= 1  # the warm-up made the derived value
        _graph_calls_after_clear(compiled, layer, xs, 5e-3, like)
        torch._dynamo.reset()
        derived_clear()
        _reduce_overhead_calls(layer, xs, "awq_gemm", 5e-3)
    finally:
        torch._dynamo.reset()


@pytest.mark.compile
@pytest.mark.parametrize("Mx", (4, 64))
def test_reduce_overhead_w8a8_asym_model(Mx):
    """A W8A8Linear with asymmetric int8 activations (scaled_mm_azp with weight_colsum) under
    mode="reduce-overhead": as the AWQ model, for the column sums."""
    torch._dynamo.reset()
    derived_clear()
    torch.manual_seed(100 + Mx)
    layer = W8A8Linear.from_linear(torch.nn.Linear(512, 512, device=DEV), symmetric=False, out_dtype=torch.float32)
    xs = [torch.randn(Mx, 512, device=DEV) + 0.3 for _ in range(3)]
    like = [layer.weight.to(torch.int32).sum(1, dtype=torch.int32)]
    try:
        compiled = _reduce_overhead_calls(layer, xs, "scaled_mm_azp", 1e-3)
        _graph_calls_after_clear(compiled, layer, xs, 1e-3, like)
        torch._dynamo.reset()
        derived_clear()
        _reduce_overhead_calls(layer, xs, "scaled_mm_azp", 1e-3)
    finally:
        torch._dynamo.reset()


def _new_weights(layer, family):
    """Another weight for ``layer``, quantized the same way: {held tensor name: tensor}."""
    torch.manual_seed(7)
    fresh = torch.nn.Linear(512, 512, device=DEV)
    if family == "awq_gemm":
        other = awq_layout_held(AWQLinear.from_linear(fresh, group_size=128, dtype=torch.float16))
        return {name: getattr(other, name) for name in ("qweight", "qzeros", "scales")}
    other = W8A8Linear.from_linear(fresh, symmetric=False, out_dtype=torch.float32)
    return {"weight": other.weight, "weight_scale": other.weight_scale}


def _plain_tensors(layer):
    """``layer`` holding plain ``nn.Parameter``s (new storage, as another library's module would)
    instead of ``HeldParameter``s; the module's own assignment would convert them back."""
    for name, t in list(layer._parameters.items()):
        if t is not None:
            layer._parameters[name] = torch.nn.Parameter(t.detach().clone(), requires_grad=False)
    return layer


@pytest.mark.compile
@pytest.mark.parametrize("holder", ("held", "plain"))
@pytest.mark.parametrize("write", ("copy_", ".data.copy_"))
@pytest.mark.parametrize("family", ("awq_gemm", "scaled_mm_azp"))
def test_reduce_overhead_refuses_changed_weights(family, write, holder):
    """A graph captured under mode="reduce-overhead" replays the derived values (repacked AWQ
    weight, column sums) it was captured with.  Once a weight changes in place -- through the
    tensor or through ``.data``, held by our module or as a plain parameter (derived/tensor_data.py) --
    the next call raises, naming the weight, instead of computing with the old one; compiled
    again, the model matches eager with the new weights."""
    torch._dynamo.reset()
    derived_clear()
    torch.manual_seed(300)
    if family == "awq_gemm":
        layer = awq_layout_held(AWQLinear.from_linear(torch.nn.Linear(512, 512, device=DEV), group_size=128,
                                                      dtype=torch.float16))
        xs = [torch.randn(64, 512, device=DEV, dtype=torch.float16) for _ in range(3)]
        bound = 5e-3
    else:
        layer = W8A8Linear.from_linear(torch.nn.Linear(512, 512, device=DEV), symmetric=False,
                                       out_dtype=torch.float32)
        xs = [torch.randn(4, 512, device=DEV) + 0.3 for _ in range(3)]
        bound = 1e-3
    if holder == "plain":
        layer = _plain_tensors(layer)
        assert type(layer.weight if family == "scaled_mm_azp" else layer.qweight) is torch.nn.Parameter
    try:
        compiled = _reduce_overhead_calls(layer, xs, family, bound)
        with torch.no_grad():
            for name, value in _new_weights(layer, family).items():
                held = getattr(layer, name)
                (held if write == "copy_" else held.data).copy_(value)
            torch.compiler.cudagraph_mark_step_begin()
            with pytest.raises(RuntimeError, match=r"weight of shape \[.*has changed since"):
                compiled(xs[0])
        torch._dynamo.reset()
        _reduce_overhead_calls(layer, xs, family, bound)
    finally:
        torch._dynamo.reset()


@pytest.mark.parametrize("Mx", (1, 64))
def test_cuda_graph_capture_keeps_no_derived_value(Mx):
    """torch.cuda.graph capture of the public awq_gemm after a warm-up call: whether or not the
    cache holds the weight's derived value, the capture adds no entry (a value made while
    capturing lives in the graph's pool and goes with it); replays give the right result with
    new activations, and so does an eager call after the graph is gone."""
    gen = torch.Generator(device=DEV).manual_seed(40 + Mx)
    qw, s, qz, G, _, _ = make_awq(512, 512, 128, torch.float16, gen)
    b = torch.randn(512, generator=gen, device=DEV).half()
    x = make_x(Mx, 512, torch.float16, gen)
    gemm = torch.ops.quantfuse.awq_gemm
    derived_clear()
    check_public_awq(gemm(x, qw, s, qz, G, b), x, qw, s, qz, G, b, "warm-up")
    assert derived_stats()[2] == 1
    for cleared in (False, True):
        if cleared:
            derived_clear()
        gc.collect()
        live = derived_stats()[2]
        assert live == (0 if cleared else 1)
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            gemm(x, qw, s, qz, G, b)
        torch.cuda.current_stream().wait_stream(stream)
        if cleared:
            derived_clear()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = gemm(x, qw, s, qz, G, b)
        assert derived_stats()[2] == (0 if cleared else 1), derived_stats()
        for i in range(2):
            x.copy_(make_x(Mx, 512, torch.float16, gen))
            out.fill_(float("nan"))
            graph.replay()
            torch.cuda.synchronize()
            check_public_awq(out, x, qw, s, qz, G, b, f"replay {i}, cleared={cleared}")
        del graph, out
        torch.cuda.empty_cache()
        check_public_awq(gemm(x, qw, s, qz, G, b), x, qw, s, qz, G, b, f"eager after the graph, cleared={cleared}")


# --------------------------------------------------------------------------- freshness


@pytest.mark.parametrize("Mx", (1, 64))
def test_in_place_weight_update_is_seen(Mx):
    """After ``layer.qweight.copy_(new)`` (a version bump) the public awq_gemm returns the new
    result and the cache made a new value; the same for in-place writes to scales and qzeros."""
    torch.manual_seed(Mx)
    # Held in the AWQ layout, from which the kernels derive theirs (AWQLinear's own layout derives nothing).
    layer, new = (awq_layout_held(AWQLinear.from_linear(torch.nn.Linear(512, 512, device=DEV), group_size=128,
                                                        dtype=torch.float16)) for _ in range(2))
    x = torch.randn(Mx, 512, device=DEV, dtype=torch.float16)
    gemm = lambda: torch.ops.quantfuse.awq_gemm(x, layer.qweight, layer.scales, layer.qzeros, 128, layer.bias)
    what = lambda s: f"M={Mx}, {s}"
    check_op(gemm(), x, layer.qweight, layer.scales, layer.qzeros, 128, layer.bias, what("before"))
    made, hits, _ = derived_stats()
    check_op(gemm(), x, layer.qweight, layer.scales, layer.qzeros, 128, layer.bias, what("cached"))
    assert derived_stats()[:2] == [made, hits + 1], (made, hits, derived_stats())
    version = layer.qweight._version
    layer.qweight.copy_(new.qweight)
    assert layer.qweight._version > version
    out = gemm()
    check_op(out, x, new.qweight, layer.scales, layer.qzeros, 128, layer.bias, what("after qweight.copy_"))
    assert derived_stats()[0] == made + 1, (made, derived_stats())
    layer.scales.copy_(new.scales)
    check_op(gemm(), x, new.qweight, new.scales, layer.qzeros, 128, layer.bias, what("after scales.copy_"))
    layer.qzeros.copy_(new.qzeros)
    check_op(gemm(), x, new.qweight, new.scales, new.qzeros, 128, layer.bias, what("after qzeros.copy_"))
    # the result is the new layer's, computed from scratch
    fresh = torch.ops.quantfuse.awq_gemm(x, new.qweight.clone(), new.scales.clone(), new.qzeros.clone(), 128,
                                         layer.bias)
    assert _rel(gemm(), fresh) < 1e-2


def test_weight_colsum_update_is_seen():
    """quantfuse.weight_colsum on CUDA: made once per weight, served after, made again after an
    in-place write; always equal to the exact sums."""
    w = torch.randint(-128, 128, (256, 512), dtype=torch.int8, device=DEV)
    colsum = torch.ops.quantfuse.weight_colsum
    assert torch.equal(colsum(w), w.to(torch.int32).sum(1, dtype=torch.int32))
    made, hits, _ = derived_stats()
    first = colsum(w)
    assert torch.equal(first, w.to(torch.int32).sum(1, dtype=torch.int32))
    assert derived_stats()[:2] == [made, hits + 1]
    first.zero_()  # a fresh tensor each call: writing to it leaves the cache alone
    assert torch.equal(colsum(w), w.to(torch.int32).sum(1, dtype=torch.int32))
    w.copy_(torch.randint(-128, 128, w.shape, dtype=torch.int8, device=DEV))
    assert torch.equal(colsum(w), w.to(torch.int32).sum(1, dtype=torch.int32))
    assert derived_stats()[0] == made + 1


def test_fp8_capability_rule():
    """Which GPUs the fp8 rule sends to a kernel (decode kernel from sm_89 up to 16 rows, SM90
    kernels on a Hopper at any M), on this GPU."""
    a, b = rand_q((17, K), FP8), rand_q((N, K), FP8).t()
    sa, sb = torch.rand(17, device=DEV) + 0.5, torch.rand(N, device=DEV) + 0.5
    reason = w8a8_kernel_reason(a, b, sa, sb, torch.float16)
    assert (reason == "") == HOPPER, reason
    reason = w8a8_kernel_reason(a[:16], b, sa[:16], sb, torch.float16)
    assert (reason == "") == (CAP >= (8, 9)), reason
