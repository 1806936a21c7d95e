"""``quantfuse::gqa_decode``: one query token attending over a grouped-query key/value cache.

``gqa_decode(Tensor q, Tensor k, Tensor v, Tensor? attn_mask, float scale) -> Tensor`` with ``q``
``[B, Hkv*n, 1, D]``, ``k`` and ``v`` ``[B, Hkv, L, D]`` (query head ``h*n + j`` reads key/value
head ``h``, as transformers' ``repeat_kv`` pairs them) and ``attn_mask`` ``[B, 1 or Hkv*n, 1, L]``:
added to the scores when floating, or True where a position is attended when bool. It returns
``softmax(q·kᵀ·scale + mask)·v``, ``[B, Hkv*n, 1, D]`` in ``q``'s dtype.

``out_order`` (optional, every op here): an int ``[H*D]`` permutation (``H = Hkv*n``) by which each batch
row of the result, read as ``H*D`` values (heads, then head dimensions), is stored in another order:
``result.view(B, H*D)[b, out_order[c]] = attention(b, c)``.  That is an act-order ``o_proj``'s input
order (``AWQLinear``'s scatter by ``perm_inverse``), which the pass moves into the op: the kernels
store each value at its place, and the separate scatter kernel before ``o_proj`` is gone.

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

import functools
import logging
import math

import torch
import torch.nn.functional as F

from .library import QuantfuseInputError, define_op, lib

log = logging.getLogger("quantfuse.gqa_decode")

DTYPES = (torch.float16, torch.bfloat16)
HEAD_DIMS = (32, 64, 128, 256)  # powers of two (tl.dot), those the GPU tests cover
MAX_GROUP = 16  # query heads per key/value head, as rows of one tl.dot (the GPU tests cover up to 16)


def _check(q, k, v, attn_mask, scale, op: str = "gqa_decode", kv: tuple[str, str] = ("k", "v")) -> None:
    """Raises naming the argument (``kv``: the names of the key and value caches in ``op``'s schema)."""
    def fail(what):
        raise QuantfuseInputError(f"quantfuse.{op}: {what}")

    kn, vn = kv
    for name, t in (("q", q), (kn, k), (vn, v)):
        if t.dim() != 4:
            fail(f"'{name}' must be 4-D, got shape {tuple(t.shape)}")
    B, H, one, D = q.shape
    if one != 1:
        fail(f"'q' must hold one query token ([B, H, 1, D]), got shape {tuple(q.shape)}")
    if k.shape != v.shape or k.shape[0] != B or k.shape[3] != D:
        fail(f"'{kn}' and '{vn}' must be [B, Hkv, L, D] with q's B={B} and D={D}, got {tuple(k.shape)} and "
             f"{tuple(v.shape)}")
    if k.shape[1] == 0 or H % k.shape[1]:
        fail(f"'{kn}' heads ({k.shape[1]}) must divide q's heads ({H})")
    if not (q.dtype == k.dtype == v.dtype and q.dtype.is_floating_point):
        fail(f"'q', '{kn}' and '{vn}' must share one floating dtype, got {q.dtype}, {k.dtype}, {v.dtype}")
    if not (q.device == k.device == v.device):
        fail(f"'q', '{kn}' and '{vn}' must be on one device, got {q.device}, {k.device}, {v.device}")
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


def _check_order(q, out_order, op: str) -> None:
    if out_order is None:
        return
    B, H, _, D = q.shape
    if (out_order.dim() != 1 or out_order.shape[0] != H * D or out_order.dtype not in (torch.int32, torch.int64)
            or out_order.device != q.device):
        raise QuantfuseInputError(
            f"quantfuse.{op}: 'out_order' must be an int32 or int64 permutation of H*D = {H * D} elements on "
            f"{q.device}, got shape {tuple(out_order.shape)}, {out_order.dtype} on {out_order.device}")


def placed(out: torch.Tensor, out_order: torch.Tensor | None) -> torch.Tensor:
    """``out`` ``[B, H, 1, D]`` with each batch row's ``H*D`` values stored at ``out_order`` (module doc)."""
    if out_order is None:
        return out
    flat = out.reshape(out.shape[0], -1)
    return torch.empty_like(flat).index_copy_(1, out_order.long(), flat).view(out.shape)


def reference(q, k, v, attn_mask, scale, out_order=None):
    """``scaled_dot_product_attention`` with the key/value heads as the batch and their query
    heads as the heads, keys and values expanded along those heads (stride 0); then ``placed``."""
    _check(q, k, v, attn_mask, scale)
    _check_order(q, out_order, "gqa_decode")
    return placed(_on_kv_heads(q, k, v, attn_mask, scale), out_order)


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


def kernel_refusal(q, k, v, attn_mask, out_order=None) -> str | None:
    """Why the Triton kernels cannot take these (valid) arguments, or None."""
    if out_order is not None and out_order.stride(0) != 1:
        return "an 'out_order' that is not contiguous"
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


def _cuda(q, k, v, attn_mask, scale, out_order=None):
    _check(q, k, v, attn_mask, scale)
    _check_order(q, out_order, "gqa_decode")
    reason = kernel_refusal(q, k, v, attn_mask, out_order)
    if reason is not None:
        log.debug("quantfuse.gqa_decode: reference runs: %s", reason)
        return placed(_on_kv_heads(q, k, v, attn_mask, scale), out_order)
    from .gqa_decode_triton import gqa_decode_triton

    with torch.cuda.device(q.device):
        return gqa_decode_triton(q, k, v, attn_mask, scale, out_order=out_order)


def _fake(q, k, v, attn_mask, scale, out_order=None):
    return q.new_empty(q.shape)


SCHEMA = "gqa_decode(Tensor q, Tensor k, Tensor v, Tensor? attn_mask, float scale, Tensor? out_order=None) -> Tensor"

# No kernels' library behind it: its CUDA implementation is the Triton kernels, registered here.
gqa_decode = define_op(SCHEMA, reference, _fake, kernel_dispatch=False, strides="any")
lib.impl("gqa_decode", _cuda, "CUDA")


# --------------------------------------------------------------------------- with rotary and the cache write
#
# ``gqa_decode_rope(q, k, v, k_cache, v_cache, position, cos, sin, attn_mask, scale)``: the decode step's
# attention from the projections' outputs, as transformers' Llama-family attention computes it with a
# static cache::
#
#     q_r, k_r = rope(q), rope(k)                       # rope(x) = x * cos + rotate_half(x) * sin
#     k_cache[:, :, position] = k_r; v_cache[:, :, position] = v
#     return gqa_decode(q_r, k_cache, v_cache, attn_mask, scale)
#
# with ``q`` ``[B, Hkv*n, 1, D]``, the new ``k`` and ``v`` ``[B, Hkv, 1, D]``, the caches ``[B, Hkv, L, D]``
# (written in place), ``position`` an int64 tensor of one element in ``[0, L)`` (transformers'
# ``cache_position``: one token, the same place for every row) and ``cos`` / ``sin`` ``[B, 1, 1, D]`` (each
# row's own position) or ``[1, 1, 1, D]`` (one for all: transformers' position ids of a static cache).
# ``rope`` is computed in float32 and rounded to the activations' dtype once.  On CUDA one pair of Triton
# kernels does all of it: the split kernel rotates the query and the new key as it loads them, uses the new
# key and value at ``position`` in place of the cache's, and the program whose slice holds ``position``
# writes them into the caches; no launch of its own for the rotary or the writes.
#
# ``gqa_decode_rope_advance(q, k, v, k_cache, v_cache, counter, cos, sin, attn_mask, scale)``: the same at
# ``position = counter``, then ``counter += 1`` in place.  transformers 5's static cache keeps a counter
# per layer and writes at ``arange(1) + counter`` before ``counter.add_(1)``; the pass hands this op the
# counter itself, so that neither the position's sum nor the counter's increment is a launch of its own
# (the combine kernel, which runs after every program of the split kernel has read the position, advances
# it).  A separate op rather than a flag: a mutable argument is an input mutation to torch.compile even
# where nothing is written, and CUDA graph trees skip a graph that mutates a non-static input such as the
# ``cache_position`` a model is called with.


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """``x * cos + rotate_half(x) * sin`` in float32, rounded to ``x``'s dtype once."""
    xf = x.float()
    return (xf * cos.float() + rotate_half(xf) * sin.float()).to(x.dtype)


def _check_rope(q, k, v, k_cache, v_cache, position, cos, sin, attn_mask, scale, op="gqa_decode_rope",
                pos_name="position") -> None:
    def fail(what):
        raise QuantfuseInputError(f"quantfuse.{op}: {what}")

    _check(q, k_cache, v_cache, attn_mask, scale, op, ("k_cache", "v_cache"))
    B, _, _, D = q.shape
    Hkv = k_cache.shape[1]
    for name, t in (("k", k), ("v", v)):
        if tuple(t.shape) != (B, Hkv, 1, D):
            fail(f"'{name}' must be the new token's [B={B}, Hkv={Hkv}, 1, D={D}], got {tuple(t.shape)}")
        if t.dtype != q.dtype or t.device != q.device:
            fail(f"'{name}' must be {q.dtype} on {q.device}, got {t.dtype} on {t.device}")
    if D % 2:
        fail(f"the head size must be even for rotate_half, got {D}")
    if position.numel() != 1 or position.dtype not in (torch.int32, torch.int64) or position.device != q.device:
        fail(f"'{pos_name}' must be one int32 or int64 element on {q.device}, got shape {tuple(position.shape)}, "
             f"{position.dtype} on {position.device}")
    for name, t in (("cos", cos), ("sin", sin)):
        if (t.dim() != 4 or t.shape[0] not in (1, B) or tuple(t.shape[1:]) != (1, 1, D)
                or not t.dtype.is_floating_point or t.device != q.device):
            fail(f"'{name}' must be floating [B={B} or 1, 1, 1, D={D}] on {q.device}, got {tuple(t.shape)}, "
                 f"{t.dtype} on {t.device}")


# (the op's name, its position argument's name) by whether it advances the position
_ROPE_OPS = {False: ("gqa_decode_rope", "position"), True: ("gqa_decode_rope_advance", "counter")}


def _check_rope_op(q, k, v, k_cache, v_cache, position, cos, sin, attn_mask, scale, out_order, advance: bool):
    op, pos_name = _ROPE_OPS[advance]
    _check_rope(q, k, v, k_cache, v_cache, position, cos, sin, attn_mask, scale, op, pos_name)
    _check_order(q, out_order, op)


def _rope_reference(q, k, v, k_cache, v_cache, position, cos, sin, attn_mask, scale, out_order, advance: bool):
    _check_rope_op(q, k, v, k_cache, v_cache, position, cos, sin, attn_mask, scale, out_order, advance)
    return _rope_on_checked(q, k, v, k_cache, v_cache, position, cos, sin, attn_mask, scale, out_order, advance)


def _rope_on_checked(q, k, v, k_cache, v_cache, position, cos, sin, attn_mask, scale, out_order, advance: bool):
    """``_rope_reference`` on checked arguments."""
    index = position.reshape(1).long().clone()
    k_cache.index_copy_(2, index, rope(k, cos, sin))
    v_cache.index_copy_(2, index, v)
    out = placed(_on_kv_heads(rope(q, cos, sin), k_cache, v_cache, attn_mask, scale), out_order)
    if advance:
        position.add_(1)
    return out


def rope_reference(q, k, v, k_cache, v_cache, position, cos, sin, attn_mask, scale, out_order=None):
    """What the op does, in torch ops: ``rope``, the cache writes (``index_copy_``), ``gqa_decode``'s
    reference."""
    return _rope_reference(q, k, v, k_cache, v_cache, position, cos, sin, attn_mask, scale, out_order, False)


def advance_reference(q, k, v, k_cache, v_cache, counter, cos, sin, attn_mask, scale, out_order=None):
    """``rope_reference`` at ``position = counter``, then ``counter += 1``."""
    return _rope_reference(q, k, v, k_cache, v_cache, counter, cos, sin, attn_mask, scale, out_order, True)


# ``out_order`` has its default here: the dispatcher hands a Python kernel only the arguments the caller gave.
def _rope_cuda(q, k, v, k_cache, v_cache, position, cos, sin, attn_mask, scale, out_order=None, *, advance: bool):
    _check_rope_op(q, k, v, k_cache, v_cache, position, cos, sin, attn_mask, scale, out_order, advance)
    reason = (kernel_refusal(q, k_cache, v_cache, attn_mask, out_order)
              or rope_kernel_refusal(k, v, k_cache, v_cache, cos, sin))
    if reason is not None:
        log.debug("quantfuse.%s: reference runs: %s", _ROPE_OPS[advance][0], reason)
        return _rope_on_checked(q, k, v, k_cache, v_cache, position, cos, sin, attn_mask, scale, out_order, advance)
    from .gqa_decode_triton import gqa_decode_triton

    with torch.cuda.device(q.device):
        return gqa_decode_triton(q, k_cache, v_cache, attn_mask, scale, rope=(k, v, position, cos, sin),
                                 out_order=out_order, advance=int(advance))


def rope_kernel_refusal(k, v, k_cache, v_cache, cos, sin) -> str | None:
    """Why the kernels cannot take the rotary part of these (valid) arguments, or None."""
    if k.stride(3) != 1 or v.stride(3) != 1 or cos.stride(3) != 1 or sin.stride(3) != 1:
        return "a new key, value, cos or sin whose head dimension is not contiguous"
    if k_cache.stride(3) != 1 or v_cache.stride(3) != 1:
        return "a cache whose head dimension is not contiguous"
    return None


def _rope_fake(q, k, v, k_cache, v_cache, position, cos, sin, attn_mask, scale, out_order=None):
    return q.new_empty(q.shape)


ROPE_SCHEMA = ("gqa_decode_rope(Tensor q, Tensor k, Tensor v, Tensor(a!) k_cache, Tensor(b!) v_cache, "
               "Tensor position, Tensor cos, Tensor sin, Tensor? attn_mask, float scale, Tensor? out_order=None) "
               "-> Tensor")
ADVANCE_SCHEMA = ("gqa_decode_rope_advance(Tensor q, Tensor k, Tensor v, Tensor(a!) k_cache, Tensor(b!) v_cache, "
                  "Tensor(c!) counter, Tensor cos, Tensor sin, Tensor? attn_mask, float scale, "
                  "Tensor? out_order=None) -> Tensor")

gqa_decode_rope = define_op(ROPE_SCHEMA, rope_reference, _rope_fake, kernel_dispatch=False, strides="any")
lib.impl("gqa_decode_rope", functools.partial(_rope_cuda, advance=False), "CUDA")
gqa_decode_rope_advance = define_op(ADVANCE_SCHEMA, advance_reference, _rope_fake, kernel_dispatch=False,
                                    strides="any")
lib.impl("gqa_decode_rope_advance", functools.partial(_rope_cuda, advance=True), "CUDA")
