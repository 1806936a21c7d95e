"""One warmed-up call of our kernel and of the baseline, each inside an NVTX range, for
Nsight Compute to profile (the figures behind the missed targets in RESULTS.md):

    ncu --nvtx --nvtx-include "ours/" --nvtx-include "baseline/" --section SpeedOfLight ... \\
        python benchmarks/dev/ncu_calls.py w8a8 N K M {int8,fp8}
    ncu ... python benchmarks/dev/ncu_calls.py w8a8_azp N K M
    ncu ... python benchmarks/dev/ncu_calls.py awq N K M

w8a8: ``quantfuse::scaled_mm`` (per-token x per-channel + bias, bf16 out; the decode kernel at
M <= 16, CUTLASS above) against ``torch._scaled_mm`` (fp8) or ``torch._int_mm`` (int8).  w8a8_azp:
``quantfuse::scaled_mm_azp`` (int8, per-token zero points) against the symmetric
``quantfuse::scaled_mm``.  awq: ``quantfuse::awq_gemm`` (fp16, group 128) against fp16 cuBLAS on
the dequantized weight.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository root (benchmarks/dev/../..)

import compile_backend  # noqa: E402,F401  (registers the quantfuse ops)


def w8a8(N: int, K: int, M: int, dtype: str):

    def rand(shape):
        if dtype == "int8":
            return torch.randint(-128, 128, shape, dtype=torch.int8, device="cuda")
        return (torch.randn(shape, device="cuda") * 2).to(torch.float8_e4m3fn)

    a, b = rand((M, K)), rand((N, K)).t()
    sa = torch.rand(M, 1, device="cuda") * 1e-2 + 1e-3
    sb = torch.rand(1, N, device="cuda") * 1e-2 + 1e-3
    bias = torch.randn(N, device="cuda", dtype=torch.bfloat16)
    ours = lambda: torch.ops.quantfuse.scaled_mm(a, b, sa, sb, torch.bfloat16, bias)  # noqa: E731
    if dtype == "fp8":
        base = lambda: torch._scaled_mm(a, b, scale_a=sa, scale_b=sb, bias=bias,  # noqa: E731
                                        out_dtype=torch.bfloat16)
    else:
        a_pad = a if M > 16 else torch.cat([a, a.new_zeros(17 - M, K)])  # _int_mm needs M > 16
        base = lambda: torch._int_mm(a_pad, b)  # noqa: E731
    return ours, base


def w8a8_azp(N: int, K: int, M: int):
    """int8 with per-token zero points (ours) against the symmetric op (baseline)."""

    a = torch.randint(-128, 128, (M, K), dtype=torch.int8, device="cuda")
    w = torch.randint(-128, 128, (N, K), dtype=torch.int8, device="cuda")
    sa = torch.rand(M, device="cuda") * 1e-2 + 1e-3
    sb = torch.rand(N, device="cuda") * 1e-2 + 1e-3
    bias = torch.randn(N, device="cuda", dtype=torch.bfloat16)
    colsum = w.to(torch.int32).sum(1, dtype=torch.int32)
    azp = torch.randint(-50, 50, (M,), dtype=torch.int32, device="cuda")
    ours = lambda: torch.ops.quantfuse.scaled_mm_azp(a, w.t(), sa, sb, torch.bfloat16, colsum, azp, bias)  # noqa: E731
    base = lambda: torch.ops.quantfuse.scaled_mm(a, w.t(), sa, sb, torch.bfloat16, bias)  # noqa: E731
    return ours, base


def awq(N: int, K: int, M: int):

    G = 128
    x = torch.randn(M, K, device="cuda", dtype=torch.float16)
    qweight = torch.randint(-(2**31), 2**31 - 1, (K, N // 8), dtype=torch.int32, device="cuda")
    qzeros = torch.randint(-(2**31), 2**31 - 1, (K // G, N // 8), dtype=torch.int32, device="cuda")
    scales = (torch.rand(K // G, N, device="cuda") * 1e-2 + 1e-3).to(torch.float16)
    dense = torch.ops.quantfuse.awq_dequantize(qweight, scales, qzeros, G)
    ours = lambda: torch.ops.quantfuse.awq_gemm(x, qweight, scales, qzeros, G)  # noqa: E731
    base = lambda: x @ dense  # noqa: E731
    return ours, base


def main() -> int:
    kind, *rest = sys.argv[1:]
    if kind == "w8a8":
        ours, base = w8a8(int(rest[0]), int(rest[1]), int(rest[2]), rest[3])
    elif kind == "w8a8_azp":
        ours, base = w8a8_azp(int(rest[0]), int(rest[1]), int(rest[2]))
    elif kind == "awq":
        ours, base = awq(int(rest[0]), int(rest[1]), int(rest[2]))
    else:
        raise SystemExit(f"kind must be w8a8, w8a8_azp or awq, got {kind!r}")
    for fn in (ours, base):
        fn()
        fn()
    torch.cuda.synchronize()
    for name, fn in (("ours", ours), ("baseline", base)):
        torch.cuda.nvtx.range_push(name)
        fn()
        torch.cuda.nvtx.range_pop()
    torch.cuda.synchronize()
    return 0


if __name__ == "__main__":
    sys.exit(main())
