"""``quantfuse::awq_gemm`` and ``quantfuse::awq_dequantize``: AWQ W4A16.

    W[k, n] = (q[k, n] − z[k // G, n]) · s[k // G, n]        Y = X W + bias   (docs/DESIGN.md)

``qweight`` holds the unsigned 4-bit values of ``W``, 8 per int32, in one of two layouts:

* the AWQ layout ``[K, N/8]`` (AutoAWQ's, the checkpoints' and ``state_dict``'s): values along N
  in AWQ order (``AWQ_ORDER``);
* the fragment layout ``[N/64, K/16, 32, 4]`` (N % 64 == 0, K % 16 == 0): the decode kernel's
  own, each lane's mma fragments contiguous (``awq_to_fragments``, csrc/awq_gemm/awq_gemm.h).
  ``AWQLinear`` holds this one, so that the kernels read the module's tensor as it is and no
  second copy of the weight exists (the Hopper prefill kernel makes its layout from it per call).

``qzeros`` ``[K/G, N/8]`` is in AWQ layout, ``scales`` ``[K/G, N]`` in the activation dtype
(float16 or bfloat16).  The reference dequantizes with one rounding (the scale product, as a
kernel that dequantizes in registers makes) and multiplies in float32.

Autograd: dX = dY Wᵀ;  dbias = Σ_m dY;  d scales[g, n] = Σ_{k in g} (Xᵀ dY)[k, n] · (q − z)[k, n];
for ``awq_dequantize``, d scales[g, n] = Σ_{k in g} dW[k, n] · (q − z)[k, n].

GPTQ's 4-bit layout is AWQ's arithmetic packed another way: ``qweight [K/8, N]`` (row ``8r + j`` in bits
``4j`` of word ``r``), ``qzeros [K/G, N/8]`` (column ``8c + j`` in bits ``4j``), ``scales [K/G, N]`` and
``g_idx [K]`` (each input channel's group), ``W[k, n] = (q[k, n] − z[g_idx[k], n]) · s[g_idx[k], n]``.
``awq_state`` is the one conversion into the operands above (``checkpoints/gptq.py`` loads with it,
``prepare`` replaces layers with it); ``quantfuse::gptq_to_awq`` is that conversion as a value derived
from the GPTQ tensors, made once per weight (the AWQ pass puts it in front of ``awq_gemm`` for a GPTQ
dequantization written in torch ops); ``gptq_dequantize_reference`` is what such a dequantization must
compute.
"""

from __future__ import annotations

import torch

from ..derived.tensor_cache import TensorCache
from . import gradients
from .library import check_devices, define_op, fail, lib

AWQ_ACT_DTYPES = (torch.float16, torch.bfloat16)
AWQ_PACK = 8  # int4 values per int32
# Logical column 8c+i sits at bits 4*AWQ_ORDER[i] of qweight[:, c].
AWQ_ORDER = (0, 4, 1, 5, 2, 6, 3, 7)
AWQ_SHIFTS = tuple(4 * o for o in AWQ_ORDER)
AWQ_STRIP_N = 64  # columns of N per strip of the fragment layout

SCHEMA = ("awq_gemm(Tensor x, Tensor qweight, Tensor scales, Tensor qzeros, int group_size, Tensor? bias=None, "
          "Tensor? perm=None) -> Tensor")
DEQUANTIZE_SCHEMA = "awq_dequantize(Tensor qweight, Tensor scales, Tensor qzeros, int group_size) -> Tensor"


def awq_shape(qweight: torch.Tensor) -> tuple[int, int] | None:
    """(K, N) of an int32 ``qweight`` in either layout (module doc), or None if it is in neither."""
    if qweight.dtype != torch.int32:
        return None
    if qweight.dim() == 2:
        return qweight.shape[0], qweight.shape[1] * AWQ_PACK
    if qweight.dim() == 4 and tuple(qweight.shape[2:]) == (32, 4):
        return qweight.shape[1] * 16, qweight.shape[0] * AWQ_STRIP_N
    return None


