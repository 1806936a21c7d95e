"""Tile-config sweep of the SM90 CUTLASS scaled_mm kernels: every forced config
(csrc/scaled_mm/gemm_sm90.cuh: 0 small 64x32x256, 1 medium 64x128x128 ping-pong, 2 large
128x128x128, 3 swapped decode 64(N)x32(M)x256) at prefill-sized M, int8 and fp8, per-token x
per-channel + bias, bf16 out, next to torch._scaled_mm (fp8) in the same run.  What the M-based
choice (choose_config) should pick comes from here.  Median µs per call over CUDA-graph replays
rotating among input copies > 2x L2 (benchmarks/timing.py).

    python benchmarks/dev/bench_scaled_mm_configs.py [--ms 128,256,512,1024,8192] [--out DIR]
        [--configs 0,1,2,3] [--swizzles 0] [--rasters 0] [--dtypes int8,fp8]

--swizzles / --rasters also sweep the persistent tile scheduler's raster swizzle (1, 2, 4, 8;
0 = the config's) and order (0 the config's, 1 along M, 2 along N) for every config but
the swapped decode one; such columns are named "config<c>/s<swizzle>/r<raster>".
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import torch

# The repository root, and benchmarks/ for timing.py (this probe lives in benchmarks/dev/).
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from timing import copies_for, load_kernels, rotating  # noqa: E402

NK = ((4096, 4096), (6144, 4096), (4096, 14336), (28672, 4096))
CONFIGS = (0, 1, 2, 3)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--ms", default="128,256,512,1024,8192")
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--configs", default=",".join(map(str, CONFIGS)))
    ap.add_argument("--swizzles", default="0")
    ap.add_argument("--rasters", default="0")
    ap.add_argument("--dtypes", default="int8,fp8")
    args = ap.parse_args()
    configs = [int(c) for c in args.configs.split(",")]
    schedules = [(int(sw), int(ra)) for sw in args.swizzles.split(",") for ra in args.rasters.split(",")]
    dtypes = {"int8": torch.int8, "fp8": torch.float8_e4m3fn}
    dts = [dtypes[d] for d in args.dtypes.split(",")]

    load_kernels()
    qf = torch.ops.quantfuse
    print(f"GPU {torch.cuda.get_device_name()}, torch {torch.__version__}", flush=True)
    torch.manual_seed(0)
    rows = []
    for N, K in NK:
        for dt in dts:
            for M in (int(m) for m in args.ms.split(",")):
                def rand(shape, dt=dt):
                    if dt == torch.int8:
                        return torch.randint(-128, 128, shape, dtype=dt, device="cuda")
                    return (torch.randn(shape, device="cuda") * 2).to(dt)

                sets = [(rand((M, K)), rand((N, K)).t(), torch.rand(M, device="cuda") * 1e-2 + 1e-3,
                         torch.rand(N, device="cuda") * 1e-2 + 1e-3,
                         torch.randn(N, device="cuda", dtype=torch.bfloat16))
                        for _ in range(copies_for(N * K + M * K))]
                r = {"N": N, "K": K, "M": M, "dtype": str(dt).split(".")[-1]}
                for cfg in configs:
                    for sw, ra in schedules if cfg != 3 else [(0, 0)]:
                        key = f"config{cfg}" if (sw, ra) == (0, 0) else f"config{cfg}/s{sw}/r{ra}"
                        if cfg == 3 and M > 1024:
                            r[key] = float("nan")  # 32-token tiles: hundreds of waves
                            continue
                        r[key] = rotating([
                            lambda a=a, b=b, sa=sa, sb=sb, bias=bias, cfg=cfg, sw=sw, ra=ra: qf._scaled_mm_cutlass(
                                a, b, sa, sb, torch.bfloat16, bias, None, None, 0, cfg, sw, ra)
                            for a, b, sa, sb, bias in sets])
                if dt == torch.float8_e4m3fn:
                    r["scaled_mm"] = rotating([
                        lambda a=a, b=b, sa=sa, sb=sb, bias=bias: torch._scaled_mm(
                            a, b, scale_a=sa.reshape(-1, 1), scale_b=sb.reshape(1, -1), bias=bias,
                            out_dtype=torch.bfloat16)
                        for a, b, sa, sb, bias in sets])
                rows.append(r)
                cols = " ".join(f"{k} {v:7.1f}" for k, v in r.items() if k.startswith(("config", "scaled")))
                print(f"{r['dtype']:>13} N={N:5d} K={K:5d} M={M:5d}: {cols}", flush=True)
                sets = None
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "bench_scaled_mm_configs.json").write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
