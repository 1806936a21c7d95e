"""``compile_backend.models.simulate``: a quantized model's scheme in float64, the accuracy tests' bound."""

from __future__ import annotations

import pytest
import torch

from compile_backend.models.llama import LlamaConfig, tiny_llama
from compile_backend.models.simulate import F64, sensitivity, simulated
from compile_backend.quantize import AWQLinear, W8A8Linear, W8A16Linear, quantize_model

CFG = LlamaConfig(vocab_size=128, hidden_size=128, intermediate_size=256, num_layers=2, num_heads=4, num_kv_heads=2)


def _model(scheme):
    dtype = torch.float16 if scheme.startswith("awq") else torch.float32
    return quantize_model(tiny_llama(CFG, seed=0, dtype=dtype), scheme)


@pytest.mark.parametrize("scheme", ["int8", "fp8-rowwise", "w8a16", "awq-g32"])
def test_simulation_computes_the_scheme(scheme):
    """The simulation and the layers' own forms compute the same scheme: they differ by float16 / float32
    rounding (and, for W8A8, an activation that lands on a quantization boundary) only."""
    model = _model(scheme)
    tokens = torch.randint(0, CFG.vocab_size, (1, 12), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        own = model(tokens).double()
        sim = simulated(model)(tokens)
    assert sim.dtype == F64
    tol = 2e-2 if scheme.startswith("awq") else 2e-3 if scheme == "w8a16" else 5e-2
    assert (own - sim).abs().max().item() <= tol * sim.abs().max().item(), scheme
    # The original is left as it is: its quantized layers and their dtypes.
    assert sum(isinstance(m, (AWQLinear, W8A8Linear, W8A16Linear)) for m in model.modules()) == 2 * 7
    assert model.embed.weight.dtype == (torch.float16 if scheme.startswith("awq") else torch.float32)


def test_weight_only_schemes_have_no_sensitivity_and_w8a8_has_some():
    tokens = torch.randint(0, CFG.vocab_size, (1, 16), generator=torch.Generator().manual_seed(2))

    def measure(m):
        with torch.no_grad():
            return float(m(tokens).double().abs().sum())

    _, moves = sensitivity(measure, _model("w8a16"), runs=2)
    assert max(moves) < 1e-12
    exact, moves = sensitivity(measure, _model("int8"), runs=2)
    assert exact > 0 and len(moves) == 3


def test_arguments_are_checked():
    model = _model("int8")
    with pytest.raises(ValueError, match="scales torch.float16; expected torch.float32 or torch.float64"):
        simulated(model, torch.float16)
    with pytest.raises(ValueError, match=r"jitter 0.01; expected a relative change in \[0, 1e-3\)"):
        simulated(model, jitter=0.01)
