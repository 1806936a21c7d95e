"""Autograd formulas of the public quantfuse ops (``torch.library.register_autograd``).

The ops are differentiable in their floating inputs; the quantized operands
(int8 / fp8 ``a`` and ``b``, int32 ``qweight`` / ``qzeros``, zero points) have
no gradient.  Each formula is the derivative of the op's own math
(docs/DESIGN.md), evaluated with the op's own numerics where it matters:

``scaled_mm``      D = s_a · s_b · (A B) + C, in float32, rounded once.
                   dC = Σ_m dD;  d s_a[m] = Σ_n dD[m, n] · (A B)[m, n] · s_b[n]
                   (summed to one element for a per-tensor scale), and the same
                   for ``s_b`` over m.  ``A B`` is the exact product, as the
                   forward accumulates it (``scaled_mm`` with unit scales).
``scaled_mm_azp``  the same with ``A B − azp term`` (``scaled_mm_azp`` with unit
                   scales and no bias).
``awq_gemm``       Y = X W + bias, W = ``awq_dequantize(...)``:
                   dX = dY Wᵀ;  dbias = Σ_m dY;  d scales[g, n] = Σ_{k in g}
                   (Xᵀ dY)[k, n] · (q − z)[k, n].
``awq_dequantize`` W = (q − z) · s:  d scales[g, n] = Σ_{k in g} dW[k, n] · (q − z)[k, n].
``w8a16_gemm``     Y = (X Qᵀ) · s + bias (s per output channel or per tensor):
                   dX = (dY · s) Q, i.e. dY times the dequantized weight;
                   d s[n] = Σ_m dY[m, n] · (X Qᵀ)[m, n] (summed for a 1-element s);
                   dbias = Σ_m dY.

So a model that calls the ops itself trains and differentiates through them,
eagerly or compiled (AOTAutograd traces these formulas into the backward).
The passes do not rely on them: under grad mode they fuse a joint graph's
forward and leave its backward, eager's own autograd of the source, as it is
(``passes/fx_helpers.py``, "joint graphs").

The backward works in float32 and returns each gradient in its input's dtype.
"""

from __future__ import annotations

import torch

from . import ops  # noqa: F401  (the ops must be defined first)

F32 = torch.float32


def _needs(ctx, index: int) -> bool:
    """Whether input ``index`` needs a gradient.  The dispatcher drops trailing arguments equal to
    their defaults (a ``bias=None``) before autograd sees the call: those need none."""
    return index < len(ctx.needs_input_grad) and bool(ctx.needs_input_grad[index])


def _unit(like: torch.Tensor) -> torch.Tensor:
    return torch.ones(1, dtype=F32, device=like.device)


def _scale_grads(ctx, grad_acc: torch.Tensor, scale_a, scale_b, ia: int, ib: int):
    """d scale_a, d scale_b from ``dD ⊙ acc`` (float32 ``[M, N]``)."""
    d_sa = d_sb = None
    if _needs(ctx, ia):
        per_row = grad_acc * scale_b.to(F32).reshape(1, -1)
        d_sa = (per_row.sum() if scale_a.numel() == 1 else per_row.sum(1)).reshape(scale_a.shape)
        d_sa = d_sa.to(scale_a.dtype)
    if _needs(ctx, ib):
        per_col = grad_acc * scale_a.to(F32).reshape(-1, 1)
        d_sb = (per_col.sum() if scale_b.numel() == 1 else per_col.sum(0)).reshape(scale_b.shape)
        d_sb = d_sb.to(scale_b.dtype)
    return d_sa, d_sb


def _bias_grad(ctx, grad: torch.Tensor, index: int, dtype):
    if not _needs(ctx, index):
        return None
    return grad.to(F32).sum(0).to(dtype)


# --------------------------------------------------------------------------- scaled_mm


def _scaled_mm_setup(ctx, inputs, output):
    a, b, scale_a, scale_b, out_dtype, bias = inputs
    ctx.save_for_backward(a, b, scale_a, scale_b)
    ctx.bias_dtype = None if bias is None else bias.dtype


def _scaled_mm_backward(ctx, grad):
    a, b, scale_a, scale_b = ctx.saved_tensors
    d_sa = d_sb = None
    if _needs(ctx, 2) or _needs(ctx, 3):
        acc = torch.ops.quantfuse.scaled_mm(a, b, _unit(a), _unit(a), F32)
        d_sa, d_sb = _scale_grads(ctx, grad.to(F32) * acc, scale_a, scale_b, 2, 3)
    return None, None, d_sa, d_sb, None, _bias_grad(ctx, grad, 5, ctx.bias_dtype)


# --------------------------------------------------------------------------- scaled_mm_azp


