"""A Hugging Face Llama, quantized, through transformers' ``generate`` with a quantfuse-compiled decode step.

For every scheme the greedy tokens equal eager's and every quantized linear of the compiled graph runs
as a fused op (``collecting_report``: fused subgraphs = quantized linears per graph, none left unfused).

* CPU (CI): a 2-layer ``LlamaForCausalLM`` (hidden 128), ``generate`` with a static cache and
  ``CompileConfig(backend="quantfuse")``; transformers compiles only on accelerators unless
  ``_compile_all_devices`` is set.  Plus the grad-mode cases: a plain forward of a model with
  trainable parameters (RMSNorms, embedding), outside ``no_grad`` (fused, equal to eager), and
  its gradients.
* GPU: the same through ``CompileConfig(backend="quantfuse", mode="reduce-overhead")`` (CUDA
  graphs), the very first call compared too, every scheme including awq-g128 (hidden 256: AWQ
  kernels want K a multiple of 128).

Both also run other decoder families (Qwen2, Phi3, Gemma, Qwen3: ``OTHER_ARCHITECTURES``).

transformers is an optional dependency (the ``hf`` extra): without it these tests are skipped.
"""

from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")

from compile_backend.passes import collecting_report  # noqa: E402
from compile_backend.quantize import AWQLinear, W8A8Linear, quantize_model  # noqa: E402

pytestmark = pytest.mark.compile

CUDA = torch.cuda.is_available()
NEW_TOKENS = 6
PROMPT = 8
# Caches off: the passes must really run in every test, or the report stays empty.
CACHES_OFF = {"fx_graph_cache": False}


def tiny_causal_lm(hidden=128, intermediate=256, heads=4, kv_heads=2, vocab=64, dtype=torch.float32, device="cpu",
                   arch="Llama"):
    """2-layer ``<arch>ForCausalLM`` (LlamaForCausalLM by default) with seeded random weights (HF's
    own init).  Init std 0.1 rather than Llama's 0.02: with 0.02 the tiny model's greedy output
    repeats one token whatever the input."""
    cfg = getattr(transformers, f"{arch}Config")(
        vocab_size=vocab, hidden_size=hidden, intermediate_size=intermediate, num_hidden_layers=2,
        num_attention_heads=heads, num_key_value_heads=kv_heads, max_position_embeddings=64,
        attn_implementation="sdpa", tie_word_embeddings=False, bos_token_id=None, eos_token_id=None,
        pad_token_id=0, initializer_range=0.1, **OTHER_ARCHITECTURES.get(arch, {}))
    torch.manual_seed(0)
    model = getattr(transformers, f"{arch}ForCausalLM")(cfg).to(device=device, dtype=dtype).eval()
    # Greedy and no EOS: both calls produce exactly NEW_TOKENS tokens.
    model.generation_config.do_sample = False
    model.generation_config.eos_token_id = None
    return model


# Decoders other than Llama, each with what sets it apart in the graph the passes see.
OTHER_ARCHITECTURES = {
    "Qwen2": {},  # q/k/v projections with a bias
    "Phi3": {},  # one fused q/k/v linear and one gate/up linear, split by the model
    "Gemma": {"head_dim": 32},  # GELU-tanh MLP, (1 + w) RMSNorm, embeddings scaled by sqrt(hidden)
    "Qwen3": {"head_dim": 32},  # RMSNorm of each query and key head before rotary
}


def quantized_linears(model) -> int:
    return sum(isinstance(m, (W8A8Linear, AWQLinear)) for m in model.modules())


def prompt(vocab: int, device: str, seed: int = 2) -> torch.Tensor:
    """The seeds used (2 for the CPU model, 4 for the GPU one) give every scheme's eager logits a top-2
    margin of at least 0.15 (CPU) and 0.03 (GPU model, eager on a CPU) of their spread at each
    generated token, above the compiled-vs-eager differences: the tokens are expected to be equal."""
    return torch.randint(0, vocab, (1, PROMPT), generator=torch.Generator().manual_seed(seed)).to(device)


