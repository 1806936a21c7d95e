"""``quantfuse::concat_weights``: the merged weight of linears that share an input.

``concat_weights(parts, dim, sizes)`` is ``torch.cat(parts, dim)``, or with ``sizes`` (one
extent per part, ``dim`` 0) the 1-D concatenation of each part flattened and, when it has one
element, broadcast to its extent (per-tensor scales made per-channel).  The horizontal pass
(``passes/horizontal.py``) puts it in the graph in front of one fused op for q/k/v or gate/up.

Its result is a value derived from weights, made once per set of parts: the CPU implementation
caches it (``derived.TensorCache``), the CUDA one in C++ (csrc/common/concat_weights.cpp).  On
CUDA, parts that already lie side by side in one tensor (``adjacent_view``: ``quantize_model``
stores the linears that share an input so) are not copied: the value is a tensor over their
memory with a storage object of its own (a custom op's output must not alias its inputs'
storages).  Either way the result may share memory with the weights: treat it as read-only.
"""

from __future__ import annotations

import torch

from ..derived.tensor_cache import TensorCache
from .library import check_devices, define_op, fail, lib

SCHEMA = "concat_weights(Tensor[] parts, int dim, int[]? sizes=None) -> Tensor"


def check_concat(op, parts, dim, sizes):
    """The shape of ``concat_weights(parts, dim, sizes)`` (see the module doc)."""
    if not isinstance(parts, (list, tuple)) or not parts:
        fail(op, "parts", parts, "a non-empty list of tensors")
    check_devices(op, "parts[0]", {f"parts[{i}]": p for i, p in enumerate(parts)})
    first = parts[0]
    for i, p in enumerate(parts):
        if p.dtype != first.dtype:
            fail(op, f"parts[{i}]", p, f"the dtype of 'parts[0]' ({first.dtype})")
    if sizes is not None:
        if dim != 0:
            fail(op, "dim", dim, "0 when 'sizes' is given (the result is 1-D)")
        if len(sizes) != len(parts):
            fail(op, "sizes", sizes, f"{len(parts)} extents, one per part")
        for i, (p, n) in enumerate(zip(parts, sizes)):
            if n < 0 or p.numel() not in (1, n):
                fail(op, f"parts[{i}]", p, f"1 element or sizes[{i}] = {n} elements")
        return (sum(sizes),)
    ndim = first.dim()
    if ndim == 0 or not -ndim <= dim < ndim:
        fail(op, "dim", dim, f"a dimension of 'parts[0]' (shape {tuple(first.shape)})")
    d = dim % ndim
    for i, p in enumerate(parts):
        if p.dim() != ndim or any(p.shape[k] != first.shape[k] for k in range(ndim) if k != d):
            fail(op, f"parts[{i}]", p, f"the shape of 'parts[0]' {tuple(first.shape)} except in dim {d}")
    return tuple(sum(p.shape[d] for p in parts) if k == d else first.shape[k] for k in range(ndim))


def adjacent_view(parts, dim: int, sizes=None) -> torch.Tensor | None:
    """The concatenation of ``parts`` as a view, when they are adjacent slices of one tensor:
    one storage, one dtype and the same strides, equal sizes but along ``dim``, each part
    starting where the one before it ends along ``dim``.  With ``sizes`` (1-D result), every
    part must hold its ``sizes[i]`` elements (no broadcast).  None otherwise.  The rule the CUDA
    implementation follows (csrc/common/concat_weights.cpp, ``adjacent_view``)."""
    first = parts[0]
    if sizes is not None:
        if any(p.numel() != n for p, n in zip(parts, sizes)) or any(p.dim() != 1 for p in parts):
            return None
        dim = 0
    ndim = first.dim()
    if ndim == 0:
        return None
    d = dim % ndim
    storage = first.untyped_storage().data_ptr()
    offset = first.storage_offset()
    for p in parts:
        if (p.dtype != first.dtype or p.device != first.device or p.stride() != first.stride()
                or p.dim() != ndim or p.untyped_storage().data_ptr() != storage or p.storage_offset() != offset
                or any(p.shape[k] != first.shape[k] for k in range(ndim) if k != d)):
            return None
        offset += p.shape[d] * p.stride(d)
    shape = list(first.shape)
    shape[d] = sum(p.shape[d] for p in parts)
    return first.as_strided(shape, first.stride(), first.storage_offset())


def concat_weights_reference(parts, dim, sizes=None):
    check_concat("concat_weights", parts, dim, sizes)
    if sizes is not None:
        parts = [p.reshape(-1).expand(n) for p, n in zip(parts, sizes)]
    return torch.cat(list(parts), dim)


def _concat_weights_fake(parts, dim, sizes=None):
    return parts[0].new_empty(check_concat("concat_weights", parts, dim, sizes))


concat_cache = TensorCache()


def _concat_weights_cached(parts, dim, sizes=None):
    if (torch.compiler.is_compiling()
            or any(p.requires_grad or p.is_inference() or getattr(p, "_is_fake", False) for p in parts)):
        return concat_weights_reference(parts, dim, sizes)
    key = (dim, None if sizes is None else tuple(sizes))
    return concat_cache.get(list(parts), lambda: concat_weights_reference(parts, dim, sizes), extra=key)


concat_weights = define_op(SCHEMA, concat_weights_reference, _concat_weights_fake,
                           cuda_fallback=_concat_weights_cached)
lib.impl("concat_weights", _concat_weights_cached, "CPU")
