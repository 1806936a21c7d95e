"""``quantfuse::gqa_decode``: one query token attending over a grouped-query key/value cache.

``gqa_decode(Tensor q, Tensor k, Tensor v, Tensor? attn_mask, float scale) -> Tensor`` with ``q``
``[B, Hkv*n, 1, D]``, ``k`` and ``v`` ``[B, Hkv, L, D]`` (query head ``h*n + j`` reads key/value
head ``h``, as transformers' ``repeat_kv`` pairs them) and ``attn_mask`` ``[B, 1 or Hkv*n, 1, L]``:
added to the scores when floating, or True where a position is attended when bool. It returns
``softmax(q·kᵀ·scale + mask)·v``, ``[B, Hkv*n, 1, D]`` in ``q``'s dtype.

``passes/gqa_decode.py`` puts it where a compiled model's one-token attention repeats its keys
and values (every model on transformers' sdpa attention, with a static cache). On CUDA it is two
Triton kernels (``gqa_decode_triton.py``) that read each key/value head's cache once for its ``n``
query heads, in slices spread over the SMs; a 32-layer Llama-3-8B decode step spent about 10 µs
per layer in cuDNN's attention and its reduction, a kernel built for many query rows
(benchmarks/RESULTS.md). The reference, on every device and for what the kernels do not take,
is ``scaled_dot_product_attention`` over the keys and values expanded along the query heads
(views, no copy): what the pass wrote before the op existed, and what the kernels are checked
against.
"""

from __future__ import annotations

import logging
import math

import torch
import torch.nn.functional as F

from .library import QuantfuseInputError, define_op, lib

log = logging.getLogger("quantfuse.gqa_decode")

DTYPES = (torch.float16, torch.bfloat16)
HEAD_DIMS = (32, 64, 128, 256)  # powers of two (tl.dot), those the GPU tests cover
MAX_GROUP = 16  # query heads per key/value head, as rows of one tl.dot (the GPU tests cover up to 16)


def _check(q, k, v, attn_mask, scale) -> None:
    def fail(what):
        raise QuantfuseInputError(f"quantfuse.gqa_decode: {what}")

    for name, t in (("q", q), ("k", k), ("v", v)):
        if t.dim() != 4:
            fail(f"'{name}' must be 4-D, got shape {tuple(t.shape)}")
    B, H, one, D = q.shape
    if one != 1:
        fail(f"'q' must hold one query token ([B, H, 1, D]), got shape {tuple(q.shape)}")
    if k.shape != v.shape or k.shape[0] != B or k.shape[3] != D:
        fail(f"'k' and 'v' must be [B, Hkv, L, D] with q's B={B} and D={D}, got {tuple(k.shape)} and {tuple(v.shape)}")
    if k.shape[1] == 0 or H % k.shape[1]:
        fail(f"'k' heads ({k.shape[1]}) must divide q's heads ({H})")
    if not (q.dtype == k.dtype == v.dtype and q.dtype.is_floating_point):
        fail(f"'q', 'k' and 'v' must share one floating dtype, got {q.dtype}, {k.dtype}, {v.dtype}")
    if not (q.device == k.device == v.device):
        fail(f"'q', 'k' and 'v' must be on one device, got {q.device}, {k.device}, {v.device}")
    if attn_mask is not None:
        L = k.shape[2]
        if attn_mask.dim() != 4 or attn_mask.shape[0] != B or attn_mask.shape[1] not in (1, H) or \
                attn_mask.shape[2] != 1 or attn_mask.shape[3] != L:
            fail(f"'attn_mask' must be [B={B}, 1 or {H}, 1, L={L}], got {tuple(attn_mask.shape)}")
        if attn_mask.device != q.device:
            fail(f"'attn_mask' must be on {q.device}, got {attn_mask.device}")
        if not (attn_mask.dtype == torch.bool or attn_mask.dtype.is_floating_point):
            fail(f"'attn_mask' must be bool or floating, got {attn_mask.dtype}")
    if not (isinstance(scale, float) and math.isfinite(scale)):
        fail(f"'scale' must be a finite float, got {scale!r}")


def reference(q, k, v, attn_mask, scale):
    """``scaled_dot_product_attention`` with the key/value heads as the batch and their query
    heads as the heads, keys and values expanded along those heads (stride 0)."""
    _check(q, k, v, attn_mask, scale)
    return _on_kv_heads(q, k, v, attn_mask, scale)


def _on_kv_heads(q, k, v, attn_mask, scale):
    """``reference`` on checked arguments."""
    B, H = q.shape[:2]
    hkv = k.shape[1]
    n = H // hkv

    def expanded(x):  # [B, Hkv, L, D] -> [B*Hkv, n, L, D], a view
        return x.unsqueeze(2).expand(-1, -1, n, -1, -1).flatten(0, 1)

    mask = None
    if attn_mask is not None:
        mask = attn_mask.expand(B, H, 1, attn_mask.shape[3]).unflatten(1, (hkv, n)).flatten(0, 1)
    out = F.scaled_dot_product_attention(q.unflatten(1, (hkv, n)).flatten(0, 1), expanded(k), expanded(v),
                                         attn_mask=mask, scale=scale)
    return out.unflatten(0, (B, hkv)).flatten(1, 2)


def kernel_refusal(q, k, v, attn_mask) -> str | None:
    """Why the Triton kernels cannot take these (valid) arguments, or None."""
    if q.dtype not in DTYPES:
        return f"dtype {q.dtype} (the kernels take {', '.join(map(str, DTYPES))})"
    if q.shape[3] not in HEAD_DIMS:
        return f"head size {q.shape[3]} (the kernels take {HEAD_DIMS})"
    if q.shape[1] // k.shape[1] > MAX_GROUP:
        return f"{q.shape[1] // k.shape[1]} query heads per key/value head (at most {MAX_GROUP})"
    if k.shape[2] == 0:
        return "an empty cache"
    if q.stride(3) != 1 or k.stride(3) != 1 or v.stride(3) != 1:
        return "a head dimension that is not contiguous"
    if attn_mask is not None and attn_mask.dtype not in (torch.bool, torch.float32, *DTYPES):
        return f"mask dtype {attn_mask.dtype}"
    try:
        import triton  # noqa: F401
    except ImportError:
        return "Triton is not installed"
    return None


def _cuda(q, k, v, attn_mask, scale):
    _check(q, k, v, attn_mask, scale)
    reason = kernel_refusal(q, k, v, attn_mask)
    if reason is not None:
        log.debug("quantfuse.gqa_decode: reference runs: %s", reason)
        return _on_kv_heads(q, k, v, attn_mask, scale)
    from .gqa_decode_triton import gqa_decode_triton

    with torch.cuda.device(q.device):
        return gqa_decode_triton(q, k, v, attn_mask, scale)


def _fake(q, k, v, attn_mask, scale):
    return q.new_empty(q.shape)


SCHEMA = "gqa_decode(Tensor q, Tensor k, Tensor v, Tensor? attn_mask, float scale) -> Tensor"

# No kernels' library behind it: its CUDA implementation is the Triton kernels, registered here.
gqa_decode = define_op(SCHEMA, reference, _fake, kernel_dispatch=False, fixed_strides=False)
lib.impl("gqa_decode", _cuda, "CUDA")
