"""GPTQ checkpoints (``quant_method: gptq``): AutoGPTQ's, GPTQModel's and transformers' format; 4-bit ->
``AWQLinear``, 8-bit per-channel symmetric -> ``W8A16Linear``.

``quantization_config``: ``{"quant_method": "gptq", "bits": 4, "group_size": G, "desc_act": ..., "sym": ...,
"checkpoint_format": "gptq" | "gptq_v2"}`` (transformers' ``GPTQConfig`` writes ``format`` and the legacy
``checkpoint_format``, which wins where both are given, as in ``GPTQConfig.__init__``; absent, ``gptq``).
Each quantized linear (``K`` inputs, ``N`` outputs, ``G = K`` for ``group_size: -1``) stores

* ``qweight`` ``[K/8, N]`` int32: eight 4-bit values along K per word, row ``8r + j`` of the weight in
  bits ``4j .. 4j+3`` of ``qweight[r]`` (lowest nibble first);
* ``qzeros`` ``[K/G, N/8]`` int32: eight zero points along N per word, column ``8c + j`` in bits ``4j``;
* ``scales`` ``[K/G, N]`` (float16, or bfloat16);
* ``g_idx`` ``[K]`` int32: each input channel's group;
* ``bias`` ``[N]`` when the layer has one,

and ``W[k, n] = (q[k, n] - z[g_idx[k], n]) * s[g_idx[k], n]`` (``Y = X W + bias``): AWQ's arithmetic in
another packing.  The ``gptq`` (v1) format stores each zero-point word minus ``0x11111111`` (every zero
point minus one, computed on the whole int32 word, so a zero point of 0 borrows from the next nibble);
``gptq_v2`` stores them as they are.  ``sym`` only says how the zero points were chosen (all ``2^(bits-1)``);
the stored ones are loaded either way.

What this relies on (GPTQModel, github.com/ModelCloud/GPTQModel, the loader transformers uses):
``gptqmodel/nn_modules/qlinear/__init__.py``, ``PackableQuantLinear.pack_original`` (``qweight[row] |=
int_weight[row * pack_factor + j] << (bits * j)``; ``qzeros[:, col] |= zeros[:, col * pack_factor + j] <<
(bits * j)``) and ``dequantize_weight`` (``scales[g_idx] * (weight - zeros[g_idx])``, v2 zero points);
``gptqmodel/utils/model.py``, ``convert_gptq_v1_to_v2_format_module`` (4-bit, int32 words:
``qzeros += 0b00010001000100010001000100010001``, the inverse of ``convert_gptq_v2_to_v1_format_module``'s
``-=``, which writes v1 checkpoints).  transformers' ``GPTQConfig`` for the config keys.

Loading repacks each layer once into ``AWQLinear``'s layout (``qweight [K, N/8]`` and ``qzeros
[K/G, N/8]`` in AWQ bit order, ``scales [K/G, N]``) and keeps nothing else.  The conversion is
``ops.awq_gemm.awq_state``, the one ``prepare`` and the AWQ pass's GPTQ reading use as well.  Act-order (``desc_act``:
``g_idx`` not ``k // G``, so a group's channels are scattered over K): the weight's rows are sorted by
group (stably) so that groups are contiguous, and the layer holds the order as ``perm``; its forward
gathers the activation to match (``AWQLinear``'s class doc).  Any ``g_idx`` that puts ``G`` channels in
each group loads; a ``g_idx`` equal to ``k // G`` (``desc_act`` false, or ``static_groups``) keeps no
``perm``; layers with the same order share one ``perm`` tensor (``GPTQFormat.shared_perm``).

8-bit, per-channel (``group_size: -1``) and symmetric: int8 weight-only (W8A16), loaded into
``W8A16Linear`` (whose forward the ``w8a16_gemm`` pass fuses).  The same layout with four 8-bit values
per int32 word: ``qweight`` ``[K/4, N]`` (row ``4r + j`` in bits ``8j .. 8j+7`` of ``qweight[r]``, lowest
byte first), ``qzeros`` ``[1, N/4]`` (column ``4c + j`` in bits ``8j``), ``scales`` ``[1, N]``, ``g_idx``
all 0 (one group; act-order changes nothing with one group).  Symmetric GPTQ's zero point is 128
(``gptq_v2``; v1 stores 127, each word minus ``0x01010101``: GPTQModel's
``convert_gptq_v1_to_v2_format_module`` for 8 bits), so ``W[k, n] = (q[k, n] - 128) * s[n]``: the layer
holds ``w_q = (q - 128)ᵀ`` as int8 ``[N, K]`` and ``weight_scale = s`` ``[N]`` (as stored where that is
the activation dtype, else widened to float32), the same values bit for bit.  A stored zero point other
than 128 is refused (it is not the symmetric scheme the config names).  GPTQModel's
``dequantize_weight`` (bits 8: ``wf = [0, 8, 16, 24]``, ``(qweight >> wf) & 0xFF`` along K,
``scales[g_idx] * (weight - zeros[g_idx])``) is what this mirrors.

Refused with ``UnsupportedCheckpointError`` naming the config key and the scheme: 2-, 3- and other-bit
GPTQ, 8-bit GPTQ with groups (int8 weight-only takes one scale per output channel) or asymmetric (it
has no zero point), other checkpoint formats (``marlin``, ``bitblas``, ...), packing words other than
int32, GPTQModel's per-module ``dynamic`` overrides.
"""

