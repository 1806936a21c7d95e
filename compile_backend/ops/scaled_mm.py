"""``quantfuse::scaled_mm``: W8A8 (int8 or fp8) GEMM with scales and bias.

    D = s_a · s_b · (Â B̂) + C        (docs/DESIGN.md)

Reference numerics: integer products are accumulated exactly (float64
accumulation of int8 products is exact for K < 2**53 / 127**2), fp8 products
are accumulated in float64, the epilogue runs in float32, and the result is
rounded once to the output dtype.

Limits every implementation keeps (the checks below are shared by the
reference, the fake and the kernels' dispatch):

* Exact int8 accumulation: int32 holds every sum of K int8 products only for
  K < ``INT8_EXACT_MAX_K`` = 2**17 (|sum| <= 128 * 128 * K < 2**31).  Longer K
  with extreme values overflows an int32 accumulator, so such shapes never run
  an int32 kernel: the reference (float64 accumulation, exact) takes them.
* Operand layouts: any strides are accepted.  An operand that is not a plain
  row- or column-major matrix (``is_blas_layout``: zero strides from
  ``expand``, overlapping or sliding-window rows, steps between elements) is
  copied to the layout the GEMM reads (``a`` row-major, ``b`` column-major)
  before it runs.
* Devices: every tensor argument on one device, 1-element scales included
  (``QuantfuseInputError`` otherwise).
* Non-finite values: the W8A8 ops apply the scales to the exact integer (or
  fp8) accumulator, as the kernels' epilogues do; the dequantize-then-matmul
  source multiplies each element by its scale before the sum.  So an infinite
  scale (e.g. the per-token scale of an activation row holding ``inf``) gives
  ``±inf`` (NaN where the accumulator is 0) where eager mostly gives NaN (a 0
  in the row gives ``0 * inf``, products of both signs ``inf - inf``).  Either
  way the row is non-finite; the fused result is not made to match eager's
  NaN.  A NaN scale gives NaN in both.

Autograd: dC = Σ_m dD;  d s_a[m] = Σ_n dD[m, n] · (A B)[m, n] · s_b[n] (summed to one element
for a per-tensor scale), and the same for ``s_b`` over m.  ``A B`` is the exact product, as the
forward accumulates it (``scaled_mm`` with unit scales).  The quantized operands have no gradient.
"""

from __future__ import annotations

import torch

from . import gradients
from .library import OUT_DTYPES, check_devices, define_op, fail

W8A8_INPUT_DTYPES = (torch.int8, torch.float8_e4m3fn)
# int8 GEMMs with K below this accumulate exactly in int32: |sum| <= 128 * 128 * K < 2**31
# needs K < 2**17.  Longer K can overflow int32 with extreme values; such shapes must
# run an exact path (the reference accumulates them in float64), never an int32 kernel.
INT8_EXACT_MAX_K = 2**17
# On CPU the reference multiplies int8 operands with torch._int_mm up to this many rows, in
# float64 (exact, and a faster GEMM once the conversion of the weight is paid) above it.
INT_MM_MAX_ROWS = 8

SCHEMA = ("scaled_mm(Tensor a, Tensor b, Tensor scale_a, Tensor scale_b, "
          "ScalarType out_dtype, Tensor? bias=None) -> Tensor")


def check_w8a8(op, a, b, scale_a, scale_b, out_dtype, bias):
    check_devices(op, "a", dict(a=a, b=b, scale_a=scale_a, scale_b=scale_b, bias=bias))
    if a.dtype not in W8A8_INPUT_DTYPES:
        fail(op, "a", a, "dtype int8 or float8_e4m3fn")
    if a.dim() != 2:
        fail(op, "a", a, "a 2-D tensor [M, K]")
    if b.dim() != 2:
        fail(op, "b", b, "a 2-D tensor [K, N]")
    if b.dtype != a.dtype:
        fail(op, "b", b, f"the dtype of 'a' ({a.dtype})")
    M, K = a.shape
    if b.shape[0] != K:
        fail(op, "b", b, f"K = {K} rows to match 'a' of shape {tuple(a.shape)}")
    N = b.shape[1]
    if out_dtype not in OUT_DTYPES:
        fail(op, "out_dtype", out_dtype, "torch.float16, torch.bfloat16 or torch.float32")
    for name, s, n, what in (("scale_a", scale_a, M, "M"), ("scale_b", scale_b, N, "N")):
        if s.dtype != torch.float32:
            fail(op, name, s, "dtype float32")
        if s.numel() != 1 and s.numel() != n:
            fail(op, name, s, f"1 element (per-tensor) or {what} = {n} elements")
    if bias is not None:
        if bias.dim() != 1 or bias.shape[0] != N:
            fail(op, "bias", bias, f"a 1-D tensor of N = {N} elements")
        if bias.dtype != out_dtype:
            fail(op, "bias", bias, f"dtype out_dtype ({out_dtype})")
    return M, K, N


# --------------------------------------------------------------------------- reference math


