"""Model-level check of the AWQ family: TinyLlama quantized with AWQ group 128 (``awq-g128``).

* every quantized linear layer is fused into quantfuse.awq_gemm (counted), on the
  graph our passes see and through ``torch.compile(backend="quantfuse")``;
* the compiled model matches the eager quantized model;
* against the unquantized model (float64) the logits error stays within what
  4-bit group-128 quantization allows.

float16 matmuls run on CPU in torch 2.13 (eager and Inductor's extern mm), so
both activation dtypes are tested here.
"""

from __future__ import annotations

import copy

import pytest
import torch
from test_pass_awq_gemm import AWQ_GEMM, trace

from compile_backend.models.llama import tiny_llama
from compile_backend.passes import collecting_report
from compile_backend.quantize import AWQLinear, quantize_model

DTYPES = (torch.float16, torch.bfloat16)
TOKENS = torch.randint(0, 512, (2, 16), generator=torch.Generator().manual_seed(0))

# Compiled vs eager quantized model: at most 4 units in the last place of the
# largest logit.  The fused op accumulates in float32 and rounds once, where
# eager rounds the matmul to the activation dtype (and rounds again after the
# bias); Inductor also keeps RMSNorm/softmax/SiLU intermediates in float32
# inside its fused kernels.  Each of those differs by about one ulp from eager,
# and the logits (|max| ~1.3) are one rounding of a sum of such terms; measured
# ~1 ulp (fp16 9e-4, bf16 7e-3 relative).
COMPILED_ULPS = 4

# Per layer: round-to-nearest asymmetric 4-bit with a zero point per group of
# 128 Gaussian weights.  The range of 128 normal samples is ~5.2 sigma, so the
# step is ~0.35 sigma and the rounding error (uniform over a step) has rms
# step/sqrt(12) ~ 0.10 sigma: ~10% relative weight error (measured 0.101-0.102).
# 0.12 allows for the fp16/bf16 rounding of the scales and sampling spread.
WEIGHT_REL_ERR_G128 = 0.12
# Logits: with std-0.02 weights the residual stream is dominated by the
# attention output, so the logits carry the error of quantized linears in
# series (v -> o in each layer, the MLPs): ~10% per layer compounds to a
# measured 0.26 relative rms error.  Random Gaussian weights are the worst case
# for 4-bit (real models have outlier-free, AWQ-scaled channels and lose far
# less).  0.35 leaves margin while staying far below the ~1.41 of unrelated
# logits, and a wrong unpack order or a dropped zero point gives > 1.
LOGITS_REL_ERR_G128 = 0.35


def rel_rms(a: torch.Tensor, ref: torch.Tensor) -> float:
    return ((a.double() - ref.double()).norm() / ref.double().norm()).item()


def assert_compiled_close(out, expected):
    scale = expected.abs().max().item()
    torch.testing.assert_close(out, expected, rtol=0, atol=COMPILED_ULPS * torch.finfo(expected.dtype).eps * scale)


@pytest.fixture(scope="module")
def reference_logits():
    with torch.no_grad():
        return tiny_llama(dtype=torch.float64)(TOKENS)


def quantized(dtype):
    """The quantized model and how many linear layers it had (all but lm_head are quantized)."""
    model = tiny_llama(dtype=dtype)
    n_linear = model.linear_count()
    return quantize_model(model, "awq-g128"), n_linear


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_every_linear_fused_on_the_graph(dtype):
    model, n_linear = quantized(dtype)
    assert n_linear == sum(isinstance(m, AWQLinear) for m in model.modules()) == 14
    t = trace(model, TOKENS)
    # q/k/v and gate/up of each of the 2 layers read one input: merged into one op each (passes/horizontal.py)
    assert [len(m.members) for m in t.report.merged] == [3, 2, 3, 2], str(t.report)
    assert t.count(AWQ_GEMM) == n_linear - 6
    assert t.count(torch.ops.aten.mm.default) == 1  # lm_head, left unquantized
    assert t.report.counts() == {"awq_gemm": n_linear}
    assert {f.detail.split()[0] for f in t.report.fused} == {"group_size=128"}
    assert_compiled_close(t.output, t.expected)


@pytest.mark.compile
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_compiled_model(dtype, reference_logits):
    """torch.compile(backend="quantfuse") with its default options (every family): all 14 AWQ layers fused."""
    model, n_linear = quantized(dtype)
    torch._dynamo.reset()
    with torch.no_grad(), collecting_report() as report:
        eager = model(TOKENS)
        # No FX graph cache, so that the passes run (and report) even if an earlier run cached this graph.
        compiled = torch.compile(model, backend="quantfuse", options={"fallback": False, "fx_graph_cache": False})
        out = compiled(TOKENS)
    torch._dynamo.reset()
    assert report.counts() == {"awq_gemm": n_linear}
    assert_compiled_close(out, eager)
    assert rel_rms(out, reference_logits) <= LOGITS_REL_ERR_G128


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_quantization_error_within_4bit_g128(dtype, reference_logits):
    ref = tiny_llama(dtype=dtype)
    model = quantize_model(copy.deepcopy(ref), "awq-g128")
    linears = {n: m for n, m in ref.named_modules() if isinstance(m, torch.nn.Linear)}
    for name, mod in model.named_modules():
        if isinstance(mod, AWQLinear):
            w = linears[name].weight.detach().t()
            assert rel_rms(mod.dequantized_weight(), w) <= WEIGHT_REL_ERR_G128, name
    with torch.no_grad():
        assert rel_rms(model(TOKENS), reference_logits) <= LOGITS_REL_ERR_G128
        # The bound is not vacuous: the same model with the zero points dropped is far off.
        for mod in model.modules():
            if isinstance(mod, AWQLinear):
                mod.qzeros.zero_()
        assert rel_rms(model(TOKENS), reference_logits) > 1.0
