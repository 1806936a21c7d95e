"""``quantize_model``: every ``nn.Linear`` of a model swapped for its quantized form.

The schemes (``SCHEMES``) name how each linear is quantized; the replacement is round-to-nearest
(``weights.py``) into the modules of ``modules.py``, after, for AWQ schemes given calibration data,
the activation-aware search of ``awq_search.py``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from ..ops.awq_gemm import AWQ_PACK
from .awq_search import AWQSearchResult, InputScaled, awq_search
from .merged import share_input_storage
from .modules import AWQLinear, W8A8Linear, W8A16Linear
from .weights import _awq_groups


@dataclass(frozen=True)
class Scheme:
    """How ``quantize_model`` quantizes each linear layer."""

    kind: str  # "w8a8", "awq" or "w8a16" (int8 weight-only)
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
    "w8a16": Scheme("w8a16"),  # int8 weight-only, per-channel
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


def _awq_dtype(linear: nn.Linear, dtype) -> torch.dtype:
    """The dtype of an AWQ layer's scales (and computation): the activation dtype where the format
    holds it, else float16 (see ``_quantize_linear``)."""
    out_dtype = dtype or linear.weight.dtype
    return out_dtype if out_dtype in (torch.float16, torch.bfloat16) else torch.float16


def _searched(linear: nn.Linear, scheme: Scheme, search: AWQSearchResult | None):
    """``(linear to quantize, 1/s or None)``: with an AWQ search's clip the weight clamped per group,
    and with a scale to apply on the activation ``W·s`` (see ``awq_search.py``)."""
    clip = None if search is None else search.clip.get(id(linear))
    s = None if search is None else search.input_scale.get(id(linear))
    if clip is None and s is None:
        return linear, None
    w = linear.weight.detach().to(torch.float32)
    if s is not None:
        w = w * s.to(w.device)
    if clip is not None:
        group = w.shape[1] if scheme.group_size in (-1, 0) else scheme.group_size
        w = _awq_groups(w, group, clip, "quantize_model").reshape(w.shape)
    src = torch.nn.utils.skip_init(nn.Linear, linear.in_features, linear.out_features, bias=linear.bias is not None,
                                   device=w.device, dtype=torch.float32)
    with torch.no_grad():
        src.weight.copy_(w)
        if linear.bias is not None:
            src.bias.copy_(linear.bias)
    return src, None if s is None else (1 / s).to(device=w.device, dtype=linear.weight.dtype)


def _quantize_linear(linear: nn.Linear, scheme: Scheme, dtype, search: AWQSearchResult | None = None) -> nn.Module:
    out_dtype = dtype or linear.weight.dtype
    if scheme.kind == "awq":
        src, input_scale = _searched(linear, scheme, search)
        scales_dtype = _awq_dtype(linear, dtype)
        # The format holds its scales in float16; in a float32 model the layer computes in float16
        # between a cast of its input and one of its output, as after AWQLinear.float(), so that
        # it takes and gives what its neighbours do.
        layer = AWQLinear.from_linear(src, group_size=scheme.group_size, dtype=scales_dtype)
        layer.made_by = "the AWQ search (calibrated)" if search is not None else "round-to-nearest"
        if scales_dtype != out_dtype:
            layer = layer.to(out_dtype)
        return layer if input_scale is None else InputScaled(layer, input_scale)
    if scheme.kind == "w8a16":
        return W8A16Linear.from_linear(linear, per_channel=scheme.per_channel, dtype=out_dtype)
    return W8A8Linear.from_linear(
        linear, weight_dtype=scheme.weight_dtype, per_channel=scheme.per_channel,
        per_token=scheme.per_token, symmetric=scheme.symmetric, out_dtype=out_dtype)


def _scheme(value, what: str) -> Scheme:
    if isinstance(value, Scheme):
        return value
    if value not in SCHEMES:
        raise ValueError(f"quantize_model: {what} {value!r}; expected one of {sorted(SCHEMES)}")
    return SCHEMES[value]


def quantize_model(model: nn.Module, scheme, *, dtype: torch.dtype = None, skip=("lm_head",), mesh=None,
                   tp_plan: dict | None = None, calibration=None, tokenizer=None, progress: bool = True,
                   awq_options: dict | None = None, lm_head=None) -> nn.Module:
    """Replace every ``nn.Linear`` (except names in ``skip``) with its quantized form, in place.

    ``scheme`` is a ``Scheme`` or one of ``SCHEMES``' names (``"w8a16"``: int8 weight-only with
    per-channel scales, ``W8A16Linear``).  ``dtype`` is the
    activation/output dtype (default: the linear weight's dtype).  AWQ layers of a
    float32 model compute in float16 between casts of their input and output, so that
    they take and give float32 like the layers around them.  Returns the model.

    All or nothing: every layer is checked, then every replacement is made, and only
    then are they swapped in, so a layer that cannot be quantized (e.g. a K that the
    group size does not divide) raises ``ValueError`` naming it and leaves the model as
    it was.  A linear shared by several parents gets one shared replacement.

    AWQ schemes (``"awq-g32"``, ``"awq-g64"``, ...) are round-to-nearest unless ``calibration`` is
    given: then the activation-aware search runs first (``awq_search.py``: per-input-channel scales
    from the calibration activations, searched by each layer's quantized output error and folded
    into the RMSNorm or linear before it, then a search over weight clipping), on the float model,
    in place.  ``calibration``: token ids (a ``[S]`` or ``[B, S]`` tensor, or a list of them; each
    tensor is one call of ``model(ids)``), or a string or list of strings tokenized with
    ``tokenizer`` (e.g. a transformers tokenizer); a few hundred to a few thousand tokens of text
    like the model's use.  ``progress``: one line per decoder layer on stderr during the search;
    ``awq_options``: keyword arguments of ``awq_search`` (``n_grid``, ``max_tokens``, ``clip``,
    ...).  The search only rescales weights (the float model's function is kept) before the
    replacement; calibration with a W8A8 scheme raises ``ValueError``.

    ``lm_head``: a scheme (name or ``Scheme``) for the output projection (the linear named ``lm_head``),
    which ``skip`` leaves dense by default; opt-in, since it quantizes the logits themselves (its
    perplexity cost on a trained model is in the README).  Round-to-nearest, whatever ``calibration``
    says.  A head tied to the input embedding gets its own quantized copy; the embedding keeps the
    float table.

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
    scheme = _scheme(scheme, "scheme")
    if calibration is not None and scheme.kind != "awq":
        raise ValueError(f"quantize_model: calibration data is for AWQ schemes (the activation-aware search); "
                         f"scheme {scheme} quantizes without it")
    plan = [(*entry, scheme) for entry in _replaceable_linears(model, skip)]
    head_ids: set[int] = set()  # the head's linear: its own scheme, never searched
    if lm_head is not None:
        head_scheme = _scheme(lm_head, "lm_head")
        heads = [(*entry, head_scheme) for entry in _replaceable_linears(model, set(skip) - {"lm_head"})
                 if entry[1] == "lm_head"]
        if not heads:
            raise ValueError("quantize_model: lm_head given, but the model has no nn.Linear named 'lm_head' "
                             "left to quantize")
        plan = [entry for entry in plan if entry[1] != "lm_head"] + heads
        head_ids = {id(entry[2]) for entry in heads}
    made: dict[int, nn.Module] = {}
    search = None
    for check in (_check_linear, "search", None):
        if check == "search":
            body = [(qualified, linear) for _, _, linear, qualified, _ in plan if id(linear) not in head_ids]
            if calibration is not None:
                linears = list({id(linear): (qualified, linear) for qualified, linear in body}.values())
                search = awq_search(model, calibration, linears, scheme.group_size,
                                    dtype=_awq_dtype(linears[0][1], dtype) if linears else torch.float16,
                                    tokenizer=tokenizer, progress=progress, **(awq_options or {}))
            continue
        for _, _, linear, qualified, layer_scheme in plan:
            if check is None and id(linear) in made:
                continue
            try:
                if check is not None:
                    check(linear, layer_scheme)
                else:
                    searched = None if id(linear) in head_ids else search
                    made[id(linear)] = _quantize_linear(linear, layer_scheme, dtype, searched)
            except ValueError as exc:
                raise ValueError(f"quantize_model: layer {qualified!r} ({linear}): {exc}; "
                                 "the model was left unchanged") from exc
    for parent, name, linear, _, _ in plan:
        setattr(parent, name, made[id(linear)])
    if mesh is not None:
        from ..tensor_parallel import tensor_parallel

        tensor_parallel(model, mesh, tp_plan)
    share_input_storage(model)
    return model
