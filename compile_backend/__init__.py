"""quantfuse: a torch.compile backend that fuses quantized matmuls into single CUDA kernels.

``torch.compile(model, backend="quantfuse")`` works after installation without importing this
package; import it for the ops (``torch.ops.quantfuse.*``), the quantized modules and
``quantize_model`` (``compile_backend.quantize``), ``prepare`` (other libraries' 4-bit layers made
``AWQLinear``s), ``explain`` and ``from_pretrained``.  The package's map is docs/DESIGN.md's first
section.
"""

from . import (  # noqa: F401  (imported for their registrations)
    backend,
    derived,  # writes through .data to tensors that do not require grad are seen
    ops,  # registers torch.ops.quantfuse.* (CUDA kernels load at the first CUDA call)
)
from .backend import quantfuse
from .explain import explain
from .prepare import prepare
from .quantize import AWQLinear, W8A8Linear, W8A16Linear, quantize_model

__all__ = ["AWQLinear", "W8A8Linear", "W8A16Linear", "backend", "explain", "from_pretrained", "ops", "prepare",
           "quantfuse", "quantize_model"]
__version__ = "0.1.0"


def __getattr__(name):
    # from_pretrained (compile_backend/checkpoints) on first use: it needs transformers and safetensors,
    # which ``import compile_backend`` does not import.
    if name == "from_pretrained":
        from .checkpoints import from_pretrained

        return from_pretrained
    raise AttributeError(f"module 'compile_backend' has no attribute {name!r}")
