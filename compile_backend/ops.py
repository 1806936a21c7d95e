"""The quantfuse ops: schemas, validation, fake and reference implementations.

Every op follows docs/DESIGN.md's contract.  The reference implementation is plain
torch and runs on any device; it is also what runs whenever the CUDA extension
cannot take an input.  Malformed input raises ``QuantfuseInputError`` naming
the argument; unsupported-but-valid input never raises.

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
"""

from __future__ import annotations

import logging

import torch

from . import kernels
from .tensor_cache import TensorCache

log = logging.getLogger("quantfuse.ops")

NAMESPACE = "quantfuse"

W8A8_INPUT_DTYPES = (torch.int8, torch.float8_e4m3fn)
OUT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
AWQ_ACT_DTYPES = (torch.float16, torch.bfloat16)
AWQ_PACK = 8  # int4 values per int32
# Logical column 8c+i sits at bits 4*AWQ_ORDER[i] of qweight[:, c].
AWQ_ORDER = (0, 4, 1, 5, 2, 6, 3, 7)
AWQ_SHIFTS = tuple(4 * o for o in AWQ_ORDER)
# int8 GEMMs with K below this accumulate exactly in int32: |sum| <= 128 * 128 * K < 2**31
# needs K < 2**17.  Longer K can overflow int32 with extreme values; such shapes must
# run an exact path (the reference accumulates them in float64), never an int32 kernel.
INT8_EXACT_MAX_K = 2**17
# On CPU the reference multiplies int8 operands with torch._int_mm up to this many rows, in
# float64 (exact, and a faster GEMM once the conversion of the weight is paid) above it.
INT_MM_MAX_ROWS = 8
# W8A16 (int8 weight-only): activations (and the output) in any of these; the per-channel weight
# scale in float32 or the activation dtype (converted to float32 exactly either way).
W8A16_ACT_DTYPES = OUT_DTYPES

SCHEMAS = {
    "scaled_mm": "scaled_mm(Tensor a, Tensor b, Tensor scale_a, Tensor scale_b, "
    "ScalarType out_dtype, Tensor? bias=None) -> Tensor",
    "scaled_mm_azp": "scaled_mm_azp(Tensor a, Tensor b, Tensor scale_a, Tensor scale_b, "
    "ScalarType out_dtype, Tensor azp_adj, Tensor? azp=None, Tensor? bias=None) -> Tensor",
    "awq_gemm": "awq_gemm(Tensor x, Tensor qweight, Tensor scales, Tensor qzeros, "
    "int group_size, Tensor? bias=None) -> Tensor",
    "awq_dequantize": "awq_dequantize(Tensor qweight, Tensor scales, Tensor qzeros, "
    "int group_size) -> Tensor",
    "w8a16_gemm": "w8a16_gemm(Tensor x, Tensor w_q, Tensor w_scale, Tensor? bias=None) -> Tensor",
    "concat_weights": "concat_weights(Tensor[] parts, int dim, int[]? sizes=None) -> Tensor",
}


class QuantfuseInputError(ValueError):
    """A quantfuse op was called with malformed arguments."""


def _describe(t: torch.Tensor) -> str:
    return f"shape {tuple(t.shape)}, dtype {t.dtype}"


def _fail(op: str, arg: str, t, expected: str):
    got = _describe(t) if isinstance(t, torch.Tensor) else repr(t)
    raise QuantfuseInputError(f"quantfuse.{op}: argument '{arg}' has {got}; expected {expected}")


def _check_devices(op: str, first: str, tensors: dict) -> None:
    """Every tensor in ``tensors`` (name -> tensor or None) on the device of ``tensors[first]``.

    Strict on purpose, 1-element scales included: torch accepts a 0-dim CPU scalar
    next to CUDA operands in element-wise ops, but a kernel handed a host pointer
    (or a fake/meta implementation handed a mix) reads or returns garbage, and a
    silent copy per call would hide a host-to-device transfer in every step.
    """
    device = tensors[first].device
    for name, t in tensors.items():
        if t is not None and t.device != device:
            raise QuantfuseInputError(
                f"quantfuse.{op}: argument '{name}' has {_describe(t)}, device {t.device}; expected "
                f"device {device} (the device of '{first}'): all tensor arguments must be on one device")


