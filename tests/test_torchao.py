"""Models quantized with torchao (``Int8DynamicActivationInt8WeightConfig``,
``Float8DynamicActivationFloat8WeightConfig`` per-row and per-tensor) under ``backend="quantfuse"``.

* FX level (fast): every linear of a small model becomes ``quantfuse::scaled_mm`` in each form
  torchao writes — int8 on CPUs with VNNI (``u8s8``: ``(x + 128)`` as uint8, minus ``128·colsum(w)``),
  without (``s8s8``) and on CUDA (``_int_mm`` times an ``expand``-ed activation scale; traced here
  on CPU by taking torchao's CUDA code path), in float32, bfloat16 and float16; fp8 through
  ``torch._scaled_mm`` (torchao's hardware check is lifted on CPU, where ``_scaled_mm`` runs).
  Results are checked against torchao's own eager output with the bound docs/DESIGN.md states:
  the fused op rounds once, so it may differ from the source by the source's own intermediate
  rounding (bfloat16/float16 between the two scale multiplications) and nothing more.
* Near-misses that must stay unfused, each with the reason the report gives.
* End to end through ``torch.compile`` (generated code counted) on CPU, and on a GPU the
  fp8 and int8 paths torchao takes there.

torchao is an optional dependency (the ``torchao`` extra): without it these tests are skipped.
"""

from __future__ import annotations

import functools
import subprocess
import sys

import pytest
import torch
from conftest import DECODE_MAX_M
from pass_helpers import apply_passes
from torch._inductor.utils import run_and_get_code
from torch.utils._python_dispatch import TorchDispatchMode

torchao = pytest.importorskip("torchao")

import torchao.kernel.intmm as intmm  # noqa: E402
import torchao.quantization.quant_api as quant_api  # noqa: E402
from torchao.quantization import (  # noqa: E402
    Float8DynamicActivationFloat8WeightConfig,
    Int8DynamicActivationInt8WeightConfig,
    MappingType,
    PerRow,
    PerTensor,
    quantize_,
)
from torchao.quantization.quantize_.common import _choose_quant_func_and_quantize_tensor  # noqa: E402

from compile_backend.passes import collecting_report  # noqa: E402

aten = torch.ops.aten
K = 64
OPTIONS = {"fx_graph_cache": False, "emulate_precision_casts": True}
UNIT_ROUNDOFF = {torch.float32: 2.0**-24, torch.bfloat16: 2.0**-8, torch.float16: 2.0**-11}
SOURCE_MATMULS = (aten._int_mm.default, aten._scaled_mm.default, aten.mm.default, aten.addmm.default)


