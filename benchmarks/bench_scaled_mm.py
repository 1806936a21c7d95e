"""Benchmark quantfuse.scaled_mm (CUTLASS SM90) against what a user runs today.

For (N, K) in {(6144,4096), (4096,4096), (28672,4096), (4096,14336)} and M in
{1,16,64,256,1024,4096,8192}: median time per call (benchmarks/timing.py: by default CUDA-graph
replays rotating over input copies that exceed twice the L2; --timer flush for do_bench's
L2 flush) of
  * ours: int8 per-token x per-channel + bias, bf16 out (the main target case)
  * ours azp: the same with per-token zero points (ScaledBiasAzpToken)
  * ours fp8: float8_e4m3fn row-wise + bias, bf16 out
  * bf16 cuBLAS  x @ w.t()
  * torch._int_mm alone (int32 out; M < 17 padded to 17 rows, its minimum)
  * _int_mm + scale/bias epilogue under Inductor (torch.compile default, dynamic shapes)
  * torch._scaled_mm FP8 row-wise + bias
Writes a markdown table (times, TOP/s, ratios), JSON and a PNG plot (TOP/s vs M, with the
dense int8 peak 1979 TOP/s and the DRAM floor at the measured copy bandwidth).

    python benchmarks/bench_scaled_mm.py --out DIR [--quick]
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from timing import copies_for, copy_bandwidth, flushed, load_kernels, rotating  # noqa: E402

NK = ((6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336))
MS = (1, 16, 64, 256, 1024, 4096, 8192)
PEAK_TOPS = 1979.0


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--no-ours-fp8", action="store_true", help="skip our fp8 kernel (debugging)")
    ap.add_argument("--ms", default="", help="comma-separated M values (default: all)")
    ap.add_argument("--timer", choices=("rotate", "flush"), default="rotate",
                    help="rotate: CUDA graph over input copies > 2x L2 (default); flush: do_bench's L2 flush; "
                    "see benchmarks/timing.py")
    ap.add_argument("--skip", default="",
                    help="comma-separated columns not to measure (nan), e.g. ours_azp,cublas_bf16")
    args = ap.parse_args()
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)


    load_kernels()
    torch.manual_seed(0)
    bw = copy_bandwidth()
    gpu = torch.cuda.get_device_name()
    print(f"GPU {gpu}, torch {torch.__version__}, copy bandwidth {bw / 1e12:.2f} TB/s", flush=True)

    def epilogue(a, b, sa, sb, bias):
        return (torch._int_mm(a, b).float() * sa * sb + bias).to(torch.bfloat16)

    inductor = torch.compile(epilogue, dynamic=True)

    rows = []
    nk_list = NK[:2] if args.quick else NK
    m_list = (1, 16, 1024) if args.quick else MS
    if args.ms:
        m_list = tuple(int(m) for m in args.ms.split(","))
    skip = set(filter(None, args.skip.split(",")))
    if args.no_ours_fp8:
        skip.add("ours_fp8")

    def measure(name, sets, fn):
        """fn(set) timed over every input set (rotate) or over the first one (flush)."""
        if name in skip:
            return float("nan")
        if args.timer == "flush":
            return flushed(lambda: fn(sets[0]))
        return rotating([lambda s=s: fn(s) for s in sets])

    def weights(N, K):
        w8 = torch.randint(-128, 128, (N, K), dtype=torch.int8, device="cuda")
        return {
            "b8": w8.t(),
            "wf8": (torch.randn(N, K, device="cuda") * 2).to(torch.float8_e4m3fn),
            "sb": torch.rand(N, device="cuda") * 1e-2 + 1e-3,
            "bias": torch.randn(N, device="cuda", dtype=torch.bfloat16),
            "colsum": w8.to(torch.int32).sum(1, dtype=torch.int32),
        }

    def activations(w, M, K):
        Mp = max(M, 17)
        a = {
            "a8": torch.randint(-128, 128, (M, K), dtype=torch.int8, device="cuda"),
            "af8": (torch.randn(M, K, device="cuda") * 2).to(torch.float8_e4m3fn),
            "abf": torch.randn(M, K, device="cuda", dtype=torch.bfloat16),
            "sa": torch.rand(M, device="cuda") * 1e-2 + 1e-3,
            "azp": torch.randint(-50, 50, (M,), dtype=torch.int32, device="cuda"),
            "a8p": torch.randint(-128, 128, (Mp, K), dtype=torch.int8, device="cuda"),
            "sap": torch.rand(Mp, 1, device="cuda") * 1e-2,
        }
        a["sa2"] = a["sa"].reshape(-1, 1)
        a["sb2"] = w["sb"].reshape(1, -1)
        return {**w, **a}

    def scaled_mm_fp8(s):
        return torch._scaled_mm(s["af8"], s["wf8"].t(), scale_a=s["sa2"], scale_b=s["sb2"], bias=s["bias"],
                                out_dtype=torch.bfloat16)

    for N, K in nk_list:
        # distinct weights per copy; each path reads one dtype of them (N*K bytes for int8 or
        # fp8), so that is what has to exceed twice the L2 over the rotation
        n_sets = 1 if args.timer == "flush" else copies_for(N * K)
        wsets = [weights(N, K) for _ in range(n_sets)]
        wbf = [torch.randn(N, K, device="cuda", dtype=torch.bfloat16) for _ in range(n_sets)]
        for M in m_list:
            sets = [activations(w, M, K) for w in wsets]
            bf_sets = [(torch.randn(M, K, device="cuda", dtype=torch.bfloat16), w) for w in wbf]
            r = {"N": N, "K": K, "M": M}
            r["ours"] = measure("ours", sets, lambda s: torch.ops.quantfuse.scaled_mm(
                s["a8"], s["b8"], s["sa"], s["sb"], torch.bfloat16, s["bias"]))
            r["ours_azp"] = measure("ours_azp", sets, lambda s: torch.ops.quantfuse.scaled_mm_azp(
                s["a8"], s["b8"], s["sa"], s["sb"], torch.bfloat16, s["colsum"], s["azp"], s["bias"]))
            r["ours_fp8"] = measure("ours_fp8", sets, lambda s: torch.ops.quantfuse.scaled_mm(
                s["af8"], s["wf8"].t(), s["sa"], s["sb"], torch.bfloat16, s["bias"]))
            # our CUTLASS fp8 kernels even where the op routes to cuBLASLt (M >= 256: scaled_mm_dispatch.cpp)
            r["ours_fp8_cutlass"] = measure("ours_fp8_cutlass", sets, lambda s: torch.ops.quantfuse._scaled_mm_cutlass(
                s["af8"], s["wf8"].t(), s["sa"], s["sb"], torch.bfloat16, s["bias"], None, None, 0, -1))
            r["cublas_bf16"] = measure("cublas_bf16", bf_sets, lambda s: s[0] @ s[1].t())
            r["int_mm"] = measure("int_mm", sets, lambda s: torch._int_mm(s["a8p"], s["b8"]))
            r["int_mm_inductor"] = measure("int_mm_inductor", sets, lambda s: inductor(
                s["a8p"], s["b8"], s["sap"], s["sb"], s["bias"]))
            try:
                scaled_mm_fp8(sets[0])
                r["scaled_mm_fp8"] = measure("scaled_mm_fp8", sets, scaled_mm_fp8)
            except RuntimeError as exc:
                print("torch._scaled_mm failed:", exc)
                r["scaled_mm_fp8"] = float("nan")
            sets = bf_sets = None
            ops_count = 2 * M * N * K
            bytes_ = M * K + N * K + 2 * M * N
            r["floor_us"] = max(bytes_ / bw, ops_count / (PEAK_TOPS * 1e12)) * 1e6
            r["dram_frac"] = bytes_ / bw * 1e6 / r["ours"]
            rows.append(r)
            print(
                f"N={N:5d} K={K:5d} M={M:5d}  ours {r['ours']:8.1f}  azp {r['ours_azp']:8.1f}  fp8 {r['ours_fp8']:8.1f}"
                f"  bf16 {r['cublas_bf16']:8.1f}  int_mm {r['int_mm']:8.1f}  ind {r['int_mm_inductor']:8.1f}"
                f"  _scaled_mm {r['scaled_mm_fp8']:8.1f}  floor {r['floor_us']:6.1f}",
                flush=True,
            )
        wsets = wbf = None  # free this shape's weights before the next
        torch.cuda.empty_cache()

    meta = {
        "gpu": gpu,
        "torch": torch.__version__,
        "date": datetime.date.today().isoformat(),
        "copy_bandwidth_TBps": bw / 1e12,
        "timer": ("median of CUDA-graph replays over input copies exceeding 2x L2, per call, µs"
                  if args.timer == "rotate" else "triton.testing.do_bench median (L2 flushed before each call), µs"),
    }
    (out_dir / "bench_scaled_mm.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
    md = render(meta, rows)
    (out_dir / "results_scaled_mm.md").write_text(md)
    print(md)
    plot(meta, rows, bw, out_dir / "bench_scaled_mm.png")
    return 0


def tops(r, key):
    return 2 * r["M"] * r["N"] * r["K"] / (r[key] * 1e-6) / 1e12


def render(meta, rows) -> str:
    cols = ("ours", "ours_azp", "ours_fp8", "ours_fp8_cutlass", "cublas_bf16", "int_mm", "int_mm_inductor",
            "scaled_mm_fp8")
    lines = [
        "# quantfuse.scaled_mm (CUTLASS SM90) benchmark",
        "",
        f"GPU {meta['gpu']}, torch {meta['torch']}, {meta['date']}; measured copy bandwidth "
        f"{meta['copy_bandwidth_TBps']:.2f} TB/s. {meta['timer']}. TOP/s in brackets.",
        "ours = int8 per-token x per-channel + bias, bf16 out; ours_azp = same + per-token zero point;"
        " ours_fp8 = fp8 row-wise + bias through the op (cuBLASLt via torch._scaled_mm from M = 256 on"
        " Hopper); ours_fp8_cutlass = our CUTLASS SM90 fp8 kernels (M <= 16: the CUTLASS decode tile)."
        " `_int_mm` rows for M < 17 are run at M = 17 (its minimum).",
        "",
    ]
    for N, K in dict.fromkeys((r["N"], r["K"]) for r in rows):
        sub = [r for r in rows if (r["N"], r["K"]) == (N, K)]
        lines += [f"## N={N}, K={K}", "", "| path | " + " | ".join(f"M={r['M']}" for r in sub) + " |",
                  "|---|" + "---|" * len(sub)]
        for c in cols:
            lines.append(f"| {c} | " + " | ".join(f"{r[c]:.1f} ({tops(r, c):.0f})" for r in sub) + " |")
        lines.append("| floor (DRAM or peak), µs | " + " | ".join(f"{r['floor_us']:.1f}" for r in sub) + " |")
        ratio = lambda num, den: " | ".join(f"{r[num] / r[den]:.2f}" for r in sub)  # noqa: E731
        lines.append("| ratio int_mm+Inductor / ours | " + ratio("int_mm_inductor", "ours") + " |")
        lines.append("| ratio int_mm / ours | " + ratio("int_mm", "ours") + " |")
        lines.append("| ratio _scaled_mm / ours_fp8 | " + ratio("scaled_mm_fp8", "ours_fp8") + " |")
        lines.append("| ratio _scaled_mm / ours_fp8_cutlass | " + ratio("scaled_mm_fp8", "ours_fp8_cutlass") + " |")
        lines.append("| ratio ours_azp / ours | " + ratio("ours_azp", "ours") + " |")
        lines.append("| DRAM fraction (bytes/bw / ours) | " + " | ".join(f"{r['dram_frac']:.2f}" for r in sub) + " |")
        lines.append("")
    return "\n".join(lines)


def plot(meta, rows, bw, path):
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    shapes = list(dict.fromkeys((r["N"], r["K"]) for r in rows))
    fig, axes = plt.subplots(1, len(shapes), figsize=(5 * len(shapes), 4.2), squeeze=False)
    for ax, (N, K) in zip(axes[0], shapes):
        sub = [r for r in rows if (r["N"], r["K"]) == (N, K)]
        ms = [r["M"] for r in sub]
        for key in ("ours", "ours_fp8", "int_mm", "int_mm_inductor", "scaled_mm_fp8", "cublas_bf16"):
            ax.plot(ms, [tops(r, key) for r in sub], marker="o", label=key)
        fine = [2 ** (i / 4) for i in range(0, 4 * 14)]
        roof = [min(PEAK_TOPS, 2 * m * N * K / ((m * K + N * K + 2 * m * N) / bw) / 1e12) for m in fine]
        ax.plot(fine, roof, "k--", label="min(peak 1979, DRAM floor)")
        ax.axhline(PEAK_TOPS, color="gray", lw=0.5)
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("M")
        ax.set_ylabel("TOP/s")
        ax.set_title(f"N={N} K={K}")
    axes[0][0].legend(fontsize=7)
    fig.suptitle(f"{meta['gpu']}, torch {meta['torch']}, {meta['date']}")
    fig.tight_layout()
    fig.savefig(path, dpi=90)


if __name__ == "__main__":
    sys.exit(main())
