"""All-reduce latency by size: NCCL against torch's symmetric-memory one-shot and two-shot (the copy into
the registered buffer included) and ``quantfuse::symm_all_reduce`` itself (the algorithm it picks by size
and dtype; float16 through our own one-shot kernel, which torch's kernels do not take), inside CUDA graphs,
one process per GPU; the thresholds of compile_backend/all_reduce.py come from these crossovers.

Per size: a CUDA graph of ``--calls`` all-reduces in a chain (each reads the previous result, as a
decoder's layers do), replayed ``--reps`` times; µs per all-reduce is the median replay over the calls,
slowest rank.  Results to ``--out``/results_all_reduce_<world>[_<dtype> unless bfloat16].{json,md}.

    torchrun --nproc-per-node 2 benchmarks/bench_all_reduce.py --out DIR
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

SIZES_KB = (2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096)


def one_shot(buf, x, name):
    staged = buf.view(x.dtype)[: x.numel()].view(x.shape)
    return torch.ops.symm_mem.one_shot_all_reduce_copy(staged, x, "sum", name)


def two_shot(buf, x, name):
    staged = buf.view(x.dtype)[: x.numel()].view(x.shape)
    staged.copy_(x)
    return torch.ops.symm_mem.two_shot_all_reduce_out(staged, "sum", name, torch.empty_like(x))


def nccl(group):
    def run(buf, x, name):
        y = x.clone()
        dist.all_reduce(y, group=group)
        return y
    return run


def quantfuse_op(buf, x, name):
    return torch.ops.quantfuse.symm_all_reduce(x, name)


LABELS = ("nccl", "one_shot", "two_shot", "quantfuse")


def time_graph(fn, x, calls: int, reps: int) -> float:
    """Median µs per call of a CUDA graph of ``calls`` chained calls of ``fn``, the slowest rank's."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        y = x
        for _ in range(3):  # warm-up outside the graph (NCCL's and symm_mem's lazy set-up)
            y = fn(x)
    torch.cuda.current_stream().wait_stream(stream)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        y = x
        for _ in range(calls):
            y = fn(y * 0.5)  # the halving keeps fp16 sums finite over the chain
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        dist.barrier()
        torch.cuda.synchronize()
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / calls)
    t = torch.tensor([statistics.median(times)], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t)


def fmt(us: float | None) -> str:
    return "—" if us is None else f"{us:.2f}"


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--calls", type=int, default=50)
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
    local = int(os.environ.get("LOCAL_RANK", "0"))
    dev = torch.device("cuda", local)
    torch.cuda.set_device(dev)
    dist.init_process_group("cuda:nccl,cpu:gloo", device_id=dev)
    from torch.distributed import _symmetric_memory as symm_mem

    from compile_backend import all_reduce

    group = dist.group.WORLD
    name = group.group_name
    dtype = getattr(torch, args.dtype)
    buf = symm_mem.empty(max(SIZES_KB) * 1024, dtype=torch.uint8, device=dev)
    symm_mem.rendezvous(buf, name)
    if not all_reduce.enable(group, dev):
        raise SystemExit("bench_all_reduce: quantfuse's symmetric-memory all-reduce is not available here")
    rows = []
    for kb in SIZES_KB:
        n = kb * 1024 // torch.empty((), dtype=dtype).element_size()
        x = torch.randn(n, device=dev, dtype=dtype)
        row = {"kb": kb}
        for label, fn in zip(LABELS, (nccl(group), one_shot, two_shot, quantfuse_op)):
            if label == "quantfuse" and not all_reduce.fits(x):
                row[label] = None  # NCCL would run: the same as the first column
                continue
            try:
                row[label] = time_graph(lambda t, fn=fn: fn(buf, t, name), x, args.calls, args.reps)
            except RuntimeError as exc:  # torch's kernels refuse float16
                row[label] = None
                if dist.get_rank() == 0 and kb == SIZES_KB[0]:
                    print(f"{label}: {str(exc).splitlines()[0]}", flush=True)
        rows.append(row)
        if dist.get_rank() == 0:
            print(f"{kb:6d} KB  " + "  ".join(f"{k} {fmt(row[k])}" for k in LABELS), flush=True)
    world = dist.get_world_size()
    if dist.get_rank() == 0 and args.out:
        os.makedirs(args.out, exist_ok=True)
        suffix = "" if args.dtype == "bfloat16" else f"_{args.dtype}"
        meta = dict(world=world, device=torch.cuda.get_device_name(dev), torch=torch.__version__,
                    dtype=args.dtype, calls=args.calls, reps=args.reps, argv=" ".join(sys.argv))
        with open(os.path.join(args.out, f"results_all_reduce_{world}{suffix}.json"), "w") as f:
            json.dump({"meta": meta, "rows": rows}, f, indent=1)
        lines = [f"# All-reduce inside CUDA graphs, {world} x {meta['device']}, {args.dtype}", "",
                 f"torch {meta['torch']}; µs per all-reduce (median of {args.reps} replays of {args.calls} "
                 "chained calls, slowest rank; each with the small scaling kernel that chains it to the previous "
                 "one); `" + meta["argv"] + "`", "",
                 "| KB | NCCL | one-shot | two-shot | quantfuse::symm_all_reduce | best of the first three |",
                 "|---|---|---|---|---|---|"]
        for r in rows:
            best = min((k for k in LABELS[:3] if r[k] is not None), key=lambda k: r[k])
            lines.append(f"| {r['kb']} | " + " | ".join(fmt(r[k]) for k in LABELS) + f" | {best} |")
        with open(os.path.join(args.out, f"results_all_reduce_{world}{suffix}.md"), "w") as f:
            f.write("\n".join(lines) + "\n")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
    sys.stdout.flush()
    os._exit(0)