class Parallel(torch.nn.Module):
    """Three linears (with and without bias, different N), each reading its own transform of the
    input: every output element comes from one linear of a model input, so each is checked against
    the bound (no error carried from layer to layer), and no two linears share an input (which
    the passes would merge into one op)."""

    def __init__(self, dtype, k=K, widths=(48, 32, 16), device="cpu"):
        super().__init__()
        torch.manual_seed(0)
        self.a = torch.nn.Linear(k, widths[0])
        self.b = torch.nn.Linear(k, widths[1], bias=False)
        self.c = torch.nn.Linear(k, widths[2])
        self.to(device=device, dtype=dtype)

    def linears(self):
        return (self.a, self.b, self.c)

    def inputs(self, x):
        return (x, x.flip(-1), -x)

    def forward(self, x):
        return torch.cat([lin(xi) for lin, xi in zip(self.linears(), self.inputs(x))], dim=-1)

    def abs_products(self, x) -> torch.Tensor:
        """``|x_i| @ |W_i|ᵀ`` per linear (float64, dequantized weights): what a float32
        accumulation's rounding error is proportional to."""
        return torch.cat([xi.double().abs() @ lin.weight.dequantize().double().abs().t()
                          for lin, xi in zip(self.linears(), self.inputs(x))], dim=-1)

    def quantized_operands(self, x):
        """Per linear, torchao's own quantization of its input and its weight, in float64:
        ``(linear, input, quantized input, a [M, K], s_a [M or 1, 1], w [N, K], s_b [1, N or 1])``."""
        for lin, xi in zip(self.linears(), self.inputs(x)):
            w = lin.weight
            q = _choose_quant_func_and_quantize_tensor(xi, w.act_quant_kwargs)
            a = q.qdata.double().reshape(-1, xi.shape[-1])
            yield lin, xi, q, a, q.scale.double().reshape(-1, 1), w.qdata.double(), w.scale.double().reshape(1, -1)

    def asymmetric_terms(self, x) -> torch.Tensor:
        """``2·(|acc·s_a·s_b| + |z·s_a·colsum·s_b|)`` per linear (float64), from torchao's own
        quantization of each input: what the asymmetric form rounds (both terms and their
        difference, which is at most their sum)."""
        parts = []
        for _, xi, q, a, sa, wq, sb in self.quantized_operands(x):
            z = q.zero_point.double().reshape(-1, 1)
            acc_term = (a @ wq.t()).abs() * sa * sb
            z_term = (z * wq.sum(-1).reshape(1, -1)).abs() * sa * sb
            parts.append((2 * (acc_term + z_term)).reshape(*xi.shape[:-1], -1))
        return torch.cat(parts, dim=-1)

    def exact(self, x) -> torch.Tensor:
        """``(a·s_a)(w·s_b)ᵀ + bias`` per linear in float64, from torchao's own quantization of each
        input: the value the fused op rounds once."""
        parts = []
        for lin, xi, _, a, sa, wq, sb in self.quantized_operands(x):
            v = (a @ wq.t()) * sa * sb
            if lin.bias is not None:
                v = v + lin.bias.double()
            parts.append(v.reshape(*xi.shape[:-1], -1))
        return torch.cat(parts, dim=-1)

    def bias(self) -> torch.Tensor:
        """The biases as they are added to the concatenated output (zeros where none)."""
        parts = [m.bias if m.bias is not None else torch.zeros(m.out_features, device=m.weight.device)
                 for m in self.linears()]
        return torch.cat([p.detach().double() for p in parts])


@pytest.fixture
def int8_path(request, monkeypatch):
    """Which of torchao's int8 matmul forms the model traces to (torchao picks by CPU ISA and device)."""
    path = request.param
    if path == "s8s8":
        monkeypatch.setattr(intmm, "_cpu_is_vnni_supported", lambda: False)
    elif path == "u8s8":
        monkeypatch.setattr(intmm, "_cpu_is_amx_tile_supported", lambda: False)
        monkeypatch.setattr(intmm, "_cpu_is_vnni_supported", lambda: True)
        if _torchao_int_mm_dtypes() != [torch.uint8]:
            pytest.skip("torchao writes its u8s8 form only where torch._int_mm takes uint8 on CPU "
                        "(torch 2.12 on); with this torch a VNNI CPU gets the s8s8 form")
    elif path == "cuda-form":
        # torchao's non-CPU path: ``_int_mm(x, w.t()) * x_scale.expand(M, N)`` (what runs on CUDA).
        monkeypatch.setattr(intmm, "_is_device", lambda *a: False)
        monkeypatch.setattr(intmm, "safe_int_mm", torch._int_mm)
    else:
        raise ValueError(path)
    return path


