"""Tensor parallel end to end: a Hugging Face Llama sharded over the ranks of ``torchrun``, decode and prefill.

Every rank builds the same ``LlamaForCausalLM`` (Llama-3-8B shapes by default: hidden 4096, intermediate
14336, 32 heads / 8 KV heads, vocab 128256, 32 layers; random weights, fixed seed), quantizes it
(``quantize_model``; lm_head stays dense), shards it with ``compile_backend.tensor_parallel.tensor_parallel``
(q/k/v/gate/up column-wise, o/down row-wise, all-reduce before the bias) and compiles it.  ``--model
llama-3-70b``: Llama-3-70B's shapes (hidden 8192, intermediate 28672, 64 heads / 8 KV heads, 80 layers),
built layer by layer (``--layerwise``): each rank makes one decoder layer at a time, quantizes and shards
it before the next, so no rank ever holds the dense model.  Configs:

* ``fp16``                      the dense model under Inductor (the baseline)
* ``awq-g128``, ``int8``, ...   quantized (any name in ``SCHEMES``), ``backend="quantfuse"``

Per config: decode tok/s at batch 1 over a static cache (gpt-fast's tight loop, ``--mode``, default
``reduce-overhead`` on CUDA), time to first token of a 1 x ``--prompt-len`` prefill (compiled, mode
default), fused subgraphs per rank (none may stay unfused), all-reduces in the decode graph, logits error
against the same sharded model in eager.  Times are the slowest rank's.  With ``--single`` (a
``results_e2e.json`` of ``bench_e2e.py``) the single-GPU ratios to fp16 are printed next to these.

    torchrun --nproc-per-node 2 benchmarks/bench_tp.py --out DIR                       # 2 GPUs, NCCL
    torchrun --nproc-per-node 2 benchmarks/bench_tp.py --configs int8,fp8-rowwise --append --out DIR
    torchrun --nproc-per-node 2 benchmarks/bench_tp.py --device cpu --quick --out DIR  # gloo, tiny dims

NVLink multicast (NVLS) is kept off (``NCCL_NVLS_ENABLE=0`` unless set).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from llama_shapes import MODELS, build_layerwise  # noqa: E402

DEFAULT_CONFIGS = "fp16,awq-g128,int8,fp8-rowwise"


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--configs", default=DEFAULT_CONFIGS)
    ap.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    ap.add_argument("--quick", action="store_true", help="2 layers, tiny dims on CPU, few steps")
    ap.add_argument("--model", default="llama-3-8b", choices=sorted(MODELS), help="the shapes (--quick: tiny)")
    ap.add_argument("--layerwise", action="store_true",
                    help="build, quantize and shard one decoder layer at a time (default for llama-3-70b)")
    ap.add_argument("--layers", type=int, default=None, help="default: the model's (--quick 2)")
    ap.add_argument("--dtype", default="float16", help="the model's dtype (activations of every config)")
    ap.add_argument("--context", type=int, default=None, help="prompt before the decode steps (512; quick 16)")
    ap.add_argument("--steps", type=int, default=None, help="timed decode steps (128; quick 4)")
    ap.add_argument("--warmup", type=int, default=None, help="decode steps before timing (5; quick 2)")
    ap.add_argument("--prompt-len", type=int, default=None, help="prefill prompt (2048; quick 32)")
    ap.add_argument("--prefill-reps", type=int, default=None, help="timed prefills (5; quick 1)")
    ap.add_argument("--mode", default=None, help="decode compile mode (reduce-overhead on CUDA, default on CPU)")
    ap.add_argument("--single", default=None, help="results_e2e.json of a single-GPU bench_e2e.py run to compare")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=None, help="directory for results_tp.{json,md} (default: print only)")
    ap.add_argument("--append", action="store_true",
                    help="add to the configs of --out's results_tp.json (a run split over several invocations)")
    args = ap.parse_args(argv)
    big = not (args.quick and args.device == "cpu")
    shapes = MODELS[args.model]
    dims = dict(hidden=shapes["hidden"], intermediate=shapes["intermediate"], heads=shapes["heads"],
                kv_heads=shapes["kv_heads"], vocab=128256) if big else \
        dict(hidden=256, intermediate=512, heads=4, kv_heads=2, vocab=512)
    for k, v in dims.items():
        setattr(args, k, v)
    args.layerwise = args.layerwise or args.model == "llama-3-70b"
    quick = dict(layers=2, context=16, steps=4, warmup=2, prompt_len=32, prefill_reps=1)
    full = dict(layers=shapes["layers"], context=512, steps=128, warmup=5, prompt_len=2048, prefill_reps=5)
    for k, v in (quick if args.quick else full).items():
        if getattr(args, k) is None:
            setattr(args, k, v)
    if args.mode is None:
        args.mode = "reduce-overhead" if args.device == "cuda" else "default"
    args.dtype = getattr(torch, args.dtype)
    return args


def log(msg: str) -> None:
    if dist.get_rank() == 0:
        print(f"[bench_tp {time.strftime('%H:%M:%S')}] {msg}", flush=True)


def build_model(args, dev: torch.device, per_layer=None):
    """The model on ``dev`` in ``args.dtype``; with ``args.layerwise``, each decoder layer passed to
    ``per_layer`` as soon as it is made (``llama_shapes.build_layerwise``)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(
        vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=args.intermediate,
        num_hidden_layers=args.layers, num_attention_heads=args.heads, num_key_value_heads=args.kv_heads,
        max_position_embeddings=max(8192, args.context + args.steps + args.warmup + 16, args.prompt_len + 16),
        rope_parameters={"rope_type": "default", "rope_theta": 500000.0}, rms_norm_eps=1e-5,
        tie_word_embeddings=False, attn_implementation="sdpa", bos_token_id=None, eos_token_id=None,
        pad_token_id=None)
    torch.manual_seed(args.seed)
    old = torch.get_default_dtype()
    torch.set_default_dtype(args.dtype)
    try:
        if args.layerwise:
            model = build_layerwise(cfg, dev, per_layer, seed=args.seed, log=log)
        else:
            with dev:
                model = LlamaForCausalLM(cfg)
    finally:
        torch.set_default_dtype(old)
    return model.eval().requires_grad_(False)


