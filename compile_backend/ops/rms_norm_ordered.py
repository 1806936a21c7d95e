"""``quantfuse::rms_norm_ordered``: transformers' RMSNorm with its result stored in another order.

``rms_norm_ordered(Tensor x, Tensor weight, float eps, Tensor order) -> Tensor`` with ``x`` ``[..., K]``
float16 or bfloat16, ``weight`` ``[K]`` in ``x``'s dtype and ``order`` an int ``[K]`` permutation.
It computes what transformers' ``LlamaRMSNorm`` (and every RMSNorm written like it) computes::

    h = x.float();  n = weight * (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)

and stores it as an act-order layer (``AWQLinear``) puts its input in its order::

    out = torch.empty_like(n).index_copy_(-1, order, n)        # out[..., order[i]] = n[..., i]

``add_rms_norm_ordered(Tensor x, Tensor residual, Tensor weight, float eps, Tensor order) -> (Tensor, Tensor)``
first adds the residual (``s = x + residual``, rounded to the dtype as the eager add rounds it), normalizes
``s`` as above and returns ``(out, s)``: a decoder layer's residual add, whose sum the next add reads.

``passes/rms_norm_ordered.py`` puts them where a compiled act-order model normalizes the input of its
q/k/v or gate/up projections.  Left to Inductor, the reordering is a scatter in the RMSNorm's own
kernel, one program per row: at batch 1 one SM stores the 4096 values one by one (7.6 µs per launch on
an H200, against 2.4 for the RMSNorm alone; benchmarks/RESULTS.md).  On CUDA it is one Triton kernel
(``rms_norm_ordered_triton.py``) whose programs each take a slice of a row: each sums the whole row's
squares (from L2; every program the same sum, in the same order) and normalizes, stores and scatters
only its slice.  The reference, on every device and for what the kernel does not take, is the torch
code above.
"""

from __future__ import annotations

import logging

import torch

from .library import QuantfuseInputError, define_op, lib

log = logging.getLogger("quantfuse.rms_norm_ordered")

DTYPES = (torch.float16, torch.bfloat16)


def _check(x, residual, weight, eps, order, op: str) -> None:
    """Raises naming the argument."""
    def fail(what):
        raise QuantfuseInputError(f"quantfuse.{op}: {what}")

    if x.dim() < 1 or x.dtype not in DTYPES:
        fail(f"'x' must be float16 or bfloat16 [..., K], got shape {tuple(x.shape)}, {x.dtype}")
    K = x.shape[-1]
    if residual is not None and (residual.shape != x.shape or residual.dtype != x.dtype
                                 or residual.device != x.device):
        fail(f"'residual' must be x's shape {tuple(x.shape)}, {x.dtype} on {x.device}, got {tuple(residual.shape)}, "
             f"{residual.dtype} on {residual.device}")
    if weight.shape != (K,) or weight.dtype != x.dtype or weight.device != x.device:
        fail(f"'weight' must be [{K}] {x.dtype} on {x.device}, got {tuple(weight.shape)}, {weight.dtype} on "
             f"{weight.device}")
    if not (isinstance(eps, float) and eps >= 0):
        fail(f"'eps' must be a float >= 0, got {eps!r}")
    if order.shape != (K,) or order.dtype not in (torch.int32, torch.int64) or order.device != x.device:
        fail(f"'order' must be int32 or int64 [{K}] on {x.device}, got {tuple(order.shape)}, {order.dtype} on "
             f"{order.device}")


def _on_checked(x, residual, weight, eps, order):
    """``(out, s)`` of ``add_rms_norm_ordered`` in torch ops (``s = x`` without ``residual``), on checked
    arguments."""
    s = x if residual is None else x + residual
    h = s.float()
    n = weight * (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)).to(s.dtype)
    return torch.empty_like(n).index_copy_(-1, order.long(), n), s


def reference(x, weight, eps, order):
    """What ``rms_norm_ordered`` does, in torch ops (the module doc)."""
    _check(x, None, weight, eps, order, "rms_norm_ordered")
    return _on_checked(x, None, weight, eps, order)[0]


def add_reference(x, residual, weight, eps, order):
    """What ``add_rms_norm_ordered`` does, in torch ops (the module doc)."""
    _check(x, residual, weight, eps, order, "add_rms_norm_ordered")
    return _on_checked(x, residual, weight, eps, order)


def kernel_refusal(x, residual, weight, order) -> str | None:
    """Why the Triton kernel cannot take these (valid) arguments, or None."""
    if any(t is not None and t.stride(-1) != 1 for t in (x, residual, weight, order)):
        return "a last dimension that is not contiguous"
    if x.shape[-1] == 0 or x.numel() == 0:
        return "an empty input"
    try:
        import triton  # noqa: F401
    except ImportError:
        return "Triton is not installed"
    return None


def _kernel_on_checked(x, residual, weight, eps, order, op: str):
    """``(out, s)`` by the Triton kernel (``s`` None without ``residual``), or by the reference where the
    kernel cannot take the arguments."""
    reason = kernel_refusal(x, residual, weight, order)
    if reason is not None:
        log.debug("quantfuse.%s: reference runs: %s", op, reason)
        return _on_checked(x, residual, weight, eps, order)
    from .rms_norm_ordered_triton import rms_norm_ordered_triton

    with torch.cuda.device(x.device):
        return rms_norm_ordered_triton(x, residual, weight, eps, order)


def _cuda(x, weight, eps, order):
    _check(x, None, weight, eps, order, "rms_norm_ordered")
    return _kernel_on_checked(x, None, weight, eps, order, "rms_norm_ordered")[0]


def _add_cuda(x, residual, weight, eps, order):
    _check(x, residual, weight, eps, order, "add_rms_norm_ordered")
    return _kernel_on_checked(x, residual, weight, eps, order, "add_rms_norm_ordered")


def _fake(x, weight, eps, order):
    return x.new_empty(x.shape)


def _add_fake(x, residual, weight, eps, order):
    return x.new_empty(x.shape), x.new_empty(x.shape)


SCHEMA = "rms_norm_ordered(Tensor x, Tensor weight, float eps, Tensor order) -> Tensor"
ADD_SCHEMA = ("add_rms_norm_ordered(Tensor x, Tensor residual, Tensor weight, float eps, Tensor order) "
              "-> (Tensor, Tensor)")

# No kernels' library behind them: their CUDA implementation is the Triton kernel, registered here.
rms_norm_ordered = define_op(SCHEMA, reference, _fake, kernel_dispatch=False)
lib.impl("rms_norm_ordered", _cuda, "CUDA")
add_rms_norm_ordered = define_op(ADD_SCHEMA, add_reference, _add_fake, kernel_dispatch=False)
lib.impl("add_rms_norm_ordered", _add_cuda, "CUDA")