def _torchao_int_mm_dtypes() -> list[torch.dtype]:
    """The activation dtype of each ``_int_mm`` torchao's CPU int8 matmul calls, with the ISA
    checks as the caller patched them: ``[torch.uint8]`` is the u8s8 form."""
    seen = []

    class Record(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func is aten._int_mm.default:
                seen.append(args[0].dtype)
            return func(*args, **(kwargs or {}))

    with Record():
        intmm._int_scaled_matmul_cpu(torch.ones(17, 8, dtype=torch.int8), torch.ones(8, 8, dtype=torch.int8),
                                     torch.ones(17, 1))
    return seen


@functools.cache
def _cpu_runs(what: str) -> bool:
    """Whether this torch's CPU kernels run ``what``: ``"uint8 _int_mm"`` (torch 2.12 on) or
    ``"row-wise _scaled_mm"`` (per-token x per-channel scales; earlier CPU builds take
    per-tensor scales only)."""
    try:
        if what == "uint8 _int_mm":
            torch._int_mm(torch.ones(17, 8, dtype=torch.uint8), torch.ones(8, 8, dtype=torch.int8))
        elif what == "row-wise _scaled_mm":
            a = torch.ones(16, 16).to(torch.float8_e4m3fn)
            torch._scaled_mm(a, a.t(), torch.ones(16, 1), torch.ones(1, 16), out_dtype=torch.bfloat16)
        else:
            raise ValueError(what)
    except RuntimeError:
        return False
    return True


def needs_cpu(what: str) -> None:
    """Skips, naming what is missing, where this torch's CPU kernels cannot run the source a test
    runs eagerly (its fake kernels reject it too, so it cannot be traced either)."""
    if not _cpu_runs(what):
        pytest.skip(f"this torch ({torch.__version__}) has no CPU kernel for {what}")


@pytest.fixture
def fp8_on_cpu(monkeypatch):
    """torchao refuses fp8 configs without an sm_89+ GPU; ``torch._scaled_mm`` runs on CPU all the same."""
    monkeypatch.setattr(quant_api, "_check_hardware_support", lambda *a, **k: None)


def int8_model(dtype, asymmetric=False, **kw):
    model = Parallel(dtype, **kw)
    mapping = MappingType.ASYMMETRIC if asymmetric else MappingType.SYMMETRIC
    quantize_(model, Int8DynamicActivationInt8WeightConfig(act_mapping_type=mapping))
    return model


def fp8_model(dtype, granularity, **kw):
    model = Parallel(dtype, **kw)
    quantize_(model, Float8DynamicActivationFloat8WeightConfig(granularity=granularity))
    return model


def check_source_bound(out, src, bias, mid_dtype, accumulation=0.0, rounded=None):
    """``|fused − source| ≤ u_mid·|p| + u_out·(|fused| + |source|) + 4·2⁻²⁴·|p| + accumulation``
    elementwise, with ``p = fused − bias`` the scaled product: the source's one rounding of the
    product to ``mid_dtype`` between the scales (``u_mid``: its unit roundoff; for float32
    sources only float32's own), the final rounding of each side to the output dtype, float32
    evaluation order of the epilogue, and for fp8 the source's float32 accumulation
    (``accumulation``; int8 products accumulate exactly on both sides).  ``rounded``: the
    magnitudes the source rounds to ``mid_dtype`` when that is more than ``p`` (the asymmetric
    form rounds both terms and their difference), in place of ``|p|`` in the first term."""
    assert out.dtype == src.dtype and out.shape == src.shape
    o, s = out.double(), src.double()
    p = (o - bias).abs()
    u_out = UNIT_ROUNDOFF[out.dtype]
    mid = p if rounded is None else rounded
    bound = UNIT_ROUNDOFF[mid_dtype] * mid + u_out * (o.abs() + s.abs()) + 4 * 2.0**-24 * p + accumulation
    err = (o - s).abs()
    bad = err > bound
    assert not bad.any(), (f"{int(bad.sum())} of {bad.numel()} elements beyond the bound; max err "
                           f"{err.max().item():.3g}, max bound {bound.max().item():.3g}")
    assert s.abs().max() > 0.1  # the comparison saw real values


def assert_all_fused(r, n: int):
    assert r.fused == n, r.report
    assert r.count(*SOURCE_MATMULS) == 0
    assert r.report.unfused == [], r.report


# --------------------------------------------------------------------------- FX level: int8


@pytest.mark.parametrize("int8_path", ["s8s8", "u8s8", "cuda-form"], indirect=True)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=["f32", "bf16", "f16"])
def test_int8_dynamic_every_linear_fused(int8_path, dtype):
    model = int8_model(dtype)
    x = torch.randn(3, 5, K, dtype=dtype, generator=torch.Generator().manual_seed(1))
    r = apply_passes(model, x)
    assert_all_fused(r, 3)
    forms = {f.form for f in r.report.fused}
    u8 = "-u8" if int8_path == "u8s8" else ""
    # bfloat16/float16 sources round between the scales; float32 ones have nothing to round.
    assert forms == {f"int_mm{u8}-rounded" if dtype != torch.float32 else f"int_mm{u8}"}, forms
    if dtype != torch.float32:
        assert all("rounds once where the source rounds" in f.detail for f in r.report.fused)
    check_source_bound(r.output, r.expected, model.bias(), dtype)


