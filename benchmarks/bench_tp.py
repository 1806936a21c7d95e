"""Tensor parallel end to end: a Hugging Face Llama sharded over the ranks of ``torchrun``, decode and prefill.

Every rank builds the same ``LlamaForCausalLM`` (Llama-3-8B shapes by default: hidden 4096, intermediate
14336, 32 heads / 8 KV heads, vocab 128256, 32 layers; random weights, fixed seed), quantizes it
(``quantize_model``; lm_head stays dense), shards it with ``compile_backend.tensor_parallel.tensor_parallel``
(q/k/v/gate/up column-wise, o/down row-wise, all-reduce before the bias) and compiles it.  ``--model
llama-3-70b``: Llama-3-70B's shapes (hidden 8192, intermediate 28672, 64 heads / 8 KV heads, 80 layers),
built layer by layer (``--layerwise``): each rank makes one decoder layer at a time, quantizes and shards
it before the next, so no rank ever holds the dense model.  Configs:

* ``fp16``                      the dense model under Inductor (the baseline)
* ``awq-g128``, ``int8``, ...   quantized (any name in ``SCHEMES``), ``backend="quantfuse"``; the row-parallel
                                all-reduces of decode sizes through symmetric memory (compile_backend/all_reduce.py)
* ``<scheme>@nccl``             the same with every all-reduce through NCCL (the comparison)

One rank (``--nproc-per-node 1``) runs the model unsharded: the 1-GPU baseline of the scaling ratios.
Per config and batch (``--batch``, default 1,8): decode tok/s over a static cache (gpt-fast's tight loop,
``--mode``, default ``reduce-overhead`` on CUDA), GPU time per step (profiler), the rank's bytes floor (its
weights but the embedding and its KV-cache share over a device-to-device copy's bandwidth measured in the
same run), the all-reduce kernels' time per call, fused subgraphs per rank (none may stay unfused), logits
error against the same sharded model in eager, peak memory per rank; and per config the time to first token
of a 1 x ``--prompt-len`` prefill (compiled, mode default; ``--prompt-len 0`` skips it).  Times are the
slowest rank's.  Each invocation writes ``--out``/results_tp_<n>gpu.json; ``--merge`` combines them into
results_tp.{json,md,png} (ratios to fp16 on as many GPUs, and to the config's own 1-GPU run).

    torchrun --nproc-per-node 2 benchmarks/bench_tp.py --model llama-3-70b --out DIR     # 2 GPUs, NCCL
    torchrun --nproc-per-node 1 benchmarks/bench_tp.py --model llama-3-70b --configs awq-g128 --out DIR
    python benchmarks/bench_tp.py --merge DIR/results_tp_*gpu.json --out benchmarks
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
from llama_shapes import MODELS, build_layerwise, step_bytes  # noqa: E402

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
    ap.add_argument("--batch", default="1,8", help="decode batch sizes (comma list)")
    ap.add_argument("--prof-steps", type=int, default=None, help="profiled decode steps for the GPU time (8; quick 2)")
    ap.add_argument("--warmup", type=int, default=None, help="decode steps before timing (5; quick 2)")
    ap.add_argument("--prompt-len", type=int, default=None, help="prefill prompt (2048; quick 32; 0: no prefill)")
    ap.add_argument("--prefill-reps", type=int, default=None, help="timed prefills (5; quick 1)")
    ap.add_argument("--mode", default=None, help="decode compile mode (reduce-overhead on CUDA, default on CPU)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=None, help="directory for results_tp.{json,md} (default: print only)")
    ap.add_argument("--append", action="store_true",
                    help="add to the configs of --out's results_tp_<n>gpu.json (a run split over invocations)")
    ap.add_argument("--merge", nargs="+", default=None, metavar="JSON",
                    help="no run: combine results_tp_<n>gpu.json files into --out's results_tp.{json,md,png}")
    args = ap.parse_args(argv)
    big = not (args.quick and args.device == "cpu")
    shapes = MODELS[args.model]
    dims = dict(hidden=shapes["hidden"], intermediate=shapes["intermediate"], heads=shapes["heads"],
                kv_heads=shapes["kv_heads"], vocab=128256) if big else \
        dict(hidden=256, intermediate=512, heads=4, kv_heads=2, vocab=512)
    for k, v in dims.items():
        setattr(args, k, v)
    args.layerwise = args.layerwise or args.model == "llama-3-70b"
    quick = dict(layers=2, context=16, steps=4, warmup=2, prompt_len=32, prefill_reps=1, prof_steps=2)
    full = dict(layers=shapes["layers"], context=512, steps=128, warmup=5, prompt_len=2048, prefill_reps=5,
                prof_steps=8)
    for k, v in (quick if args.quick else full).items():
        if getattr(args, k) is None:
            setattr(args, k, v)
    if args.mode is None:
        args.mode = "reduce-overhead" if args.device == "cuda" else "default"
    args.dtype = getattr(torch, args.dtype)
    args.batches = [int(b) for b in args.batch.split(",") if b.strip()]
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


def profile_decode(run, steps: int) -> dict:
    """GPU time per decode step (the profiler's device-side kernel time over ``steps`` steps, CUDA-graph
    replays included) and the all-reduce kernels' share of it."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        run(steps)
        torch.cuda.synchronize()
    kernels = [e for e in prof.key_averages() if getattr(e, "device_type", None) == DeviceType.CUDA]

    def us(e):
        return getattr(e, "self_device_time_total", None) or getattr(e, "self_cuda_time_total", 0.0)

    reduce = [e for e in kernels if any(k in e.key.lower() for k in ("allreduce", "all_reduce"))]
    return dict(gpu_ms_per_step=sum(us(e) for e in kernels) / 1e3 / steps,
                all_reduce_us_per_step=sum(us(e) for e in reduce) / steps,
                all_reduce_calls_per_step=sum(e.count for e in reduce) / steps,
                all_reduce_kernels=sorted({e.key[:80] for e in reduce}),
                top_kernels=[dict(name=e.key[:80], us_per_step=us(e) / steps, calls_per_step=e.count / steps)
                             for e in sorted(kernels, key=us, reverse=True)[:10]])


