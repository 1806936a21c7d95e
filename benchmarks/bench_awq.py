"""AWQ W4A16 GEMM benchmark: quantfuse against what a user runs instead, in one run.

For (N, K) in the four Llama layer shapes and M in ``MS`` (1 to 4096):

* ours            torch.ops.quantfuse.awq_gemm (dispatch: the streaming kernel for small M,
                  the SM90 mixed-input kernel above the crossover)
* ours_kernel     the streaming kernel alone (M <= 1024; to find the crossover)
* ours_dq_cublas  our dequantize kernel + cuBLAS alone
* cublas_fp16     fp16 cuBLAS on the dequantized weight, ``x @ w.t()``
* tinygemm        torch._weight_int4pack_mm (bf16, group 128)
* inductor        AWQ dequant + matmul (AWQLinear.forward) under torch.compile's default
                  backend, compiled once with dynamic shapes

fp16 activations, group size 128.  Each timed call runs as a CUDA graph that loops over
enough input copies (weights included) to exceed twice the 50 MB L2, so no call reads a
weight from L2 left there by the previous one; host launch overhead is excluded for
every path alike.  Times are medians of CUDA-event-timed replays (no L2 flush between
them; benchmarks/timing.py), divided by the calls per replay.  Effective TB/s counts the int4 weight, scales and
zeros bytes once.

    PYTHONPATH=. python benchmarks/bench_awq.py --out DIR
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

import compile_backend  # noqa: E402,F401
from compile_backend.quantize import AWQLinear, awq_pack  # noqa: E402

sys.path.insert(0, os.path.dirname(__file__))
from timing import copies_for, load_kernels, rotating  # noqa: E402

SHAPES = ((6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336))
MS = (1, 8, 16, 32, 48, 64, 128, 256, 320, 384, 512, 640, 768, 1024, 1152, 1536, 2048, 2560, 4096)
G = 128
DEV = "cuda"
# The op's streaming kernel serves M up to this (csrc/awq_gemm/awq_gemm_dispatch.cpp: kDecodeMaxM).
DECODE_MAX_M = 32
# SM90 tile configurations 0..NUM_CONFIGS-1 (csrc/awq_gemm/awq_gemm_sm90_choice.h: kNumConfigs).
NUM_CONFIGS = 13


def weight_bytes(N, K, G=G):
    return K * N // 2 + (K // G) * N * 2 + (K // G) * N // 2


def make_set(M, N, K, gen):
    q = torch.randint(0, 16, (K, N), generator=gen, device=DEV, dtype=torch.int32)
    z = torch.randint(0, 16, (K // G, N), generator=gen, device=DEV, dtype=torch.int32)
    s = (torch.rand((K // G, N), generator=gen, device=DEV) * 2e-3 + 1e-4).half()
    x = torch.randn((M, K), generator=gen, device=DEV).half()
    return x, awq_pack(q), s, awq_pack(z)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--shapes", default="all")
    ap.add_argument("--ms", default=",".join(map(str, MS)))
    ap.add_argument("--sanitize", action="store_true", help="a few small calls of every kernel, for compute-sanitizer")
    ap.add_argument("--one", default=None, help="N,K,M[,warps]: three calls of the fused kernel (for ncu)")
    args = ap.parse_args()
    load_kernels()
    if args.sanitize:
        return sanitize()
    if args.one:
        N, K, M, *w = (int(v) for v in args.one.split(","))
        x, qw, s, qz = make_set(M, N, K, torch.Generator(device=DEV).manual_seed(0))
        packed = torch.ops.quantfuse._awq_repack_cuda(qw)
        for _ in range(3):
            torch.ops.quantfuse._awq_gemm_cuda(x, packed, s, qz, G, None, w[0] if w else 0)
        torch.cuda.synchronize()
        return None
    torch.backends.cuda.matmul.allow_tf32 = False
    ms_list = [int(m) for m in args.ms.split(",")]
    shapes = SHAPES if args.shapes == "all" else [tuple(map(int, s.split("x"))) for s in args.shapes.split(",")]
    gen = torch.Generator(device=DEV).manual_seed(0)

    # Inductor baseline: one compiled AWQLinear-style forward, dynamic shapes.
    def awq_forward(x, qweight, qzeros, scales):
        from compile_backend.ops import awq_unpack

        w = awq_unpack(qweight)
        zz = awq_unpack(qzeros).repeat_interleave(G, dim=0)
        return torch.matmul(x, (w - zz).to(scales.dtype) * scales.repeat_interleave(G, dim=0))

    inductor_fn = torch.compile(awq_forward, dynamic=True)
    assert AWQLinear is not None  # the module whose forward this mirrors

    rows = []
    for N, K in shapes:
        wb = weight_bytes(N, K)
        for M in ms_list:
            row = {"N": N, "K": K, "M": M, "weight_bytes": wb}
            act_bytes = M * K * 2 + M * N * 2
            # --- ours and our two paths
            n_ours = copies_for(wb + act_bytes)
            sets = [make_set(M, N, K, gen) for _ in range(n_ours)]
            packed = []
            row["ours"] = rotating(
                [lambda s=s: torch.ops.quantfuse.awq_gemm(s[0], s[1], s[2], s[3], G) for s in sets])
            if M <= 1024:
                packed = [torch.ops.quantfuse._awq_repack_cuda(s[1]) for s in sets]
                row["ours_kernel"] = rotating(
                    [lambda s=s, p=p: torch.ops.quantfuse._awq_gemm_cuda(s[0], p, s[2], s[3], G, None)
                     for s, p in zip(sets, packed)])
            if M <= 64:
                row["ours_kernel_w8"] = rotating(
                    [lambda s=s, p=p: torch.ops.quantfuse._awq_gemm_cuda(s[0], p, s[2], s[3], G, None, 8)
                     for s, p in zip(sets, packed)])
            if M >= 16:
                row["ours_dq_cublas"] = rotating(
                    [lambda s=s: torch.mm(s[0], torch.ops.quantfuse._awq_dequantize_cuda(s[1], s[2], s[3], G))
                     for s in sets])
            # correctness spot check of the dispatch against the dense product
            x, qw, s_, qz = sets[0]
            dense = torch.ops.quantfuse.awq_dequantize(qw, s_, qz, G)
            ref = x.float() @ dense.float()
            out = torch.ops.quantfuse.awq_gemm(x, qw, s_, qz, G).float()
            row["rel_err"] = (torch.linalg.norm(out - ref) / torch.linalg.norm(ref)).item()
            # --- inductor on the same AWQ tensors
            row["inductor"] = rotating(
                [lambda s=s: inductor_fn(s[0], s[1], s[3], s[2]) for s in sets])
            del sets, packed
            # --- fp16 cuBLAS on the dequantized weight, nn.Linear layout [N, K]
            dense_t = dense.t().contiguous()
            n_cb = copies_for(K * N * 2 + act_bytes)
            cb = [(torch.randn((M, K), generator=gen, device=DEV).half(),
                   dense_t if i == 0 else dense_t.clone()) for i in range(n_cb)]
            row["cublas_fp16"] = rotating([lambda c=c: c[0] @ c[1].t() for c in cb])
            del cb, dense_t, dense
            # --- tinygemm: bf16, group 128
            n_tg = copies_for(wb + act_bytes)
            tg = []
            for _ in range(n_tg):
                wq = torch.randint(0, 16, (N, K), generator=gen, device=DEV, dtype=torch.int32)
                w_u8 = ((wq[:, ::2] << 4) | wq[:, 1::2]).to(torch.uint8)
                wpk = torch.ops.aten._convert_weight_to_int4pack(w_u8, 8)
                sz = torch.rand((K // G, N, 2), generator=gen, device=DEV).to(torch.bfloat16)
                tg.append((torch.randn((M, K), generator=gen, device=DEV).to(torch.bfloat16), wpk, sz))
            row["tinygemm"] = rotating(
                [lambda t=t: torch._weight_int4pack_mm(t[0], t[1], G, t[2]) for t in tg])
            del tg
            torch.cuda.empty_cache()
            print(json.dumps(row), flush=True)
            rows.append(row)

    meta = {
        "gpu": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "decode_max_m": DECODE_MAX_M,
        "group_size": G,
        "dtype": "float16 (tinygemm: bfloat16)",
    }
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "bench_awq.json"), "w") as f:
        json.dump({"meta": meta, "rows": rows}, f, indent=1)
    md = render(meta, rows)
    with open(os.path.join(args.out, "results_awq_table.md"), "w") as f:
        f.write(md)
    plot(rows, os.path.join(args.out, "bench_awq.png"))
    print(md)


def _sanitize_weight(N, K, g, dtype, gen):
    """Random AWQ tensors (zeros over the full range, small scales) and their dense weight."""
    q = torch.randint(0, 16, (K, N), generator=gen, device=DEV, dtype=torch.int32)
    z = torch.randint(0, 16, (K // g, N), generator=gen, device=DEV, dtype=torch.int32)
    s = (torch.rand((K // g, N), generator=gen, device=DEV) * 1e-2 + 1e-3).to(dtype)
    qw, qz = awq_pack(q), awq_pack(z)
    return qw, s, qz, torch.ops.quantfuse.awq_dequantize(qw, s, qz, g)


def _rel_err(out, ref) -> float:
    return (torch.linalg.norm(out.float() - ref) / torch.linalg.norm(ref)).item()


def sanitize():
    """Small calls of the repack, dequantize, fused (split-K and not) and large-M paths, and
    on Hopper every SM90 tile configuration."""
    gen = torch.Generator(device=DEV).manual_seed(1)
    worst = 0.0
    for dtype in (torch.float16, torch.bfloat16):
        # N = 16896: enough 64-wide strips (2 per SM on an H100) for 4-warp blocks at M = 9-16
        for (N, K, g) in ((128, 256, 32), (192, 4096, 128), (64, 64, 64), (16896, 256, 64)):
            qw, s, qz, dense = _sanitize_weight(N, K, g, dtype, gen)
            for M in (1, 5, 12, 17, 40, 100):
                x = torch.randn((M, K), generator=gen, device=DEV).to(dtype)
                b = torch.randn((N,), generator=gen, device=DEV).to(dtype)
                out = torch.ops.quantfuse.awq_gemm(x, qw, s, qz, g, b)
                worst = max(worst, _rel_err(out, x.float() @ dense.float() + b.float()))
        if torch.cuda.get_device_capability() == (9, 0):
            # every SM90 tile configuration, forced (N = 384: an odd number of 128-row tiles);
            # K = 4096 gives the stream-K configurations K iterations to split across SMs, so
            # their partial-tile reduction through the workspace runs too
            for N, K, g in ((384, 512, 128), (384, 4096, 128)):
                qw, s, qz, dense = _sanitize_weight(N, K, g, dtype, gen)
                x = torch.randn((300, K), generator=gen, device=DEV).to(dtype)
                prepared = torch.ops.quantfuse._awq_prepare_sm90_cuda(qw, s, qz, g)
                for config in range(NUM_CONFIGS):
                    out = torch.ops.quantfuse._awq_gemm_sm90_cuda(x, *prepared, g, None, config)
                    worst = max(worst, _rel_err(out, x.float() @ dense.float()))
    torch.cuda.synchronize()
    print(f"sanitize run done; worst relative error {worst:.3g}")


def render(meta, rows):
    out = [f"GPU: {meta['gpu']}; torch {meta['torch']}; {meta['date']}; fp16, group {meta['group_size']}; "
           f"streaming kernel for M <= {meta['decode_max_m']}, SM90 mixed-input kernel above. "
           "Times in µs (CUDA-graph replays, median); "
           "TB/s = int4 weight+scales+zeros bytes / time.\n"]
    for (N, K) in sorted({(r["N"], r["K"]) for r in rows}, key=lambda t: (t[0] * t[1])):
        out.append(f"\n### N={N}, K={K} (int4 weight+scales+zeros {weight_bytes(N, K) / 1e6:.1f} MB)\n")
        out.append("| M | ours | TB/s | kernel (auto warps) | kernel (8 warps) | dq+cuBLAS | fp16 cuBLAS | tinygemm | "
                   "Inductor | vs cuBLAS | vs tinygemm | vs Inductor |")
        out.append("|---|---|---|---|---|---|---|---|---|---|---|---|")
        for r in rows:
            if (r["N"], r["K"]) != (N, K):
                continue
            f = lambda k, r=r: f"{r[k]:.1f}" if k in r else "-"
            tbs = r["weight_bytes"] / (r["ours"] * 1e-6) / 1e12
            out.append(f"| {r['M']} | {f('ours')} | {tbs:.2f} | {f('ours_kernel')} | {f('ours_kernel_w8')} | "
                       f"{f('ours_dq_cublas')} | "
                       f"{f('cublas_fp16')} | {f('tinygemm')} | {f('inductor')} | "
                       f"{r['cublas_fp16'] / r['ours']:.2f}x | {r['tinygemm'] / r['ours']:.2f}x | "
                       f"{r['inductor'] / r['ours']:.2f}x |")
    return "\n".join(out) + "\n"


def plot(rows, path):
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except Exception as exc:  # plotting is optional
        print("no plot:", exc)
        return
    shapes = sorted({(r["N"], r["K"]) for r in rows})
    fig, axes = plt.subplots(1, len(shapes), figsize=(5 * len(shapes), 4), squeeze=False)
    for ax, (N, K) in zip(axes[0], shapes):
        rs = [r for r in rows if (r["N"], r["K"]) == (N, K)]
        for key in ("ours", "ours_kernel", "ours_kernel_w8", "ours_dq_cublas", "cublas_fp16", "tinygemm",
                    "inductor"):
            pts = [(r["M"], r[key]) for r in rs if key in r]
            if pts:
                ax.plot(*zip(*pts), marker="o", label=key)
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_title(f"N={N} K={K}")
        ax.set_xlabel("M")
        ax.set_ylabel("µs")
        ax.grid(True, which="both", alpha=0.3)
    axes[0][0].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    main()