@pytest.mark.parametrize("int8_path", ["u8s8", "s8s8"], indirect=True)
def test_int8_dynamic_2d_input_and_dynamic_batch(int8_path):
    model = int8_model(torch.bfloat16)
    x = torch.randn(7, K, dtype=torch.bfloat16, generator=torch.Generator().manual_seed(2))
    r = apply_passes(model, x, dynamic=True)
    assert_all_fused(r, 3)
    check_source_bound(r.output, r.expected, model.bias(), torch.bfloat16)


@pytest.mark.parametrize("int8_path,dtype", [("s8s8", torch.float32), ("s8s8", torch.bfloat16),
                                             ("u8s8", torch.bfloat16), ("cuda-form", torch.float16)],
                         ids=["s8s8-f32", "s8s8-bf16", "u8s8-bf16", "cuda-form-f16"], indirect=["int8_path"])
def test_int8_dynamic_asymmetric_every_linear_fused(int8_path, dtype):
    """``act_mapping_type=ASYMMETRIC``: per-token zero points, into ``scaled_mm_azp``."""
    model = int8_model(dtype, asymmetric=True)
    x = torch.randn(3, 5, K, dtype=dtype, generator=torch.Generator().manual_seed(8)) + 0.5
    r = apply_passes(model, x)
    assert_all_fused(r, 3)
    assert r.report.counts() == {"scaled_mm_azp": 3}, r.report
    u8 = "-u8" if int8_path == "u8s8" else ""
    assert {f.form for f in r.report.fused} == {f"int_mm{u8}-azp" + ("-rounded" if dtype != torch.float32 else "")}
    assert all("per-token zero point" in f.detail for f in r.report.fused), r.report
    with torch.no_grad():
        rounded = model.asymmetric_terms(x)
    check_source_bound(r.output, r.expected, model.bias(), dtype, rounded=rounded)


def test_zero_point_term_with_another_scale_is_not_fused():
    def fn(a, w, sa, sw):
        z = torch.full((M, 1), 3, dtype=torch.int8)
        acc = torch._int_mm(a, w.t()).to(torch.float32) * sa
        z_term = (z.to(torch.float32) * (sa * 2)) * w.sum(dim=-1).to(torch.float32)
        return (acc - z_term) * sw.flatten()

    reason = _only_unfused_reason(apply_passes(fn, *_int8_inputs()))
    assert "not by the activation scale" in reason, reason


# --------------------------------------------------------------------------- FX level: fp8


@pytest.mark.parametrize("dtype,granularity", [(torch.bfloat16, PerRow()), (torch.bfloat16, PerTensor()),
                                               (torch.float32, PerTensor())], ids=["row-bf16", "tensor-bf16",
                                                                                   "tensor-f32"])
def test_fp8_dynamic_every_scaled_mm_replaced(fp8_on_cpu, dtype, granularity):
    if isinstance(granularity, PerRow):
        needs_cpu("row-wise _scaled_mm")
    model = fp8_model(dtype, granularity)
    x = torch.randn(3, 5, K, dtype=dtype, generator=torch.Generator().manual_seed(3))
    r = apply_passes(model, x)
    assert r.before.graph.find_nodes(op="call_function", target=aten._scaled_mm.default)
    assert_all_fused(r, 3)
    kind = "per-token x per-channel" if isinstance(granularity, PerRow) else "per-tensor x per-tensor"
    assert {(f.form, f.detail) for f in r.report.fused} == {
        ("torch-scaled_mm", f"float8_e4m3fn {kind} in {str(dtype).replace('torch.', '')}")}
    # Both round once from a float32 epilogue; torch accumulates the (exact) fp8 products in float32.
    check_source_bound(r.output, r.expected, model.bias(), torch.float32, fp8_accumulation(model, x))


def fp8_accumulation(model, x) -> torch.Tensor:
    """K·2⁻²⁴·Σ|a_k·b_k|·s_a·s_b, the error bound of a float32 sum of K products; ``a·s_a`` is
    within 2⁻³ of ``x`` (e4m3 has 3 mantissa bits), ``b·s_b`` is the dequantized weight."""
    return x.shape[-1] * 2.0**-24 * (1 + 2.0**-3) * model.abs_products(x)


def test_fp8_rowwise_2d_input_and_dynamic_batch(fp8_on_cpu):
    needs_cpu("row-wise _scaled_mm")
    model = fp8_model(torch.bfloat16, PerRow())
    x = torch.randn(7, K, dtype=torch.bfloat16, generator=torch.Generator().manual_seed(9))
    r = apply_passes(model, x, dynamic=True)
    assert_all_fused(r, 3)
    check_source_bound(r.output, r.expected, model.bias(), torch.float32, fp8_accumulation(model, x))


