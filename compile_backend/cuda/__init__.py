"""CUDA dispatch for each kernel family: what the kernel supports, and how to launch it.

One module per family, named like its op and its ``csrc/`` folder; each calls
``compile_backend.kernels.register`` on import (nothing is built until the first
CUDA call).
"""

from . import awq_gemm, scaled_mm  # noqa: F401  (imported for their registrations)
