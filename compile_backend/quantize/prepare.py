"""``prepare(model)``: other libraries' AWQ layers replaced in place by ``AWQLinear``, one layout per weight.

AutoAWQ's ``WQLinear_GEMM``, transformers' and GPTQModel's AWQ layers hold ``qweight`` in the AWQ layout
``[K, N/8]``.  The passes fuse them as they are, but the kernels then keep their own layouts of each
weight beside it (the decode kernel's fragments and, on Hopper after a prefill, the prepared layout:
up to twice the packed weight; ``explain()`` says so per layer).  ``prepare`` replaces each such layer
with an ``AWQLinear`` holding the kernels' one layout, the original dropped, and stores the layers that
share an input as views of merged tensors (``share_input_storage``).

A layer is a candidate when it holds (as parameters, buffers or attributes) ``qweight`` int32
``[K, N/8]``, ``qzeros`` int32 ``[K/G, N/8]`` and ``scales`` float16 / bfloat16 ``[K/G, N]`` (``G`` from
the shapes), optionally ``bias`` ``[N]`` and an in-order ``g_idx``, and no other tensors.  It is replaced
only when what it computes is what ``AWQLinear`` computes from those tensors: both run on a probe input
on the layer's device and must agree within the rounding of the activation dtype (a layer in another
bit order, or one that scales its input, is left as it is).  Each candidate left alone is logged with the
reason, as is each replacement.
"""

from __future__ import annotations

import logging

import torch
from torch import nn

from ..ops.awq_gemm import AWQ_ACT_DTYPES, AWQ_PACK, awq_dequantize_reference
from .merged import share_input_storage
from .modules import AWQLinear

log = logging.getLogger("quantfuse")

_TENSORS = ("qweight", "qzeros", "scales")
_OPTIONAL = ("bias", "g_idx")


def _tensor(module: nn.Module, name: str):
    t = getattr(module, name, None)
    return t if isinstance(t, torch.Tensor) else None


def _candidate(module: nn.Module) -> dict | str | None:
    """The layer's AWQ tensors, why it is not an AWQ layer ``prepare`` converts, or None when it is
    no candidate at all (no int32 ``qweight``)."""
    if isinstance(module, AWQLinear):
        return None
    qweight = _tensor(module, "qweight")
    if qweight is None or qweight.dtype != torch.int32:
        return None
    tensors = {n: _tensor(module, n) for n in (*_TENSORS, *_OPTIONAL)}
    qzeros, scales = tensors["qzeros"], tensors["scales"]
    if qzeros is None or scales is None:
        return "holds qweight but not qzeros and scales"
    if qweight.dim() != 2 or scales.dim() != 2 or scales.dtype not in AWQ_ACT_DTYPES:
        return "qweight is not [K, N/8] with float16 / bfloat16 scales [K/G, N] (not the AWQ gemm layout)"
    K, N = qweight.shape[0], qweight.shape[1] * AWQ_PACK
    groups = scales.shape[0]
    if scales.shape[1] != N or groups == 0 or K % groups or tuple(qzeros.shape) != (groups, N // AWQ_PACK) \
            or qzeros.dtype != torch.int32:
        return f"shapes qweight {tuple(qweight.shape)}, qzeros {tuple(qzeros.shape)}, scales " \
               f"{tuple(scales.shape)} are not AWQ's [K, N/8], [K/G, N/8], [K/G, N]"
    g_idx = tensors["g_idx"]
    if g_idx is not None and not torch.equal(g_idx.long().cpu(), torch.arange(K) // (K // groups)):
        return "g_idx groups the input channels out of order (act-order): from_pretrained loads such checkpoints"
    bias = tensors["bias"]
    if bias is not None and (bias.dim() != 1 or bias.shape[0] != N):
        return f"bias of shape {tuple(bias.shape)} is not [N] = [{N}]"
    others = [n for n, t in [*module.named_parameters(recurse=False), *module.named_buffers(recurse=False)]
              if t is not None and n not in (*_TENSORS, *_OPTIONAL)]
    if others:
        return f"also holds {', '.join(others)} (it computes more than the AWQ linear)"
    return dict(qweight=qweight, qzeros=qzeros, scales=scales, bias=bias, K=K, N=N, group_size=K // groups)


def _probe_reason(module: nn.Module, awq: AWQLinear, t: dict) -> str | None:
    """Why ``module`` does not compute what ``awq`` does on a probe input, or None."""
    dtype = t["scales"].dtype
    gen = torch.Generator(device="cpu").manual_seed(0)
    x = torch.randn(3, t["K"], generator=gen).to(device=t["qweight"].device, dtype=dtype)
    try:
        with torch.no_grad():
            got = module(x)
    except Exception as exc:  # a layer that cannot run here is left alone, with the reason
        return f"running it on a probe input raised {type(exc).__name__}: {exc}"
    if not isinstance(got, torch.Tensor) or tuple(got.shape) != (3, t["N"]):
        return "its output on a [3, K] input is not [3, N]"
    w = awq_dequantize_reference(t["qweight"], t["scales"], t["qzeros"], t["group_size"]).float()
    want = x.float() @ w + (0 if t["bias"] is None else t["bias"].float())
    err = (got.float() - want).abs().max().item()
    # Both round each weight once to the activation dtype; a layer's matmul may round its output too.
    tol = 16 * torch.finfo(dtype).eps * max(want.abs().max().item(), 1e-3)
    if not err <= tol:
        return f"its output differs from the AWQ linear of its tensors by {err:.3g} (more than rounding, {tol:.3g})"
    return None


def prepare(model: nn.Module) -> list[str]:
    """Replaces, in place, each of ``model``'s AWQ layers from other libraries by an ``AWQLinear`` (see the
    module doc) and merges the storage of the layers that share an input.  Returns the names of the
    layers replaced (``model``'s children and theirs: a lone layer passed as ``model`` is not replaced)."""
    replaced = []
    for parent_name, parent in list(model.named_modules()):
        for name, child in list(parent.named_children()):
            full = f"{parent_name}.{name}" if parent_name else name
            t = _candidate(child)
            if t is None:
                continue
            if isinstance(t, str):
                log.info("quantfuse prepare: %s (%s) left as it is: %s", full, type(child).__name__, t)
                continue
            awq = AWQLinear(t["K"], t["N"], group_size=t["group_size"], bias=t["bias"] is not None,
                            dtype=t["scales"].dtype).to(t["qweight"].device)
            awq.load_state_dict({k: v for k, v in dict(qweight=t["qweight"], qzeros=t["qzeros"], scales=t["scales"],
                                                          bias=t["bias"]).items() if v is not None})
            why = _probe_reason(child, awq, t)
            if why is not None:
                log.info("quantfuse prepare: %s (%s) left as it is: %s", full, type(child).__name__, why)
                continue
            setattr(parent, name, awq)
            replaced.append(full)
            log.info("quantfuse prepare: %s (%s) -> AWQLinear", full, type(child).__name__)
    if replaced:
        share_input_storage(model)
    return replaced
