"""Tensor parallelism for quantized models: shard ``W8A8Linear``, ``W8A16Linear``, ``AWQLinear`` and ``nn.Linear``.

``tensor_parallel(model, group, plan)`` replaces each linear the plan names with this rank's shard:

* ``"colwise"``: output features ``N`` split over the ranks.  Everything that follows ``N`` is split with
  the weight: W8A8 and W8A16 per-channel ``weight_scale`` and ``bias``; AWQ ``qweight``/``qzeros`` columns (``N/8``
  packed) and ``scales``/``bias`` columns.  Per-tensor and activation scales are replicated.  No
  collective: the next layer reads the shard (attention heads, the SwiGLU product).
* ``"rowwise"``: input features ``K`` split; the local module computes a partial product without bias,
  ``RowParallelLinear`` all-reduces it (a functional collective, so ``torch.compile`` traces it into the
  graph) and then adds the full bias once.  AWQ groups follow ``K``: a shard holds whole groups
  (``K/ranks`` a multiple of the group size), or lies inside one group (the group size a multiple of
  ``K/ranks``: the shard takes that group's scales and zeros, with ``K/ranks`` as its group size).  A group
  that would straddle two shards otherwise raises ``ValueError`` naming the layer, the group size and the
  shard size; so does an act-order AWQ layer (``perm``: its rows are input channels reordered over the
  whole ``K``), which splits column-wise only, each shard keeping the whole order.

Dynamic activation quantization of a row-parallel W8A8 layer computes its scales over the local ``K``
shard (as every rank quantizes only its slice of the input), so its result differs from the unsharded
layer's by that quantization, not by an error; static scales give the unsharded layer's products.

Under ``backend="quantfuse"`` every shard is the plain form the passes fuse: column-parallel layers as
on one GPU, row-parallel ones as the op without bias, then ``all_reduce`` and ``wait_tensor``, then the
bias add (docs/DESIGN.md, "Tensor parallel").

Attention heads need no change for Hugging Face Llama models: their attention infers the number of
heads from the projection's output (``view(..., -1, head_dim)``), and q and k/v heads are split in
the same ratio.  The number of ranks must divide the number of KV heads.
"""

from __future__ import annotations

import fnmatch

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed import _functional_collectives as funcol

from . import all_reduce
from .derived import HeldParameter
from .ops.awq_gemm import AWQ_PACK
from .quantize.modules import AWQLinear, W8A8Linear, W8A16Linear, set_tensors

COLWISE, ROWWISE = "colwise", "rowwise"

# Hugging Face Llama (and Mistral, Qwen2, ...): Megatron's split of the decoder layer.
LLAMA_PLAN = {
    "*.self_attn.q_proj": COLWISE,
    "*.self_attn.k_proj": COLWISE,
    "*.self_attn.v_proj": COLWISE,
    "*.self_attn.o_proj": ROWWISE,
    "*.mlp.gate_proj": COLWISE,
    "*.mlp.up_proj": COLWISE,
    "*.mlp.down_proj": ROWWISE,
}


