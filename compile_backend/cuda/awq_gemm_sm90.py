"""AWQ W4A16 prefill on Hopper (csrc/awq_gemm/awq_gemm_sm90*): CUTLASS 3.x mixed-input GEMM.

The int4 weight is converted to fp16/bf16 in registers inside a TMA + wgmma
warp-specialized GEMM (CUTLASS's ``ConvertAndScaleWithZero`` mode: ``w = q * s + zero'``
with ``zero' = -z * s``), on the swapped problem ``out^T = W^T x^T`` so that the narrow
operand is the register-sourced one.

* ``supports_prefill(...)``: ``None`` when the kernel takes the inputs, else the reason.
* ``launch_prefill(...)``: ``x @ W + bias``.  The weight is prepared (int4 moved to the
  kernel's [N, K] reordered layout, the zeros folded into ``-z * s``) by
  ``_awq_prepare_sm90_cuda`` once per weight and kept in a ``TensorCache``
  (compile_backend/tensor_cache.py) keyed by where the (qweight, scales, qzeros) data is
  and valid while their version counters are unchanged; an entry goes when its qweight is
  garbage-collected, and nothing is cached while a CUDA stream is capturing (memory
  allocated then belongs to the graph's pool).

Which M to send here is the caller's choice; the tile configuration (token tiles of 128 to
256, sized to M; data-parallel or stream-K) is the kernel's
(csrc/awq_gemm/awq_gemm_sm90_choice.h: choose_config).  Measured on an H100 (fp16, group 128,
M 48 to 4096 on the Llama shapes; benchmarks/RESULTS.md, session 12): faster than dequantize +
cuBLAS at every M, 0.72-1.59x fp16 cuBLAS on the dequantized weight, at least 0.95x at 22 of
the 24 points from M = 1024 up; below 1.0x at some points, where the mixed-input mainloop's
conversion work shows.
"""

from __future__ import annotations

import torch

from ..tensor_cache import TensorCache

NUM_CONFIGS = 13  # tile configurations 0..12 (csrc/awq_gemm/awq_gemm_sm90_choice.h: kNumConfigs)
TILE_K = 64  # K % 64 == 0; group_size % 64 == 0 or group_size == K (csrc: kTileK)
ALIGN_N = 128  # N % 128 == 0 (csrc: kAlignN)

_ACT_DTYPES = (torch.float16, torch.bfloat16)


def supports_prefill(x, qweight, scales, qzeros, group_size, bias=None, checked: bool = False) -> str | None:
    """None if the SM90 prefill kernel takes these inputs, else why not (then the caller
    runs another path).  Malformed inputs raise (the op's own checks), unless ``checked``
    says the caller has run them already."""
    from .. import kernels
    from ..ops import _check_awq

    if checked:
        K, N = qweight.shape[0], qweight.shape[1] * 8
    else:
        K, N = _check_awq("awq_gemm", qweight, scales, qzeros, group_size, x, bias)
    tensors = [x, qweight, scales, qzeros] + ([bias] if bias is not None else [])
    if not all(t.is_cuda for t in tensors):
        return "tensors are not all on a CUDA device"
    if len({t.device for t in tensors}) != 1:
        return "tensors are on different devices"
    if x.dtype not in _ACT_DTYPES:
        return f"dtype {x.dtype} (the kernel takes float16/bfloat16)"
    if kernels.capability(x.device) != (9, 0):
        return "not an sm_90 GPU (the kernel uses sm_90a wgmma/TMA)"
    if K % TILE_K != 0:
        return f"K = {K} is not a multiple of {TILE_K}"
    if N % ALIGN_N != 0:
        return f"N = {N} is not a multiple of {ALIGN_N}"
    if group_size != K and group_size % TILE_K != 0:
        return f"group_size = {group_size} is below/not a multiple of the kernel's K tile ({TILE_K})"
    M = x.shape[0]
    if M * K >= 2**31 or M * N >= 2**31 or N * K >= 2**31:
        return "sizes exceed 32-bit indexing"
    if x.is_contiguous() and x.data_ptr() % 16 != 0:
        return "x not 16-byte aligned (TMA)"
    return None


# --------------------------------------------------------------------------- prepare cache

# (qweight, scales, qzeros) -> the kernel's operands; stats: "computed" = prepares, "hits"
cache = TensorCache()
stats = cache.stats


def prepared(qweight, scales, qzeros, group_size):
    """(wq, scales', zeros') for the kernel, made once per weight (again only if one of
    the three tensors is replaced or modified in place)."""
    return cache.get((qweight, scales, qzeros), lambda: torch.ops.quantfuse._awq_prepare_sm90_cuda(
        qweight.contiguous(), scales.contiguous(), qzeros.contiguous(), group_size), extra=(group_size,))


def clear_cache() -> None:
    cache.clear()


# --------------------------------------------------------------------------- launch


def launch_prefill(x, qweight, scales, qzeros, group_size, bias=None, config: int = -1):
    """``x @ W + bias`` through the SM90 mixed-input kernel (inputs must pass
    ``supports_prefill``).  ``config`` 0..NUM_CONFIGS-1 forces a tile configuration (tests,
    benchmarks)."""
    M, N = x.shape[0], qweight.shape[1] * 8
    if M == 0:
        return x.new_empty((0, N))
    wq, s, z = prepared(qweight, scales, qzeros, group_size)
    x = x.contiguous()
    bias = None if bias is None else bias.contiguous()
    return torch.ops.quantfuse._awq_gemm_sm90_cuda(x, wq, s, z, group_size, bias, config)
