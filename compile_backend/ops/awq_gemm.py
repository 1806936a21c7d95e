"""``quantfuse::awq_gemm`` and ``quantfuse::awq_dequantize``: AWQ W4A16.

    W[k, n] = (q[k, n] − z[k // G, n]) · s[k // G, n]        Y = X W + bias   (docs/DESIGN.md)

``qweight`` ``[K, N/8]`` int32 holds 8 unsigned 4-bit values per int32 in AWQ order
(``AWQ_ORDER``), ``qzeros`` ``[K/G, N/8]`` likewise, ``scales`` ``[K/G, N]`` in the activation
dtype (float16 or bfloat16).  The reference dequantizes with one rounding (the scale product,
as a kernel that dequantizes in registers makes) and multiplies in float32.

Autograd: dX = dY Wᵀ;  dbias = Σ_m dY;  d scales[g, n] = Σ_{k in g} (Xᵀ dY)[k, n] · (q − z)[k, n];
for ``awq_dequantize``, d scales[g, n] = Σ_{k in g} dW[k, n] · (q − z)[k, n].
"""

from __future__ import annotations

import torch

from . import gradients
from .library import check_devices, define_op, fail

AWQ_ACT_DTYPES = (torch.float16, torch.bfloat16)
AWQ_PACK = 8  # int4 values per int32
# Logical column 8c+i sits at bits 4*AWQ_ORDER[i] of qweight[:, c].
AWQ_ORDER = (0, 4, 1, 5, 2, 6, 3, 7)
AWQ_SHIFTS = tuple(4 * o for o in AWQ_ORDER)

SCHEMA = "awq_gemm(Tensor x, Tensor qweight, Tensor scales, Tensor qzeros, int group_size, Tensor? bias=None) -> Tensor"
DEQUANTIZE_SCHEMA = "awq_dequantize(Tensor qweight, Tensor scales, Tensor qzeros, int group_size) -> Tensor"


def check_awq(op, qweight, scales, qzeros, group_size, x=None, bias=None):
    first = "qweight" if x is None else "x"
    check_devices(op, first, dict(x=x, qweight=qweight, scales=scales, qzeros=qzeros, bias=bias))
    if qweight.dtype != torch.int32 or qweight.dim() != 2:
        fail(op, "qweight", qweight, "a 2-D int32 tensor [K, N/8]")
    K, n_packed = qweight.shape
    N = n_packed * AWQ_PACK
    if scales.dtype not in AWQ_ACT_DTYPES or scales.dim() != 2:
        fail(op, "scales", scales, "a 2-D float16 or bfloat16 tensor [K/group_size, N]")
    if not isinstance(group_size, int) or group_size <= 0 or K % group_size != 0:
        fail(op, "group_size", group_size, f"a positive divisor of K = {K}")
    groups = K // group_size
    if scales.shape[1] % AWQ_PACK != 0:
        fail(op, "scales", scales, f"N (its last dimension) a multiple of {AWQ_PACK}")
    if tuple(scales.shape) != (groups, N):
        fail(op, "scales", scales, f"shape ({groups}, {N}) = (K/group_size, N) from 'qweight'")
    if qzeros.dtype != torch.int32 or tuple(qzeros.shape) != (groups, n_packed):
        fail(op, "qzeros", qzeros, f"int32 of shape ({groups}, {n_packed}) = (K/group_size, N/8)")
    if x is not None:
        if x.dtype != scales.dtype:
            fail(op, "x", x, f"the dtype of 'scales' ({scales.dtype})")
        if x.dim() != 2 or x.shape[1] != K:
            fail(op, "x", x, f"a 2-D tensor [M, K] with K = {K} from 'qweight'")
    if bias is not None and (bias.dim() != 1 or bias.shape[0] != N or bias.dtype != scales.dtype):
        fail(op, "bias", bias, f"a 1-D {scales.dtype} tensor of N = {N} elements")
    return K, N


def awq_unpack(packed: torch.Tensor) -> torch.Tensor:
    """[R, N/8] int32 in AWQ order -> [R, N] int32 of 4-bit values."""
    shifts = torch.tensor(AWQ_SHIFTS, dtype=torch.int32, device=packed.device)
    nibbles = (packed.unsqueeze(-1) >> shifts) & 0xF
    return nibbles.reshape(packed.shape[0], packed.shape[1] * AWQ_PACK)


