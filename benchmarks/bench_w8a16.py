"""W8A16 (int8 weight-only) GEMM benchmark: quantfuse against what a user runs instead, in one run.

For (N, K) in ``SHAPES`` and M in ``MS`` (decode 1-16, then prefill):

* ours          torch.ops.quantfuse.w8a16_gemm (dispatch: the decode kernel for M <= 64 and
                K % 16 == 0, else cast + cuBLAS + epilogue)
* ours_decode   the decode kernel alone (M <= 256: slices of 16 tokens)
* ours_prefill  the cast + cuBLAS (float32 result) + epilogue path alone
* torchao_eager torchao's Int8WeightOnlyConfig eager computation, written out:
                ``mm(x, w.t().to(dt)) * s.to(dt)`` (what its Int8Tensor linear runs, CPU and CUDA)
* mm_fp16       ``x @ w.t()`` on the same weight in the activation dtype (cuBLAS), the
                unquantized baseline

Activations in ``--dtype`` (bfloat16 by default), per-channel float32 scales, with bias.  Each
timed call runs in a CUDA graph that loops over enough input copies (weights included) to exceed
twice the 50 MB L2 (benchmarks/timing.py ``rotating``), so no call reads a weight left in L2 by
the previous one; host launch overhead is excluded for every path alike.  GB/s counts the bytes a
call must move at least: its weight (int8 for ours and torchao, 2-byte for mm_fp16), scales,
bias, activations and output, once; ``%peak`` is that over ``PEAK_TBS`` (H100 SXM HBM3).

    PYTHONPATH=. python benchmarks/bench_w8a16.py --out DIR [--dtype float16] [--ms 1,16] [--shapes 4096x4096]
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

import compile_backend  # noqa: E402,F401

sys.path.insert(0, os.path.dirname(__file__))
from timing import copies_for, load_kernels, rotating  # noqa: E402

SHAPES = ((4096, 4096), (14336, 4096), (4096, 14336))  # (N, K)
MS = (1, 2, 4, 8, 16, 17, 32, 64, 128, 512, 2048)
DEV = "cuda"
PEAK_TBS = 3.35
DECODE_KERNEL_MAX_M = 256  # the decode kernel called directly: csrc/w8a16_gemm/w8a16_gemm_ops.cpp
PATHS = ("ours", "ours_decode", "ours_prefill", "torchao_eager", "mm_fp16")


def make_set(M, N, K, dtype, gen):
    x = torch.randn(M, K, generator=gen, device=DEV).to(dtype)
    w = torch.randint(-128, 128, (N, K), generator=gen, device=DEV, dtype=torch.int8)
    s = torch.rand(N, generator=gen, device=DEV) * 2e-3 + 1e-4
    b = torch.randn(N, generator=gen, device=DEV).to(dtype)
    return x, w, s, b


def min_bytes(path, M, N, K, esize):
    weight = N * K * (esize if path == "mm_fp16" else 1) + (0 if path == "mm_fp16" else 4 * N)
    return weight + N * esize + M * K * esize + M * N * esize


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=None, help="folder for bench_w8a16.json and results_w8a16.md")
    ap.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float16"))
    ap.add_argument("--ms", default=",".join(map(str, MS)))
    ap.add_argument("--shapes", default="all", help="all, or NxK[,NxK...]")
    ap.add_argument("--sweep", action="store_true",
                    help="time the decode kernel under forced work splits (warps x cluster splits) instead")
    args = ap.parse_args()
    dtype = getattr(torch, args.dtype)
    esize = torch.tensor([], dtype=dtype).element_size()
    ms = [int(m) for m in args.ms.split(",")]
    shapes = SHAPES if args.shapes == "all" else [tuple(map(int, s.split("x"))) for s in args.shapes.split(",")]
    load_kernels()
    gen = torch.Generator(device=DEV).manual_seed(0)
    ops = torch.ops.quantfuse
    if args.sweep:
        return sweep(shapes, [m for m in ms if m <= DECODE_KERNEL_MAX_M], dtype, gen)
    rows = []
    for N, K in shapes:
        for M in ms:
            copies = copies_for(N * K * (1 + esize))
            sets = [make_set(M, N, K, dtype, gen) for _ in range(copies)]
            dense = [w.to(dtype) for _, w, _, _ in sets]
            calls = {
                "ours": [lambda c=c: torch.ops.quantfuse.w8a16_gemm(*c) for c in sets],
                "ours_prefill": [lambda c=c: ops._w8a16_prefill_cuda(*c) for c in sets],
                "torchao_eager": [lambda c=c: (torch.mm(c[0], c[1].t().to(dtype)) * c[2].to(dtype)) + c[3]
                                  for c in sets],
                "mm_fp16": [lambda c=c, w=w: torch.addmm(c[3], c[0], w.t()) for c, w in zip(sets, dense)],
            }
            if M <= DECODE_KERNEL_MAX_M and K % 16 == 0:
                calls["ours_decode"] = [lambda c=c: ops._w8a16_decode_cuda(*c) for c in sets]
            row = {"N": N, "K": K, "M": M, "dtype": args.dtype}
            for path in PATHS:
                if path not in calls:
                    continue
                us = rotating(calls[path])
                gbs = min_bytes(path, M, N, K, esize) / (us * 1e-6) / 1e9
                row[path] = {"us": round(us, 2), "GB/s": round(gbs, 1), "%peak": round(100 * gbs / (PEAK_TBS * 1e3), 1)}
            del sets, dense
            rows.append(row)
            print(json.dumps(row), flush=True)
    meta = {"device": torch.cuda.get_device_name(), "torch": torch.__version__,
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "peak_TBps": PEAK_TBS, "timing": "rotating CUDA-graph replays (benchmarks/timing.py)"}
    table = ["| N x K | M | " + " | ".join(f"{p} µs (%peak)" for p in PATHS) + " | ours vs mm_fp16 | ours vs torchao |",
             "|---|---|" + "---|" * (len(PATHS) + 2)]
    for r in rows:
        cells = [f"{r[p]['us']} ({r[p]['%peak']}%)" if p in r else "-" for p in PATHS]
        vs_fp16 = r["mm_fp16"]["us"] / r["ours"]["us"]
        vs_ao = r["torchao_eager"]["us"] / r["ours"]["us"]
        table.append(f"| {r['N']} x {r['K']} | {r['M']} | " + " | ".join(cells) + f" | {vs_fp16:.2f}x | {vs_ao:.2f}x |")
    print("\n".join(table))
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "bench_w8a16.json"), "w") as f:
            json.dump({"meta": meta, "rows": rows}, f, indent=1)
        with open(os.path.join(args.out, "results_w8a16.md"), "w") as f:
            head = f"{meta['device']}, torch {meta['torch']}, {args.dtype}, {meta['date']}"
            f.write(head + "\n\n" + "\n".join(table) + "\n")


def sweep(shapes, ms, dtype, gen):
    """µs of the decode kernel per forced (warps, splits, batch), next to the automatic choice (-1s)."""
    ops = torch.ops.quantfuse
    for N, K in shapes:
        for M in ms:
            sets = [make_set(M, N, K, dtype, gen) for _ in range(copies_for(N * K))]
            line = {}
            big = 4 if M <= 8 else 2
            for warps, splits, batch in ((-1, -1, -1), (8, 1, big), (4, 1, -1), (4, 1, big), (8, 2, big)):
                line[f"w{warps}s{splits}b{batch}"] = round(
                    rotating([lambda c=c: ops._w8a16_decode_cuda(*c, splits, warps, batch) for c in sets]), 2)
            print(json.dumps({"N": N, "K": K, "M": M, **line}), flush=True)


if __name__ == "__main__":
    main()