class RowParallelLinear(nn.Module):
    """A row-parallel shard: ``all_reduce(local(x)) + bias``; ``local`` has no bias, ``bias`` is the full one.

    ``low_latency``: the group has a symmetric-memory buffer on this rank's device (``all_reduce.enable``),
    and the all-reduces it takes (``all_reduce.fits``: decode sizes) run ``quantfuse::symm_all_reduce``;
    the others, and every one without it, NCCL."""

    def __init__(self, local: nn.Module, bias: torch.Tensor | None, group: dist.ProcessGroup,
                 low_latency: bool = False):
        super().__init__()
        self.local = local
        self.group = group
        self.low_latency = low_latency
        self.in_features = local.in_features  # this rank's share of K
        self.out_features = local.out_features
        if isinstance(bias, HeldParameter):
            # A quantized layer's bias, added here outside its op: nothing is derived from it, and
            # as a plain nn.Parameter it takes what torch does with parameters (nn.Parameter(p),
            # Module._apply's swap path, Dynamo's guards), where a subclass is treated otherwise.
            bias = nn.Parameter(bias.detach(), requires_grad=bias.requires_grad)
        if isinstance(bias, nn.Parameter):
            self.bias = bias
        else:
            self.register_buffer("bias", bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.local(x)
        if self.low_latency and all_reduce.fits(y):
            y = all_reduce.symm_all_reduce(y, self.group.group_name)
        else:
            y = funcol.all_reduce(y, "sum", self.group)
        return y if self.bias is None else y + self.bias

    def extra_repr(self) -> str:
        how = "symmetric memory at decode sizes, else NCCL" if self.low_latency else "the group's backend"
        return f"all_reduce over {dist.get_world_size(self.group)} ranks ({how}), bias={self.bias is not None}"


# --------------------------------------------------------------------------- sharding one layer


def _slice(t: torch.Tensor | None, dim: int, rank: int, size: int) -> torch.Tensor | None:
    """This rank's ``size`` entries along ``dim``, in their own storage (the full tensor can be freed)."""
    if t is None:
        return t
    return t.narrow(dim, rank * size, size).clone(memory_format=torch.contiguous_format)


def _share(name: str, what: str, total: int, ranks: int, multiple: int = 1) -> int:
    """``total / ranks``, checked to be a whole multiple of ``multiple``."""
    if total % ranks != 0 or (total // ranks) % multiple != 0:
        extra = f" into shards that are multiples of {multiple}" if multiple > 1 else ""
        raise ValueError(f"tensor_parallel: layer {name!r}: {what} {total} cannot be split evenly over "
                         f"{ranks} ranks{extra}")
    return total // ranks


def _shard_w8a8(mod: W8A8Linear, name: str, style: str, rank: int, ranks: int):
    K, N = mod.in_features, mod.out_features
    kw = dict(weight_dtype=mod.weight_dtype, per_channel=mod.per_channel, dynamic=mod.dynamic,
              per_token=mod.per_token, symmetric=mod.symmetric, out_dtype=mod.out_dtype)
    shared = dict(input_scale=mod.input_scale, input_zero_point=mod.input_zero_point)
    if style == COLWISE:
        n = _share(name, "out_features", N, ranks)
        with torch.device("meta"):
            local = W8A8Linear(K, n, bias=mod.bias is not None, **kw)
        scale = _slice(mod.weight_scale, 0, rank, n) if mod.per_channel else mod.weight_scale
        return set_tensors(local, weight=_slice(mod.weight, 0, rank, n), weight_scale=scale,
                            bias=_slice(mod.bias, 0, rank, n), **shared), None
    k = _share(name, "in_features", K, ranks)
    with torch.device("meta"):
        local = W8A8Linear(k, N, bias=False, **kw)
    return set_tensors(local, weight=_slice(mod.weight, 1, rank, k), weight_scale=mod.weight_scale,
                        **shared), mod.bias


def _shard_w8a16(mod: W8A16Linear, name: str, style: str, rank: int, ranks: int):
    K, N = mod.in_features, mod.out_features
    kw = dict(per_channel=mod.per_channel, dtype=mod.out_dtype, scale_dtype=mod.weight_scale.dtype)
    if style == COLWISE:
        n = _share(name, "out_features", N, ranks)
        with torch.device("meta"):
            local = W8A16Linear(K, n, bias=mod.bias is not None, **kw)
        scale = _slice(mod.weight_scale, 0, rank, n) if mod.per_channel else mod.weight_scale
        return set_tensors(local, weight=_slice(mod.weight, 0, rank, n), weight_scale=scale,
                           bias=_slice(mod.bias, 0, rank, n)), None
    k = _share(name, "in_features", K, ranks)
    with torch.device("meta"):
        local = W8A16Linear(k, N, bias=False, **kw)
    return set_tensors(local, weight=_slice(mod.weight, 1, rank, k), weight_scale=mod.weight_scale), mod.bias


def _shard_awq(mod: AWQLinear, name: str, style: str, rank: int, ranks: int):
    K, N, G = mod.in_features, mod.out_features, mod.group_size
    dtype = mod.scales.dtype
    if style == COLWISE:
        n = _share(name, "out_features", N, ranks, AWQ_PACK)
        with torch.device("meta"):
            local = AWQLinear(K, n, group_size=G, bias=mod.bias is not None, dtype=dtype,
                              act_order=mod.perm is not None)
        set_tensors(local, qweight=local.held_layout(_slice(mod.awq_qweight(), 1, rank, n // AWQ_PACK)),
                     qzeros=_slice(mod.qzeros, 1, rank, n // AWQ_PACK), scales=_slice(mod.scales, 1, rank, n),
                     bias=_slice(mod.bias, 0, rank, n), perm=_slice(mod.perm, 0, 0, K))
        local.out_dtype = mod.out_dtype
        return local, None
    if mod.perm is not None:
        raise ValueError(f"tensor_parallel: layer {name!r}: an act-order AWQ layer (its input channels reordered "
                         "over the whole K, e.g. a GPTQ desc_act checkpoint) cannot be split row-wise")
    k = _share(name, "in_features", K, ranks)
    if k % G == 0:  # whole groups per shard
        group, rows, first = G, k // G, rank * k // G
    elif G % k == 0:  # the shard lies inside one group
        group, rows, first = k, 1, rank * k // G
    else:
        raise ValueError(f"tensor_parallel: layer {name!r}: AWQ group size {G} and the row-parallel shard of "
                         f"{k} input features (in_features {K} over {ranks} ranks) would put a group across two "
                         f"shards; the shard size must be a multiple or a divisor of the group size")
    with torch.device("meta"):
        local = AWQLinear(k, N, group_size=group, bias=False, dtype=dtype)
    set_tensors(local, qweight=local.held_layout(_slice(mod.awq_qweight(), 0, rank, k)),
                 qzeros=mod.qzeros.narrow(0, first, rows).clone(), scales=mod.scales.narrow(0, first, rows).clone())
    local.out_dtype = mod.out_dtype
    return local, mod.bias


def _shard_linear(mod: nn.Linear, name: str, style: str, rank: int, ranks: int):
    K, N = mod.in_features, mod.out_features
    keep = dict(device="meta", dtype=mod.weight.dtype)
    if style == COLWISE:
        n = _share(name, "out_features", N, ranks)
        local = nn.Linear(K, n, bias=mod.bias is not None, **keep)
        local.weight = nn.Parameter(_slice(mod.weight.detach(), 0, rank, n), mod.weight.requires_grad)
        if mod.bias is not None:
            local.bias = nn.Parameter(_slice(mod.bias.detach(), 0, rank, n), mod.bias.requires_grad)
        return local, None
    k = _share(name, "in_features", K, ranks)
    local = nn.Linear(k, N, bias=False, **keep)
    local.weight = nn.Parameter(_slice(mod.weight.detach(), 1, rank, k), mod.weight.requires_grad)
    return local, mod.bias


_SHARDERS = ((W8A8Linear, _shard_w8a8), (W8A16Linear, _shard_w8a16), (AWQLinear, _shard_awq),
             (nn.Linear, _shard_linear))


def shard_linear(module: nn.Module, style: str, group: dist.ProcessGroup, name: str = "linear",
                 low_latency: bool = False) -> nn.Module:
    """This rank's shard of one linear layer: the local module (column-wise) or a ``RowParallelLinear``
    (``low_latency``: see there; the caller has called ``all_reduce.enable`` for the group)."""
    if style not in (COLWISE, ROWWISE):
        raise ValueError(f"tensor_parallel: layer {name!r}: style {style!r}; expected {COLWISE!r} or {ROWWISE!r}")
    sharder = next((fn for cls, fn in _SHARDERS if isinstance(module, cls)), None)
    if sharder is None or getattr(module, "_tp_shard", None) is not None:
        what = "already a shard" if sharder is not None else f"a {type(module).__name__}"
        raise TypeError(f"tensor_parallel: layer {name!r} is {what}; expected an unsharded W8A8Linear, "
                        "W8A16Linear, AWQLinear or nn.Linear")
    rank, ranks = dist.get_rank(group), dist.get_world_size(group)
    local, bias = sharder(module, name, style, rank, ranks)
    local._tp_shard = (style, rank, ranks)  # this rank's part of a layer: sharding it again is an error
    return local if style == COLWISE else RowParallelLinear(local, bias, group, low_latency)


# --------------------------------------------------------------------------- the model


def _resolve_group(mesh_or_group) -> dist.ProcessGroup:
    if mesh_or_group is None:
        if not dist.is_initialized():
            raise RuntimeError("tensor_parallel: torch.distributed is not initialized; call "
                               "torch.distributed.init_process_group first or pass a DeviceMesh")
        return dist.group.WORLD
    if isinstance(mesh_or_group, dist.ProcessGroup):
        return mesh_or_group
    from torch.distributed.device_mesh import DeviceMesh

    if isinstance(mesh_or_group, DeviceMesh):
        if mesh_or_group.ndim != 1:
            raise ValueError(f"tensor_parallel: mesh_or_group is a {mesh_or_group.ndim}-D DeviceMesh; expected a "
                             "1-D mesh (pass mesh['tp'] of a larger mesh)")
        return mesh_or_group.get_group()
    raise TypeError(f"tensor_parallel: mesh_or_group is a {type(mesh_or_group).__name__}; expected a 1-D "
                    "DeviceMesh, a ProcessGroup or None (the default group)")


def _device_of(model: nn.Module) -> torch.device:
    for t in (*model.parameters(), *model.buffers()):
        if not t.is_meta:
            return t.device
    return torch.device("cpu")


def tensor_parallel(model: nn.Module, mesh_or_group=None, plan: dict | None = None, *,
                    low_latency: bool = True) -> nn.Module:
    """Shard ``model``'s linear layers over ``mesh_or_group`` in place, as ``plan`` says; returns the model.

    ``plan`` maps module-name patterns (``fnmatch``, matched against the qualified name) to ``"colwise"``
    or ``"rowwise"``; the default is ``LLAMA_PLAN``.  Every rank must call this on the same model (same
    weights).  Every layer is checked and sharded before any is swapped in, so an error (a size the
    ranks do not divide, an AWQ group across shards) leaves the model unchanged.  A plan that matches
    no layer raises ``ValueError``.

    ``low_latency``: on CUDA, the row-parallel all-reduces of decode sizes run torch's symmetric-memory
    one-shot / two-shot kernels (``compile_backend.all_reduce``), larger ones NCCL.  Registering the
    buffer is a collective, once per group and device: every rank calls this with the same value (the
    environment's ``QUANTFUSE_ALL_REDUCE=nccl`` turns it off everywhere).
    """
    group = _resolve_group(mesh_or_group)
    plan = LLAMA_PLAN if plan is None else plan
    todo = []
    for qualified, module in model.named_modules():
        styles = {style for pattern, style in plan.items() if fnmatch.fnmatchcase(qualified, pattern)}
        if not styles:
            continue
        if len(styles) > 1:
            raise ValueError(f"tensor_parallel: layer {qualified!r} matches patterns of several styles "
                             f"{sorted(styles)}")
        todo.append((qualified, module, styles.pop()))
    if not todo:
        raise ValueError(f"tensor_parallel: the plan's patterns {sorted(plan)} match no module of the model")
    low_latency = low_latency and all_reduce.enable(group, _device_of(model))
    made = [(qualified, shard_linear(module, style, group, qualified, low_latency))
            for qualified, module, style in todo]
    for qualified, shard in made:
        parent_name, _, attr = qualified.rpartition(".")
        setattr(model.get_submodule(parent_name), attr, shard)
    return model


__all__ = ["COLWISE", "LLAMA_PLAN", "ROWWISE", "RowParallelLinear", "shard_linear", "tensor_parallel"]
