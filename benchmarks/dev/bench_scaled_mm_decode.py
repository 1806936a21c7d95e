"""Decode (M <= 16) W8A8 kernel: quantfuse::_scaled_mm_decode_cuda against the CUTLASS SM90
kernel it replaces for small M, torch._scaled_mm (fp8) and torch._int_mm (int8, M padded to
its minimum 17), with the work split (cluster size, warps per CTA) swept.
Per-token x per-channel scales + bias, bf16 out.  Median µs per call, by default over CUDA-graph
replays rotating among weight copies > 2x L2 (--timer flush: do_bench's L2 flush; see
benchmarks/timing.py); DRAM fraction = (weight + activation + output bytes) / copy bandwidth / time.

    python benchmarks/dev/bench_scaled_mm_decode.py [--ms 1,8,16] [--out DIR]
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

from timing import copies_for, copy_bandwidth, flushed, load_kernels, rotating  # noqa: E402

NK = ((4096, 4096), (6144, 4096), (4096, 14336), (28672, 4096))
# (splits, warps per CTA, load batch) forced through _scaled_mm_decode_tune; -1 = chosen
VARIANTS = {"w4": (-1, 4, -1), "w8": (-1, 8, -1), "b2": (-1, -1, 2), "b4": (-1, -1, 4), "s2": (2, -1, -1)}


def kernel_of(fn) -> str:
    """'decode', 'cutlass' or 'other': which kernel family a call launches (profiler names)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    names = " ".join(e.name for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA)
    return "decode" if "scaled_mm_decode" in names else ("cutlass" if "cutlass" in names else "other")


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--ms", default="1,8,16")
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--timer", choices=("rotate", "flush"), default="rotate", help="see benchmarks/timing.py")
    args = ap.parse_args()

    def bench(sets, fn):
        if args.timer == "flush":
            return flushed(lambda: fn(*sets[0]))
        return rotating([lambda s=s: fn(*s) for s in sets])

    load_kernels()
    qf = torch.ops.quantfuse
    has_cutlass = hasattr(qf, "_scaled_mm_cutlass")
    bw = copy_bandwidth()
    print(f"GPU {torch.cuda.get_device_name()}, torch {torch.__version__}, copy {bw / 1e12:.2f} TB/s", flush=True)
    torch.manual_seed(0)
    ms = [int(m) for m in args.ms.split(",")]
    rows = []
    for N, K in NK:
        for dt in (torch.int8, torch.float8_e4m3fn):
            n_sets = 1 if args.timer == "flush" else copies_for(N * K)

            def weight(dt=dt, N=N, K=K):
                if dt == torch.int8:
                    w = torch.randint(-128, 128, (N, K), dtype=dt, device="cuda")
                else:
                    w = (torch.randn(N, K, device="cuda") * 2).to(dt)
                return (w.t(), torch.rand(N, device="cuda") * 1e-2 + 1e-3,
                        torch.randn(N, device="cuda", dtype=torch.bfloat16))

            wsets = [weight() for _ in range(n_sets)]
            cfg = list(qf._scaled_mm_decode_config(N, K))
            for M in ms:
                def act(dt=dt, M=M, K=K):
                    if dt == torch.int8:
                        return torch.randint(-128, 128, (M, K), dtype=dt, device="cuda")
                    return (torch.randn(M, K, device="cuda") * 2).to(dt)

                # (a, b, sa, sb, bias, a padded to 17 rows for _int_mm)
                sets = [(act(), b, torch.rand(M, device="cuda") * 1e-2 + 1e-3, sb, bias,
                         torch.randint(-128, 128, (max(M, 17), K), dtype=torch.int8, device="cuda"))
                        for b, sb, bias in wsets]
                r = {"N": N, "K": K, "M": M, "dtype": str(dt).split(".")[-1], "config": cfg}
                r["decode"] = bench(sets, lambda a, b, sa, sb, bias, ap_: qf._scaled_mm_decode_cuda(
                    a, b, sa, sb, torch.bfloat16, bias))
                # the public op, whose C++ dispatch routes M <= 16 here and larger M to CUTLASS
                r["public"] = bench(sets, lambda a, b, sa, sb, bias, ap_: qf.scaled_mm(
                    a, b, sa, sb, torch.bfloat16, bias))
                r["public_kernel"] = kernel_of(lambda s=sets[0]: qf.scaled_mm(*s[:4], torch.bfloat16, s[4]))
                for name, (sp, wa, st) in VARIANTS.items():
                    r[name] = bench(sets, lambda a, b, sa, sb, bias, ap_, sp=sp, wa=wa, st=st:
                                    qf._scaled_mm_decode_tune(a, b, sa, sb, torch.bfloat16, bias, sp, wa, st))
                r["cutlass"] = (bench(sets, lambda a, b, sa, sb, bias, ap_: qf._scaled_mm_cutlass(
                    a, b, sa, sb, torch.bfloat16, bias)) if has_cutlass else float("nan"))
                if dt == torch.int8:
                    r["baseline"] = bench(sets, lambda a, b, sa, sb, bias, ap_: torch._int_mm(ap_, b))
                else:
                    r["baseline"] = bench(sets, lambda a, b, sa, sb, bias, ap_: torch._scaled_mm(
                        a, b, scale_a=sa.reshape(-1, 1), scale_b=sb.reshape(1, -1), bias=bias,
                        out_dtype=torch.bfloat16))
                nbytes = N * K + M * K + 2 * M * N
                r["floor_us"] = nbytes / bw * 1e6
                r["dram_frac"] = r["floor_us"] / r["decode"]
                rows.append(r)
                sw = " ".join(f"{k} {r[k]:5.1f}" for k in VARIANTS)
                print(f"{r['dtype']:>13} N={N:5d} K={K:5d} M={M:2d} cfg {cfg}: decode {r['decode']:6.1f} µs "
                      f"({100 * r['dram_frac']:3.0f}% DRAM)  public op {r['public']:6.1f} ({r['public_kernel']})  "
                      f"{sw}  "
                      f"cutlass {r['cutlass']:6.1f}  "
                      f"{'_int_mm(M>=17)' if dt == torch.int8 else '_scaled_mm'} {r['baseline']:6.1f}  "
                      f"floor {r['floor_us']:5.1f}", flush=True)
            wsets = sets = None  # free this shape's weights before the next
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "bench_scaled_mm_decode.json").write_text(json.dumps({"copy_TBps": bw / 1e12, "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