def check_awq(op, qweight, scales, qzeros, group_size, x=None, bias=None, perm=None):
    first = "qweight" if x is None else "x"
    check_devices(op, first, dict(x=x, qweight=qweight, scales=scales, qzeros=qzeros, bias=bias, perm=perm))
    shape = awq_shape(qweight)
    if shape is None:
        fail(op, "qweight", qweight, "int32 [K, N/8] (AWQ layout) or [N/64, K/16, 32, 4] (fragment layout)")
    K, N = shape
    n_packed = N // AWQ_PACK
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
    if perm is not None and (perm.dim() != 1 or perm.shape[0] != K or perm.dtype not in (torch.int32, torch.int64)):
        fail(op, "perm", perm, f"a 1-D int32 or int64 permutation of range(K), K = {K} from 'qweight'")
    return K, N


def awq_pack_unchecked(values: torch.Tensor) -> torch.Tensor:
    """[R, N] ints in [0, 15] -> [R, N/8] int32 in AWQ order (the inverse of ``awq_unpack``; the values
    are not checked: ``quantize.awq_pack`` checks them)."""
    v = values.to(torch.int64).view(values.shape[0], -1, AWQ_PACK)
    packed = v[..., 0] << AWQ_SHIFTS[0]
    for i in range(1, AWQ_PACK):
        packed |= v[..., i] << AWQ_SHIFTS[i]
    # Reinterpret the unsigned 32-bit pattern as int32 (subtract 2^32 where bit 31 is set).
    return (packed - ((packed >> 31) << 32)).to(torch.int32).contiguous()


def awq_unpack(packed: torch.Tensor) -> torch.Tensor:
    """[R, N/8] int32 in AWQ order -> [R, N] int32 of 4-bit values."""
    shifts = torch.tensor(AWQ_SHIFTS, dtype=torch.int32, device=packed.device)
    nibbles = (packed.unsqueeze(-1) >> shifts) & 0xF
    return nibbles.reshape(packed.shape[0], packed.shape[1] * AWQ_PACK)


# --------------------------------------------------------------------------- fragment layout
#
# Word j of lane l = 4g + t at k-step kt of strip s (word index ((s*K/16 + kt)*32 + l)*4 + j,
# j = 2jh + jl) holds in nibble i = 4ih + 2im + il (bits 4i..4i+3) the value W[k, n] with
#     k = 16kt + 4t + 2jl + ih,      n = 64s + 32jh + 16il + 8im + g
# (csrc/awq_gemm/awq_gemm_kernels.cu, awq_repack_kernel).  As a tensor of nibbles
# [s, kt, g, t, jh, jl, ih, im, il] that is a permutation of W's [kt, t, jl, ih, s, jh, il, im, g].

_TO_W = (1, 3, 5, 6, 0, 4, 8, 7, 2)  # nibble tensor dims -> W's
_TO_FRAGMENTS = (4, 0, 8, 1, 5, 2, 3, 7, 6)  # W's dims -> the nibble tensor's


def fragment_layout_takes(K: int, N: int) -> bool:
    """Whether a ``[K, N]`` weight has a fragment layout (module doc)."""
    return K > 0 and N > 0 and K % 16 == 0 and N % AWQ_STRIP_N == 0


def _nibbles(words: torch.Tensor) -> torch.Tensor:
    """int32 ``[..., W]`` -> uint8 ``[..., 8W]``: nibble ``i`` of word ``w`` at ``8w + i`` (bits 4i..4i+3)."""
    b = words.contiguous().view(torch.uint8)  # little-endian: byte j holds nibbles 2j (low) and 2j + 1
    return torch.stack((b & 0xF, b >> 4), -1).flatten(-2)


def _words(nibbles: torch.Tensor) -> torch.Tensor:
    """Inverse of ``_nibbles``: uint8 values in [0, 15] ``[..., 8W]`` -> int32 ``[..., W]``."""
    pairs = nibbles.reshape(*nibbles.shape[:-1], -1, 2)
    return (pairs[..., 0] | (pairs[..., 1] << 4)).contiguous().view(torch.int32)


def _unpack_fragments_u8(fragments: torch.Tensor) -> torch.Tensor:
    """``unpack_fragments`` as uint8."""
    S, KT = fragments.shape[:2]
    nibbles = _nibbles(fragments)  # [S, KT, 32 lanes, 4 words x 8 nibbles]
    return nibbles.reshape(S, KT, 8, 4, 2, 2, 2, 2, 2).permute(_TO_W).reshape(KT * 16, S * AWQ_STRIP_N)


