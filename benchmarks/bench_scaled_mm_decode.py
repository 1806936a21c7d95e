"""Decode (M <= 16) W8A8 kernel: quantfuse::_scaled_mm_decode_cuda against the CUTLASS SM90
kernel it replaces for small M, torch._scaled_mm (fp8) and torch._int_mm (int8, M padded to
its minimum 17), with the work split (cluster size, warps per CTA, pipeline depth) swept.
Per-token x per-channel scales + bias, bf16 out.  Median of triton.testing.do_bench (L2
flushed before each call), µs; DRAM fraction = (weight + activation + output bytes) / measured copy bandwidth / time.

    python benchmarks/bench_scaled_mm_decode.py [--ms 1,8,16] [--out DIR]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

NK = ((4096, 4096), (6144, 4096), (4096, 14336), (28672, 4096))
# (splits, warps per CTA, pipeline stages) forced through _scaled_mm_decode_tune; -1 = chosen
# (a pipeline depth of 8 was measured too and is no longer instantiated; see the notes)
VARIANTS = {"s1": (1, -1, -1), "s2": (2, -1, -1), "s4": (4, -1, -1), "s8": (8, -1, -1), "w2": (-1, 2, -1),
            "w4": (-1, 4, -1), "w8": (-1, 8, -1), "s2w8": (2, 8, -1)}


def bench(fn):
    import triton.testing

    return triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median") * 1e3


def copy_bandwidth() -> float:
    n = 1 << 30
    x = torch.empty(n, dtype=torch.uint8, device="cuda")
    y = torch.empty_like(x)
    return 2 * n / (bench(lambda: y.copy_(x)) * 1e-6)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--ms", default="1,8,16")
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    args = ap.parse_args()
    import compile_backend.cuda  # noqa: F401
    from compile_backend import kernels

    assert kernels.ensure_loaded(), kernels.status()
    qf = torch.ops.quantfuse
    has_cutlass = hasattr(qf, "_scaled_mm_cutlass")
    bw = copy_bandwidth()
    print(f"GPU {torch.cuda.get_device_name()}, torch {torch.__version__}, copy {bw / 1e12:.2f} TB/s", flush=True)
    torch.manual_seed(0)
    ms = [int(m) for m in args.ms.split(",")]
    rows = []
    for N, K in NK:
        for dt in (torch.int8, torch.float8_e4m3fn):
            if dt == torch.int8:
                w = torch.randint(-128, 128, (N, K), dtype=dt, device="cuda")
            else:
                w = (torch.randn(N, K, device="cuda") * 2).to(dt)
            b = w.t()
            sb = torch.rand(N, device="cuda") * 1e-2 + 1e-3
            bias = torch.randn(N, device="cuda", dtype=torch.bfloat16)
            cfg = list(qf._scaled_mm_decode_config(N, K))
            for M in ms:
                if dt == torch.int8:
                    a = torch.randint(-128, 128, (M, K), dtype=dt, device="cuda")
                else:
                    a = (torch.randn(M, K, device="cuda") * 2).to(dt)
                sa = torch.rand(M, device="cuda") * 1e-2 + 1e-3
                r = {"N": N, "K": K, "M": M, "dtype": str(dt).split(".")[-1], "config": cfg}
                r["decode"] = bench(lambda: qf._scaled_mm_decode_cuda(a, b, sa, sb, torch.bfloat16, bias))
                for name, (s, wa, st) in VARIANTS.items():
                    r[name] = bench(lambda s=s, wa=wa, st=st: qf._scaled_mm_decode_tune(
                        a, b, sa, sb, torch.bfloat16, bias, s, wa, st))
                r["cutlass"] = (bench(lambda: qf._scaled_mm_cutlass(a, b, sa, sb, torch.bfloat16, bias))
                                if has_cutlass else float("nan"))
                if dt == torch.int8:
                    ap_ = torch.randint(-128, 128, (max(M, 17), K), dtype=dt, device="cuda")
                    r["baseline"] = bench(lambda: torch._int_mm(ap_, b))
                else:
                    sa2, sb2 = sa.reshape(-1, 1), sb.reshape(1, -1)
                    r["baseline"] = bench(lambda: torch._scaled_mm(a, b, scale_a=sa2, scale_b=sb2, bias=bias,
                                                                   out_dtype=torch.bfloat16))
                nbytes = N * K + M * K + 2 * M * N
                r["floor_us"] = nbytes / bw * 1e6
                r["dram_frac"] = r["floor_us"] / r["decode"]
                rows.append(r)
                sw = " ".join(f"{k} {r[k]:5.1f}" for k in VARIANTS)
                print(f"{r['dtype']:>13} N={N:5d} K={K:5d} M={M:2d} cfg {cfg}: decode {r['decode']:6.1f} µs "
                      f"({100 * r['dram_frac']:3.0f}% DRAM)  {sw}  cutlass {r['cutlass']:6.1f}  "
                      f"{'_int_mm(M>=17)' if dt == torch.int8 else '_scaled_mm'} {r['baseline']:6.1f}  "
                      f"floor {r['floor_us']:5.1f}", flush=True)
            w = b = None  # free this shape's weight before the next
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "bench_scaled_mm_decode.json").write_text(json.dumps({"copy_TBps": bw / 1e12, "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
