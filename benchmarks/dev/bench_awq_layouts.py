"""``quantfuse::awq_gemm`` on the two ``qweight`` layouts: the AWQ layout (the kernels derive their
layouts once and keep them) against the fragment layout ``AWQLinear`` holds (the decode kernel reads it
as it is, the Hopper prefill kernel's layout is made per call), and the per-call conversion alone.

    python benchmarks/dev/bench_awq_layouts.py [--ms 1,16,48,64,128,512,2048]

µs per call: median of 30 replays of a CUDA graph of 10 calls, fp16, group 128, Llama-3-8B's shapes;
for M ≤ 64 also the streaming kernel forced on the fragments (``_awq_gemm_cuda``).
"""

from __future__ import annotations

import argparse
import statistics

import torch

import compile_backend  # noqa: F401  (the ops)
from compile_backend.ops.awq_gemm import fragment_layout
from compile_backend.quantize import awq_pack

SHAPES = ((6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336))


def graph_us(fn, calls: int = 10, replays: int = 30) -> float:
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls):
            fn()
    times = []
    for _ in range(replays):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / calls)
    return statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--ms", default="1,16,48,64,128,512,2048")
    args = ap.parse_args()
    ops = torch.ops.quantfuse
    torch.manual_seed(0)
    print(f"{torch.cuda.get_device_name()}; torch {torch.__version__}")
    for N, K in SHAPES:
        q = awq_pack(torch.randint(0, 16, (K, N), dtype=torch.int32)).cuda()
        z = awq_pack(torch.randint(0, 16, (K // 128, N), dtype=torch.int32)).cuda()
        s = (torch.rand(K // 128, N) * 1e-3 + 1e-4).half().cuda()
        f = fragment_layout(q)
        conv = graph_us(lambda: ops._awq_prepare_sm90_from_fragments_cuda(f, s, z, 128))
        print(f"{N} x {K}: prepare from fragments {conv:.1f} us ({N * K / conv / 1e6:.2f} TB/s read + written)")
        for M in (int(m) for m in args.ms.split(",")):
            x = torch.randn(M, K, dtype=torch.half, device="cuda")
            kept = graph_us(lambda: ops.awq_gemm(x, q, s, z, 128))
            held = graph_us(lambda: ops.awq_gemm(x, f, s, z, 128))
            strip = f"  streaming kernel on fragments {graph_us(lambda: ops._awq_gemm_cuda(x, f, s, z, 128)):.1f}" \
                if M <= 64 else ""
            print(f"  M={M}: AWQ layout, layouts kept {kept:.1f} us; fragment layout {held:.1f} us "
                  f"({held / kept:.3f}x){strip}")


if __name__ == "__main__":
    main()