def generate(model, ids, **kw):
    out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=NEW_TOKENS,
                         cache_implementation="static", return_dict_in_generate=True, output_logits=True, **kw)
    return out.sequences[:, ids.shape[1]:], torch.stack(out.logits, 1).float()


def assert_tokens_match(tokens, logits, ref_tokens, ref_logits, what: str, rtol: float = 5e-2):
    """Equal greedy tokens, and logits within ``rtol`` (relative L2, per step) of eager's.

    A compiled graph rounds differently from eager (fused fp32 epilogues, another accumulation
    order), so a different pick at a step where eager's top two logits are closer than that
    difference (4 x its RMS, or 2% of the logits' spread) is a tie broken differently, not an
    error: the sequences are compared up to such a step.
    """
    assert tokens.shape == ref_tokens.shape, (what, tokens.shape, ref_tokens.shape)
    diff = (tokens != ref_tokens).nonzero()
    upto = int(diff[0, 1]) if diff.numel() else tokens.shape[1] - 1
    for step in range(upto + 1):
        ref, got = ref_logits[0, step], logits[0, step]
        rel = float((got - ref).norm() / ref.norm())
        assert rel < rtol, f"{what}: logits of token {step} off by {rel:.3g} (relative L2) from eager's"
    if diff.numel() == 0:
        return
    top2 = ref.topk(2).values
    margin = float(top2[0] - top2[1])
    tie = max(0.02 * float(ref.std()), 4 * float((got - ref).pow(2).mean().sqrt()))
    assert margin < tie, (
        f"{what}: token {upto} is {int(tokens[0, upto])}, eager's {int(ref_tokens[0, upto])}, yet eager's "
        f"top-2 margin {margin:.3g} is no tie (<{tie:.3g}); tokens {tokens.tolist()} vs {ref_tokens.tolist()}")


def rtol_for(scheme: str) -> float:
    """Compiled-vs-eager tolerance of the logits.  Dynamic activation quantization re-rounds every
    layer's input, so a last-bit difference upstream can move a value to the next quantization step;
    with fp8's 3 mantissa bits that step is 6-12%, and plain Inductor on the same fp16 model is off
    by 4-9% as well (and int8 by ~1%)."""
    return 0.15 if scheme.startswith("fp8") else 5e-2


def compiled_generate(model, ids, compile_config, report_expected: int, what: str, calls: int = 1, check=None):
    """``generate`` through transformers' compiled decode step: returns the results of each call,
    after checking that every quantized linear of every compiled graph was fused (and ``check(report,
    graphs)``, where given)."""
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    model.generation_config.compile_config = compile_config
    results = []
    with collecting_report() as report, torch._functorch.config.patch(enable_autograd_cache=False), \
            torch._inductor.config.patch(CACHES_OFF), torch.no_grad():
        for _ in range(calls):
            results.append(generate(model, ids))
    graphs = counters["stats"]["unique_graphs"]
    assert hasattr(model, "_compiled_call"), f"{what}: transformers did not compile the decode step"
    # Inductor skips CUDA graphs quietly (a log line, this counter) when a graph cannot be captured.
    assert not counters["inductor"]["cudagraph_skips"], f"{what}: CUDA graphs were skipped"
    assert graphs >= 1, what
    assert not report.unfused, f"{what}: left unfused:\n{report}"
    assert len(report.fused) == report_expected * graphs, (
        f"{what}: {len(report.fused)} fused subgraphs in {graphs} graph(s); expected {report_expected} per graph\n"
        f"{report}")
    if check is not None:
        check(report, graphs)
    return results


def eager_generate(model, ids):
    model.generation_config.compile_config = None
    with torch.no_grad():
        # disable_compile: on a GPU transformers would otherwise compile a static-cache decode by itself
        return generate(model, ids, disable_compile=True)


# --------------------------------------------------------------------------- CPU

