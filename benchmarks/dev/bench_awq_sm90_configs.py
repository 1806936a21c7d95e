"""The AWQ SM90 prefill kernel's tile configurations, each forced, against fp16 cuBLAS.

    python benchmarks/dev/bench_awq_sm90_configs.py [--ms 192,256,...] [--configs 0,1,...] [--repeats 2]
                                                    [--shapes 4096x14336,...] [--fresh-x]

One line per (shape, M): the kernel's own choice ("auto"), each configuration forced through
``_awq_gemm_sm90_cuda(..., config=c)`` on the weight prepared once (``_awq_prepare_sm90_cuda``),
and fp16 cuBLAS on a dense weight, in µs (median of rotating CUDA-graph replays,
benchmarks/timing.py).  fp16, group 128, bench_awq.py's shapes and input sets.  By default one x
per M serves every weight set (x may stay in L2 between calls); ``--fresh-x`` gives each input
set its own x, as bench_awq.py does (what a model's layers see).  ``--repeats`` times every row
that many times, interleaved (the spread between repeats is the noise).  The last lines give
each configuration's time per wave (median over the rows of time / whole waves of its tiles, at
K = 4096): the starting point of the per-wave times in ``choose_config``
(csrc/awq_gemm/awq_gemm_sm90_choice.h), which are then adjusted to the choices that minimise the
summed time over a sweep of all configurations with --fresh-x (stream-K configurations count
fractional waves plus a fixed fixup).
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

# benchmarks/ for bench_awq.py and timing.py (this probe lives in benchmarks/dev/), and the repository root.
BENCHMARKS = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, BENCHMARKS)
sys.path.insert(0, os.path.dirname(BENCHMARKS))

from bench_awq import DEV, SHAPES, G, make_set, weight_bytes  # noqa: E402
from timing import copies_for, load_kernels, rotating  # noqa: E402

# rows x tokens of each configuration's tile (csrc/awq_gemm/awq_gemm_sm90_choice.h: kCosts)
TILES = {0: (64, 128), 1: (64, 128), 2: (64, 256), 3: (128, 256), 4: (128, 128), 5: (64, 160), 6: (64, 192),
         7: (64, 224), 8: (128, 160), 9: (128, 192), 10: (128, 224), 11: (128, 256), 12: (128, 192),
         13: (64, 64)}
SMS = 132


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--ms", default="192,256,320,384,448,512,640,768,1024")
    ap.add_argument("--configs", default=",".join(str(c) for c in TILES))
    ap.add_argument("--repeats", type=int, default=1)
    ap.add_argument("--shapes", default="all", help="NxK,... (default: bench_awq's four shapes)")
    ap.add_argument("--fresh-x", action="store_true", help="each input set its own x, as bench_awq.py")
    args = ap.parse_args()
    shapes = SHAPES if args.shapes == "all" else [tuple(map(int, s.split("x"))) for s in args.shapes.split(",")]
    configs = [int(c) for c in args.configs.split(",")]
    per_wave = {c: [] for c in configs}
    if not torch.cuda.is_available() or torch.cuda.get_device_capability() != (9, 0):
        print("needs a Hopper (sm_90) GPU", file=sys.stderr)
        return 1
    load_kernels()
    if not hasattr(torch.ops.quantfuse, "_awq_gemm_sm90_cuda"):
        print("the SM90 AWQ kernel is not built", file=sys.stderr)
        return 1
    gemm = torch.ops.quantfuse._awq_gemm_sm90_cuda
    gen = torch.Generator(device=DEV).manual_seed(0)
    print(f"GPU {torch.cuda.get_device_name()}, torch {torch.__version__}; fp16, group {G}, µs", flush=True)
    for N, K in shapes:
        # (qweight, scales, qzeros) of bench_awq's input sets; x is made per M below
        sets = [make_set(1, N, K, gen)[1:] for _ in range(copies_for(weight_bytes(N, K)))]
        # each set's weight prepared once, as the op's dispatch keeps it
        prepared = [torch.ops.quantfuse._awq_prepare_sm90_cuda(*s, G) for s in sets]
        dense = [torch.randn(N, K, device=DEV).half() for _ in range(copies_for(N * K * 2))]
        for _ in range(args.repeats):
            for M in (int(m) for m in args.ms.split(",")):
                xs = [torch.randn(M, K, device=DEV).half() for _ in range(max(len(sets), len(dense)))]
                if not args.fresh_x:
                    xs = [xs[0]] * len(xs)
                auto = torch.ops.quantfuse._awq_sm90_config(M, N, K, G, SMS)
                t = {c: rotating([lambda x=x, p=p, c=c: gemm(x, *p, G, None, c)
                                  for x, p in zip(xs, prepared)])
                     for c in [-1] + configs}
                cublas = rotating([lambda x=x, w=w: x @ w.t() for x, w in zip(xs, dense)])
                best = min(configs, key=lambda c: t[c])
                for c in configs:
                    rows, tokens = TILES[c]
                    tiles = -(-N // rows) * -(-M // tokens)
                    per_wave[c].append(t[c] / -(-tiles // SMS) * 4096 / K)
                print(f"N={N:5d} K={K:5d} M={M:4d} auto(c{auto}) {t[-1]:7.1f} | "
                      + " ".join(f"c{c} {t[c]:7.1f}" for c in configs)
                      + f" | cuBLAS {cublas:7.1f} -> best c{best} {cublas / t[best]:.2f}x cuBLAS,"
                      f" auto {cublas / t[-1]:.2f}x", flush=True)
        del sets, prepared, dense
    for c in configs:
        v = sorted(per_wave[c])
        print(f"config {c} {TILES[c]}: µs per wave at K=4096, median {v[len(v) // 2]:.1f}, "
              f"min {v[0]:.1f}, max {v[-1]:.1f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
