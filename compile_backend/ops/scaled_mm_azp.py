"""``quantfuse::scaled_mm_azp``: int8 W8A8 with asymmetric activations, and
``quantfuse::weight_colsum``, the weight-side term it needs.

    D = s_a · s_b · (Â B̂ − z_a · 1ᵀB̂) + C        (docs/DESIGN.md)

Per-tensor zero point: ``azp=None`` and ``azp_adj = z_a · colsum(b)``; per-token: ``azp`` int32
``[M]`` and ``azp_adj = colsum(b)`` int32 ``[N]`` (``azp_operands`` makes either from a weight).
Numerics and limits are ``scaled_mm``'s; the zero-point term is subtracted from the exact
accumulator.  Autograd: ``scaled_mm``'s formula with ``A B − azp term`` (``scaled_mm_azp`` with
unit scales and no bias).

``weight_colsum(Tensor weight) -> Tensor``: for an int8 weight ``[N, K]`` (nn.Linear layout), the
column sums ``1ᵀb`` of ``b = weight.t()`` as int32 ``[N]``.  It takes the weight itself rather
than ``b`` so that the argument is the module's buffer (the same tensor object every call), not
a transposed view made anew per call.  The pass for asymmetric activations puts it in the graph
next to the weight:

* under ``freezing`` the weight is a constant and Inductor constant-folds the op away: the sums
  are computed once, at compile time;
* otherwise the implementation caches the sums per weight (``derived.TensorCache``: keyed by
  the weight's data pointer, shape, strides, dtype and device, validated by the version counter,
  dropped when the weight is freed).  A call with an unchanged weight only copies the cached
  ``[N]`` vector: the op is functional, so it hands out a fresh tensor that the compiled graph
  may reuse or overwrite without corrupting the cache.  On CUDA the kernels' library computes
  and caches the sums (csrc/scaled_mm_azp/scaled_mm_azp_dispatch.cpp, outside any CUDA-graph
  pool).
"""

from __future__ import annotations

import torch

from ..derived.tensor_cache import TensorCache
from . import gradients
from .library import check_devices, define_op, fail
from .scaled_mm import check_w8a8, epilogue, exact_float64_product

SCHEMA = ("scaled_mm_azp(Tensor a, Tensor b, Tensor scale_a, Tensor scale_b, "
          "ScalarType out_dtype, Tensor azp_adj, Tensor? azp=None, Tensor? bias=None) -> Tensor")
COLSUM_SCHEMA = "weight_colsum(Tensor weight) -> Tensor"


def check_azp(op, a, b, M, N, azp_adj, azp):
    check_devices(op, "a", dict(a=a, azp_adj=azp_adj, azp=azp))
    if a.dtype != torch.int8:
        fail(op, "a", a, "dtype int8 (zero points apply to int8 activations only)")
    if azp_adj.dtype != torch.int32 or azp_adj.dim() != 1 or azp_adj.shape[0] != N:
        fail(op, "azp_adj", azp_adj, f"int32 of shape ({N},) (N column sums of 'b')")
    if azp is not None and (azp.dtype != torch.int32 or azp.numel() != M):
        fail(op, "azp", azp, f"int32 with M = {M} elements (one zero point per token)")


def scaled_mm_azp_reference(a, b, scale_a, scale_b, out_dtype, azp_adj, azp=None, bias=None):
    M, _, N = check_w8a8("scaled_mm_azp", a, b, scale_a, scale_b, out_dtype, bias)
    check_azp("scaled_mm_azp", a, b, M, N, azp_adj, azp)
    if M == 0:
        return a.new_empty((0, N), dtype=out_dtype)
    acc = exact_float64_product(a, b)
    if azp is None:
        acc = acc - azp_adj.to(torch.float64).reshape(1, -1)
    else:
        acc = acc - azp.to(torch.float64).reshape(-1, 1) * azp_adj.to(torch.float64).reshape(1, -1)
    return epilogue(acc.to(torch.float32), scale_a, scale_b, out_dtype, bias)


def _scaled_mm_azp_fake(a, b, scale_a, scale_b, out_dtype, azp_adj, azp=None, bias=None):
    M, _, N = check_w8a8("scaled_mm_azp", a, b, scale_a, scale_b, out_dtype, bias)
    check_azp("scaled_mm_azp", a, b, M, N, azp_adj, azp)
    return a.new_empty((M, N), dtype=out_dtype)


def _setup(ctx, inputs, output):
    a, b, scale_a, scale_b, out_dtype, azp_adj, azp, bias = inputs
    ctx.save_for_backward(a, b, scale_a, scale_b, azp_adj, azp)
    ctx.bias_dtype = None if bias is None else bias.dtype


def _backward(ctx, grad):
    a, b, scale_a, scale_b, azp_adj, azp = ctx.saved_tensors
    d_sa = d_sb = None
    if gradients.needs(ctx, 2) or gradients.needs(ctx, 3):
        unit = gradients.unit(a)
        acc = torch.ops.quantfuse.scaled_mm_azp(a, b, unit, unit, gradients.F32, azp_adj, azp)
        d_sa, d_sb = gradients.scale_grads(ctx, grad.to(gradients.F32) * acc, scale_a, scale_b, 2, 3)
    return None, None, d_sa, d_sb, None, None, None, gradients.bias_grad(ctx, grad, 7, ctx.bias_dtype)


scaled_mm_azp = define_op(SCHEMA, scaled_mm_azp_reference, _scaled_mm_azp_fake, autograd=(_backward, _setup))


# --------------------------------------------------------------------------- weight_colsum

colsum_cache = TensorCache()
# How many times the column sums were computed (not served from the cache); tests read it.
colsum_stats = colsum_cache.stats


def _check_colsum(w: torch.Tensor) -> None:
    if w.dtype != torch.int8 or w.dim() != 2:
        fail("weight_colsum", "weight", w, "a 2-D int8 tensor [N, K]")


def colsum(weight: torch.Tensor) -> torch.Tensor:
    """Uncached: column sums of ``weight.t()``, int32 ``[N]`` (exact: |sum| <= 128 K)."""
    return weight.to(torch.int32).sum(dim=1, dtype=torch.int32)


def _weight_colsum(b: torch.Tensor) -> torch.Tensor:
    _check_colsum(b)
    if torch.compiler.is_compiling() or b.requires_grad or getattr(b, "_is_fake", False):
        return colsum(b)
    return colsum_cache.get((b,), lambda: colsum(b)).clone()


def _weight_colsum_fake(b: torch.Tensor) -> torch.Tensor:
    _check_colsum(b)
    return b.new_empty((b.shape[0],), dtype=torch.int32)


weight_colsum = define_op(COLSUM_SCHEMA, _weight_colsum, _weight_colsum_fake, strides="exact")


def azp_operands(weight: torch.Tensor, zero_point, per_tensor: bool):
    """``(azp_adj, azp)`` of ``scaled_mm_azp`` for an int8 ``[N, K]`` weight and the activations'
    zero point: a per-tensor one (tensor or number) folded into the column sums, ``azp`` None;
    per-token ones as the int32 ``[M]`` vector beside the column sums."""
    sums = weight_colsum(weight)
    if per_tensor:
        z = zero_point.to(torch.int32).reshape(()) if isinstance(zero_point, torch.Tensor) else int(zero_point)
        return sums * z, None
    return sums, zero_point.to(torch.int32).reshape(-1)


def clear_colsum_cache() -> None:
    colsum_cache.clear()
