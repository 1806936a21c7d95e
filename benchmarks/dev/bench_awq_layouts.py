"""``quantfuse::awq_gemm`` on the two ``qweight`` layouts: the AWQ layout (the kernels derive their
layouts once and keep them) against the fragment layout ``AWQLinear`` holds (the decode kernel reads it
as it is, the Hopper prefill kernel's layout is made per call), and the per-call conversion alone.

    python benchmarks/dev/bench_awq_layouts.py [--ms 1,16,48,64,128,512,2048]

µs per call: median of 30 replays of a CUDA graph of 10 calls, fp16, group 128, Llama-3-8B's shapes;
for M ≤ 64 also the streaming kernel forced on the fragments (``_awq_gemm_cuda``).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

# The repository root, and benchmarks/ for timing.py (this benchmark lives in benchmarks/dev/).
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from timing import graph_us  # noqa: E402

import compile_backend  # noqa: E402, F401  (the ops)
from compile_backend.ops.awq_gemm import fragment_layout  # noqa: E402
from compile_backend.quantize import awq_pack  # noqa: E402

SHAPES = ((6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336))


def call_us(fn) -> float:
    """µs per call of ``fn()``: a CUDA graph of 10 calls, the median of 30 replays (benchmarks/timing.py)."""
    return graph_us(fn, [()] * 10, reps=40)  # graph_us drops the first 10 replays


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
        conv = call_us(lambda: ops._awq_prepare_sm90_from_fragments_cuda(f, s, z, 128))
        print(f"{N} x {K}: prepare from fragments {conv:.1f} us ({N * K / conv / 1e6:.2f} TB/s read + written)")
        for M in (int(m) for m in args.ms.split(",")):
            x = torch.randn(M, K, dtype=torch.half, device="cuda")
            kept = call_us(lambda: ops.awq_gemm(x, q, s, z, 128))
            held = call_us(lambda: ops.awq_gemm(x, f, s, z, 128))
            strip = f"  streaming kernel on fragments {call_us(lambda: ops._awq_gemm_cuda(x, f, s, z, 128)):.1f}" \
                if M <= 64 else ""
            print(f"  M={M}: AWQ layout, layouts kept {kept:.1f} us; fragment layout {held:.1f} us "
                  f"({held / kept:.3f}x){strip}")


if __name__ == "__main__":
    main()
