"""Model-level checks on TinyLlama (2 layers, hidden 256, fixed seed) for the W8A8 schemes.

For each scheme: every quantized linear layer is fused (counted from the
fusion report), the compiled model matches the eager quantized model, and its
logits stay within what the scheme allows of the unquantized model's.
One full Inductor compile per scheme (about 20-30 s each on 2 CPU cores).
"""

from __future__ import annotations

import copy

import pytest
import torch

from compile_backend.models.llama import tiny_llama
from compile_backend.passes import collecting_report
from compile_backend.quantize import quantize_model

pytestmark = pytest.mark.compile

# Compiled vs eager quantized model, relative L2 error of the logits.  Both compute the
# same math (float32 dequant, one rounding); the fused op accumulates integers exactly
# (fp8: in float64) where eager accumulates in float32, a ~1e-7 relative difference per
# layer (measured: 5e-7 int8, 5e-7 int8-asym, 6e-6 fp8).  Such a difference can flip the
# rounding of a downstream activation's quantization by one step on a few elements, so
# the bound leaves room for that: 1e-3, far below any real mismatch (a wrong scale, zero
# point or bias gives errors of order 1).
COMPILED_VS_EAGER = 1e-3

# Quantized vs unquantized model (float32), relative L2 error of the logits.
SCHEMES = {
    # int8 symmetric, per-token activations x per-channel weights, round-to-nearest:
    # per-element noise ~ step / sqrt(12) with step = amax / 127, about 1% per matmul
    # for Gaussian-like rows; 14 linears in 2 residual layers compound to a few %.
    # Measured 2.3%; bound 5%.
    "int8": ("scaled_mm", 0.05),
    # int8 asymmetric per-token activations: 256 levels over [min, max] instead of 255
    # over [-amax, amax]; the same order of error.  Measured 2.2%; bound 5%.
    "int8-asym": ("scaled_mm_azp", 0.05),
    # fp8 e4m3 per-tensor scales: 3 mantissa bits, relative rounding error up to 2^-4 per
    # operand element (RMS ~3.6%), on both operands of every matmul, and per-tensor
    # activation scales.  Measured 8.3%; bound 15%.
    "fp8": ("scaled_mm", 0.15),
}


@pytest.fixture(scope="module")
def reference():
    model = tiny_llama(seed=0)
    tokens = torch.randint(0, model.cfg.vocab_size, (2, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        logits = model(tokens)
    return model, tokens, logits


def _rel(a, b) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


@pytest.mark.parametrize("scheme", sorted(SCHEMES))
def test_tinyllama_scheme(reference, scheme):
    family, bound = SCHEMES[scheme]
    model, tokens, ref_logits = reference
    linears = model.linear_count()
    assert linears == 14  # q, k, v, o, gate, up, down per layer; lm_head stays float
    qmodel = quantize_model(copy.deepcopy(model), scheme)
    torch._dynamo.reset()
    compiled = torch.compile(qmodel, backend="quantfuse", options={"fx_graph_cache": False})
    with torch.no_grad(), collecting_report() as report:
        out = compiled(tokens)
    with torch.no_grad():
        eager = qmodel(tokens)
    assert report.counts() == {family: linears}, str(report)
    assert report.unfused == [], str(report)
    assert _rel(out, eager) <= COMPILED_VS_EAGER, _rel(out, eager)
    err = _rel(out, ref_logits)
    assert err <= bound, f"{scheme}: logits error {err:.4f} > {bound}"
    # And the quantization is real (a scheme that silently ran in float would pass the bound).
    assert err > 1e-4