# One scheme per pattern family and activation format (each test is a full compile with C++ code
# generation, the bulk of these tests' time).  awq-g32: the CPU model's K = 128 / 256 is a multiple
# of every AWQ group size; AWQ holds fp16/bf16 activations, so its model is bf16.
CPU_SCHEMES = {"int8": torch.float32, "int8-asym": torch.float32, "fp8-rowwise": torch.float32,
               "awq-g32": torch.bfloat16}


def generate_on_cpu(scheme, arch="Llama"):
    model = quantize_model(tiny_causal_lm(dtype=CPU_SCHEMES[scheme], arch=arch), scheme)
    ids = prompt(model.config.vocab_size, "cpu")
    ref = eager_generate(model, ids)
    config = transformers.CompileConfig(backend="quantfuse", mode="default")
    config._compile_all_devices = True  # transformers compiles on accelerators only unless told
    what = f"{arch} {scheme}"
    ((tokens, logits),) = compiled_generate(model, ids, config, quantized_linears(model), what)
    assert_tokens_match(tokens, logits, *ref, what=what, rtol=rtol_for(scheme))


@pytest.mark.parametrize("scheme", list(CPU_SCHEMES))
def test_generate_cpu(scheme):
    generate_on_cpu(scheme)


# One scheme each, so that together they cover both activation formats and the zero-point path.
OTHER_ARCHITECTURE_SCHEMES = {"Qwen2": "int8-asym", "Phi3": "awq-g32", "Gemma": "int8", "Qwen3": "fp8-rowwise"}


@pytest.mark.parametrize("arch", list(OTHER_ARCHITECTURES))
def test_generate_cpu_other_architectures(arch):
    """Other decoder families through the same generate: every quantized linear fused, eager's tokens."""
    generate_on_cpu(OTHER_ARCHITECTURE_SCHEMES[arch], arch=arch)


def _grad_mode_model(scheme, dtype):
    """As built: every float parameter (embedding, RMSNorms, lm_head) trainable; the quantized
    layers' tensors are frozen parameters."""
    model = quantize_model(tiny_causal_lm(dtype=dtype), scheme)
    quantized = {id(p) for m in model.modules() if isinstance(m, (W8A8Linear, AWQLinear)) for p in m.parameters()}
    assert quantized and torch.is_grad_enabled()
    assert all(p.requires_grad != (id(p) in quantized) for p in model.parameters())
    return model


def test_grad_mode_forward_fused():
    """Outside no_grad, with trainable parameters: the quantized linears still fuse, and the
    logits equal eager's as closely as under no_grad."""
    model = _grad_mode_model("int8", torch.float32)
    ids = prompt(model.config.vocab_size, "cpu")
    ref = model(ids, use_cache=False).logits
    torch._dynamo.reset()
    with collecting_report() as report, torch._functorch.config.patch(enable_autograd_cache=False):
        out = torch.compile(model, backend="quantfuse", options=CACHES_OFF)(ids, use_cache=False).logits
    assert out.requires_grad
    # Re-quantizing activations turns the compiled graph's different rounding into a few flipped
    # int8 values per layer; 2e-2 is several times what compiled-vs-eager shows here under no_grad.
    rel = ((out - ref).norm() / ref.norm()).item()
    assert rel < 2e-2, rel
    assert not report.unfused and len(report.fused) == quantized_linears(model), str(report)


def test_grad_mode_backward():
    """Gradients of the trainable parameters through the compiled quantized model equal eager's
    (AWQ: the activation gradient flows through the dequantized weight to the norms and the
    embedding)."""
    model = _grad_mode_model("awq-g32", torch.bfloat16)
    ids = prompt(model.config.vocab_size, "cpu")
    params = [p for p in model.parameters() if p.requires_grad]

    def grads(fn):
        for p in params:
            p.grad = None
        fn(ids, use_cache=False).logits.float().square().mean().backward()
        return [p.grad.float().clone() for p in params]

    ref = grads(model)
    torch._dynamo.reset()
    with torch._functorch.config.patch(enable_autograd_cache=False):
        got = grads(torch.compile(model, backend="quantfuse", options=CACHES_OFF))
    for p, g, r in zip(params, got, ref):
        rel = ((g - r).norm() / r.norm()).item()
        assert rel < 5e-2, (p.shape, rel)  # bf16: another rounding order through two layers


