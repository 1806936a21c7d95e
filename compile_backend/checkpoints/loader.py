"""``from_pretrained``: a quantized Hugging Face checkpoint as a transformers model holding quantfuse modules."""

from __future__ import annotations

import logging
import os
import re
from collections import Counter

import torch

from ..quantize.act_order import fold_mlp_orders
from ..quantize.merged import share_input_storage
from . import files
from . import model as skeleton_ops
from .awq import AWQFormat
from .common import UnsupportedCheckpointError, by_module, parse_dtype
from .compressed_tensors import CompressedTensorsFormat
from .gptq import GPTQFormat

log = logging.getLogger("quantfuse.checkpoints")

FORMATS = {"compressed-tensors": CompressedTensorsFormat, "awq": AWQFormat, "gptq": GPTQFormat}
# Tensors that only a quantized layer reads: left over, they mean a layer was loaded without them.
QUANTIZATION_SUFFIXES = ("weight_scale", "weight_zero_point", "input_scale", "input_zero_point", "weight_packed",
                         "weight_shape", "qweight", "qzeros", "scales", "g_idx")
# Tensors older checkpoints hold that current models compute themselves.
IGNORED = re.compile(r"(^|\.)(rotary_emb\.inv_freq|position_ids)$")


def checkpoint_format(qcfg):
    if not isinstance(qcfg, dict):
        raise UnsupportedCheckpointError(f"config.json's quantization_config is {qcfg!r}; expected a mapping")
    method = qcfg.get("quant_method")
    if method not in FORMATS:
        raise UnsupportedCheckpointError(
            f"quantization_config.quant_method = {method!r} is not supported by quantfuse's loader; "
            f"expected one of {sorted(FORMATS)}")
    return FORMATS[method](qcfg)