def run_config(name: str, args, dev: torch.device, group) -> dict:
    from compile_backend.quantize import quantize_model
    from compile_backend.tensor_parallel import tensor_parallel

    scheme, _, variant = name.partition("@")
    if variant not in ("", "nccl"):
        raise ValueError(f"config {name!r}: unknown variant {variant!r}; expected '<scheme>' or '<scheme>@nccl'")
    world = dist.get_world_size()
    r = {"name": name, "world": world, "all_reduce": "nccl" if variant or world == 1 else "symm_mem"}
    t0 = time.perf_counter()
    if dev.type == "cuda":
        torch.cuda.reset_peak_memory_stats(dev)

    def quantize_and_shard(module):
        if scheme != args.dense:
            quantize_model(module, scheme)
        if world > 1:  # one rank holds the whole model: nothing to shard, no all-reduce
            # The plan's patterns name a layer's linears under a parent ("*.self_attn.q_proj").
            tensor_parallel(torch.nn.ModuleDict({"layer": module}) if args.layerwise else module, group,
                            low_latency=not variant)
        return module

    if args.layerwise:
        model = build_model(args, dev, quantize_and_shard)
    else:
        model = quantize_and_shard(build_model(args, dev))
    r["build_s"] = time.perf_counter() - t0
    r["weights_gb_per_rank"] = sum(t.numel() * t.element_size() for t in [*model.parameters(), *model.buffers()]) / 1e9
    backend = "inductor" if scheme == args.dense else "quantfuse"
    r["backend"] = backend
    ck = cache_kwarg(model)
    timer = Timer(dev)
    gen = torch.Generator().manual_seed(args.seed)
    r["decode"] = {}
    for B in args.batches:
        torch._dynamo.reset()
        if dev.type == "cuda":
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats(dev)
        d = r["decode"][f"b{B}"] = decode(model, B, args, dev, gen, ck, timer, backend)
        log(f"{name} batch {B}: {d['tok_per_s']:.1f} tok/s ({d['ms_per_step']:.2f} ms/step"
            + (f", GPU {d['gpu_ms_per_step']:.2f}, floor {d['floor_ms']:.2f}, all-reduce "
               f"{d['all_reduce_us_per_call']:.1f} us/call" if "gpu_ms_per_step" in d else "")
            + f"), fused {d['fused']} per rank, unfused {len(d['unfused'])}, logits err {d['logits_err']:.3g}, "
            f"peak {d.get('peak_gb', float('nan')):.2f} GB"
            + (f"; CUDA graphs skipped {d['cudagraph_skips']}x" if d["cudagraph_skips"] else ""))
    if args.prompt_len:
        r["prefill_ms"] = prefill(model, args, dev, gen, ck, timer, backend)
        log(f"{name}: prefill 1 x {args.prompt_len}: {r['prefill_ms']:.2f} ms")
    model = None
    if dev.type == "cuda":
        torch.cuda.empty_cache()
    return r


