"""``quantfuse::w8a16_gemm``: int8 weight-only GEMM.

    Y = (X Qᵀ) · s + bias        (s per output channel or per tensor)

Activations (and the output) in float16, bfloat16 or float32; the int8 weight ``[N, K]``
converted exactly, products accumulated in float32, the scale and bias applied to the
accumulator in float32, one rounding.  The weight scale in float32 or the activation dtype
(converted to float32 exactly either way).

Autograd: dX = (dY · s) Q, i.e. dY times the dequantized weight; d s[n] = Σ_m dY[m, n] · (X Qᵀ)[m, n]
(summed for a 1-element s); dbias = Σ_m dY.
"""

from __future__ import annotations

import torch

from . import gradients
from .library import OUT_DTYPES, check_devices, define_op, fail

W8A16_ACT_DTYPES = OUT_DTYPES

SCHEMA = "w8a16_gemm(Tensor x, Tensor w_q, Tensor w_scale, Tensor? bias=None) -> Tensor"


def check_w8a16(op, x, w_q, w_scale, bias):
    check_devices(op, "x", dict(x=x, w_q=w_q, w_scale=w_scale, bias=bias))
    if x.dtype not in W8A16_ACT_DTYPES or x.dim() != 2:
        fail(op, "x", x, "a 2-D float16, bfloat16 or float32 tensor [M, K]")
    if w_q.dtype != torch.int8 or w_q.dim() != 2:
        fail(op, "w_q", w_q, "a 2-D int8 tensor [N, K]")
    M, K = x.shape
    N = w_q.shape[0]
    if w_q.shape[1] != K:
        fail(op, "w_q", w_q, f"K = {K} columns to match 'x' of shape {tuple(x.shape)}")
    if w_scale.dtype not in (torch.float32, x.dtype):
        fail(op, "w_scale", w_scale, f"dtype float32 or the dtype of 'x' ({x.dtype})")
    if w_scale.dim() > 1 or w_scale.numel() not in (1, N):
        fail(op, "w_scale", w_scale, f"a 0-D or 1-D tensor of 1 element (per-tensor) or N = {N} (per-channel)")
    if bias is not None and (bias.dim() != 1 or bias.shape[0] != N or bias.dtype != x.dtype):
        fail(op, "bias", bias, f"a 1-D {x.dtype} tensor of N = {N} elements")
    return M, K, N


def w8a16_gemm_reference(x, w_q, w_scale, bias=None):
    """``(x @ w_qᵀ)[m, n] · w_scale[n] + bias[n]``: the int8 weight converted exactly, products
    accumulated in float32, the scale and bias applied to the accumulator in float32, one rounding."""
    M, _, N = check_w8a16("w8a16_gemm", x, w_q, w_scale, bias)
    if M == 0:
        return x.new_empty((0, N))
    out = torch.matmul(x.to(torch.float32), w_q.to(torch.float32).t()) * w_scale.to(torch.float32).reshape(1, -1)
    if bias is not None:
        out = out + bias.to(torch.float32)
    return out.to(x.dtype)


def _w8a16_gemm_fake(x, w_q, w_scale, bias=None):
    M, _, N = check_w8a16("w8a16_gemm", x, w_q, w_scale, bias)
    return x.new_empty((M, N))


def _setup(ctx, inputs, output):
    x, w_q, w_scale, bias = inputs
    ctx.save_for_backward(x, w_q, w_scale)
    ctx.bias_dtype = None if bias is None else bias.dtype


def _backward(ctx, grad):
    x, w_q, w_scale = ctx.saved_tensors
    F32 = gradients.F32
    g = grad.to(F32)
    s = w_scale.to(F32).reshape(1, -1)
    d_x = d_scale = None
    if gradients.needs(ctx, 0):
        d_x = ((g * s) @ w_q.to(F32)).to(x.dtype)
    if gradients.needs(ctx, 2):
        per = g * (x.to(F32) @ w_q.to(F32).t())
        d_scale = (per.sum() if w_scale.numel() == 1 else per.sum(0)).reshape(w_scale.shape).to(w_scale.dtype)
    return d_x, None, d_scale, gradients.bias_grad(ctx, grad, 3, ctx.bias_dtype)


w8a16_gemm = define_op(SCHEMA, w8a16_gemm_reference, _w8a16_gemm_fake, autograd=(_backward, _setup))