def from_pretrained(path, dtype=None, device=None, mesh=None, tp_plan=None):
    """Load a quantized checkpoint into a transformers model whose quantized linears are
    ``W8A8Linear`` / ``AWQLinear`` / ``W8A16Linear``, ready for ``torch.compile(model, backend="quantfuse")``.

    ``path``: a checkpoint folder (``config.json`` and ``model.safetensors`` or sharded
    ``model.safetensors.index.json``), or a Hugging Face Hub id (downloaded with
    ``huggingface_hub``).  Formats: compressed-tensors ``int-quantized`` / ``float-quantized``
    (W8A8 int8 and FP8: per-tensor or per-channel weights; dynamic per-token or per-tensor, or
    static, activations; symmetric or asymmetric int8 activations) and ``pack-quantized`` (4-bit
    weight-only, as ``AWQLinear``), AWQ ``gemm`` (``quant_method: awq``, from AutoAWQ or
    transformers) and GPTQ (``quant_method: gptq``, formats ``gptq`` and ``gptq_v2``): 4-bit, act-order
    included, repacked into ``AWQLinear``; 8-bit per-channel symmetric into ``W8A16Linear``.
    ``dtype``: the activation dtype of the model (its unquantized weights, the layers' outputs);
    default (or ``"auto"``) the config's ``dtype`` / ``torch_dtype``.  ``device``: where the tensors
    are read to (default CPU).
    ``mesh``: a 1-D ``DeviceMesh`` or a process group to shard the loaded model over with
    ``compile_backend.tensor_parallel.tensor_parallel(model, mesh, tp_plan)``; every rank loads the
    checkpoint, then keeps its shards.

    Unquantized tensors the model class keeps in float32 (transformers' ``_keep_in_fp32_modules``
    for float16, ``_keep_in_fp32_modules_strict`` for float16 and bfloat16) are loaded in float32.

    The model is built without weights and filled shard by shard: nothing is materialised in
    full precision.  A scheme no quantfuse module holds raises ``UnsupportedCheckpointError``
    naming the config key or tensor.  transformers and safetensors are needed (the ``hf`` extra).
    """
    folder = files.resolve(path)
    raw = files.read_config(folder)
    qcfg = raw.get("quantization_config")
    if qcfg is None:
        raise UnsupportedCheckpointError(
            f"from_pretrained: {folder!r}'s config.json has no quantization_config; load unquantized "
            "checkpoints with transformers' own from_pretrained")
    fmt = checkpoint_format(qcfg)
    if dtype is not None and dtype != "auto":
        dtype = parse_dtype(dtype, "from_pretrained: dtype")
    else:
        stored = raw.get("dtype") or raw.get("torch_dtype") or "float32"
        dtype = parse_dtype(stored, "config.json's dtype")
    device = torch.device(device if device is not None else "cpu")

    import transformers

    config = transformers.AutoConfig.from_pretrained(folder)
    if hasattr(config, "quantization_config"):
        # The layers hold the quantization now; transformers must not apply its own quantizer.
        del config.quantization_config
    model = skeleton_ops.skeleton(config, dtype)

    shard_keys = files.shards(folder)
    keys = {k for ks in shard_keys.values() for k in ks}
    skipped = fmt.skipped_keys(keys)
    plans, owner, modules = {}, {}, by_module(keys)
    kept = skeleton_ops.keep_in_fp32(model, dtype)
    for name, linear in skeleton_ops.linears(model):
        plan = fmt.plan(name, linear, modules.get(name, {}), dtype)
        if plan is not None:
            if kept is not None and kept.search(name):
                log.info("from_pretrained: %s is quantized: %s's float32 rule for it does not apply", name,
                         type(model).__name__)
            plans[name] = plan
            owner.update({k: plan for k in plan.keys})
            skeleton_ops.replace(model, name, plan.placeholder)
    if kept is not None:
        upcast = skeleton_ops.upcast_kept(model, kept, plans)
        if upcast:
            log.info("from_pretrained: kept in float32 as %s asks: %s", type(model).__name__, upcast)
    if not plans:
        raise UnsupportedCheckpointError(
            f"from_pretrained: no linear layer of {type(model).__name__} is quantized in {folder!r} "
            f"({fmt.method} checkpoint)")

    pending: dict[str, dict[str, torch.Tensor]] = {name: {} for name in plans}
    unexpected = []
    for key, tensor in files.read_shards(folder, shard_keys, device):
        if key in skipped:
            continue
        plan = owner.get(key)
        if plan is not None:
            got = pending[plan.name]
            got[key[len(plan.name) + 1:]] = tensor
            if len(got) == len(plan.keys):  # a layer's tensors may span shards
                skeleton_ops.replace(model, plan.name, plan.load(pending.pop(plan.name)))
            continue
        where = skeleton_ops.slot(model, key)
        if where is None:
            unexpected.append(key)
        else:
            skeleton_ops.set_tensor(key, where, tensor)

    quantized_leftovers = [k for k in unexpected if k.rpartition(".")[2] in QUANTIZATION_SUFFIXES]
    if quantized_leftovers:
        raise UnsupportedCheckpointError(
            f"from_pretrained: checkpoint tensors {quantized_leftovers[:5]} belong to no quantized linear layer "
            "of the model (a quantized module of another kind, e.g. AWQ scaled activations or fused experts, "
            "is not supported)")
    ignore = [re.compile(p) for p in getattr(model, "_keys_to_ignore_on_load_unexpected", None) or ()]
    noted = [k for k in unexpected if not IGNORED.search(k) and not any(p.search(k) for p in ignore)]
    if noted:
        log.warning("from_pretrained: %d checkpoint tensors are not used by %s: %s", len(noted),
                    type(model).__name__, noted[:10])
    skeleton_ops.tie(model)
    missing = skeleton_ops.missing(model)
    if missing:
        raise UnsupportedCheckpointError(
            f"from_pretrained: the checkpoint in {folder!r} lacks tensors the model needs: {missing[:10]}"
            + (f" and {len(missing) - 10} more" if len(missing) > 10 else ""))

    if os.path.isfile(os.path.join(folder, "generation_config.json")):
        model.generation_config = transformers.GenerationConfig.from_pretrained(folder)
    model.to(device).eval()
    fold_mlp_orders(model)  # act-order: down_proj's gather moved into gate/up's columns where it can be
    counts = Counter(p.scheme for p in plans.values())
    log.info("loaded %s: %s", folder, "; ".join(f"{n} x {s}" for s, n in counts.items()))
    if mesh is not None:
        from ..tensor_parallel import tensor_parallel

        tensor_parallel(model, mesh, tp_plan)
    # The projections that share an input as views of one merged tensor (quantize/merged.py).
    share_input_storage(model)
    return model
