"""Values derived from a weight go when the weight does.

The derived-value cache (csrc/common/derived_cache.cpp: repacked AWQ layouts, concatenated
q/k/v and gate/up weights, column sums) keeps a value while the tensors it was made from live,
but it learns that one was freed only when it next looks: at its next miss, or when
``_derived_cache_stats`` runs.  Without a look in between, a deleted model's values would stay on
the GPU on top of the next model's weights (for a 32-layer AWQ Llama, 7.3 GB of repacked and
prepared layouts).

So each tensor such a value may be made from gets a finalizer that has the cache drop the values
made from it as the tensor is freed: the quantized weights of our modules
(``compile_backend/quantize/modules.py``) and every integer or fp8 CUDA tensor a compiled graph takes
(other libraries' quantized weights; for a wrapper tensor subclass such as torchao's, the tensors
inside it, which are what our ops receive).  Every derived value is made from at least one such
tensor: AWQ's packed int32 weight, an int8 or fp8 weight, the parts of a concatenation.  Python
runs a finalizer before the tensor's TensorImpl goes, so it names the TensorImpl
(``_derived_cache_drop_source``) rather than asking the cache to find the dead ones.
"""

from __future__ import annotations

import weakref
from collections.abc import Iterable

import torch
from torch.utils._python_dispatch import is_traceable_wrapper_subclass

from ..kernels import loader as kernels

WEIGHT_DTYPES = frozenset({torch.int8, torch.uint8, torch.int32, torch.float8_e4m3fn, torch.float8_e5m2})

# ids of the tensors with a finalizer; an id leaves the set when its tensor is freed
_watched: set[int] = set()


def watchable(t) -> bool:
    """Whether ``t`` is a tensor a derived value may be made from (an integer or fp8 CUDA tensor)."""
    return isinstance(t, torch.Tensor) and t.device.type == "cuda" and t.dtype in WEIGHT_DTYPES


def _leaves(t):
    """``t``, or the tensors inside it where it is a wrapper subclass (recursively)."""
    if is_traceable_wrapper_subclass(t):
        for name in t.__tensor_flatten__()[0]:
            yield from _leaves(getattr(t, name))
    else:
        yield t


def watch(tensors: Iterable) -> int:
    """Gives each watchable tensor of ``tensors`` (once per tensor; the tensors inside a wrapper
    subclass) a finalizer that drops the values derived from it when it is freed; returns how
    many were new."""
    added = 0
    for leaf in (leaf for t in tensors for leaf in _leaves(t)):
        if watchable(leaf) and id(leaf) not in _watched:
            _watched.add(id(leaf))
            # Not at interpreter exit: the cache goes with the process.
            weakref.finalize(leaf, _freed, id(leaf), leaf._cdata).atexit = False
            added += 1
    return added


def drop_values_of(impl: int) -> None:
    """Has the cache drop the values made from the tensor whose TensorImpl is at ``impl`` (and
    those of freed tensors); nothing before the kernels are loaded, or in a build restricted to
    some families (``QUANTFUSE_CSRC_ONLY``) without the cache."""
    if kernels._state["status"] == "loaded" and hasattr(torch.ops.quantfuse, "_derived_cache_drop_source"):
        torch.ops.quantfuse._derived_cache_drop_source(impl)


# A tensor may be freed while a compiled function runs: the finalizer must run as written, never
# be traced by Dynamo (which would drop a call whose result nothing uses).
@torch.compiler.disable
def _freed(key: int, impl: int) -> None:
    _watched.discard(key)
    drop_values_of(impl)
