"""Host time per call of the quantfuse ops on a GPU, against the private kernel ops and the
torch ops a user would call instead.

    python benchmarks/host_overhead.py

Each path runs on shapes so small that the GPU finishes long before the host issues the next
call, so the wall-clock time per call (2000 calls, one synchronize at the end) is the host's
dispatch cost: what a model pays per layer when it runs without CUDA graphs.
"""

from __future__ import annotations

import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import compile_backend  # noqa: E402,F401  (registers the ops and kernel families)
from compile_backend import kernels  # noqa: E402
from compile_backend.cuda import awq_gemm as awq_cuda  # noqa: E402
from compile_backend.cuda import awq_gemm_sm90 as sm90  # noqa: E402
from compile_backend.quantize import awq_pack  # noqa: E402

DEV = "cuda"
CALLS = 2000


def per_call_us(fn) -> float:
    for _ in range(50):
        fn()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(CALLS):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - start) / CALLS * 1e6


def main() -> int:
    assert kernels.ensure_loaded(), kernels.status()
    g = torch.Generator(device=DEV).manual_seed(0)
    N = K = 256
    a = torch.randint(-127, 128, (1, K), generator=g, device=DEV, dtype=torch.int8)
    a17 = torch.randint(-127, 128, (17, K), generator=g, device=DEV, dtype=torch.int8)
    b = torch.randint(-127, 128, (N, K), generator=g, device=DEV, dtype=torch.int8).t()
    sa, sb = torch.rand(1, 1, device=DEV), torch.rand(1, N, device=DEV)
    bias = torch.randn(N, device=DEV).bfloat16()
    q = torch.randint(0, 16, (K, N), generator=g, device=DEV, dtype=torch.int32)
    z = torch.randint(0, 16, (K // 128, N), generator=g, device=DEV, dtype=torch.int32)
    s = (torch.rand(K // 128, N, device=DEV) * 1e-2).half()
    qw, qz = awq_pack(q), awq_pack(z)
    x1, x64 = torch.randn(1, K, device=DEV).half(), torch.randn(64, K, device=DEV).half()
    w = torch.randn(K, N, device=DEV).half()
    packed = awq_cuda.packed_weight(qw)
    prepared = sm90.prepared(qw, s, qz, 128) if sm90.supports_prefill(x64, qw, s, qz, 128) is None else None
    ops = torch.ops.quantfuse
    paths = [
        ("scaled_mm int8, M = 1 (op)", lambda: ops.scaled_mm(a, b, sa, sb, torch.bfloat16, bias)),
        ("  _scaled_mm_decode_cuda (kernel op)",
         lambda: ops._scaled_mm_decode_cuda(a, b, sa.reshape(-1), sb.reshape(-1), torch.bfloat16, bias)),
        ("  torch._int_mm, M = 17", lambda: torch._int_mm(a17, b)),
        ("awq_gemm, M = 1 (op)", lambda: ops.awq_gemm(x1, qw, s, qz, 128, None)),
        ("  _awq_gemm_cuda (kernel op)", lambda: ops._awq_gemm_cuda(x1, packed, s, qz, 128, None)),
        ("awq_gemm, M = 64 (op)", lambda: ops.awq_gemm(x64, qw, s, qz, 128, None)),
        ("  torch.mm fp16, M = 64", lambda: torch.mm(x64, w)),
    ]
    if prepared is not None:
        sm90_op = ops._awq_gemm_sm90_cuda
        paths.insert(6, ("  _awq_gemm_sm90_cuda (kernel op)", lambda: sm90_op(x64, *prepared, 128, None)))
    print(f"GPU {torch.cuda.get_device_name()}, torch {torch.__version__}; host µs per call ({CALLS} calls)")
    for name, fn in paths:
        print(f"{name:40s} {per_call_us(fn):7.1f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
