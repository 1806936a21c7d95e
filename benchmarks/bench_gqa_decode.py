"""One-token grouped-query attention: ``quantfuse::gqa_decode`` (Triton) against the form
``passes/gqa_decode.py`` writes without it (``scaled_dot_product_attention`` on the key/value
heads, keys and values expanded; cuDNN's kernel on Hopper), and against transformers' own form
(keys and values repeated, then the attention).

Each is captured in a CUDA graph of 32 calls, each call on its own layer's cache (as a decode
step runs 32 layers), and timed per call: the median of the graph's replays (CUDA events) over
32. Llama-3-8B heads (8 key/value heads of 4 query heads, head size 128), fp16, transformers'
float mask (0 where attended, the dtype's minimum elsewhere). Also checks each result against a
float64 reference.

    python benchmarks/bench_gqa_decode.py [--lengths 679,2048,4096] [--batch 1,8] [--out DIR]

``--sweep``: instead, the split kernel's launch (``gqa_decode_triton.Launch``: programs per SM, cache
positions per step, warps, pipeline stages) varied around the one the op uses, as a decode step runs it:
with the rotary and the cache write (``gqa_decode_rope``), each layer's cache cold (a write of twice the
L2 before each call, as the weights streamed between two layers' attentions evict it; its time, measured
alone in the same way, subtracted); each checked against the op's result; prints the best per batch and
length (results_gqa_decode_sweep.json).  The attention alone, with 32 layers' caches partly in L2, ranks
the launches otherwise (benchmarks/RESULTS.md).
"""

from __future__ import annotations

import argparse
import os
import sys

import torch
import torch.nn.functional as F

import compile_backend  # noqa: F401  (registers the op)
from compile_backend.ops.gqa_decode import gqa_decode, reference

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from timing import graph_us, write_rows  # noqa: E402

LAYERS = 32


def repeated(q, k, v, mask, scale):
    n = q.shape[1] // k.shape[1]
    rep = lambda x: x[:, :, None].expand(-1, -1, n, -1, -1).flatten(1, 2)  # noqa: E731
    return F.scaled_dot_product_attention(q, rep(k), rep(v), attn_mask=mask, scale=scale)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--lengths", default="679,2048,4096", help="cache lengths (positions attended: 3/4 of each)")
    ap.add_argument("--batch", default="1,8")
    ap.add_argument("--out", default=os.path.dirname(os.path.abspath(__file__)))
    ap.add_argument("--sweep", action="store_true", help="time the split kernel's launch variants (module doc)")
    args = ap.parse_args()
    if args.sweep:
        return sweep(args)
    dev, dtype, hkv, n, d = "cuda", torch.float16, 8, 4, 128
    scale = d ** -0.5
    rows = []
    print(f"{torch.cuda.get_device_name()}; torch {torch.__version__}")
    print("| B | L | quantfuse µs | sdpa on kv heads µs | repeated kv + sdpa µs | × sdpa on kv heads | err (float64) |")
    print("|---|---|---|---|---|---|---|")
    for b in (int(x) for x in args.batch.split(",")):
        for length in (int(x) for x in args.lengths.split(",")):
            layers = make_layers(b, length, dev, dtype, hkv, n, d)
            q, k, v, mask, _ = layers[0]
            want = repeated(q.double(), k.double(), v.double(), mask.double(), scale)
            err = ((gqa_decode(*layers[0]).double() - want).norm() / want.norm()).item()
            row = dict(batch=b, length=length, ours_us=graph_us(gqa_decode, layers),
                       sdpa_kv_heads_us=graph_us(reference, layers), repeated_us=graph_us(repeated, layers), err=err)
            rows.append(row)
            print(f"| {b} | {length} | {row['ours_us']:.1f} | {row['sdpa_kv_heads_us']:.1f} | {row['repeated_us']:.1f} "
                  f"| {row['sdpa_kv_heads_us'] / row['ours_us']:.2f}× | {err:.1e} |", flush=True)
    write_rows(args.out, "results_gqa_decode.json", rows)


