"""Per-token activation quantization: quantfuse.quantize_per_token against the form it replaces in
eager CUDA inference (W8A8Linear.quantize_input's torch ops: 8 to 17 element-wise kernels and
reductions over float32 temporaries), in one run.

For each (M, K) in ``SHAPES``, mode (int8 symmetric, int8 asymmetric, fp8) and the activation
dtype (``--dtype``, float16 by default): the median µs per call (benchmarks/timing.py ``rotating``:
CUDA graphs over input copies that exceed twice the L2, so no call reads its input from L2 and
host launch overhead is excluded for both paths), and the bytes the op must move (x read once, q
written) per second as a share of the device-to-device copy bandwidth measured in the same run.

    PYTHONPATH=. python benchmarks/bench_quantize_per_token.py [--dtype bfloat16] [--shapes 2048x4096]
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from timing import copies_for, copy_bandwidth, load_kernels, rotating  # noqa: E402

from compile_backend.ops.quantize_per_token import reference  # noqa: E402

SHAPES = ((1, 4096), (16, 4096), (256, 4096), (2048, 4096), (2048, 14336))
MODES = {"int8": (torch.int8, True), "int8-asym": (torch.int8, False), "fp8": (torch.float8_e4m3fn, True)}


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dtype", default="float16", choices=("float16", "bfloat16", "float32"))
    default_shapes = ",".join(f"{m}x{k}" for m, k in SHAPES)
    ap.add_argument("--shapes", default=None, help=f"comma list of MxK (default: {default_shapes})")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        sys.exit("bench_quantize_per_token: needs a CUDA GPU")
    dtype = getattr(torch, args.dtype)
    shapes = SHAPES if args.shapes is None else [tuple(int(v) for v in s.split("x")) for s in args.shapes.split(",")]
    load_kernels()
    copy_bw = copy_bandwidth()
    print(f"GPU {torch.cuda.get_device_name()}, torch {torch.__version__}, activations {args.dtype}; "
          f"copy bandwidth {copy_bw / 1e12:.2f} TB/s (read + write)")
    print(f"{'M x K':<12} {'mode':<10} {'op µs':>8} {'form µs':>8} {'x form':>7} {'op TB/s':>8} {'% copy':>7}")
    for M, K in shapes:
        moved = M * K * (torch.finfo(dtype).bits // 8 + 1)  # x read once, q written
        copies = copies_for(moved)
        xs = [torch.randn(M, K, device="cuda").mul_(4).to(dtype) for _ in range(copies)]
        for mode, (qdtype, symmetric) in MODES.items():
            op = rotating([lambda x=x: torch.ops.quantfuse.quantize_per_token(x, qdtype, symmetric) for x in xs])
            form = rotating([lambda x=x: reference(x, qdtype, symmetric) for x in xs])
            tbs = moved / (op * 1e-6) / 1e12
            print(f"{f'{M}x{K}':<12} {mode:<10} {op:8.1f} {form:8.1f} {form / op:6.1f}x {tbs:8.2f} "
                  f"{100 * tbs * 1e12 / copy_bw:6.0f}%")


if __name__ == "__main__":
    main()
