"""Decode (M <= 32) AWQ W4A16 kernel: the work split the dispatch chooses (warps per block, K splits,
cluster or workspace) against every other split it can launch, per Llama-3-8B linear shape.
The split heuristics (``warps_for`` / ``splits_for`` in csrc/awq_gemm/awq_gemm_kernels.cu) were
measured on an H100; this says, on the GPU at hand, how far each shape's chosen split is from the best
one.  fp16, group 128, the fragment layout.  Median µs per call over CUDA-graph replays rotating among
weight copies > 2x L2 (benchmarks/timing.py); DRAM fraction = (weight + scales + zeros + activation +
output bytes) / copy bandwidth / time.  "in L2": the chosen split on one weight copy call after call (a
weight that fits the L2 stays there), which says how much of a call's time is waiting on DRAM.

    python benchmarks/dev/bench_awq_decode.py [--ms 1,8] [--out DIR]
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import sys
from pathlib import Path

import torch

# The repository root, and benchmarks/ for timing.py (this benchmark lives in benchmarks/dev/).
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from timing import copies_for, copy_bandwidth, load_kernels, rotating  # noqa: E402

# (N, K): q/k/v merged, o_proj, gate/up merged, down_proj
NK = ((6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336))
G = 128
WARPS = (4, 8, 16)
SPLITS = (1, 2, 4, 8)


def weight_bytes(N: int, K: int) -> int:
    return N * K // 2 + (K // G) * N * 2 + (K // G) * N // 2


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--ms", default="1,8", help="comma list of M (at most 32)")
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    args = ap.parse_args()
    ms = [int(m) for m in args.ms.split(",")]
    if not all(1 <= m <= 32 for m in ms):
        ap.error(f"--ms: each M must be in 1..32 (the decode kernel's range), got {args.ms!r}")

    load_kernels()
    qf = torch.ops.quantfuse
    bw = copy_bandwidth()
    device = torch.cuda.current_device()
    print(f"GPU {torch.cuda.get_device_name()}, torch {torch.__version__}, copy {bw / 1e12:.2f} TB/s", flush=True)
    gen = torch.Generator(device="cuda").manual_seed(0)
    rows = []
    for N, K in NK:
        def weight(N=N, K=K):
            qweight = torch.randint(-2**31, 2**31 - 1, (K, N // 8), generator=gen, device="cuda", dtype=torch.int32)
            scales = (torch.rand(K // G, N, generator=gen, device="cuda") * 0.01 + 0.001).half()
            qzeros = torch.randint(-2**31, 2**31 - 1, (K // G, N // 8), generator=gen, device="cuda",
                                   dtype=torch.int32)
            return qf._awq_repack_cuda(qweight), scales, qzeros

        wsets = [weight() for _ in range(copies_for(weight_bytes(N, K)))]
        for M in ms:
            sets = [(torch.randn(M, K, generator=gen, device="cuda").half(), *w) for w in wsets]
            ref = qf._awq_gemm_cuda(*sets[0][:4], G, None)
            r = {"N": N, "K": K, "M": M, "chosen_splits": qf._awq_gemm_splits(M, N, K, False, device)}
            r["chosen"] = rotating([lambda s=s: qf._awq_gemm_cuda(*s, G, None) for s in sets])
            r["chosen_in_l2"] = rotating([lambda s=sets[0]: qf._awq_gemm_cuda(*s, G, None)])
            variants = {}
            for warps, splits, cluster in itertools.product(WARPS, SPLITS, (True, False)):
                if (warps == 16 and M > 8) or (splits == 1 and not cluster):
                    continue
                name = f"w{warps}s{splits}{'c' if cluster and splits > 1 else ''}"
                out = qf._awq_gemm_cuda(*sets[0][:4], G, None, warps, splits, cluster)
                if not torch.equal(out, ref) and not torch.allclose(out.float(), ref.float(), rtol=1e-2, atol=1e-2):
                    raise SystemExit(f"N={N} K={K} M={M} {name}: result differs from the chosen split's")
                variants[name] = rotating([lambda s=s, w=warps, p=splits, c=cluster: qf._awq_gemm_cuda(
                    *s, G, None, w, p, c) for s in sets])
            best = min(variants, key=variants.get)
            floor_us = (weight_bytes(N, K) + 2 * M * (K + N)) / bw * 1e6
            r.update(variants=variants, best=best, best_us=variants[best], floor_us=floor_us,
                     dram_frac_chosen=floor_us / r["chosen"], dram_frac_best=floor_us / variants[best])
            rows.append(r)
            print(f"N={N:5d} K={K:5d} M={M:2d}: chosen {r['chosen']:6.1f} µs ({100 * r['dram_frac_chosen']:3.0f}% "
                  f"DRAM, {r['chosen_splits']} split(s); in L2 {r['chosen_in_l2']:6.1f})  "
                  f"best {best} {variants[best]:6.1f} µs "
                  f"({100 * r['dram_frac_best']:3.0f}%)  floor {floor_us:5.1f}", flush=True)
        wsets = sets = None  # free this shape's weights before the next
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "bench_awq_decode.json").write_text(json.dumps({"gpu": torch.cuda.get_device_name(),
                                                           "copy_TBps": bw / 1e12, "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
