"""Host time per call of the quantfuse ops on a GPU, against the private kernel ops and the
torch ops a user would call instead.

    python benchmarks/host_overhead.py

Each path runs on shapes so small that the GPU finishes long before the host issues the next
call, so the wall-clock time per call (2000 calls, one synchronize at the end) is the host's
dispatch cost: what a model pays per layer when it runs without CUDA graphs.  The public ops
go through the C++ dispatch (one dispatcher trip: checks, kernel choice, the launch); the
target is at most 1.2x torch's own op on the same shapes: ``torch._int_mm`` for W8A8 (at
M = 32: it needs M > 16) and ``torch.mm`` (fp16) for AWQ.
"""

from __future__ import annotations

import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from timing import load_kernels  # noqa: E402

from compile_backend.quantize import awq_pack  # noqa: E402

DEV = "cuda"
CALLS = 2000
ROUNDS = 5
TARGET = 1.2


def per_call_us(fn) -> float:
    for _ in range(50):
        fn()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(CALLS):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - start) / CALLS * 1e6


def medians_us(fns: dict) -> dict:
    """Median over ROUNDS rounds of per_call_us, the paths interleaved within each round, so that
    a slow spell of the host weighs on every path alike."""
    rounds = {key: [] for key in fns}
    for _ in range(ROUNDS):
        for key, fn in fns.items():
            rounds[key].append(per_call_us(fn))
    return {key: statistics.median(v) for key, v in rounds.items()}


def main() -> int:
    load_kernels()
    g = torch.Generator(device=DEV).manual_seed(0)
    N = K = 256
    hopper = torch.cuda.get_device_capability() == (9, 0)
    fp8_ok = torch.cuda.get_device_capability() >= (8, 9)
    # W8A8: int8 / fp8, per-token x per-channel scales ([M, 1] and [1, N], as a model's graph has
    # them) and a bf16 bias
    a = torch.randint(-127, 128, (1, K), generator=g, device=DEV, dtype=torch.int8)
    a32 = torch.randint(-127, 128, (32, K), generator=g, device=DEV, dtype=torch.int8)
    b = torch.randint(-127, 128, (N, K), generator=g, device=DEV, dtype=torch.int8).t()
    af8 = torch.randn(1, K, generator=g, device=DEV).to(torch.float8_e4m3fn)
    bf8 = torch.randn(N, K, generator=g, device=DEV).to(torch.float8_e4m3fn).t()
    sa, sb = torch.rand(1, 1, device=DEV), torch.rand(1, N, device=DEV)
    bias = torch.randn(N, device=DEV).bfloat16()
    colsum = b.to(torch.int32).sum(0, dtype=torch.int32)
    azp = torch.randint(-50, 50, (1,), device=DEV, dtype=torch.int32)
    # AWQ: fp16, group 128
    q = torch.randint(0, 16, (K, N), generator=g, device=DEV, dtype=torch.int32)
    z = torch.randint(0, 16, (K // 128, N), generator=g, device=DEV, dtype=torch.int32)
    s = (torch.rand(K // 128, N, device=DEV) * 1e-2).half()
    qw, qz = awq_pack(q), awq_pack(z)
    x1, x64 = torch.randn(1, K, device=DEV).half(), torch.randn(64, K, device=DEV).half()
    # 192 tokens: 1.5 token tiles of 128, the last one mostly empty (too short a call to pad x:
    # awq_gemm_sm90_choice.h, padded_tokens)
    x192 = torch.randn(192, K, device=DEV).half()
    w = torch.randn(K, N, device=DEV).half()
    qf = torch.ops.quantfuse
    packed = qf._awq_repack_cuda(qw)
    prepared = qf._awq_prepare_sm90_cuda(qw, s, qz, 128) if hopper else None
    sa_flat, sb_flat = sa.reshape(-1), sb.reshape(-1)

    baselines = {
        "int_mm": ("torch._int_mm, M = 32", lambda: torch._int_mm(a32, b)),
        "mm1": ("torch.mm fp16, M = 1", lambda: torch.mm(x1, w)),
        "mm64": ("torch.mm fp16, M = 64", lambda: torch.mm(x64, w)),
        "mm192": ("torch.mm fp16, M = 192", lambda: torch.mm(x192, w)),
    }
    # (name, fn, baseline key or None for the private kernel ops)
    paths = [
        ("scaled_mm int8, M = 1 (op)", lambda: qf.scaled_mm(a, b, sa, sb, torch.bfloat16, bias), "int_mm"),
        ("  _scaled_mm_decode_cuda (kernel op)",
         lambda: qf._scaled_mm_decode_cuda(a, b, sa_flat, sb_flat, torch.bfloat16, bias), None),
        ("scaled_mm_azp int8, M = 1 (op)",
         lambda: qf.scaled_mm_azp(a, b, sa, sb, torch.bfloat16, colsum, azp, bias), "int_mm"),
    ]
    if fp8_ok:
        paths += [
            ("scaled_mm fp8, M = 1 (op)", lambda: qf.scaled_mm(af8, bf8, sa, sb, torch.bfloat16, bias), "int_mm"),
            ("  _scaled_mm_decode_cuda fp8 (kernel op)",
             lambda: qf._scaled_mm_decode_cuda(af8, bf8, sa_flat, sb_flat, torch.bfloat16, bias), None),
        ]
    paths += [
        ("awq_gemm, M = 1 (op)", lambda: qf.awq_gemm(x1, qw, s, qz, 128, None), "mm1"),
        ("  _awq_gemm_cuda (kernel op)", lambda: qf._awq_gemm_cuda(x1, packed, s, qz, 128, None), None),
        ("awq_gemm, M = 64 (op)", lambda: qf.awq_gemm(x64, qw, s, qz, 128, None), "mm64"),
        ("awq_gemm, M = 192 (op)", lambda: qf.awq_gemm(x192, qw, s, qz, 128, None), "mm192"),
    ]
    if prepared is not None:
        paths.append(("  _awq_gemm_sm90_cuda (kernel op)",
                      lambda: qf._awq_gemm_sm90_cuda(x64, *prepared, 128, None, -1), None))
    else:
        paths.append(("  _awq_gemm_cuda, M = 64 (kernel op)",
                      lambda: qf._awq_gemm_cuda(x64, packed, s, qz, 128, None), None))

    print(f"GPU {torch.cuda.get_device_name()}, torch {torch.__version__}; host µs per call "
          f"(median of {ROUNDS} interleaved rounds of {CALLS} calls)")
    timed = medians_us({**{key: fn for key, (_, fn) in baselines.items()},
                        **{name: fn for name, fn, _ in paths}})
    for key, (name, _) in baselines.items():
        print(f"{name:42s} {timed[key]:7.1f}")
    worst = 0.0
    for name, _, key in paths:
        us = timed[name]
        if key is None:
            print(f"{name:42s} {us:7.1f}")
            continue
        ratio = us / timed[key]
        worst = max(worst, ratio)
        print(f"{name:42s} {us:7.1f}  {ratio:4.2f}x {baselines[key][0]}")
    print(f"worst public op / torch baseline: {worst:.2f}x (target <= {TARGET}x): "
          f"{'met' if worst <= TARGET else 'missed'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