def decode(model, B, args, dev, gen, ck, timer, backend) -> dict:
    """Decode at batch ``B`` over a static cache: tok/s, GPU time and its floor, fused counts, logits error."""
    from torch._dynamo.utils import counters
    from transformers import StaticCache

    from compile_backend.passes import collecting_report

    r = {"batch": B}
    cache = StaticCache(config=model.config, max_cache_len=args.context + args.warmup + args.steps
                        + args.prof_steps + 8)
    prompt = torch.randint(0, args.vocab, (B, args.context), generator=gen).to(dev)

    def call(fn, tok, pos):
        return fn(input_ids=tok, position_ids=pos, use_cache=True, **{ck: cache}).logits

    step_fn = torch.compile(model.forward, backend=backend, dynamic=False,
                            mode=None if args.mode == "default" else args.mode)

    def prefill_cache():  # the cache keeps its own count of positions: a step is compared from the same state
        cache.reset()
        positions = torch.arange(args.context, device=dev).unsqueeze(0).expand(B, -1)
        return call(model.forward, prompt, positions)[:, -1:].argmax(-1)

    with torch.no_grad():
        tok = prefill_cache()
        pos = torch.full((B, 1), args.context, device=dev, dtype=torch.long)
        ref = call(model.forward, tok, pos).float()
        prefill_cache()
        counters.clear()
        with collecting_report() as report:
            logits, r["first_call_s"] = timer(lambda: call(step_fn, tok, pos))
        r["logits_err"] = rel_err(logits, ref)
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
        r["ms_per_step"] = wall * 1e3 / args.steps
        r["tok_per_s"] = B * args.steps / wall
        if dev.type == "cuda":
            r["peak_gb"] = torch.cuda.max_memory_allocated(dev) / 1e9
            if args.prof_steps:
                r.update(profile_decode(steps, args.prof_steps))
                r["all_reduce_us_per_call"] = (r["all_reduce_us_per_step"] / r["all_reduce_calls_per_step"]
                                               if r["all_reduce_calls_per_step"] else 0.0)
                heads = model.config.num_key_value_heads // dist.get_world_size()
                r["bytes_per_step"] = step_bytes(model, B, args.context + args.warmup + args.steps / 2, kv_heads=heads)
                r["floor_ms"] = r["bytes_per_step"] / args.copy_bw * 1e3
                r["floor_over_gpu"] = r["floor_ms"] / r["gpu_ms_per_step"]
    return r