# --------------------------------------------------------------------------- near-misses

M, N = 16, 16  # square, so that a scale on the wrong axis still broadcasts


def _int8_inputs(seed=4):
    gen = torch.Generator().manual_seed(seed)
    a = torch.randint(-128, 128, (M, K), dtype=torch.int8, generator=gen)
    w = torch.randint(-128, 128, (N, K), dtype=torch.int8, generator=gen)
    return a, w, torch.rand(M, 1, generator=gen) * 1e-2, torch.rand(N, 1, generator=gen) * 1e-2


def _only_unfused_reason(r) -> str:
    assert r.fused == 0, r.report
    (unfused,) = r.report.unfused
    return unfused.reason


def test_torchao_cuda_form_fused_exactly_as_written():
    """The form the near-misses below depart from: torchao's CUDA chain, written out."""
    def fn(a, w, sa, sw):
        y = (torch._int_mm(a, w.t()) * sa.expand(M, N)).to(torch.bfloat16)
        return (y * sw.flatten()).to(torch.bfloat16)

    r = apply_passes(fn, *_int8_inputs())
    assert r.fused == 1 and r.report.fused[0].form == "int_mm-rounded", r.report
    check_source_bound(r.output, r.expected, 0.0, torch.bfloat16)


@pytest.mark.parametrize("mid", [torch.int32, torch.int16])
def test_rounding_to_an_integer_between_the_scales_is_not_fused(mid):
    def fn(a, w, sa, sw):
        y = (torch._int_mm(a, w.t()) * sa.expand(M, N)).to(mid)
        return (y * sw.flatten()).to(torch.bfloat16)

    reason = _only_unfused_reason(apply_passes(fn, *_int8_inputs()))
    assert f"rounded to {mid} between the two scales" in reason, reason


def test_rounding_through_fp8_between_the_scales_is_not_fused():
    def fn(a, w, sa, sw):
        y = (torch._int_mm(a, w.t()) * sa.expand(M, N)).to(torch.float8_e4m3fn).to(torch.bfloat16)
        return (y * sw.flatten()).to(torch.bfloat16)

    r = apply_passes(fn, *_int8_inputs())
    assert r.fused == 0 and r.count(aten._int_mm.default) == 1, r.report
    (unfused,) = r.report.unfused
    assert unfused.target == "_int_mm.default", unfused


def test_weight_scale_on_the_row_axis_is_not_fused():
    def fn(a, w, sa, sw):
        y = (torch._int_mm(a, w.t()) * sa.expand(M, N)).to(torch.bfloat16)
        return (y * sw.reshape(-1, 1)).to(torch.bfloat16)  # [N, 1]: scales rows, not columns

    reason = _only_unfused_reason(apply_passes(fn, *_int8_inputs()))
    assert "scales are per-row and per-row" in reason, reason


@pytest.mark.parametrize("shift,comp", [(128, 127), (127, 127)])
def test_u8_form_with_another_offset_is_not_fused(shift, comp):
    needs_cpu("uint8 _int_mm")

    def fn(a, w, sa, sw):
        wt = w.t()
        c = torch._int_mm((a.to(torch.int32) + shift).to(torch.uint8), wt)
        c = c - wt.sum(dim=0, keepdim=True, dtype=torch.int32) * comp
        return c.to(torch.float32) * sa * sw.flatten()

    reason = _only_unfused_reason(apply_passes(fn, *_int8_inputs()))
    assert f"shifted by {shift} and corrected by {comp}" in reason, reason


def _fp8_inputs(dtype=torch.float8_e4m3fn, scales="row"):
    """``scales``: ``"row"`` (per-token x per-channel) or ``"tensor"`` (one each)."""
    gen = torch.Generator().manual_seed(5)
    a = (torch.randn(M, K, generator=gen) * 3).to(dtype)
    w = (torch.randn(N, K, generator=gen) * 3).to(dtype)
    sa, sw = torch.rand(M, 1, generator=gen) * 1e-2, torch.rand(N, 1, generator=gen) * 1e-2
    if scales == "tensor":
        sa, sw = sa.amax(), sw.amax()
    return a, w, sa, sw


