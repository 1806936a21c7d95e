"""The Triton kernels of ``quantfuse::gqa_decode`` (compile_backend/gqa_decode.py): one query token
attending over a key/value cache in ``splits`` slices of the cache (flash decoding), then the
slices' partial results combined.

Each program of the first kernel takes one key/value head of one batch row and one slice of the
cache: it reads the slice's keys and values once for all ``n`` query heads of that key/value head
(as rows of one ``tl.dot``, padded to 16), and keeps a running maximum, sum and weighted sum of
values per query head (the online softmax). The second kernel rescales the slices' sums to a
common maximum and divides. One token of one key/value head is too little work to keep an SM
busy, so the cache is split until about two programs per SM run (``Launch``).

Imported only where Triton is (a CUDA build of torch); the op's other paths need none of it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl


@dataclass(frozen=True)
class Launch:
    """How the split kernel is launched: the cache is split until about ``programs_per_sm`` programs
    per SM run (never below ``block_l`` positions per program), each stepping ``block_l`` positions
    at a time with ``num_warps`` warps and ``num_stages`` software-pipeline stages.  ``LAUNCH`` is
    what the op uses; benchmarks/bench_gqa_decode.py --sweep times the others."""
    programs_per_sm: int = 2
    block_l: int = 64
    num_warps: int = 4
    num_stages: int = 2


# In a decode step (the rotary variant, each layer's cache cold behind the weights' stream) this launch
# beats fewer, longer programs that are faster on the attention alone with its caches in L2: on an H200,
# 5.1 against 6.9 µs per layer at batch 1, 13.7 against 16.0 at batch 8 (benchmarks/RESULTS.md).
LAUNCH = Launch()
LOG2E = tl.constexpr(1.4426950408889634)  # scores are kept in base 2: exp(x) = exp2(x * log2(e))


@triton.jit
def _rotated(ptr, rd, D: tl.constexpr, cos, sin, dtype: tl.constexpr):
    """``rope`` of the ``D`` values at ``ptr`` (ops/gqa_decode.py): float32, rounded to ``dtype`` once.
    ``rotate_half`` reads the other half: element d takes -x[d + D/2] below D/2 and x[d - D/2] above."""
    x = tl.load(ptr + rd).to(tl.float32)
    other = tl.load(ptr + (rd + D // 2) % D).to(tl.float32)
    other = tl.where(rd < D // 2, -other, other)
    return (x * cos + other * sin).to(dtype)


@triton.jit
def _gqa_decode_split(q_ptr, k_ptr, v_ptr, m_ptr, part_o, part_ml, L, chunk, qk_scale,
                      sq_b, sq_h, sk_b, sk_h, sk_l, sv_b, sv_h, sv_l, sm_b, sm_h, sm_l, HKV,
                      kn_ptr, vn_ptr, pos_ptr, cos_ptr, sin_ptr, skn_b, skn_h, svn_b, svn_h, sc_b, ss_b,
                      N: tl.constexpr, NP: tl.constexpr, D: tl.constexpr, BL: tl.constexpr,
                      S, HAS_MASK: tl.constexpr, MASK_BOOL: tl.constexpr, ROPE: tl.constexpr):
    bh = tl.program_id(0)
    split = tl.program_id(1)
    b = bh // HKV
    h = bh % HKV
    rn = tl.arange(0, NP)
    rd = tl.arange(0, D)
    rl = tl.arange(0, BL)
    heads = h * N + rn  # the query heads of key/value head h
    start = split * chunk
    end = tl.minimum(start + chunk, L)
    if ROPE:
        # The query rotated as it is loaded; the new key rotated and, with the new value, used at
        # `pos` in place of what the cache holds there, and written there by the program whose
        # slice holds it (no program reads the cache at `pos`).
        cos = tl.load(cos_ptr + b * sc_b + rd).to(tl.float32)
        sin = tl.load(sin_ptr + b * ss_b + rd).to(tl.float32)
        q_rows = q_ptr + b * sq_b + heads[:, None] * sq_h
        q_x = tl.load(q_rows + rd[None, :], mask=rn[:, None] < N, other=0.0)
        q_o = tl.load(q_rows + ((rd + D // 2) % D)[None, :], mask=rn[:, None] < N, other=0.0).to(tl.float32)
        q_o = tl.where(rd[None, :] < D // 2, -q_o, q_o)
        q = (q_x.to(tl.float32) * cos[None, :] + q_o * sin[None, :]).to(q_x.dtype)
        pos = tl.load(pos_ptr).to(tl.int64)
        k_new = _rotated(kn_ptr + b * skn_b + h * skn_h, rd, D, cos, sin, q_x.dtype)
        v_new = tl.load(vn_ptr + b * svn_b + h * svn_h + rd)
        mine = (pos >= start) & (pos < end)
        tl.store(k_ptr + b * sk_b + h * sk_h + pos * sk_l + rd, k_new, mask=mine & (rd < D))
        tl.store(v_ptr + b * sv_b + h * sv_h + pos * sv_l + rd, v_new, mask=mine & (rd < D))
    else:
        q = tl.load(q_ptr + b * sq_b + heads[:, None] * sq_h + rd[None, :], mask=rn[:, None] < N, other=0.0)
    m_i = tl.full((NP,), -float("inf"), tl.float32)
    l_i = tl.zeros((NP,), tl.float32)
    acc = tl.zeros((NP, D), tl.float32)
    for l0 in range(start, end, BL):
        offs = l0 + rl
        valid = offs < end
        k = tl.load(k_ptr + b * sk_b + h * sk_h + offs[:, None] * sk_l + rd[None, :], mask=valid[:, None], other=0.0)
        if ROPE:
            k = tl.where((offs == pos)[:, None], k_new[None, :], k)
        s = tl.dot(q, tl.trans(k)) * qk_scale  # qk_scale = scale * log2(e)
        if HAS_MASK:
            mk = tl.load(m_ptr + b * sm_b + heads[:, None] * sm_h + offs[None, :] * sm_l,
                         mask=(rn[:, None] < N) & valid[None, :], other=0)
            if MASK_BOOL:
                s = tl.where(mk != 0, s, -float("inf"))
            else:
                s = s + mk.to(tl.float32) * LOG2E
        s = tl.where(valid[None, :], s, -float("inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        # a row with every score -inf so far: keep its sums at 0 instead of exp2(-inf - -inf)
        m_ref = tl.where(m_new == -float("inf"), 0.0, m_new)
        alpha = tl.exp2(m_i - m_ref)
        p = tl.exp2(s - m_ref[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(v_ptr + b * sv_b + h * sv_h + offs[:, None] * sv_l + rd[None, :], mask=valid[:, None], other=0.0)
        if ROPE:
            v = tl.where((offs == pos)[:, None], v_new[None, :], v)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
        m_i = m_new
    row = (bh * S + split) * NP + rn
    tl.store(part_o + row[:, None] * D + rd[None, :], acc)
    tl.store(part_ml + row * 2, m_i)
    tl.store(part_ml + row * 2 + 1, l_i)


@triton.jit
def _gqa_decode_combine(part_o, part_ml, out_ptr, so_b, so_h, HKV, S, order_ptr, pos_ptr,
                        N: tl.constexpr, NP: tl.constexpr, D: tl.constexpr, SP: tl.constexpr, ORDER: tl.constexpr,
                        ADVANCE: tl.constexpr):
    bh = tl.program_id(0)
    j = tl.program_id(1)
    if ADVANCE != 0:
        # Every program of the split kernel has read the position (it ran before this kernel).
        if (bh == 0) & (j == 0):
            tl.store(pos_ptr, tl.load(pos_ptr) + ADVANCE)
    b = bh // HKV
    h = bh % HKV
    rs = tl.arange(0, SP)
    rd = tl.arange(0, D)
    row = (bh * S + rs) * NP + j
    m = tl.load(part_ml + row * 2, mask=rs < S, other=-float("inf"))
    sums = tl.load(part_ml + row * 2 + 1, mask=rs < S, other=0.0)
    m_max = tl.max(m, 0)
    m_max = tl.where(m_max == -float("inf"), 0.0, m_max)
    w = tl.exp2(m - m_max)
    o = tl.load(part_o + row[:, None] * D + rd[None, :], mask=(rs < S)[:, None], other=0.0)
    out = tl.sum(o * w[:, None], 0) / tl.sum(sums * w, 0)
    if ORDER:
        # Each value at its place in the row (out contiguous, so_b = H*D); an index outside the row is
        # not stored (out_order is a permutation: every place is written once).
        dest = tl.load(order_ptr + (h * N + j) * D + rd).to(tl.int64)
        tl.store(out_ptr + b * so_b + dest, out.to(out_ptr.dtype.element_ty), mask=(dest >= 0) & (dest < so_b))
    else:
        tl.store(out_ptr + b * so_b + (h * N + j) * so_h + rd, out.to(out_ptr.dtype.element_ty))


def gqa_decode_triton(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None,
                      scale: float, rope: tuple | None = None, out_order: torch.Tensor | None = None,
                      advance: int = 0, launch: Launch = LAUNCH) -> torch.Tensor:
    """``q`` [B, Hkv*n, 1, D], ``k``/``v`` [B, Hkv, L, D] (last dim contiguous), ``mask``
    [B, 1 or Hkv*n, 1, L] (float, added to the scores, or bool, True = attend) or None.  ``rope``:
    ``(k_new, v_new, position, cos, sin)`` of ``quantfuse::gqa_decode_rope`` (``q`` then un-rotated,
    ``k``/``v`` the caches, written at ``position``).  ``out_order``: contiguous [H*D], where each batch
    row's values are stored (ops/gqa_decode.py).  ``advance``: added to ``rope``'s ``position`` afterwards.
    ``launch``: the split kernel's launch (``Launch``)."""
    B, H, _, D = q.shape
    Hkv, L = k.shape[1], k.shape[2]
    n = H // Hkv
    NP = max(16, triton.next_power_of_2(n))
    sms = torch.cuda.get_device_properties(q.device).multi_processor_count
    block = launch.block_l
    splits = max(1, min(triton.cdiv(L, block), launch.programs_per_sm * sms // (B * Hkv)))
    chunk = triton.cdiv(triton.cdiv(L, splits), block) * block
    S = triton.cdiv(L, chunk)
    part_o = torch.empty(B * Hkv * S * NP * D, device=q.device, dtype=torch.float32)
    part_ml = torch.empty(B * Hkv * S * NP * 2, device=q.device, dtype=torch.float32)
    out = torch.empty(B, H, 1, D, device=q.device, dtype=q.dtype)
    if mask is None:
        mask_arg, sm_b, sm_h, sm_l = q, 0, 0, 0
    else:
        m = mask.expand(B, H, 1, L)  # a view: a shared head dimension gets stride 0
        mask_arg, (sm_b, sm_h, _, sm_l) = m, m.stride()
    if rope is None:
        rope_args = (q, q, q, q, q, 0, 0, 0, 0, 0, 0)  # unread (ROPE=False)
    else:
        k_new, v_new, position, cos, sin = rope
        per_row = [t.stride(0) if t.shape[0] > 1 else 0 for t in (cos, sin)]  # one row: shared by the batch
        rope_args = (k_new, v_new, position, cos, sin, k_new.stride(0), k_new.stride(1), v_new.stride(0),
                     v_new.stride(1), *per_row)
    _gqa_decode_split[(B * Hkv, S)](
        q, k, v, mask_arg, part_o, part_ml, L, chunk, scale * LOG2E,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), k.stride(2), v.stride(0), v.stride(1), v.stride(2),
        sm_b, sm_h, sm_l, Hkv, *rope_args,
        N=n, NP=NP, D=D, BL=block, S=S, HAS_MASK=mask is not None,
        MASK_BOOL=mask is not None and mask.dtype == torch.bool, ROPE=rope is not None, num_warps=launch.num_warps,
        num_stages=launch.num_stages)
    _gqa_decode_combine[(B * Hkv, n)](part_o, part_ml, out, out.stride(0), out.stride(1), Hkv, S,
                                      part_ml if out_order is None else out_order,  # unread without an order
                                      part_ml if not advance else rope[2],  # unread without an advance
                                      N=n, NP=NP, D=D, SP=triton.next_power_of_2(S), ORDER=out_order is not None,
                                      ADVANCE=advance, num_warps=4)
    return out