def unpack_fragments(fragments: torch.Tensor) -> torch.Tensor:
    """Fragment layout ``[N/64, K/16, 32, 4]`` int32 -> ``[K, N]`` int32 of 4-bit values."""
    return _unpack_fragments_u8(fragments).to(torch.int32)


def pack_fragments(values: torch.Tensor) -> torch.Tensor:
    """``[K, N]`` ints in [0, 15] -> the fragment layout ``[N/64, K/16, 32, 4]`` int32."""
    K, N = values.shape
    if not fragment_layout_takes(K, N):
        raise ValueError(f"pack_fragments: a [K, N] = [{K}, {N}] weight; the fragment layout needs K % 16 == 0 "
                         f"and N % {AWQ_STRIP_N} == 0")
    S, KT = N // AWQ_STRIP_N, K // 16
    v = values.to(torch.uint8).reshape(KT, 4, 2, 2, S, 2, 2, 2, 8).permute(_TO_FRAGMENTS)
    return _words(v.reshape(S, KT, 32, 32))


def awq_to_fragments(qweight: torch.Tensor) -> torch.Tensor:
    """AWQ layout ``[K, N/8]`` -> fragment layout (what ``_awq_repack_cuda`` makes on the GPU)."""
    return pack_fragments(awq_unpack(qweight))


def awq_from_fragments(fragments: torch.Tensor) -> torch.Tensor:
    """Fragment layout -> AWQ layout ``[K, N/8]``."""
    return awq_pack_unchecked(_unpack_fragments_u8(fragments))


def _cuda_op(t: torch.Tensor, name: str):
    """The private CUDA op ``name`` for ``t`` when ``t`` is on a GPU and the kernels are loaded."""
    if not t.is_cuda:
        return None
    from ..kernels.loader import ensure_loaded

    return getattr(torch.ops.quantfuse, name) if ensure_loaded() else None


def awq_layout(qweight: torch.Tensor) -> torch.Tensor:
    """``qweight`` in the AWQ layout ``[K, N/8]``: itself, or converted from the fragment layout."""
    if qweight.dim() != 4:
        return qweight
    op = _cuda_op(qweight, "_awq_unrepack_cuda")
    return op(qweight.contiguous()) if op is not None else awq_from_fragments(qweight)


def fragment_layout(qweight: torch.Tensor) -> torch.Tensor:
    """``qweight`` in the fragment layout where its shape has one (``fragment_layout_takes``), else
    as it is."""
    if qweight.dim() != 2 or not fragment_layout_takes(qweight.shape[0], qweight.shape[1] * AWQ_PACK):
        return qweight
    op = _cuda_op(qweight, "_awq_repack_cuda")
    return op(qweight.contiguous()) if op is not None else awq_to_fragments(qweight)


def awq_values(qweight: torch.Tensor) -> torch.Tensor:
    """``[K, N]`` int32 4-bit values of ``qweight`` in either layout."""
    return unpack_fragments(qweight) if qweight.dim() == 4 else awq_unpack(qweight)


def _awq_weight(qweight, scales, qzeros, group_size):
    q = awq_values(qweight)
    z = awq_unpack(qzeros).repeat_interleave(group_size, dim=0)
    s = scales.repeat_interleave(group_size, dim=0)
    # (q - z) is exact in the activation dtype; the one rounding is the scale product,
    # the same rounding a kernel that dequantizes in registers makes.
    return (q - z).to(scales.dtype) * s


def awq_dequantize_reference(qweight, scales, qzeros, group_size):
    check_awq("awq_dequantize", qweight, scales, qzeros, group_size)
    return _awq_weight(qweight, scales, qzeros, group_size)


def awq_gemm_reference(x, qweight, scales, qzeros, group_size, bias=None, perm=None):
    _, N = check_awq("awq_gemm", qweight, scales, qzeros, group_size, x, bias, perm)
    if x.shape[0] == 0:
        return x.new_empty((0, N))
    if perm is not None:  # act-order: row j of the weight is input channel perm[j]
        x = x.index_select(1, perm)
    w = _awq_weight(qweight, scales, qzeros, group_size)
    out = torch.matmul(x.to(torch.float32), w.to(torch.float32))
    if bias is not None:
        out = out + bias.to(torch.float32)
    return out.to(x.dtype)


