"""The AWQ SM90 prefill kernel's tile configurations, each forced, against fp16 cuBLAS.

    python benchmarks/bench_awq_sm90_configs.py [--ms 192,256,320,384,448,512,640,768,1024]

One line per (shape, M): the op's own choice ("auto"), configurations 0-4 forced through
``launch_prefill(config=c)``, and fp16 cuBLAS on a dense weight, in µs (median of rotating
CUDA-graph replays, benchmarks/timing.py).  fp16, group 128, bench_awq.py's shapes and
input sets.  What ``choose_config`` (csrc/awq_gemm/awq_gemm_sm90_f16.cu) was fitted to;
output of session 10: benchmarks/probe/awq_sm90_streamk_2026-11-24.txt.
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench_awq import DEV, SHAPES, G, make_set, weight_bytes  # noqa: E402
from timing import copies_for, rotating  # noqa: E402

CONFIGS = (0, 1, 2, 3, 4)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--ms", default="192,256,320,384,448,512,640,768,1024")
    args = ap.parse_args()
    if not torch.cuda.is_available() or torch.cuda.get_device_capability() != (9, 0):
        print("needs a Hopper (sm_90) GPU", file=sys.stderr)
        return 1
    import compile_backend.ops  # noqa: F401  (registers the ops)
    from compile_backend import kernels
    from compile_backend.cuda import awq_gemm_sm90 as sm90

    if not kernels.ensure_loaded() or not kernels.op_built("_awq_gemm_sm90_cuda"):
        print("the SM90 AWQ kernel is not built", file=sys.stderr)
        return 1
    gen = torch.Generator(device=DEV).manual_seed(0)
    print(f"GPU {torch.cuda.get_device_name()}, torch {torch.__version__}; fp16, group {G}, µs", flush=True)
    for N, K in SHAPES:
        # (qweight, scales, qzeros) of bench_awq's input sets; x is made per M below
        sets = [make_set(1, N, K, gen)[1:] for _ in range(copies_for(weight_bytes(N, K)))]
        dense = [torch.randn(N, K, device=DEV).half() for _ in range(copies_for(N * K * 2))]
        for M in (int(m) for m in args.ms.split(",")):
            x = torch.randn(M, K, device=DEV).half()
            t = {c: rotating([lambda s=s, c=c: sm90.launch_prefill(x, *s, G, None, c) for s in sets])
                 for c in (-1,) + CONFIGS}
            cublas = rotating([lambda w=w: x @ w.t() for w in dense])
            best = min(t[c] for c in CONFIGS)
            print(f"N={N:5d} K={K:5d} M={M:4d} auto {t[-1]:7.1f} | "
                  + " ".join(f"c{c} {t[c]:7.1f}" for c in CONFIGS)
                  + f" | cuBLAS {cublas:7.1f} -> best/cuBLAS {cublas / best:.2f}, auto/cuBLAS {cublas / t[-1]:.2f}",
                  flush=True)
        del sets, dense
    return 0


if __name__ == "__main__":
    sys.exit(main())
