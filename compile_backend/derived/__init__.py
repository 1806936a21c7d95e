"""Values derived from weights, and how they are kept correct (docs/DESIGN.md, "Values derived
from weights").

Repacked AWQ layouts, the merged q/k/v and gate/up weights and the column sums of an int8
weight are made once per weight, never per call: cached per source tensor (``TensorCache`` here,
the kernels' C++ cache on CUDA), served while the source's version counter is unchanged, and
dropped when the source is freed.  The pieces of that one mechanism:

* ``tensor_cache``: the Python cache (CPU, and the reference implementations);
* ``held_parameter``: ``HeldParameter``, our modules' parameters, whose ``.data`` shares the
  version counter, so a write through it is seen;
* ``tensor_data``: the same ``.data`` for other libraries' plain tensors that do not require grad
  (installed when this package is imported);
* ``freed_weights``: ``watch`` has the C++ cache drop a tensor's values as the tensor is freed;
* ``captured_graphs``: a CUDA graph whose derived values went stale refuses to replay.

Other modules use these names from here.
"""

from . import tensor_data  # noqa: F401  (installs the version-sharing .data)
from .captured_graphs import guard_derived_reads, uses_cuda_graphs
from .freed_weights import watch, watchable
from .held_parameter import HeldParameter
from .tensor_cache import TensorCache

__all__ = ["HeldParameter", "TensorCache", "guard_derived_reads", "uses_cuda_graphs", "watch", "watchable"]
