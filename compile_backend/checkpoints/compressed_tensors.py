"""compressed-tensors checkpoints (what llm-compressor writes): W8A8 int8 and FP8 -> ``W8A8Linear``, W4A16.

``quantization_config`` (``quant_method: compressed-tensors``) holds ``config_groups``, each with
``targets`` (module names, ``re:`` regexes or class names such as ``Linear``), ``weights`` and
``input_activations`` arguments and a ``format``; ``ignore`` lists modules left unquantized.
Formats ``int-quantized``, ``float-quantized`` (and ``naive-quantized``) store per layer:

* ``weight``: int8 or float8_e4m3fn ``[N, K]``;
* ``weight_scale``: ``[N, 1]`` (strategy ``channel``) or ``[1]`` (``tensor``);
* ``input_scale`` ``[1]`` (and ``input_zero_point`` ``[1]`` int8 when asymmetric) for static
  activations; none for dynamic ones (strategy ``token`` or ``tensor``);
* ``bias`` when the layer has one.

``pack-quantized`` 4-bit weight-only layers (W4A16) become ``AWQLinear`` (``pack_quantized.py``).
Every other scheme (group/block scales on 8-bit weights, asymmetric 8-bit weights, per-group
activation scales, 8-bit weight-only, other bit widths, sparsity, transforms) raises
``UnsupportedCheckpointError`` naming the config key and the scheme.
"""

from __future__ import annotations

import logging
import re
from dataclasses import dataclass

import torch
from torch import nn

from ..quantize.modules import W8A8Linear
from . import pack_quantized
from .common import LayerPlan, UnsupportedCheckpointError, check_tensor, fill_tensors, unsupported

log = logging.getLogger("quantfuse.checkpoints")

FORMATS = ("int-quantized", "float-quantized", "naive-quantized")
WEIGHT_DTYPES = {"int": torch.int8, "float": torch.float8_e4m3fn}
SCALE_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
# KV-cache scales live on attention modules; this loader leaves the cache in the model's dtype.
KV_CACHE_SUFFIXES = (".k_scale", ".v_scale", ".q_scale", ".k_zero_point", ".v_zero_point", ".q_zero_point")


@dataclass(frozen=True)
class Group:
    name: str
    targets: tuple[str, ...]
    weights: dict | None
    inputs: dict | None
    outputs: dict | None
    format: str


def _specificity(name: str, module: nn.Module, targets) -> int | None:
    """How specifically ``targets`` name a module, by compressed-tensors' rules (an exact module name,
    a ``re:`` regex matched at the start of the name, or the name of a class in the module's MRO;
    the most specific wins): 0 exact name, 1 regex, 2 class name, None no match."""
    best = None
    for t in targets:
        if t.startswith("re:"):
            rank = 1 if re.match(t[3:], name) else None
        elif t == name:
            rank = 0
        else:
            rank = 2 if any(cls.__name__ == t for cls in type(module).__mro__) else None
        if rank is not None and (best is None or rank < best):
            best = rank
    return best


