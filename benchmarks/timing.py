"""Timers shared by the benchmarks, and the kernels' loading.

Two ways to keep a call from reading its weight out of the 50 MB L2:

* ``rotating(calls)``: the calls (closures over distinct input sets whose bytes together
  exceed twice the L2) are captured in one CUDA graph, repeated until a replay lasts at
  least ``MIN_REPLAY_US``; the median replay time (CUDA events, no flush between replays) is
  divided by the number of calls.  This is what a model sees (each layer reads weights no
  one read recently, the lines left in L2 are clean) and it excludes host launch overhead
  for every path alike.  (triton's do_bench is not used here: its flush before every replay
  would leave the first call of each replay writing back dirty lines.)

  Each replay also costs a fixed amount that belongs to no call: the host's ``replay()``,
  during which the GPU would idle after the start event, and the graph's launch (9.5-16 µs
  per replay on the H100 for a graph of one tiny kernel).  So a GPU sleep is queued before
  the start event, which keeps the GPU busy until the graph is submitted, and the calls are
  repeated in the same order (the rotation is unchanged) until a replay lasts
  ``MIN_REPLAY_US``, which makes the launch a small part of it.  A tiny kernel times at
  1.2 µs per call this way.
* ``flushed(fn)``: ``triton.testing.do_bench``, which zero-fills a 256 MB buffer before every
  call.  That leaves the L2 full of dirty lines, so a memory-bound call also writes back
  lines it never touched (H100, int8 4096 x 4096 at M = 1: 12-20% slower than rotating).
  It is kept for comparison with figures measured by do_bench.
"""

from __future__ import annotations

import json
import math
import os
import statistics

import torch

L2_BYTES = 50 * 2**20


def load_kernels() -> None:
    """Loads the CUDA kernels as a program's first CUDA call of a quantfuse op does (after which
    the public ops' C++ implementations serve every call); exits if they cannot be loaded."""
    import compile_backend  # noqa: F401  (registers the ops)
    from compile_backend.kernels import loader as kernels

    qweight = torch.zeros(16, 8, dtype=torch.int32, device="cuda")
    scales = torch.ones(1, 64, dtype=torch.float16, device="cuda")
    torch.ops.quantfuse.awq_dequantize(qweight, scales, torch.zeros(1, 8, dtype=torch.int32, device="cuda"), 16)
    if not kernels.ensure_loaded():
        raise SystemExit(f"the CUDA kernels did not load: {kernels.status()}")


def copies_for(set_bytes: int, cap: int = 8) -> int:
    """Input sets needed so that one pass over them reads more than twice the L2."""
    return max(1, min(cap, math.ceil(2 * L2_BYTES / max(1, set_bytes))))


def flushed(fn) -> float:
    """Median µs of ``fn()`` with triton's L2 flush before every call."""
    from triton.testing import do_bench

    return do_bench(fn, warmup=25, rep=100, return_mode="median") * 1e3


# A replay at least this long, so that the graph launch is a small part of it.
MIN_REPLAY_US = 500.0
# GPU cycles of the sleep queued before each start event; longer than the host's replay()
# (~10 µs) at the H100's clock.
_SLEEP_CYCLES = 100_000


def _capture(calls) -> torch.cuda.CUDAGraph:
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for c in calls:
            c()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for c in calls:
            c()
    torch.cuda.synchronize()
    for _ in range(3):
        graph.replay()
    return graph


def _median_replay_us(graph: torch.cuda.CUDAGraph, reps: int) -> float:
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda._sleep(_SLEEP_CYCLES)  # the GPU is busy while the host submits the replay
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    times.sort()
    return times[len(times) // 2] * 1000.0


def rotating(calls, reps: int = 60) -> float:
    """Median µs of one call; ``calls`` are closures over distinct inputs, replayed as one graph
    (repeated until a replay lasts ``MIN_REPLAY_US``)."""
    calls = list(calls)
    for c in calls:  # warm up outside the graph (builds, caches, autotuning)
        c()
    torch.cuda.synchronize()
    graph = _capture(calls)
    repeat = max(1, math.ceil(MIN_REPLAY_US / _median_replay_us(graph, 5)))
    if repeat > 1:
        del graph
        graph = _capture(calls * repeat)
    us = _median_replay_us(graph, reps)
    del graph
    return us / (len(calls) * repeat)


def graph_us(fn, arg_sets, reps: int = 60) -> float:
    """Median µs of one call of ``fn`` over a CUDA graph of one call per argument tuple in ``arg_sets``
    (as a decode step calls a kernel once per layer, each on its own tensors), timed by events around
    each replay, the first 10 replays dropped."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for args in arg_sets[:3]:
            fn(*args)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for args in arg_sets:
            fn(*args)
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1000 / len(arg_sets))
    return statistics.median(times[10:])


def write_rows(out_dir: str, name: str, rows: list) -> None:
    """``rows`` with the GPU and the torch version as ``out_dir/name`` (JSON)."""
    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, name), "w") as f:
        json.dump(dict(device=torch.cuda.get_device_name(), torch=torch.__version__, rows=rows), f, indent=1)


def copy_bandwidth() -> float:
    """Bytes read plus bytes written per second by a 1 GiB device-to-device copy."""
    n = 1 << 30
    x = torch.empty(n, dtype=torch.uint8, device="cuda")
    y = torch.empty_like(x)
    t = flushed(lambda: y.copy_(x))
    return 2 * n / (t * 1e-6)