def is_blas_layout(t: torch.Tensor) -> bool:
    """``t`` (2-D) is a plain row- or column-major matrix, possibly padded: one unit
    stride, and the other at least the extent of the unit-stride dimension.

    Anything else (a zero stride from ``expand``, overlapping rows from a sliding
    window, a step between elements) is not: GEMMs that take a leading dimension
    read such operands wrongly (CPU ``torch._int_mm`` returns garbage for them).
    """
    (rows, cols), (s0, s1) = t.shape, t.stride()
    return (s1 == 1 and s0 >= max(1, cols)) or (s0 == 1 and s1 >= max(1, rows))


def _copy_to(t: torch.Tensor, column_major: bool) -> torch.Tensor:
    """A fresh dense copy of 2-D ``t``, row- or column-major.  ``torch.empty`` rather than
    ``.contiguous()``: a tensor with a size-1 dimension counts as contiguous whatever
    that dimension's stride (0 after ``expand``), and would come back unchanged."""
    if column_major:
        return torch.empty(t.shape[::-1], dtype=t.dtype, device=t.device).copy_(t.t()).t()
    return torch.empty(t.shape, dtype=t.dtype, device=t.device).copy_(t)


def exact_float64_product(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``a @ b`` for int8 / fp8 operands as float64, every int8 partial sum exact.

    int8: partial sums are integers below 2**53, so float64 holds them exactly, and the
    float64 GEMM gives the same sums as any exact int32 accumulation.  On CPU
    ``torch._int_mm`` (exact int32 accumulation, a simple kernel) is the faster of the
    two only for a few rows, where converting ``b`` to float64 costs more than the
    product (a 2-core CPU, 4096 x 4096 weight: 5.9 ms against 63 ms at M = 1; at M = 128
    and K = 256 it is 10 to 17 times slower than float64): used for M <= ``INT_MM_MAX_ROWS``
    when int32 cannot overflow (K < ``INT8_EXACT_MAX_K``), on operands copied to a
    layout it reads correctly (``a`` row-major, ``b`` column-major) unless they already
    have one.  fp8 products are exact in float64 and their sum is rounded far below
    fp32's epsilon.
    """
    if (a.dtype == torch.int8 and a.device.type == "cpu" and a.shape[0] <= INT_MM_MAX_ROWS
            and a.shape[1] < INT8_EXACT_MAX_K):
        a = a if is_blas_layout(a) else _copy_to(a, column_major=False)
        b = b if is_blas_layout(b) else _copy_to(b, column_major=True)
        return torch._int_mm(a, b).to(torch.float64)
    # float64 conversion makes fresh dense tensors: any input strides are fine here.
    return torch.matmul(a.to(torch.float64), b.to(torch.float64))


def exact_product(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``a @ b`` for int8 / fp8 operands, accumulated exactly, as float32 (the rounding
    a kernel's int32 -> float32 conversion makes)."""
    return exact_float64_product(a, b).to(torch.float32)


def epilogue(acc, scale_a, scale_b, out_dtype, bias):
    out = acc * scale_b.reshape(1, -1).to(acc.device) * scale_a.reshape(-1, 1).to(acc.device)
    if bias is not None:
        out = out + bias.to(torch.float32)
    return out.to(out_dtype)


def scaled_mm_reference(a, b, scale_a, scale_b, out_dtype, bias=None):
    M, _, N = check_w8a8("scaled_mm", a, b, scale_a, scale_b, out_dtype, bias)
    if M == 0:
        return a.new_empty((0, N), dtype=out_dtype)
    return epilogue(exact_product(a, b), scale_a, scale_b, out_dtype, bias)


def _scaled_mm_fake(a, b, scale_a, scale_b, out_dtype, bias=None):
    M, _, N = check_w8a8("scaled_mm", a, b, scale_a, scale_b, out_dtype, bias)
    return a.new_empty((M, N), dtype=out_dtype)


# --------------------------------------------------------------------------- autograd


def _setup(ctx, inputs, output):
    a, b, scale_a, scale_b, out_dtype, bias = inputs
    ctx.save_for_backward(a, b, scale_a, scale_b)
    ctx.bias_dtype = None if bias is None else bias.dtype


def _backward(ctx, grad):
    a, b, scale_a, scale_b = ctx.saved_tensors
    d_sa = d_sb = None
    if gradients.needs(ctx, 2) or gradients.needs(ctx, 3):
        unit = gradients.unit(a)
        acc = torch.ops.quantfuse.scaled_mm(a, b, unit, unit, gradients.F32)
        d_sa, d_sb = gradients.scale_grads(ctx, grad.to(gradients.F32) * acc, scale_a, scale_b, 2, 3)
    return None, None, d_sa, d_sb, None, gradients.bias_grad(ctx, grad, 5, ctx.bias_dtype)


scaled_mm = define_op(SCHEMA, scaled_mm_reference, _scaled_mm_fake, autograd=(_backward, _setup))