class CompressedTensorsFormat:
    """Reads one ``quantization_config`` of ``quant_method: compressed-tensors``."""

    method = "compressed-tensors"

    def __init__(self, qcfg: dict):
        where = "quantization_config"
        for key, what in (("sparsity_config", "sparsity"), ("transform_config", "transforms (rotations)")):
            if qcfg.get(key):
                raise UnsupportedCheckpointError(
                    f"{where}.{key} is set: compressed-tensors {what} are not supported by quantfuse's loader")
        status = qcfg.get("quantization_status", "compressed")
        if status != "compressed":
            raise UnsupportedCheckpointError(
                f"{where}.quantization_status = {status!r}: the weights are not stored compressed "
                "(expected 'compressed')")
        groups = qcfg.get("config_groups")
        if not isinstance(groups, dict) or not groups:
            raise UnsupportedCheckpointError(f"{where}.config_groups: expected a non-empty mapping of schemes")
        top_format = qcfg.get("format")
        self.groups = []
        for gname, g in groups.items():
            if not isinstance(g, dict):
                raise UnsupportedCheckpointError(
                    f"{where}.config_groups.{gname} = {g!r}: preset-name groups are not supported; expected a "
                    "scheme with 'targets', 'weights' and 'input_activations'")
            self.groups.append(Group(
                gname, tuple(g.get("targets") or ()), g.get("weights"), g.get("input_activations"),
                g.get("output_activations"), g.get("format") or top_format))
        self.ignore = tuple(qcfg.get("ignore") or ())
        self.kv_cache = qcfg.get("kv_cache_scheme")
        self._schemes: dict[str, dict] = {}

    # ------------------------------------------------------------------ which layers, which scheme

    def _group_of(self, name: str, module: nn.Module) -> Group | None:
        if _specificity(name, module, self.ignore) is not None:
            return None
        ranked = [(r, g) for g in self.groups if (r := _specificity(name, module, g.targets)) is not None]
        if not ranked:
            return None
        best = min(r for r, _ in ranked)
        chosen = [g for r, g in ranked if r == best]
        if len(chosen) > 1:
            raise UnsupportedCheckpointError(
                f"module {name!r} is targeted equally by config_groups {[g.name for g in chosen]}; "
                "expected one scheme per module")
        return chosen[0]

    def _scheme(self, g: Group) -> dict:
        """W8A8Linear's arguments for group ``g``, or UnsupportedCheckpointError naming the config key."""
        if g.name in self._schemes:
            return self._schemes[g.name]

        def no(key, value, scheme):
            unsupported(f"quantization_config.config_groups.{g.name}", key, value, scheme)

        if g.format not in FORMATS:
            no("format", g.format,
               f"the {g.format!r} storage format (supported: {', '.join(FORMATS)}, pack-quantized)")
        w, a = g.weights, g.inputs
        if not w:
            no("weights", w, "a scheme without weight quantization")
        if w.get("num_bits") != 8:
            no("weights.num_bits", w.get("num_bits"), f"{w.get('num_bits')}-bit weights (only 8-bit)")
        if w.get("type") not in WEIGHT_DTYPES:
            no("weights.type", w.get("type"), "this weight type (expected 'int' or 'float')")
        if w.get("strategy") not in ("channel", "tensor"):
            no("weights.strategy", w.get("strategy"),
                        "group-wise or block-wise weight scales (expected 'channel' or 'tensor')")
        if not w.get("symmetric", True):
            no("weights.symmetric", False, "asymmetric weights (a weight_zero_point)")
        if w.get("dynamic"):
            no("weights.dynamic", w.get("dynamic"), "dynamic weight quantization")
        if w.get("actorder"):
            no("weights.actorder", w.get("actorder"), "activation ordering (act-order)")
        if not a:
            no("input_activations", a, "8-bit weight-only quantization (W8A16)")
        if a.get("num_bits") != 8:
            no("input_activations.num_bits", a.get("num_bits"),
                        f"{a.get('num_bits')}-bit activations (only 8-bit)")
        if a.get("type") != w.get("type"):
            no("input_activations.type", a.get("type"),
                        f"{a.get('type')} activations with {w.get('type')} weights")
        dynamic = a.get("dynamic", False)
        if dynamic not in (True, False):
            no("input_activations.dynamic", dynamic, "locally dynamic activation scales")
        strategy = a.get("strategy")
        if strategy not in ("token", "tensor") or (strategy == "token" and not dynamic):
            no("input_activations.strategy", strategy,
                        "this activation scale granularity (per-group activation scales included; expected "
                        "'token' (dynamic) or 'tensor')")
        symmetric = a.get("symmetric", True)
        if not symmetric and w["type"] != "int":
            no("input_activations.symmetric", False, "asymmetric float8 activations")
        if g.outputs:
            no("output_activations", g.outputs, "output activation quantization")
        scheme = dict(weight_dtype=WEIGHT_DTYPES[w["type"]], per_channel=w["strategy"] == "channel",
                      dynamic=bool(dynamic), per_token=strategy == "token", symmetric=symmetric)
        self._schemes[g.name] = scheme
        return scheme

    # ------------------------------------------------------------------ loader interface

    def skipped_keys(self, keys) -> set[str]:
        """Checkpoint keys this format reads but does not load (KV-cache scales), with a warning."""
        if not self.kv_cache:
            return set()
        skipped = {k for k in keys if k.endswith(KV_CACHE_SUFFIXES)}
        log.warning("quantization_config.kv_cache_scheme is set: the KV cache stays in the model's dtype "
                    "(%d KV-cache scale tensors not loaded)", len(skipped))
        return skipped

    def plan(self, name: str, linear: nn.Linear, tensors: dict[str, str], dtype: torch.dtype) -> LayerPlan | None:
        g = self._group_of(name, linear)
        if g is None:
            if "weight_scale" in tensors:
                raise UnsupportedCheckpointError(
                    f"checkpoint tensor {tensors['weight_scale']!r}: module {name!r} is quantized in the checkpoint "
                    "but no config group targets it (or it is in 'ignore')")
            return None
        if g.format == "pack-quantized":
            return pack_quantized.plan(name, linear, tensors, g, dtype)
        scheme = self._scheme(g)
        allowed = {"weight", "weight_scale", "bias"}
        required = {"weight", "weight_scale"}
        if not scheme["dynamic"]:
            allowed.add("input_scale")
            required.add("input_scale")
            if not scheme["symmetric"]:
                allowed.add("input_zero_point")
                required.add("input_zero_point")
        # Zero points of symmetric schemes (all zero) appear in checkpoints of older writers.
        allowed |= {"weight_zero_point", "input_zero_point"}
        for suffix in sorted(set(tensors) - allowed):
            raise UnsupportedCheckpointError(
                f"checkpoint tensor {tensors[suffix]!r}: config group {g.name!r} ({g.format}) does not expect it")
        for suffix in sorted(required - set(tensors)):
            raise UnsupportedCheckpointError(
                f"checkpoint tensor {name}.{suffix} is missing: config group {g.name!r} targets {name!r} "
                f"with a {'static' if not scheme['dynamic'] else 'dynamic'} scheme")
        K, N = linear.in_features, linear.out_features
        has_bias = "bias" in tensors
        with torch.device("meta"):
            placeholder = W8A8Linear(K, N, bias=has_bias, out_dtype=dtype, **scheme)
        desc = (f"compressed-tensors {g.format} {'int8' if scheme['weight_dtype'] == torch.int8 else 'fp8'} "
                f"{'per-channel' if scheme['per_channel'] else 'per-tensor'} weights, "
                f"{'dynamic' if scheme['dynamic'] else 'static'} "
                f"{'per-token' if scheme['per_token'] else 'per-tensor'} "
                f"{'symmetric' if scheme['symmetric'] else 'asymmetric'} activations")

        def load(t: dict[str, torch.Tensor]) -> nn.Module:
            return _load_w8a8(name, tensors, t, scheme, K, N, has_bias, dtype)

        return LayerPlan(name, desc, tuple(tensors.values()), placeholder, load)


