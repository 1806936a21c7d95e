"""The AWQ search (``compile_backend/quantize/awq_search.py``) on small models: folding the scales
keeps the float model's function, the search never does worse than round-to-nearest on what it
measures, the calibration forms, and the scale applied on the activation where no operation can
carry it still fuses.  The real model's accuracy: ``test_smollm2.py``."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from compile_backend.models.llama import LlamaConfig, tiny_llama
from compile_backend.quantize import AWQLinear, quantize_model, quantize_weight_awq
from compile_backend.quantize.awq_search import InputScaled, awq_search, calibration_batches
from compile_backend.quantize.model import _replaceable_linears
from compile_backend.quantize.weights import fake_quantize_awq

# 2 layers, hidden 128, 4 heads / 2 key-value heads (grouped-query attention), group size 64 below.
CFG = LlamaConfig(vocab_size=256, hidden_size=128, intermediate_size=256, num_heads=4, num_kv_heads=2)
CALIBRATION = torch.randint(0, CFG.vocab_size, (2, 32), generator=torch.Generator().manual_seed(1))
TOKENS = torch.randint(0, CFG.vocab_size, (1, 32), generator=torch.Generator().manual_seed(2))

# Folded vs original float model, relative to the largest logit.  Both Llamas' RMSNorms compute in
# float32 whatever the model's dtype, so a float64 model's norms round their output to float32
# (2^-24 relative): the folded model, whose norm weights and activations are rescaled, differs from
# the original by a few such roundings per layer.  Measured ~2e-7; quantization changes the logits
# by ~1e-1, a fold that missed one side of a scale by the scale (here up to ~3x).
FOLD_RTOL = 1e-5


def linears(model):
    return [(q, lin) for _, _, lin, q in _replaceable_linears(model, ("lm_head",))]


def logits(model, tokens):
    out = model(tokens)
    return out if isinstance(out, torch.Tensor) else out.logits


def assert_same_function(folded, original, tokens):
    with torch.no_grad():
        a, b = logits(folded, tokens), logits(original, tokens)
    assert (a - b).abs().max().item() <= FOLD_RTOL * b.abs().max().item()


def changed_weights(folded, original) -> int:
    before = dict(original.named_parameters())
    return sum(not torch.equal(p, before[n]) for n, p in folded.named_parameters())


def test_fold_keeps_function_tiny_llama():
    model = tiny_llama(CFG, dtype=torch.float64)
    folded = copy.deepcopy(model)
    result = awq_search(folded, CALIBRATION, linears(folded), 64, clip=False, n_grid=8, progress=False)
    assert sorted({g.fold for g in result.groups}) == ["heads", "linear", "norm"]
    # The scales are not all ones: norms, q/k/v/o, gate/up/down and v/up rows changed.
    assert any(g.alpha > 0 for g in result.groups)
    assert changed_weights(folded, model) >= 10
    assert_same_function(folded, model, TOKENS)


@pytest.mark.parametrize("arch", ["Llama", "Qwen2", "Gemma"])
def test_fold_keeps_function_transformers(arch):
    """transformers' decoders: Llama (grouped-query attention: o's scale shared by the query heads of
    each key/value head), Qwen2 (q/k/v with a bias), Gemma (an ``x·(1 + w)`` RMSNorm: not a norm a
    scale can be folded into, so its q/k/v and gate/up get the scale on their activation)."""
    pytest.importorskip("transformers")
    from test_e2e_hf import tiny_causal_lm

    model = tiny_causal_lm(arch=arch, dtype=torch.float64)
    tokens = torch.randint(0, 64, (2, 24), generator=torch.Generator().manual_seed(3))
    folded = copy.deepcopy(model)
    result = awq_search(folded, tokens, linears(folded), 32, clip=False, n_grid=8, progress=False)
    folds = {g.fold for g in result.groups}
    if arch == "Gemma":
        assert "norm" not in folds and "activation" in folds and result.input_scale
    else:
        assert {"norm", "heads", "linear"} <= folds and not result.input_scale
    assert_same_function(folded, model, tokens[:1])


def test_search_never_worse_than_round_to_nearest_on_its_measure():
    """alpha = 0 (s = 1) is round-to-nearest and on the grid, and clipping starts from no clipping:
    on the calibration samples each group's chosen error is at most round-to-nearest's."""
    model = tiny_llama(CFG)
    result = awq_search(model, CALIBRATION, linears(model), 64, progress=False)
    assert all(g.loss <= g.loss_rtn for g in result.groups)
    assert any(g.loss < 0.99 * g.loss_rtn for g in result.groups)
    clips = [c for c in result.clip.values() if c is not None]
    assert len(clips) == 2 * 5  # every linear but q and k
    clipped = [lin for _, lin in linears(model) if result.clip[id(lin)] is not None]
    assert any((c < lin.weight.detach().abs().reshape(c.shape[0], c.shape[1], -1).amax(-1)).any()
               for c, lin in zip(clips, clipped))


def test_quantize_model_calibrated(capsys):
    model = tiny_llama(CFG)
    quantized = quantize_model(copy.deepcopy(model), "awq-g64", calibration=CALIBRATION)
    assert sum(isinstance(m, AWQLinear) for m in quantized.modules()) == model.linear_count()
    err = capsys.readouterr().err
    assert "awq: [1/2] layers.0" in err and "awq: [2/2] layers.1" in err and "calibration tokens" in err
    with torch.no_grad():
        ref, out = model(TOKENS), quantized(TOKENS)
    # 4-bit group-64 error of random Gaussian weights (test_model_accuracy_awq.py: ~0.2 relative).
    assert ((out - ref).norm() / ref.norm()).item() < 0.35
    quantize_model(copy.deepcopy(model), "awq-g64", calibration=CALIBRATION, progress=False,
                   awq_options={"n_grid": 4, "clip": False})
    assert capsys.readouterr().err == ""


def test_fake_quantize_is_what_the_module_dequantizes():
    lin = nn.Linear(256, 64)
    for dtype in (torch.float16, torch.bfloat16):
        clip = lin.weight.detach().abs().reshape(64, 4, 64).amax(-1) * torch.linspace(0.5, 1, 64)[:, None]
        for c in (None, clip):
            layer = AWQLinear(256, 64, group_size=64, dtype=dtype)
            qweight, qzeros, scales = quantize_weight_awq(lin.weight, 64, dtype, clip=c)
            layer.qweight.copy_(layer.held_layout(qweight))
            layer.qzeros.copy_(qzeros)
            layer.scales.copy_(scales)
            assert torch.equal(layer.dequantized_weight().float().t(), fake_quantize_awq(lin.weight, 64, dtype, c))
        # Clipping is clamping before rounding.
        clamped = torch.maximum(torch.minimum(lin.weight.detach().reshape(64, 4, 64), clip[..., None]),
                                -clip[..., None]).reshape(64, 256)
        for a, b in zip(quantize_weight_awq(clamped, 64, dtype), quantize_weight_awq(lin.weight, 64, dtype, clip=clip)):
            assert torch.equal(a, b)


class _Tokenizer:
    """A tokenizer's call as transformers' (``input_ids`` of a ``[1, S]`` tensor)."""

    def __call__(self, text, return_tensors=None):
        return {"input_ids": torch.tensor([[ord(c) % 512 for c in text]])}


def test_calibration_forms():
    ids = torch.arange(10)
    assert [b.shape for b in calibration_batches(ids)] == [(1, 10)]
    assert [b.shape for b in calibration_batches(ids.view(2, 5))] == [(2, 5)]
    assert [b.shape for b in calibration_batches([ids, ids[:4]])] == [(1, 10), (1, 4)]
    assert [b.shape for b in calibration_batches(["abc", "de"], _Tokenizer())] == [(1, 3), (1, 2)]
    with pytest.raises(ValueError, match="tokenizer"):
        calibration_batches(["abc"])
    assert [b.shape for b in calibration_batches(torch.randn(4, 8))] == [(4, 8)]  # activations, as they are
    with pytest.raises(TypeError, match="token ids"):
        calibration_batches([3.5])
    with pytest.raises(TypeError, match="token ids"):
        calibration_batches(torch.zeros(2, 3, 4, dtype=torch.long))
    with pytest.raises(ValueError, match="no data"):
        calibration_batches([])
    with pytest.raises(ValueError, match="empty"):
        calibration_batches(torch.zeros(0, dtype=torch.long))
    with pytest.raises(ValueError, match="calibration data is for AWQ"):
        quantize_model(tiny_llama(CFG), "int8", calibration=ids)


class _MLP(nn.Module):
    """Linears with nothing before them that could carry a scale: the input and a GELU."""

    def __init__(self):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(128, 256), nn.Linear(256, 64)

    def forward(self, x):
        return self.fc2(torch.nn.functional.gelu(self.fc1(x)))


@pytest.mark.compile
def test_scale_on_the_activation_still_fuses():
    import compile_backend

    torch.manual_seed(0)
    model = _MLP()
    # Outlier channels, as in trained models, where the scales matter.
    x = torch.randn(64, 128) * torch.where(torch.arange(128) % 17 == 0, 20.0, 1.0)
    ref = model(x).detach()
    rtn = quantize_model(copy.deepcopy(model), "awq-g64")
    calibrated = quantize_model(model, "awq-g64", calibration=[x], progress=False)
    assert isinstance(calibrated.fc1, InputScaled) and isinstance(calibrated.fc1.layer, AWQLinear)
    with torch.no_grad():
        err_rtn = (rtn(x) - ref).norm().item()
        err = (calibrated(x) - ref).norm().item()
        assert err < err_rtn
        report = compile_backend.explain(calibrated, x)
    assert len(report.fused) == 2 and not report.unfused
