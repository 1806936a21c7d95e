"""``quantize_model``: every ``nn.Linear`` of a model swapped for its quantized form.

The schemes (``SCHEMES``) name how each linear is quantized; the replacement is round-to-nearest
(``weights.py``) into the modules of ``modules.py``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from ..ops.awq_gemm import AWQ_PACK
from .merged import share_input_storage
from .modules import AWQLinear, W8A8Linear


@dataclass(frozen=True)
class Scheme:
    """How ``quantize_model`` quantizes each linear layer."""

    kind: str  # "w8a8" or "awq"
    weight_dtype: torch.dtype = torch.int8
    per_channel: bool = True
    per_token: bool = True
    symmetric: bool = True
    group_size: int = 128


SCHEMES = {
    "int8": Scheme("w8a8"),
    "int8-asym": Scheme("w8a8", symmetric=False),
    "int8-asym-per-tensor": Scheme("w8a8", symmetric=False, per_token=False),
    "int8-per-tensor": Scheme("w8a8", per_channel=False, per_token=False),
    "fp8": Scheme("w8a8", weight_dtype=torch.float8_e4m3fn, per_channel=False, per_token=False),
    "fp8-rowwise": Scheme("w8a8", weight_dtype=torch.float8_e4m3fn),
    "awq": Scheme("awq", group_size=128),
    "awq-g32": Scheme("awq", group_size=32),
    "awq-g64": Scheme("awq", group_size=64),
    "awq-g128": Scheme("awq", group_size=128),
    "awq-per-channel": Scheme("awq", group_size=-1),
}


def _replaceable_linears(module: nn.Module, skip, prefix: str = ""):
    """(parent, attribute name, nn.Linear, qualified name) for every linear ``quantize_model`` replaces."""
    for name, child in module.named_children():
        if name in skip:
            continue
        qualified = f"{prefix}{name}"
        if isinstance(child, nn.Linear):
            yield module, name, child, qualified
        else:
            yield from _replaceable_linears(child, skip, qualified + ".")


def _check_linear(linear: nn.Linear, scheme: Scheme) -> None:
    """The shape checks the quantized module's constructor makes, without quantizing anything."""
    if scheme.kind == "awq":
        K, N = linear.in_features, linear.out_features
        group = K if scheme.group_size in (-1, 0) else scheme.group_size
        if group <= 0 or K % group != 0:
            raise ValueError(f"group_size {scheme.group_size} does not divide in_features {K}")
        if N % AWQ_PACK != 0:
            raise ValueError(f"out_features {N} is not a multiple of {AWQ_PACK}")


def _quantize_linear(linear: nn.Linear, scheme: Scheme, dtype) -> nn.Module:
    out_dtype = dtype or linear.weight.dtype
    if scheme.kind == "awq":
        if out_dtype in (torch.float16, torch.bfloat16):
            return AWQLinear.from_linear(linear, group_size=scheme.group_size, dtype=out_dtype)
        # The format holds its scales in float16; in a float32 model the layer computes in float16
        # between a cast of its input and one of its output, as after AWQLinear.float(), so that
        # it takes and gives what its neighbours do.
        return AWQLinear.from_linear(linear, group_size=scheme.group_size, dtype=torch.float16).to(out_dtype)
    return W8A8Linear.from_linear(
        linear, weight_dtype=scheme.weight_dtype, per_channel=scheme.per_channel,
        per_token=scheme.per_token, symmetric=scheme.symmetric, out_dtype=out_dtype)


def quantize_model(model: nn.Module, scheme, *, dtype: torch.dtype = None, skip=("lm_head",), mesh=None,
                   tp_plan: dict | None = None) -> nn.Module:
    """Replace every ``nn.Linear`` (except names in ``skip``) with its quantized form, in place.

    ``scheme`` is a ``Scheme`` or one of ``SCHEMES``' names.  ``dtype`` is the
    activation/output dtype (default: the linear weight's dtype).  AWQ layers of a
    float32 model compute in float16 between casts of their input and output, so that
    they take and give float32 like the layers around them.  Returns the model.

    All or nothing: every layer is checked, then every replacement is made, and only
    then are they swapped in, so a layer that cannot be quantized (e.g. a K that the
    group size does not divide) raises ``ValueError`` naming it and leaves the model as
    it was.  A linear shared by several parents gets one shared replacement.

    ``mesh``: a 1-D ``DeviceMesh`` or a process group; the quantized model is then sharded over
    it with ``compile_backend.tensor_parallel.tensor_parallel(model, mesh, tp_plan)``
    (``tp_plan`` default: its ``LLAMA_PLAN``).  Every rank calls this on the same model.

    The linears that share an input (q/k/v, gate/up) are stored as views of one merged tensor
    per name (``merged.share_input_storage``), so that the compiled model's merged op reads them
    without a copy.  Quantize the model on the device it will run on: moving it afterwards
    (``model.cuda()``) moves each view on its own, which is correct but copies the merged weights
    again when the model is compiled; ``share_input_storage(model)`` after the move merges them
    again.
    """
    if isinstance(scheme, str):
        if scheme not in SCHEMES:
            raise ValueError(f"quantize_model: scheme {scheme!r}; expected one of {sorted(SCHEMES)}")
        scheme = SCHEMES[scheme]
    plan = list(_replaceable_linears(model, skip))
    made: dict[int, nn.Module] = {}
    for check in (_check_linear, None):
        for _, _, linear, qualified in plan:
            if check is None and id(linear) in made:
                continue
            try:
                if check is not None:
                    check(linear, scheme)
                else:
                    made[id(linear)] = _quantize_linear(linear, scheme, dtype)
            except ValueError as exc:
                raise ValueError(f"quantize_model: layer {qualified!r} ({linear}): {exc}; "
                                 "the model was left unchanged") from exc
    for parent, name, linear, _ in plan:
        setattr(parent, name, made[id(linear)])
    if mesh is not None:
        from ..tensor_parallel import tensor_parallel

        tensor_parallel(model, mesh, tp_plan)
    share_input_storage(model)
    return model