def prefill(model, args, dev, gen, ck, timer, backend) -> float:
    """Time to first token of a 1 x ``args.prompt_len`` prompt, compiled (mode default), median ms."""
    from transformers import StaticCache

    cache = StaticCache(config=model.config, max_cache_len=args.prompt_len + 8)
    ids = torch.randint(0, args.vocab, (1, args.prompt_len), generator=gen).to(dev)
    positions = torch.arange(args.prompt_len, device=dev).unsqueeze(0)
    torch._dynamo.reset()
    prefill_fn = torch.compile(model.forward, backend=backend, dynamic=False)

    def first_token(fn):
        return fn(input_ids=ids, position_ids=positions, use_cache=True, logits_to_keep=1,
                  **{ck: cache}).logits[:, -1].argmax(-1)

    with torch.no_grad():
        cache.reset()
        timer(lambda: first_token(prefill_fn))
        times = []
        for i in range(args.prefill_reps + 1):
            cache.reset()
            _, dt = timer(lambda: first_token(prefill_fn))
            if i:
                times.append(dt)
    return statistics.median(times) * 1e3


def _rows(runs: list):
    """(run, config name, batch key, decode record) of every decode measurement."""
    for run in runs:
        for name, r in run["configs"].items():
            for key, d in r.get("decode", {}).items():
                yield run, name, key, d


