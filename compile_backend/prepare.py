"""``prepare(model)``: other libraries' 4-bit layers replaced in place by ``AWQLinear``, one layout per weight.

AutoAWQ's ``WQLinear_GEMM``, transformers' and GPTQModel's AWQ layers hold ``qweight`` in the AWQ layout
``[K, N/8]``.  The passes fuse them as they are, but the kernels then keep their own layouts of each
weight beside it (the decode kernel's fragments and, on Hopper after a prefill, the prepared layout:
up to twice the packed weight; ``explain()`` says so per layer).  GPTQ layers in torch form (GPTQModel's
torch kernel, what transformers gives with ``backend="torch"``) pack along K (``qweight [K/8, N]``); the
AWQ pass fuses them as they are through a conversion into the AWQ layout made once per weight, which the
kernels then keep beside the GPTQ tensors, and cannot merge them.  ``prepare`` replaces each such layer
with an ``AWQLinear`` holding the kernels' one layout, the original dropped, and stores the layers that
share an input as views of merged tensors (``share_input_storage``).

A layer is a candidate when it holds (as parameters, buffers or attributes) an int32 ``qweight``,
``qzeros`` and float16 / bfloat16 ``scales`` of one of the two formats:

* AWQ: ``qweight [K, N/8]``, ``qzeros [K/G, N/8]``, ``scales [K/G, N]``, an in-order ``g_idx`` if any;
* GPTQ, 4-bit (``bits`` 4 where the layer says): ``qweight [K/8, N]``, ``qzeros [K/G, N/8]``, ``scales
  [K/G, N]``, ``g_idx [K]`` (act-order included: ``checkpoints/gptq.py``'s conversion, ``perm``), zero
  points stored as they are (v2) or minus one (v1: both are tried);

optionally a ``bias [N]``, and no other floating-point tensor.  It is replaced only when what it computes
is what the ``AWQLinear`` made from those tensors computes: both run on a probe input on the layer's device
and must agree within the rounding of the activation dtype (a layer in another bit order, or one that
scales its input, is left as it is).  Each candidate left alone is logged with the reason, as is each
replacement.
"""

from __future__ import annotations

import logging

import torch
from torch import nn

from .ops.awq_gemm import AWQ_ACT_DTYPES, AWQ_PACK
from .quantize import AWQLinear, share_input_storage
from .quantize.act_order import fold_mlp_orders

log = logging.getLogger("quantfuse")

_OPTIONAL = ("bias", "g_idx")


def _tensor(module: nn.Module, name: str):
    t = getattr(module, name, None)
    return t if isinstance(t, torch.Tensor) else None


