"""compressed-tensors ``pack-quantized`` 4-bit weight-only layers (W4A16) -> ``AWQLinear``, repacked once.

compressed-tensors stores a W4A16 layer as
* ``weight_packed`` ``[N, K/8]`` int32: 8 consecutive input channels per word, element ``i`` in
  bits ``4i .. 4i+3``, each value offset by +8 (the signed int4 ``q`` stored as ``q + 8``);
* ``weight_scale`` ``[N, K/G]`` (strategy ``group``) or ``[N, 1]`` (``channel``);
* ``weight_zero_point`` ``[N/8, K/G]`` int32 when asymmetric: packed the same way along N;
* ``weight_shape`` ``[N, K]``.

``W = (q - z) * s`` with the +8 offset on both ``q`` and ``z`` (a symmetric layer has ``z = 8``
after the offset): exactly AWQ's ``(q - z) * s`` with unsigned nibbles, so the layer is repacked
into AWQ's ``qweight [K, N/8]`` / ``qzeros [K/G, N/8]`` / ``scales [K/G, N]`` bit-exactly.
"""

from __future__ import annotations

import torch
from torch import nn

from ..quantize.modules import AWQLinear
from ..quantize.weights import awq_pack
from .common import LayerPlan, UnsupportedCheckpointError, check_tensor, half_scales, unsupported

HALF = (torch.float16, torch.bfloat16)
SHIFTS = tuple(range(0, 32, 4))


def scheme(g, where: str) -> dict:
    """The group's weight arguments, checked: 4-bit int, group or channel, no activation quantization."""
    w, a = g.weights or {}, g.inputs
    if w.get("num_bits") != 4:
        bits = w.get("num_bits")
        unsupported(where, "weights.num_bits", bits, f"{bits}-bit packed weights (only 4-bit)")
    if w.get("type") != "int":
        unsupported(where, "weights.type", w.get("type"), "packed non-integer weights")
    if w.get("strategy") not in ("group", "channel"):
        unsupported(where, "weights.strategy", w.get("strategy"),
                    "this 4-bit weight scale granularity (expected 'group' or 'channel')")
    if w.get("actorder"):
        unsupported(where, "weights.actorder", w.get("actorder"), "activation ordering (act-order)")
    if w.get("dynamic"):
        unsupported(where, "weights.dynamic", w.get("dynamic"), "dynamic weight quantization")
    if a:
        unsupported(where, "input_activations", a, "4-bit weights with quantized activations (only W4A16)")
    if g.outputs:
        unsupported(where, "output_activations", g.outputs, "output activation quantization")
    return dict(group=w.get("group_size") if w["strategy"] == "group" else None, symmetric=w.get("symmetric", True))


def unpack_rows(packed: torch.Tensor) -> torch.Tensor:
    """[R, C/8] int32 -> [R, C] nibbles, element i of a word in bits 4i..4i+3."""
    shifts = torch.tensor(SHIFTS, dtype=torch.int32, device=packed.device)
    return ((packed.unsqueeze(-1) >> shifts) & 0xF).reshape(packed.shape[0], -1)


def plan(name: str, linear: nn.Linear, tensors: dict[str, str], g, dtype: torch.dtype) -> LayerPlan:
    where = f"quantization_config.config_groups.{g.name}"
    s = scheme(g, where)
    K, N = linear.in_features, linear.out_features
    group = s["group"] or K
    if not isinstance(group, int) or group <= 0 or K % group:
        unsupported(where, "weights.group_size", s["group"], f"a group size that does not divide {name}'s K = {K}")
    if K % 8 or N % 8:
        raise UnsupportedCheckpointError(f"{name}: {K} -> {N} layer; 4-bit packing here needs K and N multiples of 8")
    allowed = {"weight_packed", "weight_scale", "weight_shape", "bias"} | (set() if s["symmetric"] else
                                                                          {"weight_zero_point"})
    if "weight_g_idx" in tensors:
        raise UnsupportedCheckpointError(
            f"checkpoint tensor {tensors['weight_g_idx']!r}: activation ordering (act-order) is not supported")
    for suffix in sorted(set(tensors) - allowed):
        raise UnsupportedCheckpointError(
            f"checkpoint tensor {tensors[suffix]!r}: config group {g.name!r} (pack-quantized) does not expect it")
    for suffix in sorted(allowed - {"bias"} - set(tensors)):
        raise UnsupportedCheckpointError(f"checkpoint tensor {name}.{suffix} is missing (config group {g.name!r})")
    act = dtype if dtype in HALF else torch.float16
    with torch.device("meta"):
        placeholder = AWQLinear(K, N, group_size=group, bias="bias" in tensors, dtype=act)

    def load(t: dict[str, torch.Tensor]) -> nn.Module:
        packed = check_tensor(tensors["weight_packed"], t["weight_packed"], dtypes=(torch.int32,), shapes=[(N, K // 8)])
        shape = t["weight_shape"].tolist()
        if shape != [N, K]:
            raise UnsupportedCheckpointError(f"checkpoint tensor {tensors['weight_shape']!r} is {shape}; "
                                             f"the model's {name!r} is [{N}, {K}]")
        scale = check_tensor(tensors["weight_scale"], t["weight_scale"], shapes=[(N, K // group)],
                             dtypes=(*HALF, torch.float32))
        scale = half_scales(tensors["weight_scale"], scale, dtype)
        q = unpack_rows(packed)  # [N, K], the +8 offset kept: AWQ's unsigned nibbles
        if s["symmetric"]:
            z = torch.full((K // group, N), 8, dtype=torch.int32, device=q.device)
        else:
            zp = check_tensor(tensors["weight_zero_point"], t["weight_zero_point"], dtypes=(torch.int32,),
                              shapes=[(N // 8, K // group)])
            z = unpack_rows(zp.t().contiguous())  # [K/G, N]
        state = {"qweight": awq_pack(q.t()), "qzeros": awq_pack(z), "scales": scale.t().contiguous()}
        if "bias" in t:
            state["bias"] = t["bias"].to(scale.dtype)
        try:
            module = AWQLinear.from_state_dict(state, group_size=group)
        except (KeyError, ValueError) as exc:
            raise UnsupportedCheckpointError(f"pack-quantized layer {name!r}: {exc}") from None
        return module.to(dtype)

    sym = "symmetric" if s["symmetric"] else "asymmetric"
    desc = f"compressed-tensors pack-quantized 4-bit {sym}, group size {group} (as AWQ)"
    return LayerPlan(name, desc, tuple(tensors.values()), placeholder, load)
