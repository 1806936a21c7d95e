"""Weight-side precomputation that must happen once per weight, never per call.

``quantfuse::weight_colsum(Tensor weight) -> Tensor``: for an int8 weight
``[N, K]`` (nn.Linear layout), the column sums ``1ᵀb`` of ``b = weight.t()``
(``[K, N]``, the operand ``scaled_mm_azp`` takes), as int32 ``[N]``: the
``azp_adj`` term of docs/DESIGN.md.  It takes the weight itself rather than ``b`` so
that the argument is the module's buffer (the same tensor object every call),
not a transposed view made anew per call.  The pass for asymmetric activations
puts it in the graph next to the weight:

* under ``freezing`` the weight is a constant and Inductor constant-folds the
  op away: the sums are computed once, at compile time;
* otherwise the implementation caches the sums per weight (``tensor_cache``:
  keyed by the weight's data pointer, shape, strides, dtype and device,
  validated by the version counter, dropped when the weight is freed).  A call
  with an unchanged weight only copies the cached ``[N]`` vector: the op is
  functional, so it hands out a fresh tensor that the compiled graph may
  reuse or overwrite without corrupting the cache.
"""

from __future__ import annotations

import torch

from . import ops
from .tensor_cache import TensorCache

_lib = torch.library.Library("quantfuse", "FRAGMENT")
_lib.define("weight_colsum(Tensor weight) -> Tensor")

cache = TensorCache()
# How many times the column sums were computed (not served from the cache); tests read it.
stats = cache.stats


def _check(w: torch.Tensor) -> None:
    if w.dtype != torch.int8 or w.dim() != 2:
        raise ValueError(f"quantfuse.weight_colsum: argument 'weight' has shape {tuple(w.shape)}, dtype {w.dtype}; "
                         "expected a 2-D int8 tensor [N, K]")


def colsum(weight: torch.Tensor) -> torch.Tensor:
    """Uncached: column sums of ``weight.t()``, int32 ``[N]`` (exact: |sum| <= 128 K)."""
    return weight.to(torch.int32).sum(dim=1, dtype=torch.int32)


def _weight_colsum(b: torch.Tensor) -> torch.Tensor:
    _check(b)
    if torch.compiler.is_compiling() or b.requires_grad or getattr(b, "_is_fake", False):
        return colsum(b)
    return cache.get((b,), lambda: colsum(b)).clone()


def _weight_colsum_fake(b: torch.Tensor) -> torch.Tensor:
    _check(b)
    return b.new_empty((b.shape[0],), dtype=torch.int32)


_lib.impl("weight_colsum", _weight_colsum, "CompositeExplicitAutograd")
torch.library.register_fake("quantfuse::weight_colsum", _weight_colsum_fake, lib=_lib)
# On CUDA the kernels' library computes the sums (csrc/scaled_mm_azp/scaled_mm_azp_dispatch.cpp,
# outside any CUDA-graph pool); this reference, for inputs it refuses, says why.
_lib.define("_weight_colsum_reference(Tensor weight, str reason) -> Tensor")
_lib.impl("_weight_colsum_reference", ops.logged_reference("weight_colsum", _weight_colsum),
          "CompositeExplicitAutograd")
ops.add_cuda_bootstrap("weight_colsum", _weight_colsum)

weight_colsum = torch.ops.quantfuse.weight_colsum


def azp_operands(weight: torch.Tensor, zero_point, per_tensor: bool):
    """``(azp_adj, azp)`` of ``scaled_mm_azp`` for an int8 ``[N, K]`` weight and the activations'
    zero point: a per-tensor one (tensor or number) folded into the column sums, ``azp`` None;
    per-token ones as the int32 ``[M]`` vector beside the column sums."""
    colsum = weight_colsum(weight)
    if per_tensor:
        z = zero_point.to(torch.int32).reshape(()) if isinstance(zero_point, torch.Tensor) else int(zero_point)
        return colsum * z, None
    return colsum, zero_point.to(torch.int32).reshape(-1)


def clear_cache() -> None:
    cache.clear()