def _scalar(key: str, t: torch.Tensor) -> torch.Tensor:
    if t.numel() != 1:
        raise UnsupportedCheckpointError(
            f"checkpoint tensor {key!r} has shape {tuple(t.shape)}; expected one element (a per-tensor value)")
    return t.reshape(())


def _zero_point(key: str, t: torch.Tensor) -> torch.Tensor:
    if t.dtype.is_floating_point and not torch.equal(t, t.round()):
        raise UnsupportedCheckpointError(f"checkpoint tensor {key!r} holds non-integer zero points")
    if t.numel() and (t.min() < -128 or t.max() > 127):
        raise UnsupportedCheckpointError(f"checkpoint tensor {key!r} holds zero points outside int8's range")
    return t.to(torch.int32)


def _load_w8a8(name, keys, t, scheme, K, N, has_bias, dtype) -> nn.Module:
    weight = check_tensor(keys["weight"], t["weight"], dtypes=(scheme["weight_dtype"],), shapes=[(N, K)])
    scale = check_tensor(keys["weight_scale"], t["weight_scale"], dtypes=SCALE_DTYPES)
    if scheme["per_channel"]:
        check_tensor(keys["weight_scale"], scale, shapes=[(N, 1), (N,)], what=f"[{N}, 1] (one scale per channel)")
        scale = scale.reshape(N)
    else:
        scale = _scalar(keys["weight_scale"], scale)
    for suffix, symmetric in (("weight_zero_point", True), ("input_zero_point", scheme["symmetric"])):
        if suffix in t and symmetric and torch.count_nonzero(t[suffix]):
            raise UnsupportedCheckpointError(
                f"checkpoint tensor {keys[suffix]!r} holds non-zero zero points for a symmetric scheme")
    tensors = {"weight": weight, "weight_scale": scale.to(torch.float32)}
    if has_bias:
        bias = check_tensor(keys["bias"], t["bias"], dtypes=SCALE_DTYPES, shapes=[(N,)])
        tensors["bias"] = bias.to(dtype)
    if not scheme["dynamic"]:
        s = check_tensor(keys["input_scale"], t["input_scale"], dtypes=SCALE_DTYPES)
        tensors["input_scale"] = _scalar(keys["input_scale"], s).to(torch.float32)
        if not scheme["symmetric"]:
            tensors["input_zero_point"] = _zero_point(
                keys["input_zero_point"], _scalar(keys["input_zero_point"], t["input_zero_point"]))
    with torch.device("meta"):
        module = W8A8Linear(K, N, bias=has_bias, out_dtype=dtype, **scheme)
    return fill_tensors(module, name, tensors)