def _scaled_mm_azp_setup(ctx, inputs, output):
    a, b, scale_a, scale_b, out_dtype, azp_adj, azp, bias = inputs
    ctx.save_for_backward(a, b, scale_a, scale_b, azp_adj, azp)
    ctx.bias_dtype = None if bias is None else bias.dtype


def _scaled_mm_azp_backward(ctx, grad):
    a, b, scale_a, scale_b, azp_adj, azp = ctx.saved_tensors
    d_sa = d_sb = None
    if _needs(ctx, 2) or _needs(ctx, 3):
        acc = torch.ops.quantfuse.scaled_mm_azp(a, b, _unit(a), _unit(a), F32, azp_adj, azp)
        d_sa, d_sb = _scale_grads(ctx, grad.to(F32) * acc, scale_a, scale_b, 2, 3)
    return None, None, d_sa, d_sb, None, None, None, _bias_grad(ctx, grad, 7, ctx.bias_dtype)


# --------------------------------------------------------------------------- AWQ


def _awq_offsets(qweight, scales, qzeros, group_size) -> torch.Tensor:
    """(q − z) as ``[K, N]`` float32 (exact: the dequantization with unit scales)."""
    return torch.ops.quantfuse.awq_dequantize(qweight, torch.ones_like(scales), qzeros, group_size).to(F32)


def _awq_scales_grad(grad_w: torch.Tensor, qweight, scales, qzeros, group_size) -> torch.Tensor:
    """d scales ``[K/G, N]`` from dW ``[K, N]`` (float32)."""
    per_k = grad_w * _awq_offsets(qweight, scales, qzeros, group_size)
    return per_k.reshape(-1, group_size, per_k.shape[-1]).sum(1).to(scales.dtype)


def _awq_gemm_setup(ctx, inputs, output):
    x, qweight, scales, qzeros, group_size, bias = inputs
    ctx.save_for_backward(x, qweight, scales, qzeros)
    ctx.group_size = group_size
    ctx.bias_dtype = None if bias is None else bias.dtype


def _awq_gemm_backward(ctx, grad):
    x, qweight, scales, qzeros = ctx.saved_tensors
    g = grad.to(F32)
    d_x = d_scales = None
    if _needs(ctx, 0):
        w = torch.ops.quantfuse.awq_dequantize(qweight, scales, qzeros, ctx.group_size)
        d_x = (g @ w.to(F32).t()).to(x.dtype)
    if _needs(ctx, 2):
        d_scales = _awq_scales_grad(x.to(F32).t() @ g, qweight, scales, qzeros, ctx.group_size)
    return d_x, None, d_scales, None, None, _bias_grad(ctx, grad, 5, ctx.bias_dtype)


def _awq_dequantize_setup(ctx, inputs, output):
    qweight, scales, qzeros, group_size = inputs
    ctx.save_for_backward(qweight, scales, qzeros)
    ctx.group_size = group_size


def _awq_dequantize_backward(ctx, grad):
    qweight, scales, qzeros = ctx.saved_tensors
    d_scales = None
    if _needs(ctx, 1):
        d_scales = _awq_scales_grad(grad.to(F32), qweight, scales, qzeros, ctx.group_size)
    return None, d_scales, None, None


# --------------------------------------------------------------------------- W8A16


def _w8a16_gemm_setup(ctx, inputs, output):
    x, w_q, w_scale, bias = inputs
    ctx.save_for_backward(x, w_q, w_scale)
    ctx.bias_dtype = None if bias is None else bias.dtype


def _w8a16_gemm_backward(ctx, grad):
    x, w_q, w_scale = ctx.saved_tensors
    g = grad.to(F32)
    s = w_scale.to(F32).reshape(1, -1)
    d_x = d_scale = None
    if _needs(ctx, 0):
        d_x = ((g * s) @ w_q.to(F32)).to(x.dtype)
    if _needs(ctx, 2):
        per = g * (x.to(F32) @ w_q.to(F32).t())
        d_scale = (per.sum() if w_scale.numel() == 1 else per.sum(0)).reshape(w_scale.shape).to(w_scale.dtype)
    return d_x, None, d_scale, _bias_grad(ctx, grad, 3, ctx.bias_dtype)


FORMULAS = {
    "scaled_mm": (_scaled_mm_backward, _scaled_mm_setup),
    "scaled_mm_azp": (_scaled_mm_azp_backward, _scaled_mm_azp_setup),
    "awq_gemm": (_awq_gemm_backward, _awq_gemm_setup),
    "awq_dequantize": (_awq_dequantize_backward, _awq_dequantize_setup),
    "w8a16_gemm": (_w8a16_gemm_backward, _w8a16_gemm_setup),
}

for _name, (_backward, _setup) in FORMULAS.items():
    torch.library.register_autograd(f"{ops.NAMESPACE}::{_name}", _backward, setup_context=_setup)