class Timer:
    """Wall time of ``fn()`` on this rank after the device finished, slowest rank's."""

    def __init__(self, dev: torch.device):
        self.dev = dev

    def sync(self):
        if self.dev.type == "cuda":
            torch.cuda.synchronize(self.dev)

    def __call__(self, fn):
        self.sync()
        dist.barrier()
        t0 = time.perf_counter()
        out = fn()
        self.sync()
        dt = torch.tensor([time.perf_counter() - t0], dtype=torch.float64)
        dist.all_reduce(dt, op=dist.ReduceOp.MAX)  # gloo and NCCL both take CPU/GPU as set up below
        return out, float(dt)


def rel_err(out, ref) -> float:
    return float((out.float() - ref.float()).norm() / ref.float().norm())


def cache_kwarg(model) -> str:
    import inspect

    return "past_key_values" if "past_key_values" in inspect.signature(model.forward).parameters else "cache"


def run_config(name: str, args, dev: torch.device, group) -> dict:
    from torch._dynamo.utils import counters
    from transformers import StaticCache

    from compile_backend.passes import collecting_report
    from compile_backend.quantize import quantize_model
    from compile_backend.tensor_parallel import tensor_parallel

    r = {"name": name}
    t0 = time.perf_counter()
    def quantize_and_shard(module):
        if name != args.dense:
            quantize_model(module, name)
        # The plan's patterns name a layer's linears under a parent ("*.self_attn.q_proj").
        tensor_parallel(torch.nn.ModuleDict({"layer": module}) if args.layerwise else module, group)
        return module

    if args.layerwise:
        model = build_model(args, dev, quantize_and_shard)
    else:
        model = quantize_and_shard(build_model(args, dev))
    r["build_s"] = time.perf_counter() - t0
    r["weights_gb_per_rank"] = sum(t.numel() * t.element_size() for t in [*model.parameters(), *model.buffers()]) / 1e9
    backend = "inductor" if name == args.dense else "quantfuse"
    r["backend"] = backend
    ck = cache_kwarg(model)
    timer = Timer(dev)
    gen = torch.Generator().manual_seed(args.seed)
    torch._dynamo.reset()

    # decode, batch 1
    cache = StaticCache(config=model.config, max_cache_len=args.context + args.warmup + args.steps + 8)
    prompt = torch.randint(0, args.vocab, (1, args.context), generator=gen).to(dev)

    def call(fn, tok, pos):
        return fn(input_ids=tok, position_ids=pos, use_cache=True, **{ck: cache}).logits

    step_fn = torch.compile(model.forward, backend=backend, dynamic=False,
                            mode=None if args.mode == "default" else args.mode)
    def prefill():  # the cache keeps its own count of positions: a step is compared from the same state
        cache.reset()
        return call(model.forward, prompt, torch.arange(args.context, device=dev).unsqueeze(0))[:, -1:].argmax(-1)

    with torch.no_grad():
        tok = prefill()
        pos = torch.full((1, 1), args.context, device=dev, dtype=torch.long)
        ref = call(model.forward, tok, pos).float()
        prefill()
        counters.clear()
        with collecting_report() as report:
            logits, r["decode_first_call_s"] = timer(lambda: call(step_fn, tok, pos))
        r["decode_logits_err"] = rel_err(logits, ref)
        r["fused"], r["unfused"] = len(report.fused), [str(u) for u in report.unfused]
        r["graphs"] = counters["stats"]["unique_graphs"]
        r["cudagraph_skips"] = dict(counters["inductor"]).get("cudagraph_skips", 0)
        tok = logits[:, -1:].argmax(-1)

        def steps(n):
            nonlocal tok
            for _ in range(n):
                pos.add_(1)
                tok = call(step_fn, tok, pos)[:, -1:].argmax(-1)

        timer(lambda: steps(args.warmup))
        _, wall = timer(lambda: steps(args.steps))
        r["decode_ms_per_step"] = wall * 1e3 / args.steps
        r["tok_per_s"] = args.steps / wall
    log(f"{name}: {r['tok_per_s']:.1f} tok/s ({r['decode_ms_per_step']:.2f} ms/step), fused {r['fused']} per rank, "
        f"unfused {len(r['unfused'])}, logits err {r['decode_logits_err']:.3g}"
        + (f"; CUDA graphs skipped {r['cudagraph_skips']}x" if r["cudagraph_skips"] else ""))
    step_fn = cache = None  # free the decode graph and cache before the prefill's

    # prefill 1 x prompt_len, first token included
    cache = StaticCache(config=model.config, max_cache_len=args.prompt_len + 8)
    ids = torch.randint(0, args.vocab, (1, args.prompt_len), generator=gen).to(dev)
    positions = torch.arange(args.prompt_len, device=dev).unsqueeze(0)
    prefill_fn = torch.compile(model.forward, backend=backend, dynamic=False)

    def first_token(fn):
        return fn(input_ids=ids, position_ids=positions, use_cache=True, logits_to_keep=1,
                  **{ck: cache}).logits[:, -1].argmax(-1)

    with torch.no_grad():
        cache.reset()
        _, r["prefill_first_call_s"] = timer(lambda: first_token(prefill_fn))
        times = []
        for i in range(args.prefill_reps + 1):
            cache.reset()
            _, dt = timer(lambda: first_token(prefill_fn))
            if i:
                times.append(dt)
        r["prefill_ms"] = statistics.median(times) * 1e3
    log(f"{name}: prefill 1 x {args.prompt_len}: {r['prefill_ms']:.2f} ms")
    prefill_fn = cache = model = None
    if dev.type == "cuda":
        torch.cuda.empty_cache()
    return r