def _awq_gemm_fake(x, qweight, scales, qzeros, group_size, bias=None, perm=None):
    _, N = check_awq("awq_gemm", qweight, scales, qzeros, group_size, x, bias, perm)
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
    x, qweight, scales, qzeros, group_size, *rest = inputs
    bias, perm = (*rest, None, None)[:2]
    ctx.save_for_backward(x, qweight, scales, qzeros, perm)
    ctx.group_size = group_size
    ctx.bias_dtype = None if bias is None else bias.dtype


def _gemm_backward(ctx, grad):
    x, qweight, scales, qzeros, perm = ctx.saved_tensors
    g = grad.to(F32)
    d_x = d_scales = None
    if gradients.needs(ctx, 0):
        w = torch.ops.quantfuse.awq_dequantize(qweight, scales, qzeros, ctx.group_size)
        d_x = (g @ w.to(F32).t()).to(x.dtype)  # by the weight's rows: input channel perm[j] at j
        if perm is not None:
            d_x = d_x.new_empty(d_x.shape).index_copy_(1, perm.long(), d_x)
    if gradients.needs(ctx, 2):
        xs = x if perm is None else x.index_select(1, perm)
        d_scales = _scales_grad(xs.to(F32).t() @ g, qweight, scales, qzeros, ctx.group_size)
    return d_x, None, d_scales, None, None, gradients.bias_grad(ctx, grad, 5, ctx.bias_dtype), None


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


# --------------------------------------------------------------------------- GPTQ -> AWQ

# Row 8r + j of a GPTQ ``qweight`` (column 8c + j of its ``qzeros``) sits at bits 4j: lowest nibble first.
GPTQ_SHIFTS = tuple(4 * j for j in range(AWQ_PACK))
# One per packed value of a zero-point word, by bit width: a v1 word is the v2 word minus this, word-wise.
V1_ZERO_OFFSET = {4: 0x11111111, 8: 0x01010101}
_V1_MAX_STORED_ZERO = 14  # a v1 zero point of 0 would be stored as 15 with a borrow from its neighbour


def v1_to_v2_zeros(qzeros: torch.Tensor, bits: int = 4) -> torch.Tensor:
    """v1 zero-point words -> v2 ones: ``+ 0x11111111`` (8-bit: ``+ 0x01010101``) on the unsigned 32-bit
    word, as GPTQModel's ``convert_gptq_v1_to_v2_format_module`` does (``[R, C]`` int32 -> int64 holding
    the unsigned words)."""
    return (qzeros.to(torch.int64) + V1_ZERO_OFFSET[bits]) & 0xFFFFFFFF


def gptq_unpack(packed: torch.Tensor) -> torch.Tensor:
    """``[R, C]`` int32 (or int64 holding unsigned words) -> ``[R, 8C]`` int32 nibbles, element ``8c + j``
    from bits ``4j`` of word ``c`` (GPTQ's order along a word; ``gptq_unpack(qweight.t()).t()`` unpacks
    along K)."""
    shifts = torch.tensor(GPTQ_SHIFTS, dtype=packed.dtype, device=packed.device)
    return ((packed.unsqueeze(-1) >> shifts) & 0xF).reshape(packed.shape[0], -1).to(torch.int32)


