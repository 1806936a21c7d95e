"""transformers' RMSNorm stored in an act-order layer's input order: ``quantfuse::add_rms_norm_ordered``
(Triton) against what Inductor makes of the same code (the residual add, the RMSNorm and
``AWQLinear``'s scatter in one kernel), and against Inductor's RMSNorm without the order (what the
same step costs a model without act-order).

Each is captured in a CUDA graph of 64 calls (a 32-layer decode step has 64 such norms), each on its
own tensors, and timed per call: the median of the graph's replays (CUDA events).  Llama-3-8B's hidden
size (4096), fp16.  Also checks the op against the float64 computation.

    python benchmarks/bench_rms_norm_ordered.py [--batch 1,8] [--out DIR] [--sweep]

``--sweep``: instead, the kernel's launch (values per program, values per step of the sum of squares,
warps) varied around the op's, each timed the same way; prints the best per batch.
"""

from __future__ import annotations

import argparse
import itertools
import os
import sys

import torch

import compile_backend  # noqa: F401  (registers the op)

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from timing import graph_us, write_rows  # noqa: E402

CALLS = 64
K = 4096


def make_calls(b: int):
    g = torch.Generator(device="cuda").manual_seed(b)
    weight = (1 + 0.1 * torch.randn(K, device="cuda", generator=g)).half()
    order = torch.randperm(K, device="cuda", generator=g)
    return [(torch.randn(b, 1, K, device="cuda", generator=g).half(),
             torch.randn(b, 1, K, device="cuda", generator=g).half(), weight, 1e-5, order) for _ in range(CALLS)]


def transformers_form(x, residual, weight, eps, order, ordered=True):
    s = x + residual
    h = s.to(torch.float32)
    n = weight * (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)).to(s.dtype)
    return (torch.empty_like(n).index_copy_(-1, order, n) if ordered else n), s


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--batch", default="1,8")
    ap.add_argument("--out", default=os.path.dirname(os.path.abspath(__file__)))
    ap.add_argument("--sweep", action="store_true", help="time the kernel's launch variants (module doc)")
    args = ap.parse_args()
    print(f"{torch.cuda.get_device_name()}; torch {torch.__version__}")
    if args.sweep:
        return sweep(args)
    op = torch.ops.quantfuse.add_rms_norm_ordered
    inductor = torch.compile(transformers_form)
    plain = torch.compile(lambda *a: transformers_form(*a, ordered=False))
    rows = []
    print("| B | quantfuse µs | Inductor, with the order µs | Inductor, without the order µs | err (float64) |")
    print("|---|---|---|---|---|")
    for b in (int(x) for x in args.batch.split(",")):
        calls = make_calls(b)
        x, r, w, eps, order = calls[0]
        s = (x + r).double()
        want = (w.double() * s * torch.rsqrt(s.pow(2).mean(-1, keepdim=True) + eps))[..., torch.argsort(order)]
        err = ((op(*calls[0])[0].double() - want).norm() / want.norm()).item()
        row = dict(batch=b, ours_us=graph_us(op, calls), inductor_us=graph_us(inductor, calls),
                   inductor_unordered_us=graph_us(plain, calls), err=err)
        rows.append(row)
        print(f"| {b} | {row['ours_us']:.2f} | {row['inductor_us']:.2f} | {row['inductor_unordered_us']:.2f} "
              f"| {err:.1e} |", flush=True)
    write_rows(args.out, "results_rms_norm_ordered.json", rows)


def sweep(args) -> None:
    from compile_backend.ops import rms_norm_ordered_triton as kernels

    op_launch = (kernels.BLOCK, kernels.RBLOCK, kernels.NUM_WARPS)
    rows = []
    for b in (int(x) for x in args.batch.split(",")):
        calls = make_calls(b)
        want = kernels.rms_norm_ordered_triton(*calls[0])
        times = {}
        for launch in itertools.product((128, 256, 512, 1024), (512, 1024, 2048, 4096), (1, 2, 4, 8)):
            block, rblock, warps = launch
            run = lambda *a, block=block, rblock=rblock, warps=warps: kernels.rms_norm_ordered_triton(  # noqa: E731
                *a, block=block, rblock=rblock, num_warps=warps)
            got = run(*calls[0])
            if not (torch.equal(got[1], want[1]) and torch.allclose(got[0].float(), want[0].float(), atol=2e-3)):
                raise SystemExit(f"B={b} {launch}: result differs from the op's launch")
            times[launch] = graph_us(run, calls)
        best = min(times, key=times.get)
        rows.append(dict(batch=b, op_us=times[op_launch], best_us=times[best], best=best,
                         all={str(k): t for k, t in times.items()}))
        print(f"B={b}: the op's launch {op_launch} {times[op_launch]:.2f} µs, best {best} {times[best]:.2f} µs",
              flush=True)
    write_rows(args.out, "results_rms_norm_ordered_sweep.json", rows)


if __name__ == "__main__":
    main()
