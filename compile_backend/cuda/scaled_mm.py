"""CUDA dispatch for quantfuse.scaled_mm and quantfuse.scaled_mm_azp (csrc/scaled_mm/,
csrc/scaled_mm_azp/): CUTLASS 3.x SM90 kernels (int8, fp8) on Hopper and CUTLASS 2.x
SM80 kernels (int8) on other sm_80+ GPUs, all with epilogue visitor trees.  Up to
``DECODE_MAX_M`` rows of activations run the hand-written weight-streaming decode kernel
(``_scaled_mm_decode_cuda``) instead, where the H100 measured it faster than the CUTLASS
decode tile (benchmarks/notes_scaled_mm_decode.md).  fp8 with row-wise scales from
``FP8_CUBLASLT_MIN_M`` rows on Hopper runs cuBLASLt's fp8 kernel through ``torch._scaled_mm``,
measured faster there than our CUTLASS fp8 kernels.

``supports`` returns None when the kernel can take the inputs, else the reason it
cannot (``kernels.try_cuda`` then logs it and runs the reference).  It never raises:
malformed inputs are left to the reference implementation, which names the argument.
``launch`` makes the small operands (scales, bias, zero points) contiguous, aligned
and on the device, then calls the C++ op ``quantfuse._scaled_mm_cutlass``.
"""

from __future__ import annotations

import torch

from .. import kernels

_INPUT_DTYPES = (torch.int8, torch.float8_e4m3fn)
_OUT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
_capability = kernels.capability


def _aligned(t: torch.Tensor, nbytes: int = 16) -> bool:
    return t.data_ptr() % nbytes == 0


def _common(a, b, scale_a, scale_b, out_dtype, bias) -> str | None:
    if not (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)):
        return "a and b must be tensors"
    if not a.is_cuda or not b.is_cuda or a.device != b.device:
        return "a and b must be on one CUDA device"
    if a.dtype not in _INPUT_DTYPES or b.dtype != a.dtype:
        return f"input dtypes {a.dtype}/{b.dtype} not int8 or float8_e4m3fn"
    if out_dtype not in _OUT_DTYPES:
        return f"out_dtype {out_dtype} not float16/bfloat16/float32"
    if a.dim() != 2 or b.dim() != 2 or a.shape[1] != b.shape[0]:
        return "shapes are not [M, K] x [K, N]"
    M, K = a.shape
    N = b.shape[1]
    if M == 0 or N == 0 or K == 0:
        return "empty problem"
    if M >= 2**31 or N >= 2**31 or K >= 2**31:
        return "dimension too large for int32 problem shapes"
    if K % 16 or N % 16:
        return f"K={K} and N={N} must be multiples of 16 (16-byte TMA alignment)"
    cap = _capability(a.device)
    # sm_90: the SM90 kernels; other sm_80+ GPUs: the CUTLASS 2.x SM80 kernels, int8 only.
    if cap < (8, 0):
        return f"compute capability {cap}: the CUTLASS kernels need sm_80 or later"
    if cap != (9, 0) and a.dtype != torch.int8:
        return f"compute capability {cap}: fp8 kernels are built for Hopper (sm_90) only; the SM80 kernels take int8"
    if a.stride(1) != 1 or (M > 1 and (a.stride(0) < K or a.stride(0) % 16)) or not _aligned(a):
        return f"a (strides {a.stride()}) must be row-major with a 16-byte aligned start and row pitch"
    if b.stride(0) != 1 or b.stride(1) < K or b.stride(1) % 16 or not _aligned(b):
        return f"b (strides {b.stride()}) must be column-major ([N, K] weight transposed) with 16-byte alignment"
    for name, s, n in (("scale_a", scale_a, M), ("scale_b", scale_b, N)):
        if not isinstance(s, torch.Tensor) or s.dtype != torch.float32 or s.numel() not in (1, n):
            return f"{name} must be float32 with 1 or {n} elements"
    if bias is not None and (
        not isinstance(bias, torch.Tensor) or bias.dtype != out_dtype or bias.dim() != 1 or bias.shape[0] != N
    ):
        return "bias must be [N] in out_dtype"
    return None


def supports(a, b, scale_a, scale_b, out_dtype, bias=None) -> str | None:
    return _common(a, b, scale_a, scale_b, out_dtype, bias)


def supports_azp(a, b, scale_a, scale_b, out_dtype, azp_adj, azp=None, bias=None) -> str | None:
    reason = _common(a, b, scale_a, scale_b, out_dtype, bias)
    if reason is not None:
        return reason
    if a.dtype != torch.int8:
        return "zero points apply to int8 activations only"
    N = b.shape[1]
    if not isinstance(azp_adj, torch.Tensor) or azp_adj.dtype != torch.int32 or azp_adj.numel() != N:
        return "azp_adj must be int32 with N elements"
    if azp is not None and (not isinstance(azp, torch.Tensor) or azp.dtype != torch.int32 or azp.numel() != a.shape[0]):
        return "azp must be int32 with M elements"
    return None