# --------------------------------------------------------------------------- validation


def _check_w8a8(op, a, b, scale_a, scale_b, out_dtype, bias):
    _check_devices(op, "a", dict(a=a, b=b, scale_a=scale_a, scale_b=scale_b, bias=bias))
    if a.dtype not in W8A8_INPUT_DTYPES:
        _fail(op, "a", a, "dtype int8 or float8_e4m3fn")
    if a.dim() != 2:
        _fail(op, "a", a, "a 2-D tensor [M, K]")
    if b.dim() != 2:
        _fail(op, "b", b, "a 2-D tensor [K, N]")
    if b.dtype != a.dtype:
        _fail(op, "b", b, f"the dtype of 'a' ({a.dtype})")
    M, K = a.shape
    if b.shape[0] != K:
        _fail(op, "b", b, f"K = {K} rows to match 'a' of shape {tuple(a.shape)}")
    N = b.shape[1]
    if out_dtype not in OUT_DTYPES:
        _fail(op, "out_dtype", out_dtype, "torch.float16, torch.bfloat16 or torch.float32")
    for name, s, n, what in (("scale_a", scale_a, M, "M"), ("scale_b", scale_b, N, "N")):
        if s.dtype != torch.float32:
            _fail(op, name, s, "dtype float32")
        if s.numel() != 1 and s.numel() != n:
            _fail(op, name, s, f"1 element (per-tensor) or {what} = {n} elements")
    if bias is not None:
        if bias.dim() != 1 or bias.shape[0] != N:
            _fail(op, "bias", bias, f"a 1-D tensor of N = {N} elements")
        if bias.dtype != out_dtype:
            _fail(op, "bias", bias, f"dtype out_dtype ({out_dtype})")
    return M, K, N


def _check_azp(op, a, b, M, N, azp_adj, azp):
    _check_devices(op, "a", dict(a=a, azp_adj=azp_adj, azp=azp))
    if a.dtype != torch.int8:
        _fail(op, "a", a, "dtype int8 (zero points apply to int8 activations only)")
    if azp_adj.dtype != torch.int32 or azp_adj.dim() != 1 or azp_adj.shape[0] != N:
        _fail(op, "azp_adj", azp_adj, f"int32 of shape ({N},) (N column sums of 'b')")
    if azp is not None and (azp.dtype != torch.int32 or azp.numel() != M):
        _fail(op, "azp", azp, f"int32 with M = {M} elements (one zero point per token)")


def _check_awq(op, qweight, scales, qzeros, group_size, x=None, bias=None):
    first = "qweight" if x is None else "x"
    _check_devices(op, first, dict(x=x, qweight=qweight, scales=scales, qzeros=qzeros, bias=bias))
    if qweight.dtype != torch.int32 or qweight.dim() != 2:
        _fail(op, "qweight", qweight, "a 2-D int32 tensor [K, N/8]")
    K, n_packed = qweight.shape
    N = n_packed * AWQ_PACK
    if scales.dtype not in AWQ_ACT_DTYPES or scales.dim() != 2:
        _fail(op, "scales", scales, "a 2-D float16 or bfloat16 tensor [K/group_size, N]")
    if not isinstance(group_size, int) or group_size <= 0 or K % group_size != 0:
        _fail(op, "group_size", group_size, f"a positive divisor of K = {K}")
    groups = K // group_size
    if scales.shape[1] % AWQ_PACK != 0:
        _fail(op, "scales", scales, f"N (its last dimension) a multiple of {AWQ_PACK}")
    if tuple(scales.shape) != (groups, N):
        _fail(op, "scales", scales, f"shape ({groups}, {N}) = (K/group_size, N) from 'qweight'")
    if qzeros.dtype != torch.int32 or tuple(qzeros.shape) != (groups, n_packed):
        _fail(op, "qzeros", qzeros, f"int32 of shape ({groups}, {n_packed}) = (K/group_size, N/8)")
    if x is not None:
        if x.dtype != scales.dtype:
            _fail(op, "x", x, f"the dtype of 'scales' ({scales.dtype})")
        if x.dim() != 2 or x.shape[1] != K:
            _fail(op, "x", x, f"a 2-D tensor [M, K] with K = {K} from 'qweight'")
    if bias is not None and (bias.dim() != 1 or bias.shape[0] != N or bias.dtype != scales.dtype):
        _fail(op, "bias", bias, f"a 1-D {scales.dtype} tensor of N = {N} elements")
    return K, N


