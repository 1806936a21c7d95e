"""Dynamic per-token activation quantization: the rule, and the op that runs it in one kernel.

``quantfuse::quantize_per_token(Tensor x, ScalarType qdtype, bool symmetric=True)
-> (Tensor q, Tensor scale, Tensor zero_point)`` quantizes each row of ``x`` ``[M, K]``
(float16, bfloat16 or float32) with its own scale, as ``W8A8Linear`` does with dynamic
per-token activations:

* symmetric: ``scale = max(amax|x_m| / qmax, MIN_SCALE)`` with ``qmax`` 127 (int8) or 448
  (float8_e4m3fn); ``q = clamp(round(x / scale))`` for int8, ``clamp(x / scale, ±448)``
  rounded to e4m3 for fp8; ``zero_point`` is 0;
* asymmetric (int8 only): the row's range ``[min(x_m, 0), max(x_m, 0)]`` over 255 steps,
  ``zero_point = clamp(round(-128 - min / scale), -128, 127)`` and
  ``q = clamp(round(x / scale) + zero_point, -128, 127)``.

``scale`` and ``zero_point`` are float32 ``[M, 1]``.

``W8A8Linear.quantize_input`` writes this rule in torch ops (``activation_params`` and
``quantize_with`` below): that form is what a compiled graph holds, and Inductor fuses it into
the kernels around the matmul.  In eager CUDA inference the layer calls the op instead
(``quantize.modules.calls_op_eagerly``): the form there is a chain of 8 (fp8) to 17 (asymmetric int8)
element-wise kernels and reductions over ``[M, K]`` float32 temporaries, the op one kernel that
reads ``x`` twice (the second time from L2) and writes ``q``.  Its CUDA implementation
(csrc/quantize_per_token/) gives bit for bit what the form gives on CUDA, where torch computes
``t / c`` for a Python number ``c`` as ``t * (1 / c)``: the scale is ``amax * (1 / qmax)``.  The
op's reference is the form itself.
"""

from __future__ import annotations

import torch

from .library import define_op, fail

INT8_MAX = 127
FP8_MAX = float(torch.finfo(torch.float8_e4m3fn).max)  # 448
# Smallest scale: keeps an all-zero row from dividing by zero.
MIN_SCALE = 1e-8
QDTYPES = (torch.int8, torch.float8_e4m3fn)
X_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def activation_params(xf: torch.Tensor, qdtype: torch.dtype, symmetric: bool, per_token: bool):
    """(scale, zero point or None) of float32 activations ``[M, K]``, per row or for the whole tensor."""
    reduce = dict(dim=-1, keepdim=True) if per_token else {}
    if symmetric:
        qmax = INT8_MAX if qdtype == torch.int8 else FP8_MAX
        return (xf.abs().amax(**reduce) / qmax).clamp(min=MIN_SCALE), None
    xmin = xf.amin(**reduce).clamp(max=0)
    xmax = xf.amax(**reduce).clamp(min=0)
    scale = ((xmax - xmin) / 255).clamp(min=MIN_SCALE)
    zero_point = torch.round(-128 - xmin / scale).clamp(-128, 127)
    return scale, zero_point


def quantize_with(xf: torch.Tensor, scale: torch.Tensor, zero_point, qdtype: torch.dtype) -> torch.Tensor:
    """Float32 activations quantized with ``scale`` (and a float32 ``zero_point``, int8 only)."""
    if qdtype == torch.float8_e4m3fn:
        return (xf / scale).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    q = torch.round(xf / scale)
    if zero_point is not None:
        q = q + zero_point
    return q.clamp(-INT8_MAX - 1, INT8_MAX).to(torch.int8)


def _check(x, qdtype, symmetric) -> None:
    op = "quantize_per_token"
    if x.dtype not in X_DTYPES or x.dim() != 2 or x.shape[1] == 0:
        fail(op, "x", x, "a 2-D float16, bfloat16 or float32 tensor [M, K] with K >= 1")
    if qdtype not in QDTYPES:
        fail(op, "qdtype", qdtype, "torch.int8 or torch.float8_e4m3fn")
    if not symmetric and qdtype != torch.int8:
        fail(op, "symmetric", symmetric, "True for float8_e4m3fn (zero points apply to int8 only)")


def reference(x: torch.Tensor, qdtype: torch.dtype, symmetric: bool = True):
    _check(x, qdtype, symmetric)
    xf = x.to(torch.float32)
    scale, zero_point = activation_params(xf, qdtype, symmetric, per_token=True)
    q = quantize_with(xf, scale, zero_point, qdtype)
    return q, scale, torch.zeros_like(scale) if zero_point is None else zero_point


def _fake(x, qdtype, symmetric=True):
    _check(x, qdtype, symmetric)
    M, K = x.shape
    return (x.new_empty((M, K), dtype=qdtype), x.new_empty((M, 1), dtype=torch.float32),
            x.new_empty((M, 1), dtype=torch.float32))


SCHEMA = "quantize_per_token(Tensor x, ScalarType qdtype, bool symmetric=True) -> (Tensor, Tensor, Tensor)"

# On CUDA the kernels' library runs it (csrc/quantize_per_token/quantize_per_token_dispatch.cpp);
# for inputs its kernel does not take, this reference runs and logs why.
quantize_per_token = define_op(SCHEMA, reference, _fake, strides="exact")
