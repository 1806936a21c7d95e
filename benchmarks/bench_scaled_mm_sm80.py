"""The CUTLASS 2.x (SM80) scaled_mm kernels, forced on the GPU at hand (arch=80), against the
SM90 kernels (on Hopper) and torch._int_mm alone.

int8 per-token x per-channel + bias, bf16 out; (N, K) in {(4096, 4096), (28672, 4096)}, M in
{1, 16, 256, 1024, 4096}.  Medians of triton.testing.do_bench (L2 flushed before each call),
µs.  Also each SM80 tile config forced (c0/c1/c2) and the per-token zero-point variant.

    python benchmarks/bench_scaled_mm_sm80.py [--out DIR]
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from timing import load_kernels  # noqa: E402

NK = ((4096, 4096), (28672, 4096))
MS = (1, 16, 256, 1024, 4096)
COLS = ("sm80", "sm80_azp", "sm90", "int_mm")
# forced SM80 tile configs (csrc/scaled_mm/gemm_sm80.cuh: 0 narrow, 1 medium, 2 large)
CONFIGS = (0, 1, 2)


def bench(fn):
    import triton.testing

    return triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median") * 1e3


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    args = ap.parse_args()

    load_kernels()
    torch.manual_seed(0)
    hopper = torch.cuda.get_device_capability() == (9, 0)
    op = torch.ops.quantfuse._scaled_mm_cutlass
    bf16 = torch.bfloat16
    configs = []
    for c in CONFIGS:
        a, b, s = (torch.ones(16, 64, dtype=torch.int8, device="cuda"), torch.ones(64, 64, dtype=torch.int8,
                   device="cuda").t(), torch.ones(1, device="cuda"))
        try:
            op(a, b, s, s, bf16, None, None, None, 80, c)
            configs.append(c)
        except RuntimeError:
            pass
    cols = COLS + tuple(f"sm80_c{c}" for c in configs)
    print("SM80 configs built:", configs, flush=True)
    rows = []
    for N, K in NK:
        b = torch.randint(-128, 128, (N, K), dtype=torch.int8, device="cuda").t()
        sb = torch.rand(N, device="cuda") * 1e-2 + 1e-3
        bias = torch.randn(N, device="cuda", dtype=bf16)
        colsum = b.to(torch.int32).sum(0, dtype=torch.int32)
        for M in MS:
            a = torch.randint(-128, 128, (M, K), dtype=torch.int8, device="cuda")
            sa = torch.rand(M, device="cuda") * 1e-2 + 1e-3
            azp = torch.randint(-50, 50, (M,), dtype=torch.int32, device="cuda")
            ap17 = torch.randint(-128, 128, (max(M, 17), K), dtype=torch.int8, device="cuda")
            r = {"N": N, "K": K, "M": M}
            r["sm80"] = bench(lambda: op(a, b, sa, sb, bf16, bias, None, None, 80, -1))
            r["sm80_azp"] = bench(lambda: op(a, b, sa, sb, bf16, bias, colsum, azp, 80, -1))
            r["sm90"] = bench(lambda: op(a, b, sa, sb, bf16, bias, None, None, 90, -1)) if hopper else float("nan")
            r["int_mm"] = bench(lambda: torch._int_mm(ap17, b))
            for c in configs:
                r[f"sm80_c{c}"] = bench(lambda c=c: op(a, b, sa, sb, bf16, bias, None, None, 80, c))
            rows.append(r)
            print(" ".join(f"{k}={v:.1f}" if isinstance(v, float) else f"{k}={v}" for k, v in r.items()), flush=True)

    lines = [f"GPU {torch.cuda.get_device_name()}, torch {torch.__version__}; do_bench medians, µs "
             "(TOP/s in brackets). int8 per-token x per-channel + bias -> bf16. int_mm alone: int32 out, "
             "M < 17 run at 17.", ""]
    for N, K in NK:
        sub = [r for r in rows if (r["N"], r["K"]) == (N, K)]
        lines += [f"N={N}, K={K}", "", "| path | " + " | ".join(f"M={r['M']}" for r in sub) + " |",
                  "|---|" + "---|" * len(sub)]
        for c in cols:
            lines.append(f"| {c} | " + " | ".join(
                f"{r[c]:.1f} ({2 * r['M'] * N * K / r[c] / 1e6:.0f})" for r in sub) + " |")
        for num, den in (("sm90", "sm80"), ("int_mm", "sm80")):
            lines.append(f"| {num} / {den} | " + " | ".join(f"{r[num] / r[den]:.2f}" for r in sub) + " |")
        lines.append("")
    text = "\n".join(lines)
    Path(args.out).mkdir(parents=True, exist_ok=True)
    (Path(args.out) / "bench_sm80.md").write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