def _check_w8a16(op, x, w_q, w_scale, bias):
    _check_devices(op, "x", dict(x=x, w_q=w_q, w_scale=w_scale, bias=bias))
    if x.dtype not in W8A16_ACT_DTYPES or x.dim() != 2:
        _fail(op, "x", x, "a 2-D float16, bfloat16 or float32 tensor [M, K]")
    if w_q.dtype != torch.int8 or w_q.dim() != 2:
        _fail(op, "w_q", w_q, "a 2-D int8 tensor [N, K]")
    M, K = x.shape
    N = w_q.shape[0]
    if w_q.shape[1] != K:
        _fail(op, "w_q", w_q, f"K = {K} columns to match 'x' of shape {tuple(x.shape)}")
    if w_scale.dtype not in (torch.float32, x.dtype):
        _fail(op, "w_scale", w_scale, f"dtype float32 or the dtype of 'x' ({x.dtype})")
    if w_scale.dim() > 1 or w_scale.numel() not in (1, N):
        _fail(op, "w_scale", w_scale, f"a 0-D or 1-D tensor of 1 element (per-tensor) or N = {N} (per-channel)")
    if bias is not None and (bias.dim() != 1 or bias.shape[0] != N or bias.dtype != x.dtype):
        _fail(op, "bias", bias, f"a 1-D {x.dtype} tensor of N = {N} elements")
    return M, K, N


def _check_concat(op, parts, dim, sizes):
    """The shape of ``concat_weights(parts, dim, sizes)``: ``torch.cat(parts, dim)``, or with
    ``sizes`` (one extent per part, ``dim`` 0) the 1-D concatenation of each part flattened and,
    when it has one element, broadcast to its extent (per-tensor scales made per-channel)."""
    if not isinstance(parts, (list, tuple)) or not parts:
        _fail(op, "parts", parts, "a non-empty list of tensors")
    _check_devices(op, "parts[0]", {f"parts[{i}]": p for i, p in enumerate(parts)})
    first = parts[0]
    for i, p in enumerate(parts):
        if p.dtype != first.dtype:
            _fail(op, f"parts[{i}]", p, f"the dtype of 'parts[0]' ({first.dtype})")
    if sizes is not None:
        if dim != 0:
            _fail(op, "dim", dim, "0 when 'sizes' is given (the result is 1-D)")
        if len(sizes) != len(parts):
            _fail(op, "sizes", sizes, f"{len(parts)} extents, one per part")
        for i, (p, n) in enumerate(zip(parts, sizes)):
            if n < 0 or p.numel() not in (1, n):
                _fail(op, f"parts[{i}]", p, f"1 element or sizes[{i}] = {n} elements")
        return (sum(sizes),)
    ndim = first.dim()
    if ndim == 0 or not -ndim <= dim < ndim:
        _fail(op, "dim", dim, f"a dimension of 'parts[0]' (shape {tuple(first.shape)})")
    d = dim % ndim
    for i, p in enumerate(parts):
        if p.dim() != ndim or any(p.shape[k] != first.shape[k] for k in range(ndim) if k != d):
            _fail(op, f"parts[{i}]", p, f"the shape of 'parts[0]' {tuple(first.shape)} except in dim {d}")
    return tuple(sum(p.shape[d] for p in parts) if k == d else first.shape[k] for k in range(ndim))


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


