"""The transformers model skeleton: built without weights, its linears swapped, tensors set in place."""

from __future__ import annotations

import contextlib
import re

import torch
from torch import nn

from .common import UnsupportedCheckpointError


@contextlib.contextmanager
def _parameters_on_meta():
    """Parameters are created on the meta device (no memory, no initialisation cost); buffers
    stay real, so values a model computes in ``__init__`` (rotary frequencies) are kept."""
    register = nn.Module.register_parameter

    def on_meta(module, name, param):
        if param is not None and param.device.type != "meta":
            param = nn.Parameter(param.to("meta"), requires_grad=param.requires_grad)
        register(module, name, param)

    nn.Module.register_parameter = on_meta
    try:
        yield
    finally:
        nn.Module.register_parameter = register


@contextlib.contextmanager
def _default_dtype(dtype: torch.dtype):
    old = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(old)


def model_class(config):
    """The class named by ``config.architectures``, else the causal-LM class of the config's type."""
    import transformers

    for arch in getattr(config, "architectures", None) or ():
        cls = getattr(transformers, arch, None)
        if cls is not None:
            return cls
    try:
        return transformers.AutoModelForCausalLM._model_mapping[type(config)]
    except KeyError:
        raise ValueError(f"from_pretrained: no transformers model class for config {type(config).__name__} "
                         f"(architectures {getattr(config, 'architectures', None)})") from None


def skeleton(config, dtype: torch.dtype) -> nn.Module:
    """The model with every parameter on the meta device and its float parameters in ``dtype``."""
    cls = model_class(config)
    with _parameters_on_meta(), _default_dtype(dtype):
        return cls(config)


def keep_in_fp32(model: nn.Module, dtype: torch.dtype) -> re.Pattern | None:
    """The names transformers keeps in float32 when it loads this model in ``dtype``: the model's
    ``_keep_in_fp32_modules`` for float16 (bfloat16 holds their range) and
    ``_keep_in_fp32_modules_strict`` for float16 and bfloat16, as globs searched in the names
    (transformers' ``_get_dtype_plan``); None when nothing is kept."""
    kept = set()
    if dtype == torch.float16:
        kept |= set(getattr(model, "_keep_in_fp32_modules", None) or ())
    if dtype in (torch.float16, torch.bfloat16):
        kept |= set(getattr(model, "_keep_in_fp32_modules_strict", None) or ())
    if not kept:
        return None
    return re.compile("|".join(f"(?:{g.replace('*', '.*')})" for g in sorted(kept)))


def upcast_kept(model: nn.Module, kept: re.Pattern, quantized) -> list[str]:
    """Makes the still unloaded float parameters and buffers whose names ``kept`` matches float32,
    so that ``set_tensor`` converts their checkpoint values to float32; returns their names.
    Modules named in ``quantized`` (placeholders of quantized layers) keep their dtypes."""
    names = []
    for mod_name, module in model.named_modules():
        if mod_name in quantized:
            continue
        for store in (module._parameters, module._buffers):
            for attr, t in store.items():
                full = f"{mod_name}.{attr}" if mod_name else attr
                if t is None or not t.is_floating_point() or t.dtype == torch.float32 or not kept.search(full):
                    continue
                if isinstance(t, nn.Parameter):
                    store[attr] = nn.Parameter(t.to(torch.float32), requires_grad=t.requires_grad)
                else:
                    store[attr] = t.to(torch.float32)
                names.append(full)
    return names


def linears(model: nn.Module):
    """(qualified name, module) of every ``nn.Linear``."""
    return [(name, m) for name, m in model.named_modules() if isinstance(m, nn.Linear)]


def replace(model: nn.Module, name: str, module: nn.Module) -> None:
    parent, _, attr = name.rpartition(".")
    setattr(model.get_submodule(parent) if parent else model, attr, module)


def slot(model: nn.Module, key: str):
    """(module, attribute, kind) of the parameter or buffer a checkpoint key names, or None."""
    owner, _, attr = key.rpartition(".")
    try:
        module = model.get_submodule(owner) if owner else model
    except AttributeError:
        return None
    if attr in module._parameters and module._parameters[attr] is not None:
        return module, attr, "parameter"
    if attr in module._buffers and module._buffers[attr] is not None and attr not in module._non_persistent_buffers_set:
        return module, attr, "buffer"
    return None


def set_tensor(key: str, where, value: torch.Tensor) -> None:
    """Set a plain (unquantized) parameter or buffer, in the placeholder's dtype."""
    module, attr, kind = where
    old = getattr(module, attr)
    if tuple(value.shape) != tuple(old.shape):
        raise UnsupportedCheckpointError(
            f"checkpoint tensor {key!r} has shape {tuple(value.shape)}; the model's {kind} has {tuple(old.shape)}")
    if (old.is_floating_point() and not value.is_floating_point()) or value.dtype == torch.float8_e4m3fn:
        raise UnsupportedCheckpointError(
            f"checkpoint tensor {key!r} is quantized ({value.dtype}) but {type(module).__name__} is not a linear "
            "layer this checkpoint's quantization config covers; quantized non-linear modules are not supported")
    value = value.to(old.dtype)
    if kind == "parameter":
        module._parameters[attr] = nn.Parameter(value, requires_grad=old.requires_grad and value.is_floating_point())
    else:
        module._buffers[attr] = value


def tie(model: nn.Module) -> None:
    """Tie the output embedding to the input embedding where the config asks for it (the
    checkpoint then usually omits it)."""
    config = model.config
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    if not getattr(text, "tie_word_embeddings", getattr(config, "tie_word_embeddings", False)):
        return
    out, inp = model.get_output_embeddings(), model.get_input_embeddings()
    if out is None or inp is None:
        return
    if not isinstance(out, (nn.Linear, nn.Embedding)):
        raise UnsupportedCheckpointError(
            f"the config ties the output embedding to the input embedding, but the output layer is quantized "
            f"({type(out).__name__}); tied quantized embeddings are not supported")
    out.weight = inp.weight


def missing(model: nn.Module) -> list[str]:
    """Names of parameters and persistent buffers still on the meta device (nothing loaded them)."""
    names = [n for n, p in model.named_parameters(remove_duplicate=False) if p.device.type == "meta"]
    for mod_name, module in model.named_modules():
        for b, t in module._buffers.items():
            if t is not None and t.device.type == "meta":
                names.append(f"{mod_name}.{b}" if mod_name else b)
    return names
