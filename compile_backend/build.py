"""Prebuild the CUDA extension: ``python -m compile_backend.build [--verbose]``.

Builds csrc/ for the GPU present (sm_90a on Hopper) with ``MAX_JOBS`` parallel
jobs, into torch's extension cache, so the first compiled model does not wait.
"""

from __future__ import annotations

import argparse
import sys

import torch

from . import kernels


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--verbose", action="store_true", help="show the compiler's command lines")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("quantfuse build: no CUDA GPU here; nothing to build (the reference implementations run).")
        return 0
    if not kernels.sources():
        print("quantfuse build: no kernel sources under csrc/.")
        return 0
    try:
        kernels.build(verbose=args.verbose)
    except Exception as exc:
        print(f"quantfuse build: failed: {exc}", file=sys.stderr)
        return 1
    print(f"quantfuse build: ok ({torch.cuda.get_device_name()}, families: {', '.join(kernels.status()['families'])})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