def _exact_float64_product(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
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
    return _exact_float64_product(a, b).to(torch.float32)


def _epilogue(acc, scale_a, scale_b, out_dtype, bias):
    out = acc * scale_b.reshape(1, -1).to(acc.device) * scale_a.reshape(-1, 1).to(acc.device)
    if bias is not None:
        out = out + bias.to(torch.float32)
    return out.to(out_dtype)


def scaled_mm_reference(a, b, scale_a, scale_b, out_dtype, bias=None):
    M, _, N = _check_w8a8("scaled_mm", a, b, scale_a, scale_b, out_dtype, bias)
    if M == 0:
        return a.new_empty((0, N), dtype=out_dtype)
    return _epilogue(exact_product(a, b), scale_a, scale_b, out_dtype, bias)


def scaled_mm_azp_reference(a, b, scale_a, scale_b, out_dtype, azp_adj, azp=None, bias=None):
    M, _, N = _check_w8a8("scaled_mm_azp", a, b, scale_a, scale_b, out_dtype, bias)
    _check_azp("scaled_mm_azp", a, b, M, N, azp_adj, azp)
    if M == 0:
        return a.new_empty((0, N), dtype=out_dtype)
    acc = _exact_float64_product(a, b)
    if azp is None:
        acc = acc - azp_adj.to(torch.float64).reshape(1, -1)
    else:
        acc = acc - azp.to(torch.float64).reshape(-1, 1) * azp_adj.to(torch.float64).reshape(1, -1)
    return _epilogue(acc.to(torch.float32), scale_a, scale_b, out_dtype, bias)


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
    _check_awq("awq_dequantize", qweight, scales, qzeros, group_size)
    return _awq_weight(qweight, scales, qzeros, group_size)


def awq_gemm_reference(x, qweight, scales, qzeros, group_size, bias=None):
    _, N = _check_awq("awq_gemm", qweight, scales, qzeros, group_size, x, bias)
    if x.shape[0] == 0:
        return x.new_empty((0, N))
    w = _awq_weight(qweight, scales, qzeros, group_size)
    out = torch.matmul(x.to(torch.float32), w.to(torch.float32))
    if bias is not None:
        out = out + bias.to(torch.float32)
    return out.to(x.dtype)


def w8a16_gemm_reference(x, w_q, w_scale, bias=None):
    """``(x @ w_qᵀ)[m, n] · w_scale[n] + bias[n]``: the int8 weight converted exactly, products
    accumulated in float32, the scale and bias applied to the accumulator in float32, one rounding."""
    M, _, N = _check_w8a16("w8a16_gemm", x, w_q, w_scale, bias)
    if M == 0:
        return x.new_empty((0, N))
    out = torch.matmul(x.to(torch.float32), w_q.to(torch.float32).t()) * w_scale.to(torch.float32).reshape(1, -1)
    if bias is not None:
        out = out + bias.to(torch.float32)
    return out.to(x.dtype)


def concat_weights_reference(parts, dim, sizes=None):
    _check_concat("concat_weights", parts, dim, sizes)
    if sizes is not None:
        parts = [p.reshape(-1).expand(n) for p, n in zip(parts, sizes)]
    return torch.cat(list(parts), dim)


# --------------------------------------------------------------------------- fakes


def _scaled_mm_fake(a, b, scale_a, scale_b, out_dtype, bias=None):
    M, _, N = _check_w8a8("scaled_mm", a, b, scale_a, scale_b, out_dtype, bias)
    return a.new_empty((M, N), dtype=out_dtype)


def _scaled_mm_azp_fake(a, b, scale_a, scale_b, out_dtype, azp_adj, azp=None, bias=None):
    M, _, N = _check_w8a8("scaled_mm_azp", a, b, scale_a, scale_b, out_dtype, bias)
    _check_azp("scaled_mm_azp", a, b, M, N, azp_adj, azp)
    return a.new_empty((M, N), dtype=out_dtype)


def _awq_gemm_fake(x, qweight, scales, qzeros, group_size, bias=None):
    _, N = _check_awq("awq_gemm", qweight, scales, qzeros, group_size, x, bias)
    return x.new_empty((x.shape[0], N))


def _awq_dequantize_fake(qweight, scales, qzeros, group_size):
    K, N = _check_awq("awq_dequantize", qweight, scales, qzeros, group_size)
    return scales.new_empty((K, N))


def _w8a16_gemm_fake(x, w_q, w_scale, bias=None):
    M, _, N = _check_w8a16("w8a16_gemm", x, w_q, w_scale, bias)
    return x.new_empty((M, N))


def _concat_weights_fake(parts, dim, sizes=None):
    return parts[0].new_empty(_check_concat("concat_weights", parts, dim, sizes))


# --------------------------------------------------------------------------- registration

REFERENCES = {
    "scaled_mm": scaled_mm_reference,
    "scaled_mm_azp": scaled_mm_azp_reference,
    "awq_gemm": awq_gemm_reference,
    "awq_dequantize": awq_dequantize_reference,
    "w8a16_gemm": w8a16_gemm_reference,
    "concat_weights": concat_weights_reference,
}
FAKES = {
    "scaled_mm": _scaled_mm_fake,
    "scaled_mm_azp": _scaled_mm_azp_fake,
    "awq_gemm": _awq_gemm_fake,
    "awq_dequantize": _awq_dequantize_fake,
    "w8a16_gemm": _w8a16_gemm_fake,
    "concat_weights": _concat_weights_fake,
}


# The CUDA implementations of the public ops are registered in C++ (csrc/*/*_dispatch.cpp), so
# that a call takes one dispatcher trip; where no kernel takes an input they call back into
# these private ops with the reason, which is logged before the reference runs.
REFERENCE_SCHEMAS = {
    "scaled_mm": "_scaled_mm_reference(Tensor a, Tensor b, Tensor scale_a, Tensor scale_b, "
    "ScalarType out_dtype, Tensor? bias, str reason) -> Tensor",
    "scaled_mm_azp": "_scaled_mm_azp_reference(Tensor a, Tensor b, Tensor scale_a, Tensor scale_b, "
    "ScalarType out_dtype, Tensor azp_adj, Tensor? azp, Tensor? bias, str reason) -> Tensor",
    "awq_gemm": "_awq_gemm_reference(Tensor x, Tensor qweight, Tensor scales, Tensor qzeros, "
    "int group_size, Tensor? bias, str reason) -> Tensor",
    "awq_dequantize": "_awq_dequantize_reference(Tensor qweight, Tensor scales, Tensor qzeros, "
    "int group_size, str reason) -> Tensor",
    "w8a16_gemm": "_w8a16_gemm_reference(Tensor x, Tensor w_q, Tensor w_scale, Tensor? bias, str reason) -> Tensor",
    "concat_weights": "_concat_weights_reference(Tensor[] parts, int dim, int[]? sizes, str reason) -> Tensor",
}


def logged_reference(name, reference):
    """``reference`` as the implementation of ``quantfuse::_<name>_reference``: it takes the op's
    arguments and the reason the C++ dispatch gives, logs the reason and runs the reference."""

    def impl(*args):
        *args, reason = args
        log.debug("quantfuse.%s: reference runs: %s", name, reason)
        return reference(*args)

    impl.__name__ = f"_{name}_reference"
    return impl


def _cuda_bootstrap(name):
    """The CUDA implementation until the kernels are loaded: the first call loads (or builds)
    them, after which the C++ implementation serves this and every later call; if they
    cannot be loaded, the reference runs."""
    reference = _BOOTSTRAPPED[name]

    def impl(*args, **kwargs):
        # Loading replaces this implementation with the library's C++ one (kernels.on_load below).
        if kernels.ensure_loaded():
            return getattr(torch.ops.quantfuse, name)(*args, **kwargs)
        log.debug("quantfuse.%s: reference runs: the CUDA kernels are not available", name)
        return reference(*args, **kwargs)

    impl.__name__ = f"{name}_cuda_bootstrap"
    return impl


_bootstrap_lib: torch.library.Library | None = None
# Op name -> the implementation that runs on CUDA when the kernels cannot be loaded.
_BOOTSTRAPPED = dict(REFERENCES)


def _install_bootstrap() -> None:
    global _bootstrap_lib
    if _bootstrap_lib is not None:
        return
    _bootstrap_lib = torch.library.Library(NAMESPACE, "IMPL", "CUDA")
    for name in _BOOTSTRAPPED:
        _bootstrap_lib.impl(name, _cuda_bootstrap(name))


def add_cuda_bootstrap(name: str, fallback) -> None:
    """Gives another quantfuse op whose CUDA implementation lives in the kernels' library
    (e.g. weight_colsum) the same first-call loading, with ``fallback`` when they can't load."""
    _BOOTSTRAPPED[name] = fallback
    if _bootstrap_lib is not None:
        _bootstrap_lib.impl(name, _cuda_bootstrap(name))


def _remove_bootstrap() -> None:
    global _bootstrap_lib
    if _bootstrap_lib is not None:
        _bootstrap_lib._destroy()
        _bootstrap_lib = None


# Looked up at call time, so that a replaced function (tests) is the one that runs.
kernels.on_load(lambda: _remove_bootstrap(), lambda: _install_bootstrap())


_lib = torch.library.Library(NAMESPACE, "DEF")
for _name, _schema in SCHEMAS.items():
    # Kernels read their operands with fixed strides; without the tag Inductor may
    # hand a pass-inserted op a layout of its own choosing.
    _lib.define(_schema, tags=(torch.Tag.needs_fixed_stride_order,))
    _lib.impl(_name, REFERENCES[_name], "CompositeExplicitAutograd")
    torch.library.register_fake(f"{NAMESPACE}::{_name}", FAKES[_name], lib=_lib)
    _lib.define(REFERENCE_SCHEMAS[_name])
    _lib.impl(f"_{_name}_reference", logged_reference(_name, REFERENCES[_name]), "CompositeExplicitAutograd")

# concat_weights returns values derived from weights, made once per set of parts (the CUDA
# implementation caches them in C++, csrc/common/concat_weights.cpp).  The cached tensor itself
# is returned, not a copy: treat it as read-only.
_concat_cache = TensorCache()


def _concat_weights_cached(parts, dim, sizes=None):
    if (torch.compiler.is_compiling()
            or any(p.requires_grad or p.is_inference() or getattr(p, "_is_fake", False) for p in parts)):
        return concat_weights_reference(parts, dim, sizes)
    key = (dim, None if sizes is None else tuple(sizes))
    return _concat_cache.get(list(parts), lambda: concat_weights_reference(parts, dim, sizes), extra=key)


_lib.impl("concat_weights", _concat_weights_cached, "CPU")
_BOOTSTRAPPED["concat_weights"] = _concat_weights_cached
_install_bootstrap()

scaled_mm = torch.ops.quantfuse.scaled_mm
scaled_mm_azp = torch.ops.quantfuse.scaled_mm_azp
awq_gemm = torch.ops.quantfuse.awq_gemm
awq_dequantize = torch.ops.quantfuse.awq_dequantize
w8a16_gemm = torch.ops.quantfuse.w8a16_gemm
concat_weights = torch.ops.quantfuse.concat_weights
