"""quantfuse: a torch.compile backend that fuses quantized matmuls into single CUDA kernels.

``torch.compile(model, backend="quantfuse")`` works after installation without
importing this package; import it for the ops (``torch.ops.quantfuse.*``),
the reference modules (``compile_backend.quantize``) and ``explain``.
"""

from . import (  # noqa: F401  (cuda, ops: imported for their registrations)
    backend,
    cuda,  # registers the CUDA kernel families (no build until first CUDA call)
    ops,  # registers torch.ops.quantfuse.*
    weight_cache,  # registers torch.ops.quantfuse.weight_colsum
)
from .backend import quantfuse
from .explain import explain
from .quantize import AWQLinear, W8A8Linear, quantize_model

__all__ = ["AWQLinear", "W8A8Linear", "backend", "explain", "ops", "quantfuse", "quantize_model"]
__version__ = "0.1.0"
