"""The CUDA kernels of ``csrc/``: where they come from and how they are built.

``loader``: loads them at an op's first CUDA call (prebuilt, or built at first use);
``build``: ``python -m compile_backend.kernels.build`` builds them ahead of that call;
``build_config``: the sources, flags and include directories every build uses (``setup.py``,
the JIT build and CI's compile-only check), importable without torch.
"""

from .loader import ensure_loaded, on_load, status

__all__ = ["ensure_loaded", "on_load", "status"]