# Decode (small M): the weight-streaming mma.sync kernel (csrc/scaled_mm/scaled_mm_decode*)
# instead of CUTLASS, up to this many rows of a (the kernel takes M <= 16; 0 turns it off).
# H100, bf16 out, on the four LLM shapes (int8 and fp8): M = 1 3-18% faster than the CUTLASS
# decode tile; M = 12 up to 13% faster; M = 16 within run-to-run noise of it
# (benchmarks/notes_scaled_mm_decode.md, v3).
DECODE_MAX_M = 16


def _decode_reason(a, b) -> str | None:
    """None when the decode kernel takes inputs that ``_common`` accepted, else why not."""
    M, K = a.shape
    N = b.shape[1]
    if M > DECODE_MAX_M:
        return f"M={M} > DECODE_MAX_M={DECODE_MAX_M}"
    if not kernels.op_built("_scaled_mm_decode_cuda"):
        return "decode kernel not built"
    if K % 16:
        return f"K={K} not a multiple of 16"
    if a.stride(1) != 1 or (M > 1 and a.stride(0) % 16) or not _aligned(a):
        return "a rows not 16-byte aligned"
    if b.stride(0) != 1 or (N > 1 and b.stride(1) % 16) or not _aligned(b):
        return "b not column-major with 16-byte aligned weight rows"
    if _capability(a.device) < ((8, 9) if a.dtype == torch.float8_e4m3fn else (8, 0)):
        return "fp8 needs sm_89+, int8 sm_80+"
    return None


# Prefill fp8 with row-wise scales on Hopper: cuBLASLt's fp8 kernel, through torch._scaled_mm
# (one kernel with the same fused epilogue), from this many rows of a; 0 turns it off.  On the
# H100 (torch 2.11), at M >= 256 on the four LLM shapes, our CUTLASS fp8 kernels measured
# 0.84-1.01x of it over two runs; below, ours are faster (benchmarks/RESULTS.md,
# notes_scaled_mm.md v5).
FP8_CUBLASLT_MIN_M = 256


def _cublaslt_fp8_reason(a, b, scale_a, scale_b, out_dtype, bias) -> str | None:
    """None when cuBLASLt (torch._scaled_mm) takes inputs that ``_common`` accepted, else why not."""
    M = a.shape[0]
    N = b.shape[1]
    if a.dtype != torch.float8_e4m3fn:
        return "not fp8"
    if FP8_CUBLASLT_MIN_M <= 0 or M < FP8_CUBLASLT_MIN_M:
        return f"M={M} < FP8_CUBLASLT_MIN_M={FP8_CUBLASLT_MIN_M}"
    if _capability(a.device) != (9, 0):
        return "measured on Hopper only"
    if scale_a.numel() != M or scale_b.numel() != N:
        return "per-token x per-channel scales only"
    if bias is not None and out_dtype == torch.float32:
        return "torch._scaled_mm takes no bias with float32 output"
    return None


def _prep(t: torch.Tensor | None, device: torch.device) -> torch.Tensor | None:
    """Flat, contiguous, 16-byte aligned, on ``device`` (copies only when needed)."""
    if t is None:
        return None
    t = t.reshape(-1)
    if t.device != device:
        t = t.to(device)
    if not t.is_contiguous() or not _aligned(t):
        t = t.clone(memory_format=torch.contiguous_format)
    return t


def launch(a, b, scale_a, scale_b, out_dtype, bias=None, *, arch: int = 0, config: int = -1):
    d = a.device
    if arch == 0 and config == -1 and _decode_reason(a, b) is None:
        return torch.ops.quantfuse._scaled_mm_decode_cuda(
            a, b, _prep(scale_a, d), _prep(scale_b, d), out_dtype, _prep(bias, d))
    if arch == 0 and config == -1 and _cublaslt_fp8_reason(a, b, scale_a, scale_b, out_dtype, bias) is None:
        sa, sb = _prep(scale_a, d).reshape(-1, 1), _prep(scale_b, d).reshape(1, -1)
        return torch._scaled_mm(a, b, scale_a=sa, scale_b=sb, bias=_prep(bias, d), out_dtype=out_dtype)
    return torch.ops.quantfuse._scaled_mm_cutlass(
        a, b, _prep(scale_a, d), _prep(scale_b, d), out_dtype, _prep(bias, d), None, None, arch, config
    )


def launch_azp(a, b, scale_a, scale_b, out_dtype, azp_adj, azp=None, bias=None, *, arch: int = 0, config: int = -1):
    d = a.device
    if arch == 0 and config == -1 and _decode_reason(a, b) is None:
        return torch.ops.quantfuse._scaled_mm_decode_cuda(
            a, b, _prep(scale_a, d), _prep(scale_b, d), out_dtype, _prep(bias, d), _prep(azp_adj, d), _prep(azp, d))
    return torch.ops.quantfuse._scaled_mm_cutlass(
        a, b, _prep(scale_a, d), _prep(scale_b, d), out_dtype, _prep(bias, d), _prep(azp_adj, d), _prep(azp, d),
        arch, config,
    )


kernels.register("scaled_mm", supports, launch)
kernels.register("scaled_mm_azp", supports_azp, launch_azp)
