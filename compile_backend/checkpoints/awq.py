"""AWQ checkpoints (``quant_method: awq``): AutoAWQ's and transformers' ``gemm`` format -> ``AWQLinear``.

AutoAWQ writes ``{"quant_method": "awq", "bits": 4, "group_size": G, "zero_point": true,
"version": "gemm"}``; transformers' ``AwqConfig`` writes the same keys (``format`` besides
``version``) plus GPTQ-style ones (``desc_act``, ``sym``, ...).  Each quantized linear stores
``qweight`` ``[K, N/8]`` int32, ``qzeros`` ``[K/G, N/8]`` int32 and ``scales`` ``[K/G, N]`` float16
(AWQ bit order), and ``bias`` when it has one.  A linear is quantized exactly when the checkpoint
holds its ``qweight``; ``AWQLinear.from_state_dict`` checks and loads each layer bit-exactly.
"""

from __future__ import annotations

import torch
from torch import nn

from ..quantize.modules import AWQLinear
from .common import LayerPlan, UnsupportedCheckpointError, check_layer_tensors, unsupported

LAYER_TENSORS = {"qweight", "qzeros", "scales", "bias", "g_idx"}


class AWQFormat:
    """Reads one ``quantization_config`` of ``quant_method: awq``."""

    method = "awq"

    def __init__(self, qcfg: dict):
        def no(key, value, scheme):
            unsupported("quantization_config", key, value, scheme)

        bits = qcfg.get("bits", qcfg.get("w_bit", 4))
        if bits != 4:
            no("bits", bits, f"{bits}-bit AWQ (only 4-bit)")
        version = str(qcfg.get("version") or qcfg.get("format") or "gemm").lower()
        if version != "gemm":
            no("version", version, f"the AWQ {version!r} weight layout (only 'gemm')")
        if not qcfg.get("zero_point", True):
            no("zero_point", False, "AWQ without zero points")
        if qcfg.get("desc_act"):
            no("desc_act", True, "activation ordering (act-order)")
        group = qcfg.get("group_size", qcfg.get("q_group_size", 128))
        if not isinstance(group, int) or not (group > 0 or group == -1):
            no("group_size", group, "this group size (expected a positive integer or -1)")
        self.group_size = group

    def skipped_keys(self, keys) -> set[str]:
        return set()

    def plan(self, name: str, linear: nn.Linear, tensors: dict[str, str], dtype: torch.dtype) -> LayerPlan | None:
        if "qweight" not in tensors:
            return None
        check_layer_tensors(name, tensors, LAYER_TENSORS, ("qzeros", "scales"), "an AWQ gemm layer", "AWQ")
        K, N = linear.in_features, linear.out_features
        group = K if self.group_size == -1 else self.group_size
        act = dtype if dtype in (torch.float16, torch.bfloat16) else torch.float16
        try:
            with torch.device("meta"):
                placeholder = AWQLinear(K, N, group_size=group, bias="bias" in tensors, dtype=act)
        except ValueError as exc:
            raise UnsupportedCheckpointError(f"AWQ layer {name!r}: {exc}") from None

        def load(t: dict[str, torch.Tensor]) -> nn.Module:
            try:
                module = AWQLinear.from_state_dict(t, group_size=group)
            except (KeyError, ValueError) as exc:
                raise UnsupportedCheckpointError(f"AWQ layer {name!r}: {exc}") from None
            if (module.in_features, module.out_features) != (K, N):
                raise UnsupportedCheckpointError(
                    f"checkpoint tensor {tensors['qweight']!r} describes a {module.in_features} -> "
                    f"{module.out_features} layer; the model's {name!r} is {K} -> {N}")
            # The model's dtype: scales convert to float16/bfloat16, or stay as stored for float32
            # (AWQLinear then casts its input and output, see its class doc).
            return module.to(dtype)

        return LayerPlan(name, f"AWQ gemm 4-bit, group size {group}", tuple(tensors.values()), placeholder, load)