@pytest.mark.parametrize("scales", ["row", "tensor"])
@pytest.mark.parametrize("case", ["e5m2", "fp8-out"])
def test_scaled_mm_the_op_cannot_take_is_not_fused(case, scales):
    if scales == "row":
        needs_cpu("row-wise _scaled_mm")
    dtype = torch.float8_e5m2 if case == "e5m2" else torch.float8_e4m3fn
    out_dtype = torch.float8_e4m3fn if case == "fp8-out" else torch.bfloat16

    def fn(a, w, sa, sw):
        return torch._scaled_mm(a, w.t(), sa, sw.t(), out_dtype=out_dtype)

    reason = _only_unfused_reason(apply_passes(fn, *_fp8_inputs(dtype, scales)))
    expected = "expected float8_e4m3fn" if case == "e5m2" else "out_dtype is torch.float8_e4m3fn"
    assert expected in reason, reason


# --------------------------------------------------------------------------- end to end (CPU)


class TorchaoAndE5M2(torch.nn.Module):
    """A torchao int8 linear (fused) and a ``torch._scaled_mm`` on float8_e5m2 (the op takes e4m3 only)."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.lin = torch.nn.Linear(K, N).to(torch.bfloat16)
        quantize_(self.lin, Int8DynamicActivationInt8WeightConfig())
        self.register_buffer("w8", (torch.randn(N, N) * 3).to(torch.float8_e5m2))

    def forward(self, x):
        h = self.lin(x)
        s = h.abs().amax(-1, keepdim=True).float() / 57344
        q = (h.float() / s).to(torch.float8_e5m2)
        return torch._scaled_mm(q, self.w8.t(), s, torch.ones(1, N), out_dtype=torch.bfloat16)


@pytest.mark.compile
@pytest.mark.parametrize("int8_path", ["u8s8"], indirect=True)
def test_explain_reports_torchao_forms(int8_path):
    import compile_backend

    needs_cpu("row-wise _scaled_mm")

    x = torch.randn(4, K, dtype=torch.bfloat16, generator=torch.Generator().manual_seed(10))
    with torch.no_grad():
        report = compile_backend.explain(TorchaoAndE5M2(), x)
    (fused,) = report.fused
    assert (fused.family, fused.form) == ("scaled_mm", "int_mm-u8-rounded"), report
    assert "rounds once where the source rounds to bfloat16 between the scales" in fused.detail
    (unfused,) = report.unfused
    assert unfused.target == "_scaled_mm.default" and "expected float8_e4m3fn" in unfused.reason, report


def _compile_and_run(model, x):
    torch._dynamo.reset()
    with torch.no_grad(), collecting_report() as report:
        out, (code, *_) = run_and_get_code(torch.compile(model, backend="quantfuse", options=OPTIONS), x)
    return out, code, report


@functools.cache
def _inductor_cpu_rounds_as_eager() -> bool:
    """Whether Inductor's CPU code rounds to bfloat16 where eager does, as ``emulate_precision_casts``
    asks (torch 2.13 on).  Before, its C++ backend reads a value it has just rounded to bfloat16
    back as the float32 before the rounding, so a compiled torchao model differs from its own
    eager run (activation scales left unrounded, activations quantized with them), with or
    without our passes."""
    def fn(x):
        return (x * 1.1).float() * 3

    x = torch.linspace(1, 2, 64, dtype=torch.bfloat16)
    torch._dynamo.reset()
    return torch.equal(torch.compile(fn, backend="inductor", options=OPTIONS)(x), fn(x))


def _source_output(model, x, eager):
    """What a compiled fused model is checked against: torchao's eager output where Inductor's CPU
    code reproduces eager's roundings, else the model compiled without our passes, which then
    differs from eager by Inductor's roundings alone and from ours by our fusion alone."""
    if _inductor_cpu_rounds_as_eager():
        return eager
    torch._dynamo.reset()
    with torch.no_grad():
        return torch.compile(model, backend="quantfuse", options={**OPTIONS, "passes": False})(x)


def _code_fuses(code: str, n: int) -> None:
    assert code.count("torch.ops.quantfuse.scaled_mm.default(") == n, code
    for unfused in ("_int_mm", "_scaled_mm(", "extern_kernels.mm(", "extern_kernels.addmm(", "aten.mm"):
        assert unfused not in code, f"{unfused!r} still in the generated code"