from __future__ import annotations

import torch
from torch import nn

from ..ops.awq_gemm import awq_state, v1_to_v2_zeros
from ..quantize.modules import AWQLinear, W8A16Linear, set_tensors
from .common import LayerPlan, UnsupportedCheckpointError, check_layer_tensors, check_tensor, half_scales, unsupported

LAYER_TENSORS = {"qweight", "qzeros", "scales", "g_idx", "bias"}
HALF = (torch.float16, torch.bfloat16)
FORMATS = ("gptq", "gptq_v2")
INT8_ZERO = 128  # the zero point of symmetric 8-bit GPTQ (v2; v1 stores 127)
BYTE_SHIFTS = (0, 8, 16, 24)


def unpack_bytes(packed: torch.Tensor) -> torch.Tensor:
    """[R, C/4] int32 (or int64 holding unsigned words) -> [R, C] values in [0, 255], element i of a
    word in bits 8i .. 8i+7."""
    shifts = torch.tensor(BYTE_SHIFTS, dtype=packed.dtype, device=packed.device)
    return ((packed.unsqueeze(-1) >> shifts) & 0xFF).reshape(packed.shape[0], -1)


class GPTQFormat:
    """Reads one ``quantization_config`` of ``quant_method: gptq``."""

    method = "gptq"

    def __init__(self, qcfg: dict):
        def no(key, value, scheme):
            unsupported("quantization_config", key, value, scheme)

        group = qcfg.get("group_size", 128)
        if isinstance(group, bool) or not isinstance(group, int) or not (group > 0 or group == -1):
            no("group_size", group, "this group size (expected a positive integer or -1)")
        sym = qcfg.get("sym", True)
        where_g = "per-channel (group_size -1)" if group == -1 else f"group size {group}"
        bits = qcfg.get("bits")
        if isinstance(bits, bool) or not isinstance(bits, int):
            no("bits", bits, "a GPTQ config without an integer bit width")
        if bits == 8:
            if group != -1:
                no("bits", bits, f"8-bit GPTQ with {where_g} (int8 weight-only takes one scale per output channel)")
            if not sym:
                no("bits", bits, "8-bit GPTQ, per-channel asymmetric (int8 weight-only has no zero point)")
        elif bits != 4:
            no("bits", bits, f"{bits}-bit GPTQ with {where_g} (only 4-bit GPTQ, and 8-bit per-channel symmetric, "
                             "load)")
        fmt = qcfg.get("checkpoint_format") or qcfg.get("format") or "gptq"
        fmt = fmt.lower() if isinstance(fmt, str) else fmt
        key = "checkpoint_format" if qcfg.get("checkpoint_format") else "format"
        if fmt not in FORMATS:
            no(key, fmt, f"the GPTQ {fmt!r} weight layout (only 'gptq' and 'gptq_v2')")
        pack = qcfg.get("pack_dtype", "int32")
        if str(pack).removeprefix("torch.") != "int32":
            no("pack_dtype", pack, "GPTQ packed in words other than int32")
        if qcfg.get("dynamic"):
            no("dynamic", qcfg["dynamic"], "per-module quantization overrides (GPTQModel's dynamic)")
        self.bits, self.group_size, self.v1, self.sym = bits, group, fmt == "gptq", bool(sym)
        self.desc_act = bool(qcfg.get("desc_act", False))
        self.format = fmt
        self._perms: dict[bytes, torch.Tensor] = {}  # see shared_perm

    def shared_perm(self, module: AWQLinear) -> AWQLinear:
        """Layers whose act-order is the same (GPTQ gives q/k/v, and gate/up, one order: they read
        the same activations) hold one ``perm`` tensor: the compiled graph then gathers their shared
        input once, and ``passes/horizontal.py`` can merge their ops as it does without act-order."""
        if module.perm is None:
            return module
        key = module.perm.detach().cpu().numpy().tobytes() + str(module.perm.device).encode()
        held = self._perms.setdefault(key, module.perm)
        return module if held is module.perm else set_tensors(module, perm=held)

    def skipped_keys(self, keys) -> set[str]:
        return set()

    def plan(self, name: str, linear: nn.Linear, tensors: dict[str, str], dtype: torch.dtype) -> LayerPlan | None:
        if "qweight" not in tensors:
            return None
        check_layer_tensors(name, tensors, LAYER_TENSORS, ("qzeros", "scales"), "a GPTQ layer", "GPTQ")
        if self.bits == 8:
            return self._plan_int8(name, linear, tensors, dtype)
        if self.desc_act and "g_idx" not in tensors:
            raise UnsupportedCheckpointError(f"checkpoint tensor {name}.g_idx is missing: quantization_config.desc_act "
                                             "= True (act-order) needs each layer's input channel groups")
        K, N = linear.in_features, linear.out_features
        group = K if self.group_size == -1 else self.group_size
        if K % 8 or N % 8:
            raise UnsupportedCheckpointError(f"{name}: {K} -> {N} layer; 4-bit GPTQ here needs K and N multiples of 8")
        if K % group:
            unsupported("quantization_config", "group_size", self.group_size,
                        f"a group size that does not divide {name}'s K = {K}")
        act = dtype if dtype in HALF else torch.float16
        with torch.device("meta"):
            placeholder = AWQLinear(K, N, group_size=group, bias="bias" in tensors, dtype=act)

        def load(t: dict[str, torch.Tensor]) -> nn.Module:
            qweight = check_tensor(tensors["qweight"], t["qweight"], dtypes=(torch.int32,), shapes=[(K // 8, N)])
            qzeros = check_tensor(tensors["qzeros"], t["qzeros"], dtypes=(torch.int32,), shapes=[(K // group, N // 8)])
            scales = check_tensor(tensors["scales"], t["scales"], dtypes=(*HALF, torch.float32),
                                  shapes=[(K // group, N)])
            scales = half_scales(tensors["scales"], scales, dtype)
            g_idx = None
            if "g_idx" in t:
                g_idx = check_tensor(tensors["g_idx"], t["g_idx"], dtypes=(torch.int32, torch.int64), shapes=[(K,)])
            try:
                state = awq_state(qweight, qzeros, scales, g_idx, group, self.v1)
            except ValueError as exc:
                raise UnsupportedCheckpointError(f"checkpoint tensor {tensors['g_idx']!r} {exc}") from None
            if "bias" in t:
                state["bias"] = t["bias"].to(scales.dtype)
            try:
                module = AWQLinear.from_state_dict({k: v for k, v in state.items() if v is not None}, group_size=group)
            except (KeyError, ValueError) as exc:
                raise UnsupportedCheckpointError(f"GPTQ layer {name!r}: {exc}") from None
            return self.shared_perm(module.to(dtype))

        sym = "symmetric" if self.sym else "asymmetric"
        act_order = ", act-order" if self.desc_act else ""
        desc = f"GPTQ ({self.format}) 4-bit {sym}, group size {group}{act_order} (as AWQ)"
        return LayerPlan(name, desc, tuple(tensors.values()), placeholder, load)

    def _plan_int8(self, name: str, linear: nn.Linear, tensors: dict[str, str], dtype: torch.dtype) -> LayerPlan:
        """8-bit per-channel symmetric GPTQ -> ``W8A16Linear`` (see the module doc)."""
        K, N = linear.in_features, linear.out_features
        if K % 4 or N % 4:
            raise UnsupportedCheckpointError(f"{name}: {K} -> {N} layer; 8-bit GPTQ here needs K and N multiples of 4")
        with torch.device("meta"):
            placeholder = W8A16Linear(K, N, bias="bias" in tensors, dtype=dtype)

        def load(t: dict[str, torch.Tensor]) -> nn.Module:
            qweight = check_tensor(tensors["qweight"], t["qweight"], dtypes=(torch.int32,), shapes=[(K // 4, N)])
            qzeros = check_tensor(tensors["qzeros"], t["qzeros"], dtypes=(torch.int32,), shapes=[(1, N // 4)])
            scales = check_tensor(tensors["scales"], t["scales"], dtypes=(*HALF, torch.float32), shapes=[(1, N)])
            if "g_idx" in t:
                g_idx = check_tensor(tensors["g_idx"], t["g_idx"], dtypes=(torch.int32, torch.int64), shapes=[(K,)])
                if bool((g_idx != 0).any()):
                    raise UnsupportedCheckpointError(
                        f"checkpoint tensor {tensors['g_idx']!r} holds group indices outside [0, 1) "
                        "(group_size -1: one group)")
            z = unpack_bytes(v1_to_v2_zeros(qzeros, 8) if self.v1 else qzeros)  # [1, N]
            off = (z != INT8_ZERO).nonzero()
            if off.numel():
                n = int(off[0, 1])
                raise UnsupportedCheckpointError(
                    f"checkpoint tensor {tensors['qzeros']!r} stores zero point {int(unpack_bytes(qzeros)[0, n])} "
                    f"for output channel {n}; "
                    f"8-bit symmetric GPTQ ({self.format}) stores {INT8_ZERO - (1 if self.v1 else 0)} for every "
                    "channel (int8 weight-only has no zero point)")
            q = unpack_bytes(qweight.t().contiguous())  # [N, K]: column 4r + j from bits 8j of qweight[r]
            state = {"weight": (q - INT8_ZERO).to(torch.int8), "weight_scale": scales.reshape(N)}
            if "bias" in t:
                state["bias"] = t["bias"]
            try:
                return W8A16Linear.from_state_dict(state, dtype=dtype)
            except (KeyError, ValueError) as exc:
                raise UnsupportedCheckpointError(f"GPTQ layer {name!r}: {exc}") from None

        desc = f"GPTQ ({self.format}) 8-bit symmetric, per-channel (as int8 weight-only, W8A16)"
        return LayerPlan(name, desc, tuple(tensors.values()), placeholder, load)