def single_gpu_ratios(path: str) -> dict:
    """tok/s and prefill ratios to fp16 of a bench_e2e.py run (loop path, batch 1)."""
    configs = json.load(open(path))["configs"]
    base = configs.get("fp16", {})
    out = {}
    for name, c in configs.items():
        try:
            out[name] = dict(decode=c["loop"]["b1"]["tok_per_s"] / base["loop"]["b1"]["tok_per_s"],
                             prefill=base["prefill"]["ttft_ms"] / c["prefill"]["ttft_ms"])
        except (KeyError, TypeError, ZeroDivisionError):
            continue
    return out


def render_md(res: dict) -> str:
    m = res["meta"]
    lines = [f"# Tensor parallel {m['world']}: {m['layers']}-layer Llama (hidden {m['hidden']}, intermediate "
             f"{m['intermediate']}, {m['heads']}/{m['kv_heads']} heads, vocab {m['vocab']}), random weights", "",
             f"- {m['device']}; torch {m['torch']}; `{m['argv']}`",
             f"- decode: batch 1, context {m['context']}, {m['steps']} timed steps, mode `{m['mode']}`; prefill "
             f"1 x {m['prompt_len']} (mode default, first token included); times of the slowest rank", "",
             "| config | backend | tok/s | x fp16 | single-GPU x fp16 | ms/step | prefill ms | x fp16 | "
             "single-GPU x fp16 | fused/rank | unfused | logits err | GB/rank |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    base = res["configs"].get(m["dense"], {})
    single = res.get("single", {})
    for name, r in res["configs"].items():
        if "error" in r:
            lines.append(f"| {name} | error: {r['error'][:200]} |" + " |" * 11)
            continue
        dx = r["tok_per_s"] / base["tok_per_s"] if "tok_per_s" in base else float("nan")
        px = base["prefill_ms"] / r["prefill_ms"] if "prefill_ms" in base else float("nan")
        s = single.get(name, {})
        nan = float("nan")
        lines.append(f"| {name} | {r['backend']} | {r['tok_per_s']:.1f} | {dx:.2f} | {s.get('decode', nan):.2f} "
                     f"| {r['decode_ms_per_step']:.2f} | {r['prefill_ms']:.2f} | {px:.2f} | "
                     f"{s.get('prefill', nan):.2f} | {r['fused']} | {len(r['unfused'])} | "
                     f"{r['decode_logits_err']:.2e} | {r['weights_gb_per_rank']:.3f} |")
    return "\n".join(lines) + "\n"


def main(argv=None):
    args = parse_args(argv)
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
    local = int(os.environ.get("LOCAL_RANK", "0"))
    if args.device == "cuda":
        torch.cuda.set_device(local)
        dev = torch.device("cuda", local)
        # NCCL for the model's collectives; the timer's all-reduce of a CPU scalar goes through gloo.
        dist.init_process_group("cuda:nccl,cpu:gloo", device_id=dev)
    else:
        dev = torch.device("cpu")
        torch.set_num_threads(max(1, (os.cpu_count() or 2) // int(os.environ.get("LOCAL_WORLD_SIZE", "1"))))
        dist.init_process_group("gloo")
    import compile_backend  # noqa: F401  (registers the ops and the backend)

    args.dense = "fp16" if args.dtype == torch.float16 else "bf16" if args.dtype == torch.bfloat16 else "dense"
    configs = [c.strip() for c in args.configs.split(",") if c.strip()]
    configs = [args.dense if c in ("fp16", "bf16", "dense") else c for c in configs]
    res = {"meta": dict(world=dist.get_world_size(), model=args.model, layerwise=args.layerwise, layers=args.layers,
                        hidden=args.hidden,
                        intermediate=args.intermediate, heads=args.heads, kv_heads=args.kv_heads, vocab=args.vocab,
                        context=args.context, steps=args.steps, prompt_len=args.prompt_len, mode=args.mode,
                        dense=args.dense, torch=torch.__version__, argv=" ".join(sys.argv),
                        device=torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu"),
           "configs": {}}
    previous = os.path.join(args.out or "", "results_tp.json")
    if args.append and args.out and os.path.exists(previous):
        with open(previous) as f:
            res["configs"] = json.load(f)["configs"]
    if args.single:
        res["single"] = single_gpu_ratios(args.single)
    group = dist.group.WORLD
    for name in configs:
        log(f"{name}: build, quantize, shard over {dist.get_world_size()} ranks")
        try:
            res["configs"][name] = run_config(name, args, dev, group)
        except Exception as exc:  # the others still run; the error is in the table
            res["configs"][name] = {"name": name, "error": f"{type(exc).__name__}: {exc}"}
            print(f"[rank {dist.get_rank()}] {name} failed: {type(exc).__name__}: {exc}", file=sys.stderr, flush=True)
        if dist.get_rank() == 0 and args.out:
            os.makedirs(args.out, exist_ok=True)
            with open(os.path.join(args.out, "results_tp.json"), "w") as f:
                json.dump(res, f, indent=1)
            with open(os.path.join(args.out, "results_tp.md"), "w") as f:
                f.write(render_md(res))
    if dist.get_rank() == 0:
        print(render_md(res), flush=True)
    failed = [n for n, r in res["configs"].items() if "error" in r or r.get("unfused")]
    dist.destroy_process_group()
    return 1 if failed else 0


if __name__ == "__main__":
    code = main()
    # The results are written and the process group is gone: leave now.  The interpreter's teardown
    # (compile worker pools, CUDA-graph and NCCL state) can keep torchrun waiting for minutes after the
    # last result; nothing it would do is needed.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