def _awq_weight(qweight, scales, qzeros, group_size):
    q = awq_unpack(qweight)
    z = awq_unpack(qzeros).repeat_interleave(group_size, dim=0)
    s = scales.repeat_interleave(group_size, dim=0)
    # (q - z) is exact in the activation dtype; the one rounding is the scale product,
    # the same rounding a kernel that dequantizes in registers makes.
    return (q - z).to(scales.dtype) * s


def awq_dequantize_reference(qweight, scales, qzeros, group_size):
    check_awq("awq_dequantize", qweight, scales, qzeros, group_size)
    return _awq_weight(qweight, scales, qzeros, group_size)


def awq_gemm_reference(x, qweight, scales, qzeros, group_size, bias=None):
    _, N = check_awq("awq_gemm", qweight, scales, qzeros, group_size, x, bias)
    if x.shape[0] == 0:
        return x.new_empty((0, N))
    w = _awq_weight(qweight, scales, qzeros, group_size)
    out = torch.matmul(x.to(torch.float32), w.to(torch.float32))
    if bias is not None:
        out = out + bias.to(torch.float32)
    return out.to(x.dtype)


def _awq_gemm_fake(x, qweight, scales, qzeros, group_size, bias=None):
    _, N = check_awq("awq_gemm", qweight, scales, qzeros, group_size, x, bias)
    return x.new_empty((x.shape[0], N))


def _awq_dequantize_fake(qweight, scales, qzeros, group_size):
    K, N = check_awq("awq_dequantize", qweight, scales, qzeros, group_size)
    return scales.new_empty((K, N))


# --------------------------------------------------------------------------- autograd

F32 = gradients.F32


def _offsets(qweight, scales, qzeros, group_size) -> torch.Tensor:
    """(q − z) as ``[K, N]`` float32 (exact: the dequantization with unit scales)."""
    return torch.ops.quantfuse.awq_dequantize(qweight, torch.ones_like(scales), qzeros, group_size).to(F32)


def _scales_grad(grad_w: torch.Tensor, qweight, scales, qzeros, group_size) -> torch.Tensor:
    """d scales ``[K/G, N]`` from dW ``[K, N]`` (float32)."""
    per_k = grad_w * _offsets(qweight, scales, qzeros, group_size)
    return per_k.reshape(-1, group_size, per_k.shape[-1]).sum(1).to(scales.dtype)


def _gemm_setup(ctx, inputs, output):
    x, qweight, scales, qzeros, group_size, bias = inputs
    ctx.save_for_backward(x, qweight, scales, qzeros)
    ctx.group_size = group_size
    ctx.bias_dtype = None if bias is None else bias.dtype


def _gemm_backward(ctx, grad):
    x, qweight, scales, qzeros = ctx.saved_tensors
    g = grad.to(F32)
    d_x = d_scales = None
    if gradients.needs(ctx, 0):
        w = torch.ops.quantfuse.awq_dequantize(qweight, scales, qzeros, ctx.group_size)
        d_x = (g @ w.to(F32).t()).to(x.dtype)
    if gradients.needs(ctx, 2):
        d_scales = _scales_grad(x.to(F32).t() @ g, qweight, scales, qzeros, ctx.group_size)
    return d_x, None, d_scales, None, None, gradients.bias_grad(ctx, grad, 5, ctx.bias_dtype)


def _dequantize_setup(ctx, inputs, output):
    qweight, scales, qzeros, group_size = inputs
    ctx.save_for_backward(qweight, scales, qzeros)
    ctx.group_size = group_size


def _dequantize_backward(ctx, grad):
    qweight, scales, qzeros = ctx.saved_tensors
    d_scales = None
    if gradients.needs(ctx, 1):
        d_scales = _scales_grad(grad.to(F32), qweight, scales, qzeros, ctx.group_size)
    return None, d_scales, None, None


awq_gemm = define_op(SCHEMA, awq_gemm_reference, _awq_gemm_fake, autograd=(_gemm_backward, _gemm_setup))
awq_dequantize = define_op(DEQUANTIZE_SCHEMA, awq_dequantize_reference, _awq_dequantize_fake,
                           autograd=(_dequantize_backward, _dequantize_setup))
