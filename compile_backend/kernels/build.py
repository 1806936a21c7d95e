"""Build (or check) the CUDA kernels ahead of the first call: ``python -m compile_backend.kernels.build [--verbose]``.

Where the package carries prebuilt kernels (a wheel built with
``QUANTFUSE_BUILD_CUDA=1``) and they serve this GPU and torch, this loads them
and says so.  Otherwise it builds csrc/ for the GPU present (sm_90a on Hopper)
with ``MAX_JOBS`` parallel jobs into torch's extension cache, so the first
compiled model does not wait.
"""

from __future__ import annotations

import argparse
import sys

import torch

from . import loader as kernels


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--verbose", action="store_true", help="show the compiler's command lines")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("quantfuse build: no CUDA GPU here; nothing to build (the reference implementations run).")
        return 0
    library = kernels.prebuilt_library()
    reason = kernels.prebuilt_unusable(library) if library is not None else "none in the package"
    if reason is None:
        if not kernels.ensure_loaded():
            print(f"quantfuse build: the prebuilt kernels failed to load: {kernels.status()['error']}", file=sys.stderr)
            return 1
        how = f"{kernels.status()['kernels']} {kernels.status()['library'] or ''}".strip()
    else:
        print(f"quantfuse build: prebuilt kernels not used ({reason}); building from source")
        try:
            kernels.csrc_dir()
        except FileNotFoundError as exc:
            print(f"quantfuse build: {exc}", file=sys.stderr)
            return 1
        if not kernels.sources():
            print("quantfuse build: no kernel sources under csrc/.")
            return 0
        try:
            kernels.build(verbose=args.verbose)
        except Exception as exc:
            print(f"quantfuse build: failed: {exc}", file=sys.stderr)
            return 1
        how = "built from source"
    families = ", ".join(kernels.status()["families"])
    print(f"quantfuse build: ok ({how}; {torch.cuda.get_device_name()}, families: {families})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
