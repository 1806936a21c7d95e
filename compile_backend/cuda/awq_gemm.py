"""CUDA dispatch for quantfuse.awq_gemm and quantfuse.awq_dequantize (csrc/awq_gemm/).

``awq_gemm`` by M (thresholds measured on an H100, benchmarks/results_awq.md):

* M <= ``DECODE_MAX_M``: the weight-streaming tensor-core kernel (int4 turned into mma.sync
  A fragments in registers; zeros and scales applied per group to the accumulators at
  M <= 8, and at M <= 16 where blocks have 8 warps, else in the fragments; K split over
  the SMs).  It reads the weight in its own fragment layout, made once per weight by
  ``_awq_repack_cuda`` and kept in a ``TensorCache`` (compile_backend/tensor_cache.py:
  keyed by where the weight's data is, valid while its version counter is unchanged):
  never per call.
* larger M on Hopper: the CUTLASS mixed-input (TMA + wgmma) kernel of
  ``awq_gemm_sm90`` where it takes the shape (group size a multiple of 64 or per-channel,
  K % 64, N % 128); it runs on a zero-padded copy of x when most of the last token tile
  would be out of bounds (csrc/awq_gemm/awq_gemm_sm90.h: padded_tokens);
* otherwise the streaming kernel up to ``KERNEL_MAX_M``, and above that the dequantize
  kernel to a dense weight plus cuBLAS (``addmm``).

``awq_dequantize``: the dequantize kernel.

Unsupported inputs (N not a multiple of 64, K or the group size not a multiple of 16,
pre-sm_80 GPUs, CPU tensors) return a reason and the reference runs.
"""

from __future__ import annotations

import logging
import os

import torch

from .. import kernels
from ..tensor_cache import TensorCache
from . import awq_gemm_sm90

STRIP_N = 64
# The streaming kernel runs for M <= DECODE_MAX_M, and up to KERNEL_MAX_M where the SM90
# prefill kernel cannot take the input; override for experiments.
DECODE_MAX_M = int(os.environ.get("QUANTFUSE_AWQ_DECODE_MAX_M", "32"))
KERNEL_MAX_M = int(os.environ.get("QUANTFUSE_AWQ_KERNEL_MAX_M", "64"))

_ACT_DTYPES = (torch.float16, torch.bfloat16)
log = logging.getLogger(__name__)


def _common_reason(qweight, scales, qzeros, group_size) -> str | None:
    """Why the kernels cannot take well-formed AWQ tensors (None if they can)."""
    if not (qweight.is_cuda and scales.is_cuda and qzeros.is_cuda):
        return "tensors are not all on a CUDA device"
    if len({qweight.device, scales.device, qzeros.device}) != 1:
        return "tensors are on different devices"
    if scales.dtype not in _ACT_DTYPES:
        return f"dtype {scales.dtype} (kernels take float16/bfloat16)"
    if kernels.capability(qweight.device) < (8, 0):
        return "GPU older than sm_80 (no bf16 mma.sync)"
    return None


def supports_gemm(x, qweight, scales, qzeros, group_size, bias=None) -> str | None:
    from ..ops import _check_awq

    _check_awq("awq_gemm", qweight, scales, qzeros, group_size, x, bias)
    reason = _common_reason(qweight, scales, qzeros, group_size)
    if reason is not None:
        return reason
    if not x.is_cuda or x.device != qweight.device or (bias is not None and bias.device != x.device):
        return "x/bias not on the weight's CUDA device"
    K, N = qweight.shape[0], qweight.shape[1] * 8
    if N % STRIP_N != 0:
        return f"N = {N} is not a multiple of {STRIP_N}"
    if K % 16 != 0 or group_size % 16 != 0:
        return f"K = {K} and group_size = {group_size} must be multiples of 16"
    if x.shape[0] * max(K, N) >= 2**31 or K * N >= 2**31:
        return "sizes exceed 32-bit indexing"
    if x.is_contiguous() and x.data_ptr() % 8 != 0:
        return "x not 8-byte aligned"
    for name, t in (("scales", scales), ("qzeros", qzeros)):
        if t.is_contiguous() and t.data_ptr() % 16 != 0:
            return f"{name} not 16-byte aligned"
    return None


def supports_dequantize(qweight, scales, qzeros, group_size) -> str | None:
    from ..ops import _check_awq

    _check_awq("awq_dequantize", qweight, scales, qzeros, group_size)  # malformed input raises
    reason = _common_reason(qweight, scales, qzeros, group_size)
    if reason is not None:
        return reason
    if qweight.shape[0] * qweight.shape[1] * 8 >= 2**31:
        return "sizes exceed 32-bit indexing"
    if scales.is_contiguous() and scales.data_ptr() % 16 != 0:
        return "scales not 16-byte aligned"
    return None


# --------------------------------------------------------------------------- repack cache

# qweight -> its fragment-layout copy; stats: "computed" = repacks, "hits"
cache = TensorCache()
stats = cache.stats


def packed_weight(qweight: torch.Tensor) -> torch.Tensor:
    """The fragment-layout copy of ``qweight``, made once per weight (and again only if
    the weight is replaced or modified in place)."""
    return cache.get((qweight,), lambda: torch.ops.quantfuse._awq_repack_cuda(qweight.contiguous()))


def clear_cache() -> None:
    cache.clear()


# --------------------------------------------------------------------------- launches


def prefill_reason(x, qweight, scales, qzeros, group_size, bias=None) -> str | None:
    """None when the SM90 prefill kernel takes these (already checked) inputs and is
    built, else why not."""
    if not kernels.op_built("_awq_gemm_sm90_cuda"):
        return "not built (csrc/awq_gemm/awq_gemm_sm90*)"
    return awq_gemm_sm90.supports_prefill(x, qweight, scales, qzeros, group_size, bias, checked=True)


def launch_gemm(x, qweight, scales, qzeros, group_size, bias=None):
    M, N = x.shape[0], qweight.shape[1] * 8
    if M == 0:
        return x.new_empty((0, N))
    if M > DECODE_MAX_M:
        # The caller's own tensors: the prefill kernel's prepared-weight cache is keyed by them.
        reason = prefill_reason(x, qweight, scales, qzeros, group_size, bias)
        if reason is None:
            return awq_gemm_sm90.launch_prefill(x, qweight, scales, qzeros, group_size, bias)
        log.debug("quantfuse awq_gemm: M = %d, SM90 prefill kernel not used: %s", M, reason)
    x = x.contiguous()
    scales, qzeros = scales.contiguous(), qzeros.contiguous()
    bias = None if bias is None else bias.contiguous()
    if M <= KERNEL_MAX_M:
        return torch.ops.quantfuse._awq_gemm_cuda(x, packed_weight(qweight), scales, qzeros, group_size, bias)
    w = torch.ops.quantfuse._awq_dequantize_cuda(qweight.contiguous(), scales, qzeros, group_size)
    return torch.addmm(bias, x, w) if bias is not None else torch.mm(x, w)


def launch_dequantize(qweight, scales, qzeros, group_size):
    return torch.ops.quantfuse._awq_dequantize_cuda(qweight.contiguous(), scales.contiguous(),
                                                    qzeros.contiguous(), group_size)


kernels.register("awq_gemm", supports_gemm, launch_gemm)
kernels.register("awq_dequantize", supports_dequantize, launch_dequantize)
