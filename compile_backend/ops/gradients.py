"""What the ops' autograd formulas share.

The ops are differentiable in their floating inputs; the quantized operands (int8 / fp8 ``a``
and ``b``, int32 ``qweight`` / ``qzeros``, zero points) have no gradient.  Each family module
registers the derivative of its op's own math, evaluated with the op's own numerics where it
matters; the backward works in float32 and returns each gradient in its input's dtype.  So a
model that calls the ops itself trains and differentiates through them, eagerly or compiled
(AOTAutograd traces these formulas into the backward).  The passes do not rely on them: under
grad mode they fuse a joint graph's forward and leave its backward, eager's own autograd of the
source, as it is (``passes/fx_helpers.py``, "joint graphs").
"""

from __future__ import annotations

import torch

F32 = torch.float32


def needs(ctx, index: int) -> bool:
    """Whether input ``index`` needs a gradient.  The dispatcher drops trailing arguments equal to
    their defaults (a ``bias=None``) before autograd sees the call: those need none."""
    return index < len(ctx.needs_input_grad) and bool(ctx.needs_input_grad[index])


def unit(like: torch.Tensor) -> torch.Tensor:
    return torch.ones(1, dtype=F32, device=like.device)


def scale_grads(ctx, grad_acc: torch.Tensor, scale_a, scale_b, ia: int, ib: int):
    """d scale_a, d scale_b from ``dD ⊙ acc`` (float32 ``[M, N]``)."""
    d_sa = d_sb = None
    if needs(ctx, ia):
        per_row = grad_acc * scale_b.to(F32).reshape(1, -1)
        d_sa = (per_row.sum() if scale_a.numel() == 1 else per_row.sum(1)).reshape(scale_a.shape)
        d_sa = d_sa.to(scale_a.dtype)
    if needs(ctx, ib):
        per_col = grad_acc * scale_a.to(F32).reshape(-1, 1)
        d_sb = (per_col.sum() if scale_b.numel() == 1 else per_col.sum(0)).reshape(scale_b.shape)
        d_sb = d_sb.to(scale_b.dtype)
    return d_sa, d_sb


def bias_grad(ctx, grad: torch.Tensor, index: int, dtype):
    if not needs(ctx, index):
        return None
    return grad.to(F32).sum(0).to(dtype)