def regroup(g_idx: torch.Tensor, group: int) -> torch.Tensor | None:
    """The order of input channels that makes groups contiguous (``g_idx`` sorted, stably), or None
    when they already are (``g_idx[k] == k // group``).  ``ValueError`` for group indices outside
    ``[0, K / group)``, or when some group does not hold exactly ``group`` channels (no contiguous
    layout serves that)."""
    K = g_idx.shape[0]
    if g_idx.numel() and (int(g_idx.min()) < 0 or int(g_idx.max()) >= K // group):
        raise ValueError(f"holds group indices outside [0, {K // group})")
    in_order = torch.arange(K, device=g_idx.device) // group
    g = g_idx.to(torch.int64)
    if torch.equal(g, in_order):
        return None
    counts = torch.bincount(g, minlength=K // group)
    if counts.shape[0] != K // group or not bool((counts == group).all()):
        bad = int((counts != group).nonzero()[0, 0])
        raise ValueError(f"puts {int(counts[bad])} input channels in group {bad}; every group must hold "
                         f"group_size = {group} of them")
    return torch.sort(g, stable=True).indices


def awq_state(qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor, g_idx: torch.Tensor | None,
              group: int, v1: bool) -> dict:
    """A 4-bit GPTQ layer's tensors (module doc) as ``AWQLinear.from_state_dict`` takes them: ``qweight`` and
    ``qzeros`` in the AWQ layout, ``scales``, and ``perm`` (None without act-order: rows sorted by group,
    ``regroup``).  v1 zero points are given back their ``0x11111111`` first (``v1_to_v2_zeros``).
    ``ValueError`` for a ``g_idx`` with group indices out of range or groups of another size."""
    q = gptq_unpack(qweight.t().contiguous()).t()  # [K, N]: row 8r + j from bits 4j of qweight[r]
    z = gptq_unpack(v1_to_v2_zeros(qzeros, 4) if v1 else qzeros)  # [K/G, N]
    perm = None if g_idx is None else regroup(g_idx, group)
    if perm is not None:
        q = q.index_select(0, perm)
    return {"qweight": awq_pack_unchecked(q), "qzeros": awq_pack_unchecked(z), "scales": scales.contiguous(),
            "perm": perm}


def gptq_dequantize_reference(qweight, qzeros, scales, g_idx=None, v1=False):
    """``W [K, N]`` of GPTQ tensors: ``(q[k, n] − z[g, n]) · s[g, n]`` with ``g = g_idx[k]`` (``k // G``
    without one), rounded once to the scales' dtype as ``awq_dequantize`` rounds.  ``v1``: each zero point
    is its stored nibble plus one (what a torch dequantization of a v1 layer computes after unpacking)."""
    K = qweight.shape[0] * AWQ_PACK
    q = gptq_unpack(qweight.t().contiguous()).t()
    z = gptq_unpack(qzeros) + (1 if v1 else 0)
    g = torch.arange(K, device=qweight.device) // (K // scales.shape[0]) if g_idx is None else g_idx.long()
    return (q - z[g]).to(scales.dtype) * scales[g]


GPTQ_TO_AWQ_SCHEMA = ("gptq_to_awq(Tensor qweight, Tensor qzeros, Tensor? g_idx, int group_size, bool v1, "
                      "Tensor[] shift_tables) -> (Tensor, Tensor, Tensor)")


def check_gptq(op, qweight, qzeros, g_idx, group_size, shift_tables=()):
    """(K, N) of GPTQ tensors, checked (module doc); ``shift_tables``: int tensors of 8 elements."""
    check_devices(op, "qweight", dict(qweight=qweight, qzeros=qzeros, g_idx=g_idx,
                                      **{f"shift_tables[{i}]": t for i, t in enumerate(shift_tables)}))
    if qweight.dtype != torch.int32 or qweight.dim() != 2:
        fail(op, "qweight", qweight, "int32 [K/8, N] (GPTQ layout, packed along K)")
    K, N = qweight.shape[0] * AWQ_PACK, qweight.shape[1]
    if N % AWQ_PACK:
        fail(op, "qweight", qweight, f"N (its last dimension) a multiple of {AWQ_PACK}")
    if not isinstance(group_size, int) or group_size <= 0 or K % group_size != 0:
        fail(op, "group_size", group_size, f"a positive divisor of K = {K}")
    if qzeros.dtype != torch.int32 or tuple(qzeros.shape) != (K // group_size, N // AWQ_PACK):
        fail(op, "qzeros", qzeros, f"int32 of shape ({K // group_size}, {N // AWQ_PACK}) = (K/group_size, N/8)")
    if g_idx is not None and (g_idx.dim() != 1 or g_idx.shape[0] != K or g_idx.dtype not in (torch.int32, torch.int64)):
        fail(op, "g_idx", g_idx, f"a 1-D int32 or int64 tensor of K = {K} group indices")
    for i, t in enumerate(shift_tables):
        if t.dtype not in (torch.int32, torch.int64) or t.numel() != AWQ_PACK:
            fail(op, f"shift_tables[{i}]", t, f"an int32 or int64 tensor of {AWQ_PACK} shifts")
    return K, N


def _check_gptq_values(qzeros, g_idx, group_size, v1, shift_tables):
    """The value rules of ``gptq_to_awq`` (its schema's doc), raising ``QuantfuseInputError``."""
    op = "gptq_to_awq"
    want = torch.tensor(GPTQ_SHIFTS, dtype=torch.int64)
    for i, t in enumerate(shift_tables):
        if not torch.equal(t.reshape(-1).to(device="cpu", dtype=torch.int64), want):
            fail(op, f"shift_tables[{i}]", t, f"the shifts {list(GPTQ_SHIFTS)} the graph was matched with")
    if v1 and qzeros.numel() and int(gptq_unpack(qzeros).max()) > _V1_MAX_STORED_ZERO:
        fail(op, "qzeros", qzeros, f"v1 zero points stored as 0..{_V1_MAX_STORED_ZERO} (a stored 15, a zero "
             "point of 0 borrowing from its neighbour, is read differently by v1 dequantizations)")
    if g_idx is not None:
        try:
            regroup(g_idx, group_size)
        except ValueError as exc:
            fail(op, "g_idx", g_idx, f"group indices that put group_size = {group_size} channels in every "
                 f"group (it {exc})")


def gptq_to_awq_reference(qweight, qzeros, g_idx, group_size, v1, shift_tables):
    """GPTQ tensors -> (``qweight [K, N/8]`` and ``qzeros [K/G, N/8]`` in the AWQ layout, ``perm`` int32
    ``[K]``): ``awq_gemm(x, qweight', scales, qzeros', G, bias, perm)`` computes ``x @ W`` of the GPTQ
    dequantization (``gptq_dequantize_reference``; the scales are the GPTQ ones as they are).  ``perm``
    is the identity without ``g_idx`` or when the groups are in order.  ``shift_tables``: tensors the
    matched graph reads as GPTQ's shifts ``[0, 4, ..., 28]``, checked to hold them.  Refused
    (``QuantfuseInputError``): a ``g_idx`` out of range or with groups of another size than
    ``group_size``, and, with ``v1``, a stored zero-point nibble of 15."""
    K, _ = check_gptq("gptq_to_awq", qweight, qzeros, g_idx, group_size, shift_tables)
    _check_gptq_values(qzeros, g_idx, group_size, v1, shift_tables)
    state = awq_state(qweight, qzeros, qzeros.new_empty(0), g_idx, group_size, v1)
    perm = state["perm"]
    perm = torch.arange(K, device=qweight.device) if perm is None else perm
    return state["qweight"], state["qzeros"], perm.to(torch.int32)


def _gptq_to_awq_fake(qweight, qzeros, g_idx, group_size, v1, shift_tables):
    K, N = check_gptq("gptq_to_awq", qweight, qzeros, g_idx, group_size, shift_tables)
    return (qweight.new_empty((K, N // AWQ_PACK)), qzeros.new_empty(tuple(qzeros.shape)),
            qweight.new_empty((K,)))


gptq_cache = TensorCache()


def _gptq_to_awq_cached(qweight, qzeros, g_idx, group_size, v1, shift_tables):
    """The conversion once per set of GPTQ tensors (served while none of them changed: ``TensorCache``)."""
    sources = [t for t in (qweight, qzeros, g_idx, *shift_tables) if t is not None]
    if torch.compiler.is_compiling() or any(t.is_inference() or getattr(t, "_is_fake", False) for t in sources):
        return gptq_to_awq_reference(qweight, qzeros, g_idx, group_size, v1, shift_tables)
    return gptq_cache.get(sources, lambda: gptq_to_awq_reference(qweight, qzeros, g_idx, group_size, v1,
                                                                 shift_tables),
                          extra=(group_size, bool(v1), g_idx is None, len(shift_tables)))


gptq_to_awq = define_op(GPTQ_TO_AWQ_SCHEMA, gptq_to_awq_reference, _gptq_to_awq_fake, kernel_dispatch=False)
lib.impl("gptq_to_awq", _gptq_to_awq_cached, "CPU")
lib.impl("gptq_to_awq", _gptq_to_awq_cached, "CUDA")
