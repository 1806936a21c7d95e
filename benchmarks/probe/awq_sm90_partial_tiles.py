"""Probe: the SM90 AWQ prefill kernel when the last token tile is partly past the end of x.

Run from the repository root on an H100 (extension built).  For each Llama shape and M, times the
op as it runs ("auto") against x zero-padded to a multiple of 128 or 256 rows inside the timed
call, and with configs 0 and 1 forced.  Written before the op padded x itself (session 9); since
then "auto" includes the op's own padding (awq_gemm_sm90.h: padded_tokens).  Output of the run
behind that rule: awq_sm90_partial_tiles_2026-11-24.txt.
"""
import os
import sys

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
from bench_awq import G, make_set, weight_bytes  # noqa: E402
from timing import copies_for, rotating  # noqa: E402

import compile_backend  # noqa: E402,F401
from compile_backend import kernels  # noqa: E402
from compile_backend.cuda import awq_gemm_sm90 as sm90  # noqa: E402

assert kernels.ensure_loaded()
gen = torch.Generator(device="cuda").manual_seed(0)

def padded(s, mult, cfg=-1):
    M = s[0].shape[0]
    Mp = -(-M // mult) * mult
    return sm90.launch_prefill(F.pad(s[0], (0, 0, 0, Mp - M)), s[1], s[2], s[3], G, None, cfg)[:M]

for N, K in ((28672, 4096), (6144, 4096), (4096, 14336), (4096, 4096)):
    for M in (33, 64, 100, 129, 200, 256, 300, 1000, 1024):
        n = copies_for(weight_bytes(N, K) + M * K * 2 + M * N * 2)
        sets = [make_set(M, N, K, gen) for _ in range(n)]
        row = [f"N={N} K={K} M={M:4d} cfg={torch.ops.quantfuse._awq_sm90_config(M, N, K, G, 0)}"]
        t = rotating([lambda s=s: sm90.launch_prefill(s[0], s[1], s[2], s[3], G, None) for s in sets])
        row.append(f"auto {t:6.1f}")
        for mult in (128, 256):
            Mp = -(-M // mult) * mult
            t = rotating([lambda s=s: padded(s, mult) for s in sets])
            row.append(f"pad{mult}(cfg {torch.ops.quantfuse._awq_sm90_config(Mp, N, K, G, 0)}) {t:6.1f}")
        for cfg in (0, 1):
            t = rotating([lambda s=s: padded(s, 128, cfg) for s in sets])
            row.append(f"pad128-c{cfg} {t:6.1f}")
        unpadded = sm90.launch_prefill(sets[0][0], *sets[0][1:], G)
        err = (padded(sets[0], 128).float() - unpadded.float()).abs().max().item()
        row.append(f"maxdiff {err:.3g}")
        print("  ".join(row), flush=True)
