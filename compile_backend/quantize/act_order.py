"""Act-order in a gated MLP without a gather: ``down_proj``'s input order moved into the output columns
of ``gate_proj`` and ``up_proj``.

An act-order ``AWQLinear`` (GPTQ ``desc_act``) holds its weight rows sorted by group and multiplies
``x[:, perm]``: a gather of the activation on every call.  In a gated MLP, ``down_proj(act(gate_proj(x))
* up_proj(x))``, ``down_proj``'s input is elementwise in the outputs of ``gate_proj`` and ``up_proj``, so
when those two produce their output columns in ``down_proj``'s order (their weight, scales, zero points
and bias columns permuted once) the product arrives already gathered and ``down_proj`` needs no
``perm``.  Every output value is computed by the same products as before, only in another column.

``fold_mlp_orders`` does that for every module holding ``AWQLinear`` children ``gate_proj``, ``up_proj``
and ``down_proj`` (Llama, Mistral, Qwen2 and their likes), and keeps it only where the module's output on
a probe input is unchanged within rounding (so a module that uses the three otherwise is left as it
was, with the reason logged).  ``from_pretrained`` and ``prepare`` call it.
"""

from __future__ import annotations

import logging

import torch
from torch import nn

from ..ops.awq_gemm import awq_pack_unchecked, awq_unpack
from .modules import AWQLinear, set_tensors

log = logging.getLogger("quantfuse")

GATED = ("gate_proj", "up_proj", "down_proj")


def _rebuilt(layer: AWQLinear, qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor,
             bias: torch.Tensor | None, perm: torch.Tensor | None) -> AWQLinear:
    """A new ``AWQLinear`` of these tensors (AWQ layout) with ``layer``'s output dtype; ``perm`` is held as
    the same tensor, not a copy: layers that share an input share it (horizontal.py merges them)."""
    state = {"qweight": qweight, "qzeros": qzeros, "scales": scales}
    if bias is not None:
        state["bias"] = bias
    made = AWQLinear.from_state_dict(state)
    made.out_dtype = layer.out_dtype
    return made if perm is None else set_tensors(made, perm=perm)


def columns_permuted(layer: AWQLinear, order: torch.Tensor) -> AWQLinear:
    """A new ``AWQLinear`` whose output column ``j`` is ``layer``'s column ``order[j]``."""
    order = order.to(device=layer.scales.device, dtype=torch.long)
    return _rebuilt(layer, awq_pack_unchecked(awq_unpack(layer.awq_qweight()).index_select(1, order)),
                    awq_pack_unchecked(awq_unpack(layer.qzeros).index_select(1, order)),
                    layer.scales.index_select(1, order),
                    None if layer.bias is None else layer.bias.index_select(0, order), layer.perm)


def _probe_output(mlp: nn.Module, hidden: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    gen = torch.Generator(device="cpu").manual_seed(0)
    x = torch.randn(3, hidden, generator=gen).to(device=device, dtype=dtype)
    with torch.no_grad():
        return mlp(x).float()


def _fold_reason(mlp: nn.Module) -> str | None:
    """Folds ``mlp``'s ``down_proj`` order into ``gate_proj`` and ``up_proj`` in place; None when done,
    else why not (``mlp`` then as it was)."""
    gate, up, down = (getattr(mlp, n) for n in GATED)
    if gate.out_features != down.in_features or up.out_features != down.in_features:
        return f"gate_proj / up_proj give {gate.out_features} / {up.out_features} features, down_proj takes " \
               f"{down.in_features}"
    dtype, device = down.scales.dtype, down.scales.device
    try:  # in the model's activation dtype (the layers' outputs)
        before = _probe_output(mlp, gate.in_features, gate.out_dtype, device)
    except Exception as exc:  # a module that cannot run on a [3, hidden] input is left alone
        return f"running it on a probe input raised {type(exc).__name__}: {exc}"
    new = {"gate_proj": columns_permuted(gate, down.perm), "up_proj": columns_permuted(up, down.perm),
           "down_proj": _without_perm(down)}
    for name, layer in new.items():
        setattr(mlp, name, layer)
    after = _probe_output(mlp, gate.in_features, gate.out_dtype, device)
    err = (after - before).abs().max().item()
    tol = 16 * torch.finfo(dtype).eps * max(before.abs().max().item(), 1e-3)
    if after.shape == before.shape and err <= tol:
        return None
    for name, layer in zip(GATED, (gate, up, down)):
        setattr(mlp, name, layer)
    return f"its output on a probe input moved by {err:.3g} (more than rounding, {tol:.3g}): it does not use " \
           "down_proj's input elementwise in gate_proj's and up_proj's outputs"


def _without_perm(layer: AWQLinear) -> AWQLinear:
    """``layer`` with ``perm`` dropped: its rows multiply the input as it comes."""
    return _rebuilt(layer, layer.awq_qweight(), layer.qzeros, layer.scales, layer.bias, None)


def fold_mlp_orders(model: nn.Module) -> list[str]:
    """Moves each gated MLP's ``down_proj`` act-order into its ``gate_proj`` and ``up_proj`` columns (module
    doc), in place.  Returns the names of the MLPs folded."""
    folded = []
    for name, module in list(model.named_modules()):  # the loop replaces children
        layers = [getattr(module, n, None) for n in GATED]
        if not all(isinstance(m, AWQLinear) for m in layers) or layers[2].perm is None:
            continue
        why = _fold_reason(module)
        if why is None:
            folded.append(name)
        else:
            log.info("quantfuse: %s keeps down_proj's activation gather: %s", name, why)
    if folded:
        log.info("quantfuse: down_proj's act-order folded into gate_proj / up_proj columns in %d MLPs", len(folded))
    return folded


__all__ = ["columns_permuted", "fold_mlp_orders"]