@pytest.mark.compile
@pytest.mark.parametrize("int8_path,dtype", [("u8s8", torch.bfloat16), ("s8s8", torch.bfloat16),
                                             ("s8s8", torch.float32)],
                         ids=["u8s8-bf16", "s8s8-bf16", "s8s8-f32"], indirect=["int8_path"])
def test_compile_int8_dynamic(int8_path, dtype):
    model = int8_model(dtype)
    x = torch.randn(2, 9, K, dtype=dtype, generator=torch.Generator().manual_seed(6))
    with torch.no_grad():
        ref = model(x)
    out, code, report = _compile_and_run(model, x)
    _code_fuses(code, 3)
    assert report.counts() == {"scaled_mm": 3} and report.unfused == [], report
    check_source_bound(out, _source_output(model, x, ref), model.bias(), dtype)


@pytest.mark.compile
@pytest.mark.parametrize("granularity", [PerRow(), PerTensor()], ids=["row", "tensor"])
def test_compile_fp8_dynamic(fp8_on_cpu, granularity):
    if isinstance(granularity, PerRow):
        needs_cpu("row-wise _scaled_mm")
    model = fp8_model(torch.bfloat16, granularity)
    x = torch.randn(2, 9, K, dtype=torch.bfloat16, generator=torch.Generator().manual_seed(7))
    with torch.no_grad():
        ref = model(x)
    out, code, report = _compile_and_run(model, x)
    _code_fuses(code, 3)
    assert report.counts() == {"scaled_mm": 3} and report.unfused == [], report
    check_source_bound(out, _source_output(model, x, ref), model.bias(), torch.float32, fp8_accumulation(model, x))




