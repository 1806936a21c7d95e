"""Linears that share an input stored as one merged tensor, each module's tensors views of it.

The horizontal pass (``passes/horizontal.py``) runs the linears that read one activation (q/k/v,
gate/up) as one fused op over their weights concatenated along N.  Were they stored apart, the
concatenation would be a second copy of those weights (about two thirds of a Llama layer's).
So ``quantize_model`` and ``from_pretrained`` store each such group's tensors as one merged
tensor per name, and each member's tensor is the view of its columns: ``concat_weights`` then
finds the parts side by side and, on CUDA, reads the merged tensor's memory rather than copying
it (``ops.concat_weights``, ``adjacent_view``).  Each member still holds and computes with its own
tensors: a write to one (``copy_``, ``load_state_dict``, ``.data``) is a write into the merged
tensor, seen by the merged op.  ``load_state_dict(assign=True)`` or ``set_tensors`` replace a
member's tensor: the group is then concatenated (and cached) as before.

Groups are siblings with the names of the projections that share an input in the models people
quantize (``SHARED_INPUT_NAMES``), of one class, holding the same tensors with the same dtypes,
devices and shapes but along N.  An ``AWQLinear``'s tensors are merged along N too: its
``qweight`` in the fragment layout along the first dimension (N's strips: each member's part is
contiguous), ``qzeros`` and ``scales`` along their columns (column slices, not contiguous; a member
run on its own on CUDA outside a compiled graph copies its small scales and zeros into a contiguous
buffer per call).
"""

from __future__ import annotations

import torch
from torch import nn

from ..ops.concat_weights import adjacent_view
from .modules import AWQLinear, W8A8Linear, W8A16Linear, held_tensors, set_tensors

# Sibling names of the projections that read one input, as the models on the Hub name them.
SHARED_INPUT_NAMES = (
    ("q_proj", "k_proj", "v_proj"),  # Llama, Mistral, Qwen, Gemma, ...
    ("gate_proj", "up_proj"),
    ("query", "key", "value"),  # BERT-style attention
    ("wq", "wk", "wv"),  # Meta's reference Llama
    ("w1", "w3"),
)

# Per class: tensor name -> the dimension that holds N.
_N_DIM = {
    W8A8Linear: {"weight": 0, "weight_scale": 0, "bias": 0},
    AWQLinear: {"qweight": 1, "qzeros": 1, "scales": 1, "bias": 0},
    W8A16Linear: {"weight": 0, "weight_scale": 0, "bias": 0},
}


def _mergeable(members: list[nn.Module], name: str, dim: int) -> bool:
    tensors = [held_tensors(m).get(name) for m in members]
    if any(t is None for t in tensors):
        return False
    first = tensors[0]
    if name == "weight_scale" and any(t.dim() != 1 or t.numel() != m.out_features for t, m in zip(tensors, members)):
        return False  # a per-tensor scale stays each member's own
    return all(t.dtype == first.dtype and t.device == first.device and t.dim() == first.dim()
               and all(t.shape[k] == first.shape[k] for k in range(t.dim()) if k != dim) for t in tensors)


def _share(members: list[nn.Module]) -> list[str]:
    """Stores ``members``' tensors as views of merged ones; returns the names merged."""
    merged = []
    if isinstance(members[0], AWQLinear) and len({m.qweight.dim() for m in members}) > 1:
        # Some members' N is not a whole number of the fragment layout's strips (a small model's
        # k/v projections): the group is held in the AWQ layout, one merged tensor all the same.
        for m in members:
            if m.qweight.dim() == 4 and not m.qweight.requires_grad:
                set_tensors(m, qweight=m.awq_qweight())
    for name, dim in _N_DIM[type(members[0])].items():
        if name == "qweight" and isinstance(members[0], AWQLinear) and members[0].qweight.dim() == 4:
            dim = 0  # the fragment layout: N's strips first
        if not _mergeable(members, name, dim):
            continue
        parts = [held_tensors(m)[name] for m in members]
        if adjacent_view(parts, dim) is not None:
            merged.append(name)  # side by side already
        elif not any(p.requires_grad for p in parts):
            whole = torch.cat([p.detach() for p in parts], dim)
            offset = 0
            for m, p in zip(members, parts):
                set_tensors(m, **{name: whole.narrow(dim, offset, p.shape[dim])})
                offset += p.shape[dim]
            merged.append(name)
    return merged


def share_input_storage(model: nn.Module) -> int:
    """Stores each group of ``model``'s quantized linears that share an input (see the module
    doc) as views of merged tensors, leaving groups that are so already as they are.  Returns
    the number of groups that hold merged tensors."""
    groups = 0
    for parent in model.modules():
        children = dict(parent.named_children())
        for names in SHARED_INPUT_NAMES:
            members = [children[n] for n in names if n in children]
            if len(members) < 2 or len({type(m) for m in members}) != 1 or type(members[0]) not in _N_DIM:
                continue
            if len({id(m) for m in members}) != len(members):
                continue  # one module under two names
            if _share(members):
                groups += 1
    return groups