# --------------------------------------------------------------------------- GPU

GPU_SCHEMES = ["int8", "int8-asym", "int8-per-tensor", "fp8-rowwise", "fp8", "awq-g128", "awq-g64"]


def generate_with_cuda_graphs(scheme, device="cuda", mode="reduce-overhead", arch="Llama"):
    model = quantize_model(tiny_causal_lm(hidden=256, intermediate=512, heads=4, kv_heads=2, dtype=torch.float16,
                                          device=device, arch=arch), scheme)
    ids = prompt(model.config.vocab_size, device, seed=4)
    ref = eager_generate(model, ids)
    config = transformers.CompileConfig(backend="quantfuse", mode=mode)
    config._compile_all_devices = device != "cuda"
    what = f"{arch} {scheme}"
    first, second = compiled_generate(model, ids, config, quantized_linears(model), what, calls=2)
    if device == "cuda" and mode == "reduce-overhead":
        from torch._dynamo.utils import counters

        # Every decode attention takes the rotary and the cache writes, but Phi3's (a partial rotary).
        # and with them the static cache's own position counter where it keeps one (transformers 5: the op
        # reads and advances it).
        rope, counted = counters["quantfuse"]["gqa_decode_rope"], counters["quantfuse"]["gqa_decode_rope_counter"]
        assert (rope >= model.config.num_hidden_layers) if arch != "Phi3" else rope == 0, (what, rope)
        layer = transformers.StaticCache(config=model.config, max_cache_len=8).layers[0]
        assert counted == (rope if isinstance(getattr(layer, "cumulative_length", None), torch.Tensor) else 0), (
            what, rope, counted)
    assert_tokens_match(*first, *ref, what=f"{what}, first call", rtol=rtol_for(scheme))
    assert_tokens_match(*second, *ref, what=f"{what}, second call", rtol=rtol_for(scheme))


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU")
@pytest.mark.parametrize("scheme", GPU_SCHEMES)
def test_generate_cuda_graphs(scheme):
    """CUDA graphs from the very first call: the first generate (compile, warm-up run, graph
    recording) and the second (replays) give eager's tokens."""
    generate_with_cuda_graphs(scheme)


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU")
@pytest.mark.parametrize("scheme", ["awq-g128", "int8"])
def test_pdl_on_and_off_give_the_same_generate(monkeypatch, scheme):
    """CUDA graphs with programmatic dependent launch (on sm_90+: Inductor's kernels, the backend's ``pdl``
    option, and ours, ``QUANTFUSE_PDL``) and without give the same logits, bit for bit, through
    ``generate``."""
    model = quantize_model(tiny_causal_lm(hidden=256, intermediate=512, heads=4, kv_heads=2, dtype=torch.float16,
                                          device="cuda"), scheme)
    ids = prompt(model.config.vocab_size, "cuda", seed=4)
    runs = {}
    for pdl in (False, True):
        monkeypatch.setenv("QUANTFUSE_PDL", "1" if pdl else "0")
        config = transformers.CompileConfig(backend="quantfuse", mode=None, options={"triton.cudagraphs": True,
                                                                                  "pdl": pdl})
        (runs[pdl],) = compiled_generate(model, ids, config, quantized_linears(model), f"{scheme} pdl={pdl}")
    assert torch.equal(runs[True][0], runs[False][0]) and torch.equal(runs[True][1], runs[False][1]), scheme


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU")
@pytest.mark.parametrize("scheme", ["awq-g128", "int8"])
@pytest.mark.parametrize("arch", list(OTHER_ARCHITECTURES))
def test_generate_cuda_graphs_other_architectures(arch, scheme):
    """The other decoder families under CUDA graphs from the first call (the decode attention op
    included, with their head sizes and biases)."""
    generate_with_cuda_graphs(scheme, arch=arch)