def test_torchao_not_imported_by_the_package_or_its_passes():
    code = ("import importlib, sys, compile_backend\n"
            "from compile_backend.passes.framework import FAMILIES\n"
            "for family in FAMILIES: importlib.import_module('compile_backend.passes.' + family)\n"
            "assert 'torchao' not in sys.modules, 'torchao imported'\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr


# --------------------------------------------------------------------------- GPU: the paths torchao takes there

GPU_K, GPU_WIDTHS = 256, (256, 128, 384)  # sizes the kernels take (multiples of their tiles)


def _gpu_compile(model, m, dtype, x=None):
    if x is None:
        x = torch.randn(m, GPU_K, dtype=dtype, device="cuda", generator=torch.Generator("cuda").manual_seed(m))
    with torch.no_grad():
        ref = model(x)
    out, code, report = _compile_and_run(model, x)
    return x, ref, out, code, report


def fp8_exact_input(m: int, k: int, dtype, seed: int) -> torch.Tensor:
    """``m × k`` activations that quantize to float8_e4m3fn exactly, by any correct evaluation: e4m3
    values times one power of two, with ±448 (e4m3's largest) in every row, so that amax / 448 is that
    power of two per row and per tensor alike, and ``x / scale`` an e4m3 value.  Inductor's fused
    quantization (a division in another order) and torchao's eager one then give the same operands,
    and the comparison sees the matmul and its epilogue alone: on random activations an element
    quantized one e4m3 step apart moves its whole output row by more than any rounding bound."""
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(m, k, generator=gen).mul(64).clamp(-448, 448).to(torch.float8_e4m3fn).float()
    peak = torch.randint(0, k, (m,), generator=gen)
    q[torch.arange(m), peak] = 448.0 * torch.where(torch.rand(m, generator=gen) < 0.5, -1.0, 1.0)
    return (q * 2.0**-7).to(dtype).cuda()  # e4m3 values carry 4 significant bits: exact in bf16


@pytest.mark.gpu
@pytest.mark.compile
@pytest.mark.parametrize("m", [1, 48, 300])
@pytest.mark.parametrize("granularity", [PerRow(), PerTensor()], ids=["row", "tensor"])
def test_gpu_fp8_dynamic(granularity, m):
    if torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("torchao's fp8 configs need sm_89 or later")
    model = fp8_model(torch.bfloat16, granularity, k=GPU_K, widths=GPU_WIDTHS, device="cuda")
    x, ref, out, code, report = _gpu_compile(model, m, torch.bfloat16, fp8_exact_input(m, GPU_K, torch.bfloat16, m))
    if torch.cuda.get_device_capability()[0] != 9:
        # Beyond Hopper's kernels torch._scaled_mm is kept, and the report says why.
        assert report.counts() == {} and len(report.unfused) == 3, report
        assert all("torch._scaled_mm is kept" in u.reason for u in report.unfused), report
        return
    _code_fuses(code, 3)
    assert report.counts() == {"scaled_mm": 3} and report.unfused == [], report
    # The source, torch._scaled_mm, accumulates with fast accumulation on Hopper (reduced-precision
    # partial sums: conftest.check_w8a8 allows 2e-3 of max|ref| for fp8).
    fast_accum = 2e-3 * ref.double().abs().max()
    # Ours: float32 sums in the decode kernel (M <= 16); from M = 17 Hopper's fp8 tensor cores sum
    # the products (wgmma), keeping about 13 bits between float32 promotions: |error| <= 2^-12.3 of
    # sum|a*b|*s_a*s_b measured for our kernels, 2^-13.2 for torch._scaled_mm (docs/DESIGN.md, "The
    # ops: the contract"); 2^-11 bounds both.
    accumulation = fp8_accumulation(model, x) if m <= DECODE_MAX_M else 2.0**-11 * model.abs_products(x)
    check_source_bound(out, ref, model.bias(), torch.float32, accumulation + fast_accum)
    # The op's own contract: the exact products summed as above, one rounding to bfloat16.
    with torch.no_grad():
        exact = model.exact(x)
    err = (out.double() - exact).abs()
    bound = UNIT_ROUNDOFF[torch.bfloat16] * exact.abs() + accumulation + 4 * 2.0**-24 * exact.abs()
    assert (err <= bound).all(), f"{int((err > bound).sum())} elements beyond the bound; max err {err.max():.3g}"


@pytest.mark.gpu
@pytest.mark.compile
@pytest.mark.parametrize("m", [1, 48, 300])
@pytest.mark.parametrize("asymmetric", [False, True], ids=["sym", "asym"])
def test_gpu_int8_dynamic(asymmetric, m):
    model = int8_model(torch.bfloat16, asymmetric=asymmetric, k=GPU_K, widths=GPU_WIDTHS, device="cuda")
    x, ref, out, code, report = _gpu_compile(model, m, torch.bfloat16)
    op = "scaled_mm_azp" if asymmetric else "scaled_mm"
    assert code.count(f"torch.ops.quantfuse.{op}.default(") == 3, code
    assert "_int_mm" not in code and "extern_kernels.mm(" not in code, code
    assert report.counts() == {op: 3} and report.unfused == [], report
    assert {f.form for f in report.fused} == {"int_mm-azp-rounded" if asymmetric else "int_mm-rounded"}, report
    with torch.no_grad():
        rounded = model.asymmetric_terms(x) if asymmetric else None
    check_source_bound(out, ref, model.bias(), torch.bfloat16, rounded=rounded)


# --------------------------------------------------------------------------- a Hugging Face Llama


@pytest.mark.parametrize("int8_path", ["u8s8"], indirect=True)
def test_hf_llama_int8_dynamic_every_linear_fused(int8_path):
    """A 2-layer HF Llama in bfloat16, quantized with torchao: all 15 linears (7 per layer and
    lm_head) fused.  Logits within 5% of their largest magnitude of torchao's own: every layer is
    within the per-linear bound checked above, and a difference of one bfloat16 rounding may move
    the next layer's int8 activations by one quantization step; a wrong fusion (a scale on the
    wrong axis, a lost zero-point or offset) puts the logits off by their own size."""
    pytest.importorskip("transformers")
    from test_e2e_hf import tiny_causal_lm

    model = tiny_causal_lm(dtype=torch.bfloat16)
    quantize_(model, Int8DynamicActivationInt8WeightConfig())
    ids = torch.randint(0, 64, (1, 12), generator=torch.Generator().manual_seed(2))
    r = apply_passes(lambda i: model(i).logits, ids)
    assert len(r.report.fused) == 15 and r.report.unfused == [], r.report
    assert r.count(*SOURCE_MATMULS[:2]) == 0  # no _int_mm / _scaled_mm left
    err = (r.output.float() - r.expected.float()).abs().max()
    assert err <= 0.05 * r.expected.float().abs().max(), err
