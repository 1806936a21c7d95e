"""The Triton kernel of ``quantfuse::rms_norm_ordered`` and ``add_rms_norm_ordered``
(compile_backend/ops/rms_norm_ordered.py).

A program takes ``BLOCK`` values of one row: it sums the squares of the whole row (adding the
residual first where there is one, rounded to the dtype as the eager add is), then normalizes its
own values, stores the sum's values in place and each normalized value at its place in the order.
Every program of a row sums the same values in the same order, so they agree on the row's scale;
the row is read once from DRAM and again from L2 by its other programs, so the scattered stores are
spread over as many SMs as the row has slices rather than left to one.

Imported only where Triton is (a CUDA build of torch); the op's other paths need none of it.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

# The launch: the best of benchmarks/bench_rms_norm_ordered.py --sweep on an H200 at Llama-3-8B's hidden size
# (2.12 µs at batch 1, 2.92 at batch 8, within 1% of the best at each; 256 / 1024 / 4 warps took 2.66 and 3.41).
BLOCK = 256  # values of a row per program: Llama-3-8B's 4096 are 16 programs per row
RBLOCK = 4096  # values per step of a program's sum of squares (at most the row's, rounded up to a power of 2)
NUM_WARPS = 8


@triton.jit
def _row_values(x_row, r_row, cols, mask, HAS_RESIDUAL: tl.constexpr):
    """The row's values at ``cols`` as float32: ``x``, or ``x + residual`` rounded to the dtype."""
    v = tl.load(x_row + cols, mask=mask, other=0.0)
    if HAS_RESIDUAL:
        v = (v.to(tl.float32) + tl.load(r_row + cols, mask=mask, other=0.0).to(tl.float32)).to(v.dtype)
    return v.to(tl.float32)


@triton.jit
def _rms_norm_ordered(x_ptr, r_ptr, w_ptr, order_ptr, out_ptr, sum_ptr, K, eps, sx, sr,
                      HAS_RESIDUAL: tl.constexpr, BLOCK: tl.constexpr, RBLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    x_row = x_ptr + row * sx
    r_row = r_ptr + row * sr
    squares = tl.zeros([RBLOCK], dtype=tl.float32)
    for k0 in range(0, K, RBLOCK):
        cols = k0 + tl.arange(0, RBLOCK)
        v = _row_values(x_row, r_row, cols, cols < K, HAS_RESIDUAL)
        squares += v * v
    scale = tl.rsqrt(tl.sum(squares, axis=0) / K + eps)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < K
    v = _row_values(x_row, r_row, cols, mask, HAS_RESIDUAL)
    dtype = out_ptr.dtype.element_ty
    if HAS_RESIDUAL:
        tl.store(sum_ptr + row * K + cols, v.to(dtype), mask=mask)
    w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    y = w * (v * scale).to(dtype).to(tl.float32)  # transformers rounds before the weight's product
    place = tl.load(order_ptr + cols, mask=mask, other=0)
    tl.store(out_ptr + row * K + place, y.to(dtype), mask=mask)


def rms_norm_ordered_triton(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float,
                            order: torch.Tensor, block: int = BLOCK, rblock: int = RBLOCK,
                            num_warps: int = NUM_WARPS) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``(out, s)`` of ``add_rms_norm_ordered`` (``s`` None without ``residual``); ``x``, ``residual``,
    ``weight`` and ``order`` checked by the op, their last dimension contiguous; the results contiguous.
    ``block``, ``rblock``, ``num_warps``: the launch (benchmarks/bench_rms_norm_ordered.py --sweep)."""
    K = x.shape[-1]
    x2 = x.reshape(-1, K)
    r2 = x2 if residual is None else residual.reshape(-1, K)
    out = torch.empty(x.shape, device=x.device, dtype=x.dtype)
    s = None if residual is None else torch.empty(x.shape, device=x.device, dtype=x.dtype)
    rblock = min(rblock, triton.next_power_of_2(K))
    _rms_norm_ordered[(x2.shape[0], triton.cdiv(K, block))](
        x2, r2, weight, order, out, out if s is None else s, K, eps, x2.stride(0), r2.stride(0),
        HAS_RESIDUAL=residual is not None, BLOCK=block, RBLOCK=rblock, num_warps=num_warps)
    return out, s