def _candidate(module: nn.Module) -> list[dict] | str | None:
    """The ``AWQLinear.from_state_dict`` states the layer may be (one per reading of its tensors), why it
    is not a layer ``prepare`` converts, or None when it is no candidate at all (no int32 ``qweight``)."""
    if isinstance(module, AWQLinear):
        return None
    qweight = _tensor(module, "qweight")
    if qweight is None or qweight.dtype != torch.int32:
        return None
    qzeros, scales, g_idx, bias = (_tensor(module, n) for n in ("qzeros", "scales", "g_idx", "bias"))
    if qzeros is None or scales is None:
        return "holds qweight but not qzeros and scales"
    if qweight.dim() != 2 or scales.dim() != 2 or scales.dtype not in AWQ_ACT_DTYPES or qzeros.dtype != torch.int32:
        return "qweight, qzeros and scales are not 2-D int32, int32 and float16 / bfloat16 tensors"
    others = [n for n, t in [*module.named_parameters(recurse=False), *module.named_buffers(recurse=False)]
              if t is not None and t.is_floating_point() and n not in ("scales", *_OPTIONAL)]
    if others:
        return f"also holds {', '.join(others)} (it computes more than a 4-bit linear)"
    groups, N = scales.shape
    gptq = qweight.shape[1] == N
    K = qweight.shape[0] * (AWQ_PACK if gptq else 1)
    if (not gptq and qweight.shape[1] * AWQ_PACK != N) or groups == 0 or K % groups \
            or tuple(qzeros.shape) != (groups, N // AWQ_PACK):
        return (f"shapes qweight {tuple(qweight.shape)}, qzeros {tuple(qzeros.shape)}, scales {tuple(scales.shape)} "
                "are neither AWQ's [K, N/8], [K/G, N/8], [K/G, N] nor 4-bit GPTQ's [K/8, N], [K/G, N/8], [K/G, N]")
    if bias is not None and (bias.dim() != 1 or bias.shape[0] != N):
        return f"bias of shape {tuple(bias.shape)} is not [N] = [{N}]"
    group = K // groups
    extra = {} if bias is None else {"bias": bias.to(scales.dtype)}
    if not gptq:
        if g_idx is not None and not torch.equal(g_idx.long().cpu(), torch.arange(K) // group):
            return "an AWQ-layout layer whose g_idx groups the input channels out of order"
        return [dict(qweight=qweight, qzeros=qzeros, scales=scales, **extra)]
    bits = getattr(module, "bits", 4)
    if bits != 4:
        return f"{bits}-bit GPTQ (4-bit layers only; from_pretrained loads 8-bit per-channel checkpoints)"
    if g_idx is not None and tuple(g_idx.shape) != (K,):
        return f"g_idx of shape {tuple(g_idx.shape)} is not [K] = [{K}]"
    from .checkpoints.gptq import awq_state

    states = []
    for v1 in (False, True):
        try:
            state = awq_state(qweight, qzeros, scales, g_idx, group, v1)
        except ValueError as exc:
            return f"g_idx {exc}"
        states.append({k: v for k, v in {**state, **extra}.items() if v is not None})
    return states


def _probe_reason(module: nn.Module, awq: AWQLinear) -> str | None:
    """Why ``module`` does not compute what ``awq`` does on a probe input, or None."""
    dtype = awq.scales.dtype
    gen = torch.Generator(device="cpu").manual_seed(0)
    x = torch.randn(3, awq.in_features, generator=gen).to(device=awq.scales.device, dtype=dtype)
    try:
        with torch.no_grad():
            got = module(x)
            want = awq(x)
    except Exception as exc:  # a layer that cannot run here is left alone, with the reason
        return f"running it on a probe input raised {type(exc).__name__}: {exc}"
    if not isinstance(got, torch.Tensor) or tuple(got.shape) != tuple(want.shape):
        return f"its output on a [3, K] input is not [3, N] = [3, {awq.out_features}]"
    err = (got.float() - want.float()).abs().max().item()
    # Both round each weight once to the activation dtype; each may round its output too.
    tol = 16 * torch.finfo(dtype).eps * max(want.float().abs().max().item(), 1e-3)
    if not err <= tol:
        return f"its output differs from the 4-bit linear of its tensors by {err:.3g} (more than rounding, {tol:.3g})"
    return None


def _replacement(module: nn.Module, states: list[dict]) -> AWQLinear | str:
    """The ``AWQLinear`` among ``states`` that computes what ``module`` does, or why none does."""
    why = ""
    for state in states:
        awq = AWQLinear.from_state_dict(state)
        why = _probe_reason(module, awq)
        if why is None:
            return awq
    return why


def prepare(model: nn.Module) -> list[str]:
    """Replaces, in place, each of ``model``'s 4-bit layers from other libraries by an ``AWQLinear`` (see
    the module doc) and merges the storage of the layers that share an input.  Returns the names of the
    layers replaced (``model``'s children and theirs: a lone layer passed as ``model`` is not replaced)."""
    replaced = []
    for parent_name, parent in list(model.named_modules()):
        for name, child in list(parent.named_children()):
            full = f"{parent_name}.{name}" if parent_name else name
            states = _candidate(child)
            if states is None:
                continue
            made = states if isinstance(states, str) else _replacement(child, states)
            if isinstance(made, str):
                log.info("quantfuse prepare: %s (%s) left as it is: %s", full, type(child).__name__, made)
                continue
            setattr(parent, name, made)
            replaced.append(full)
            log.info("quantfuse prepare: %s (%s) -> AWQLinear", full, type(child).__name__)
    if replaced:
        fold_mlp_orders(model)  # act-order: down_proj's gather moved into gate/up's columns where it can be
        share_input_storage(model)
    return replaced