def make_layers(b: int, length: int, dev="cuda", dtype=torch.float16, hkv=8, n=4, d=128):
    """LAYERS argument tuples (q, k, v, mask, scale) of Llama-3-8B heads; 3/4 of the cache attended."""
    g = torch.Generator(device=dev).manual_seed(length + b)
    mask = torch.zeros(b, 1, 1, length, device=dev, dtype=dtype)
    mask[..., length * 3 // 4:] = torch.finfo(dtype).min
    return [(torch.randn(b, hkv * n, 1, d, device=dev, dtype=dtype, generator=g),
             torch.randn(b, hkv, length, d, device=dev, dtype=dtype, generator=g),
             torch.randn(b, hkv, length, d, device=dev, dtype=dtype, generator=g), mask, d ** -0.5)
            for _ in range(LAYERS)]


def make_rope_layers(b: int, length: int, dev="cuda", dtype=torch.float16, hkv=8, n=4, d=128):
    """LAYERS argument tuples ``(q, k_cache, v_cache, mask, scale, rope)`` of ``gqa_decode_triton`` with the
    rotary and the cache write (``rope``: the new key and value, the position, cos, sin) at the last of
    the attended 3/4 of the cache."""
    g = torch.Generator(device=dev).manual_seed(length + b)
    pos = length * 3 // 4 - 1
    mask = torch.zeros(b, 1, 1, length, device=dev, dtype=dtype)
    mask[..., pos + 1:] = torch.finfo(dtype).min
    angle = torch.rand(1, 1, 1, d // 2, device=dev, generator=g) * 6
    cos, sin = (torch.cat([f(angle)] * 2, -1).to(dtype) for f in (torch.cos, torch.sin))
    position = torch.tensor([pos], device=dev)

    def randn(*shape):
        return torch.randn(*shape, device=dev, dtype=dtype, generator=g)

    return [(randn(b, hkv * n, 1, d), randn(b, hkv, length, d), randn(b, hkv, length, d), mask, d ** -0.5,
             (randn(b, hkv, 1, d), randn(b, hkv, 1, d), position, cos, sin)) for _ in range(LAYERS)]


def sweep(args) -> None:
    import itertools

    import triton

    from compile_backend.ops.gqa_decode_triton import LAUNCH as op_launch
    from compile_backend.ops.gqa_decode_triton import Launch, gqa_decode_triton

    print(f"{torch.cuda.get_device_name()}; torch {torch.__version__}; the op's launch: {op_launch}")
    flush = torch.empty(2 * torch.cuda.get_device_properties(0).L2_cache_size, dtype=torch.uint8, device="cuda")
    rows = []
    for b in (int(x) for x in args.batch.split(",")):
        for length in (int(x) for x in args.lengths.split(",")):
            layers = make_rope_layers(b, length)
            flush_us = graph_us(lambda *a: flush.zero_(), layers)
            want = gqa_decode_triton(*layers[0][:5], rope=layers[0][5])
            times = {}
            for per_sm, block, warps, stages in itertools.product((1, 2, 4, 8), (32, 64, 128), (4, 8), (1, 2, 3)):
                launch = Launch(per_sm, block, warps, stages)
                try:
                    got = gqa_decode_triton(*layers[0][:5], rope=layers[0][5], launch=launch)
                except triton.runtime.errors.OutOfResources:  # a pipeline larger than an SM's shared memory
                    continue
                if not torch.allclose(got.float(), want.float(), rtol=2e-3, atol=2e-3):
                    raise SystemExit(f"B={b} L={length} {launch}: result differs from the op's launch")

                def cold(q, k, v, mask, scale, rope, launch=launch):
                    flush.zero_()
                    gqa_decode_triton(q, k, v, mask, scale, rope=rope, launch=launch)

                times[launch] = graph_us(cold, layers) - flush_us
            best = min(times, key=times.get)
            row = dict(batch=b, length=length, op_us=times[op_launch], best_us=times[best], best=vars(best),
                       flush_us=flush_us, all={str(vars(k)): t for k, t in times.items()})
            rows.append(row)
            print(f"B={b} L={length}: the op's launch {times[op_launch]:.1f} µs, best {times[best]:.1f} µs with {best}",
                  flush=True)
    write_rows(args.out, "results_gqa_decode_sweep.json", rows)

if __name__ == "__main__":
    main()