def render_md(merged: dict) -> str:
    runs = sorted(merged["runs"], key=lambda run: run["meta"]["world"])
    m = runs[0]["meta"]
    nan = float("nan")
    # (world, config, batch) -> tok/s; (scheme, batch) -> its 1-GPU tok/s
    tps = {(run["meta"]["world"], name, key): d["tok_per_s"] for run, name, key, d in _rows(runs)}
    lines = [f"# Tensor parallel: {m['layers']}-layer Llama ({m['model']} shapes: hidden {m['hidden']}, intermediate "
             f"{m['intermediate']}, {m['heads']}/{m['kv_heads']} heads, vocab {m['vocab']}), random weights", ""]
    for run in runs:
        r = run["meta"]
        lines.append(f"- {r['world']} x {r['device']}, {r.get('date', '')}; torch {r['torch']}; copy bandwidth "
                     f"{(r.get('copy_bw') or nan) / 1e12:.2f} TB/s; `{r['argv']}`"
                     + (f" (figures from {r['source']})" if r.get("source") else ""))
    lines += [f"- decode: context {m['context']}, {m['steps']} timed steps (tight loop, mode `{m['mode']}`), GPU time "
              "from the profiler over the profiled steps; floor = the bytes a rank's step reads (its weights but the "
              "embedding, its KV-cache share) over the copy bandwidth; all-reduce: the all-reduce kernels' GPU time "
              "per call (a kernel that waits for the slowest rank counts the wait); "
              + (f"prefill 1 x {m['prompt_len']} (first token included); " if m["prompt_len"] else "prefill not run; ")
              + "times of the slowest rank; "
              "`@nccl`: every all-reduce through NCCL", "",
              f"| GPUs | config | batch | tok/s | x {m['dense']} (same GPUs) | x own 1 GPU | ms/step | GPU ms | "
              "floor ms | floor/GPU | all-reduce µs/call | prefill ms | fused/rank | unfused | logits err | GB/rank | "
              "peak GB |",
              "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for run in runs:
        world, dense = run["meta"]["world"], run["meta"]["dense"]
        for name, r in run["configs"].items():
            if "error" in r:
                lines.append(f"| {world} | {name} | | error: {r['error'][:200]} |" + " |" * 13)
                continue
            for key, d in r.get("decode", {}).items():
                base = tps.get((world, dense, key), nan)
                own = tps.get((1, name.partition("@")[0], key), nan)
                lines.append(
                    f"| {world} | {name} | {d['batch']} | {d['tok_per_s']:.1f} | {d['tok_per_s'] / base:.2f} | "
                    f"{d['tok_per_s'] / own:.2f} | {d['ms_per_step']:.2f} | {d.get('gpu_ms_per_step', nan):.2f} | "
                    f"{d.get('floor_ms', nan):.2f} | {d.get('floor_over_gpu', nan):.2f} | "
                    f"{d.get('all_reduce_us_per_call', nan):.1f} | {r.get('prefill_ms', nan):.1f} | {d['fused']} | "
                    f"{len(d['unfused'])} | {d['logits_err']:.2e} | {r.get('weights_gb_per_rank', nan):.2f} | "
                    f"{d.get('peak_gb', nan):.2f} |")
    return "\n".join(lines) + "\n"


def render_png(merged: dict, path: str) -> None:
    """tok/s per config against the number of GPUs, batch 1 and 8."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    rows = list(_rows(merged["runs"]))
    batches = sorted({d["batch"] for *_, d in rows})
    fig, axes = plt.subplots(1, len(batches), figsize=(6 * len(batches), 4), squeeze=False)
    for ax, b in zip(axes[0], batches):
        by = {}
        for run, name, _, d in rows:
            if d["batch"] == b:
                by.setdefault(name, []).append((run["meta"]["world"], d["tok_per_s"]))
        for name, pts in sorted(by.items()):
            pts.sort()
            ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=name)
        ax.set_xlabel("GPUs")
        ax.set_ylabel("tok/s")
        ax.set_title(f"decode, batch {b}")
        ax.set_xticks(sorted({w for pts in by.values() for w, _ in pts}))
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def merge(paths: list, out: str) -> dict:
    """Runs of several invocations (``results_tp_<n>gpu.json``) into ``out``/results_tp.{json,md,png}; a
    later file's configs replace an earlier one's of the same number of GPUs."""
    by_world = {}
    for path in paths:
        with open(path) as f:
            data = json.load(f)
        for run in data.get("runs", [data]):
            world = run["meta"]["world"]
            if world in by_world:
                by_world[world]["configs"].update(run["configs"])
            else:
                by_world[world] = run
    merged = {"runs": [by_world[w] for w in sorted(by_world)]}
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, "results_tp.json"), "w") as f:
        json.dump(merged, f, indent=1)
    with open(os.path.join(out, "results_tp.md"), "w") as f:
        f.write(render_md(merged))
    render_png(merged, os.path.join(out, "results_tp.png"))
    return merged


def main(argv=None):
    args = parse_args(argv)
    if args.merge:
        print(render_md(merge(args.merge, args.out or ".")), flush=True)
        return 0
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

    args.copy_bw = None
    if args.device == "cuda":
        from timing import copy_bandwidth

        args.copy_bw = copy_bandwidth()
    world = dist.get_world_size()
    args.dense = "fp16" if args.dtype == torch.float16 else "bf16" if args.dtype == torch.bfloat16 else "dense"
    configs = [c.strip() for c in args.configs.split(",") if c.strip()]
    configs = [args.dense if c in ("fp16", "bf16", "dense") else c for c in configs]
    res = {"meta": dict(world=world, model=args.model, layerwise=args.layerwise, layers=args.layers,
                        hidden=args.hidden, intermediate=args.intermediate, heads=args.heads, kv_heads=args.kv_heads,
                        vocab=args.vocab, context=args.context, steps=args.steps, prompt_len=args.prompt_len,
                        mode=args.mode, dense=args.dense, torch=torch.__version__, argv=" ".join(sys.argv),
                        copy_bw=args.copy_bw, date=time.strftime("%Y-%m-%d"),
                        device=torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu"),
           "configs": {}}
    path = os.path.join(args.out or "", f"results_tp_{world}gpu.json")
    if args.append and args.out and os.path.exists(path):
        with open(path) as f:
            res["configs"] = json.load(f)["configs"]
    group = dist.group.WORLD
    for name in configs:
        log(f"{name}: build, quantize, shard over {world} ranks")
        try:
            res["configs"][name] = run_config(name, args, dev, group)
        except Exception as exc:  # the others still run; the error is in the table
            res["configs"][name] = {"name": name, "error": f"{type(exc).__name__}: {exc}"}
            print(f"[rank {dist.get_rank()}] {name} failed: {type(exc).__name__}: {exc}", file=sys.stderr, flush=True)
        if dist.get_rank() == 0 and args.out:
            os.makedirs(args.out, exist_ok=True)
            with open(path, "w") as f:
                json.dump(res, f, indent=1)
    if dist.get_rank() == 0:
        print(render_md({"runs": [res]}), flush=True)
    failed = [n for n, r in res["configs"].items()
              if "error" in r or any(d.get("unfused") for d in r.get("decode", {}).values())]
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
