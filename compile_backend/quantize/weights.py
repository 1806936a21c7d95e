"""Round-to-nearest weight quantizers and the AWQ packing (docs/DESIGN.md's bit order).

What ``quantize_model`` and the quantized modules' ``from_linear`` use to make their tensors
from a float weight.
"""

from __future__ import annotations

import torch

from ..ops.awq_gemm import AWQ_PACK, awq_pack_unchecked, awq_unpack
from ..ops.quantize_per_token import FP8_MAX, INT8_MAX, MIN_SCALE


def awq_pack(values: torch.Tensor) -> torch.Tensor:
    """[R, N] ints in [0, 15] -> [R, N/8] int32 in AWQ bit order."""
    if values.dim() != 2 or values.shape[1] % AWQ_PACK != 0:
        raise ValueError(f"awq_pack: 'values' has shape {tuple(values.shape)}; expected [R, N] with N % 8 == 0")
    if values.numel() and (values.min() < 0 or values.max() > 15):
        raise ValueError("awq_pack: 'values' must lie in [0, 15]")
    return awq_pack_unchecked(values)


def awq_unpack_values(packed: torch.Tensor) -> torch.Tensor:
    """Inverse of ``awq_pack``."""
    return awq_unpack(packed)


def quantize_weight_int8(weight: torch.Tensor, per_channel: bool = True):
    """Symmetric round-to-nearest int8: returns (int8 [N, K], float32 scale [N] or [])."""
    w = weight.detach().to(torch.float32)
    amax = w.abs().amax(dim=1) if per_channel else w.abs().amax()
    scale = (amax / INT8_MAX).clamp(min=MIN_SCALE)
    q = torch.round(w / (scale.unsqueeze(1) if per_channel else scale)).clamp(-INT8_MAX - 1, INT8_MAX)
    return q.to(torch.int8), scale


def quantize_weight_fp8(weight: torch.Tensor, per_channel: bool = False):
    """float8_e4m3fn with an amax scale: returns (fp8 [N, K], float32 scale [N] or [])."""
    w = weight.detach().to(torch.float32)
    amax = w.abs().amax(dim=1) if per_channel else w.abs().amax()
    scale = (amax / FP8_MAX).clamp(min=MIN_SCALE)
    q = (w / (scale.unsqueeze(1) if per_channel else scale)).clamp(-FP8_MAX, FP8_MAX)
    return q.to(torch.float8_e4m3fn), scale


def _awq_round_groups(w: torch.Tensor, dtype):
    """Round-to-nearest of ``quantize_weight_awq`` over groups along the last dimension of ``w``
    (float32 ``[..., G]``): ``(q [..., G], zeros [...], scales [...] in dtype)``, q and zeros as
    float32 integers in [0, 15]."""
    wmin, wmax = torch.aminmax(w, dim=-1)
    lo, hi = wmin.clamp(max=0), wmax.clamp(min=0)
    constant = wmin == wmax
    scale = torch.where(constant, wmax.abs(), (hi - lo) / 15)
    scales = scale.to(dtype).clamp(min=torch.finfo(dtype).tiny)
    s = scales.to(torch.float32)
    zeros = torch.round(-lo / s).clamp(0, 15)
    # round(w / s + z) clamped, in place on one temporary (the AWQ search calls this per candidate)
    q = (w / s.unsqueeze(-1)).add_(zeros.unsqueeze(-1)).round_().clamp_(0, 15)
    return q, zeros, scales


def _awq_groups(weight: torch.Tensor, group_size: int, clip: torch.Tensor | None, name: str) -> torch.Tensor:
    """``weight [N, K]`` as float32 ``[N, K/G, G]``, clamped to ``[-clip, clip]`` per group when
    ``clip`` (broadcastable to ``[N, K/G]``) is given; checks the shapes."""
    N, K = weight.shape
    if not isinstance(group_size, int) or group_size <= 0 or K % group_size != 0:
        raise ValueError(f"{name}: group_size {group_size!r} is not a positive divisor of K = {K}")
    w = weight.detach().to(torch.float32).reshape(N, K // group_size, group_size)
    if clip is not None:
        c = clip.detach().to(device=w.device, dtype=torch.float32)
        try:
            c = c.expand(N, K // group_size).unsqueeze(-1)
        except RuntimeError:
            raise ValueError(f"{name}: clip has shape {tuple(clip.shape)}; expected one broadcastable to "
                             f"[N, K/group_size] = [{N}, {K // group_size}]") from None
        w = torch.maximum(torch.minimum(w, c), -c)
    return w


def quantize_weight_awq(weight: torch.Tensor, group_size: int, dtype=torch.float16, clip: torch.Tensor | None = None):
    """Asymmetric round-to-nearest 4-bit with a zero point per group (AWQ format).

    ``weight`` is ``[N, K]`` (nn.Linear layout); returns ``qweight [K, N/8]``,
    ``qzeros [K/G, N/8]`` (int32) and ``scales [K/G, N]`` in ``dtype``.

    Each group's range is widened to include 0 (a zero point in [0, 15] can only
    describe such ranges).  A constant group ``c`` (pruned or padded channels) gets
    the scale ``|c|`` and ``q - z = sign(c)``, so it dequantizes to ``c`` rounded to
    ``dtype`` (exactly when ``dtype`` holds ``c``).  Scales are at least ``dtype``'s
    smallest normal number: a scale that underflows to 0 or a subnormal (1e-8 in
    float16) would divide by zero here or depend on denormal handling in a kernel;
    an all-zero group dequantizes to exact zeros.  Weights too large for ``dtype``'s
    scales raise ``ValueError``.

    ``clip``: the largest magnitude kept per group (``[N, K/G]``, or anything broadcastable to it;
    AWQ's clipping search, ``awq_search.py``): the weight is clamped to ``[-clip, clip]`` before
    it is rounded.  None: no clamping.
    """
    N, K = weight.shape
    w = _awq_groups(weight, group_size, clip, "quantize_weight_awq")
    if N % AWQ_PACK != 0:
        raise ValueError(f"quantize_weight_awq: N = {N} is not a multiple of {AWQ_PACK}")
    q, zeros, scales = _awq_round_groups(w, dtype)
    if not torch.isfinite(scales).all():
        raise ValueError(f"quantize_weight_awq: weight values up to {w.abs().max().item():.4g} need scales "
                         f"beyond {dtype}'s range")
    qweight = awq_pack_unchecked(q.reshape(N, K).t().to(torch.int32))
    qzeros = awq_pack_unchecked(zeros.t().to(torch.int32))
    return qweight, qzeros, scales.t().contiguous()


def fake_quantize_awq(weight: torch.Tensor, group_size: int, dtype=torch.float16,
                      clip: torch.Tensor | None = None) -> torch.Tensor:
    """What ``quantize_weight_awq(weight, group_size, dtype, clip)`` dequantizes to, as a float32
    ``[N, K]`` weight (``AWQLinear.dequantized_weight()`` transposed, in float32), without
    packing: ``(q - z) · s`` rounded to ``dtype``.  What the AWQ search measures candidates with.
    Any N; leading dimensions of ``weight`` beyond ``[N, K]`` are not taken."""
    N, K = weight.shape
    q, zeros, scales = _awq_round_groups(_awq_groups(weight, group_size, clip, "fake_quantize_awq"), dtype)
    w = q.sub_(zeros.unsqueeze(-1)).mul_(scales.to(torch.float32).unsqueeze(-1)).to(dtype)
    return w.to(torch.float32).reshape(N, K)
