"""quantfuse demo: ``python -m compile_backend.demo``.

Quantizes a small Llama-style model (W8A8 int8, and AWQ 4-bit), compiles it with
``backend="quantfuse"`` on whatever device is present, and prints per scheme:
the number of fused subgraphs (and unfused candidates), the error against the
eager quantized model, and the time against ``torch.compile``'s default backend
(on a GPU also both replayed as CUDA graphs).
"""

from __future__ import annotations

import argparse
import copy
import time

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


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description="quantfuse demo")
    parser.add_argument("--schemes", nargs="+", default=["int8", "awq-g128"])
    parser.add_argument("--iters", type=int, default=None)
    args = parser.parse_args(argv)

    cuda = torch.cuda.is_available()
    device = "cuda" if cuda else "cpu"
    # On a GPU, a model large enough for the matmuls to matter; on a CPU, one that compiles quickly.
    cfg = LlamaConfig(hidden_size=2048, intermediate_size=5632, num_layers=4, num_heads=16, num_kv_heads=4,
                      vocab_size=4096) if cuda else LlamaConfig()
    iters = args.iters or (50 if cuda else 10)
    print(f"quantfuse demo on {torch.cuda.get_device_name() if cuda else 'CPU'}, torch {torch.__version__}")
    print(f"model: {cfg.num_layers} layers, hidden {cfg.hidden_size}; batch 4 x 32 tokens")
    for scheme in args.schemes:
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
