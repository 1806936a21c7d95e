"""What every checkpoint format shares: the error it raises and the plan of one quantized layer."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn


class UnsupportedCheckpointError(ValueError):
    """A checkpoint uses a quantization scheme (or a tensor layout) that no quantfuse module holds."""


def unsupported(where: str, key: str, value, scheme: str):
    """Raise for config key ``where.key`` set to ``value``, which asks for ``scheme``."""
    raise UnsupportedCheckpointError(f"{where}.{key} = {value!r}: {scheme} is not supported by quantfuse's loader")


@dataclass
class LayerPlan:
    """How one linear layer of the model is loaded from the checkpoint.

    A format's ``plan(name, linear, tensors, dtype)`` returns one for each linear it quantizes
    (``tensors``: that module's checkpoint tensors, ``by_module``'s value), None for the others.

    ``placeholder`` (on the meta device) takes the linear's place in the model while the
    tensors are read; ``load`` gets this layer's tensors (by suffix: ``"weight"``,
    ``"weight_scale"``, ...) once all of ``keys`` have been read and returns the real module.
    """

    name: str
    scheme: str  # what the layer holds, for log lines and errors
    keys: tuple[str, ...]  # the checkpoint keys (full names) this layer reads
    placeholder: nn.Module
    load: Callable[[dict[str, torch.Tensor]], nn.Module]


def by_module(keys) -> dict[str, dict[str, str]]:
    """module name -> {suffix: full key} of the checkpoint tensors that belong to it directly
    (``"model.layers.0.mlp.up_proj"`` -> ``{"weight": ..., "weight_scale": ...}``)."""
    out: dict[str, dict[str, str]] = {}
    for key in keys:
        owner, _, suffix = key.rpartition(".")
        out.setdefault(owner, {})[suffix] = key
    return out


def fill_tensors(module: nn.Module, name: str, tensors: dict[str, torch.Tensor]) -> nn.Module:
    """Set the tensors a quantized module (built on the meta device) holds to ``tensors``,
    checking each against the placeholder's shape and dtype; every tensor the module holds
    must be given."""
    from ..quantize.modules import held_tensors, set_tensors

    filled = {}
    for key, placeholder in held_tensors(module).items():
        if placeholder is None:
            continue
        if key not in tensors:
            raise UnsupportedCheckpointError(f"{name}: no tensor for the module's {key!r}")
        t = tensors[key]
        if tuple(t.shape) != tuple(placeholder.shape) or t.dtype != placeholder.dtype:
            raise UnsupportedCheckpointError(
                f"{name}.{key}: converted to shape {tuple(t.shape)}, dtype {t.dtype}; the module holds "
                f"shape {tuple(placeholder.shape)}, dtype {placeholder.dtype}")
        filled[key] = t.contiguous()
    return set_tensors(module, **filled)


def check_tensor(key: str, t: torch.Tensor, *, dtypes=None, shapes=None, what: str = "") -> torch.Tensor:
    """``t`` (checkpoint tensor ``key``) has one of ``dtypes`` and one of ``shapes``; else a clear error."""
    ok_dtype = dtypes is None or t.dtype in dtypes
    ok_shape = shapes is None or tuple(t.shape) in [tuple(s) for s in shapes]
    if not (ok_dtype and ok_shape):
        expected = what or " or ".join(
            ([f"dtype {'/'.join(str(d) for d in dtypes)}"] if dtypes else [])
            + ([f"shape {' or '.join(str(tuple(s)) for s in shapes)}"] if shapes else []))
        raise UnsupportedCheckpointError(
            f"checkpoint tensor {key!r} has shape {tuple(t.shape)}, dtype {t.dtype}; expected {expected}")
    return t


DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32,
          "half": torch.float16, "float": torch.float32}


def check_layer_tensors(name: str, tensors: dict[str, str], allowed: set, required, layer: str, kind: str) -> None:
    """A quantized layer's checkpoint tensors (suffix -> key): none beyond ``allowed``, every one of
    ``required``; ``layer`` and ``kind`` name the format in the messages."""
    for suffix in sorted(set(tensors) - allowed):
        raise UnsupportedCheckpointError(f"checkpoint tensor {tensors[suffix]!r}: {layer} holds only {sorted(allowed)}")
    for suffix in required:
        if suffix not in tensors:
            raise UnsupportedCheckpointError(f"checkpoint tensor {name}.{suffix} is missing ({kind} layer {name!r})")


def half_scales(key: str, scales: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """AWQ-layout scales in float16 / bfloat16 as ``AWQLinear`` holds them: kept when they are, else
    rounded to ``dtype`` when that is one, else refused naming the checkpoint tensor."""
    if scales.dtype in (torch.float16, torch.bfloat16):
        return scales
    if dtype not in (torch.float16, torch.bfloat16):
        raise UnsupportedCheckpointError(
            f"checkpoint tensor {key!r} is {scales.dtype}; AWQLinear holds float16 or "
            "bfloat16 scales: pass dtype=torch.float16 or torch.bfloat16 to round them to it")
    return scales.to(dtype)


def parse_dtype(value, what: str) -> torch.dtype:
    if isinstance(value, torch.dtype):
        dtype = value
    elif isinstance(value, str) and value.removeprefix("torch.") in DTYPES:
        dtype = DTYPES[value.removeprefix("torch.")]
    else:
        raise ValueError(f"{what} {value!r}; expected torch.float16, torch.bfloat16 or torch.float32")
    if dtype not in (torch.float16, torch.bfloat16, torch.float32):
        raise ValueError(f"{what} {dtype}; expected torch.float16, torch.bfloat16 or torch.float32")
    return dtype
