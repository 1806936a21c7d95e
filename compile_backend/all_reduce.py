"""The all-reduce of row-parallel layers at NVLink latency: torch's symmetric-memory one-shot and two-shot
all-reduce on a buffer every rank registers once, NCCL for the rest.

At decode sizes (a few tokens x hidden) an all-reduce is latency-bound: NCCL's ring protocol costs
10-20 us per call where every rank reading its peers' buffers directly over NVLink takes a few.  torch's
symmetric memory (``torch.distributed._symmetric_memory``) gives both kernels, which run inside CUDA
graphs: *one-shot* (each rank reads every peer's whole input and sums it: one step, ``world`` times the
bytes) and *two-shot* (reduce-scatter then all-gather over the peers' buffers: two steps, the bytes once).
Both need their input in memory every rank has mapped, so ``enable(group, device)`` allocates one buffer
per group and device and registers it with the peers (a collective: every rank calls it, as
``tensor_parallel`` does), and ``quantfuse::symm_all_reduce`` copies its input there first:

* one-shot: ``symm_mem.one_shot_all_reduce_copy`` (the copy and the sum in one kernel) up to
  ``ONE_SHOT_MAX_BYTES``; float16, which torch's kernels do not take, through our own one-shot kernel
  (``quantfuse::_one_shot_all_reduce_cuda``, csrc/all_reduce/: the same algorithm on the same buffer
  and signal pads);
* two-shot (bfloat16, float32): a copy into the buffer, ``symm_mem.two_shot_all_reduce_out``, up to the
  buffer's size;
* larger inputs (float16: past one-shot), CPU tensors, groups without a buffer: NCCL (``all_reduce`` in
  ``RowParallelLinear``, the functional collective ``torch.compile`` traces).

The kernels synchronise the ranks on entry and on exit (signal pads), so one buffer serves every call in
turn.  The sum is computed in the same order on every rank, so all ranks hold the same result; it can
differ from NCCL's in the last bit of a half-precision sum over more than two ranks (another order).
The thresholds are the measured crossovers on H200s (benchmarks/bench_all_reduce.py);
``QUANTFUSE_ALL_REDUCE=nccl`` keeps every all-reduce on NCCL.
"""

from __future__ import annotations

import logging
import os

import torch
import torch.distributed as dist

log = logging.getLogger("quantfuse.all_reduce")

# Crossovers measured with benchmarks/bench_all_reduce.py inside CUDA graphs (H200, NVLink, bfloat16): one-shot
# is faster than NCCL up to 1 MB on 2 ranks and 512 KB on 4, two-shot faster than both from there to 4 MB (the
# largest size measured).
ONE_SHOT_MAX_BYTES = 512 * 1024
BUFFER_BYTES = 4 * 1024 * 1024  # two-shot up to this; NCCL beyond
# torch's symmetric-memory all-reduce kernels take float32 and bfloat16; float16 runs our one-shot kernel
DTYPES = (torch.float16, torch.bfloat16, torch.float32)
ENV = "QUANTFUSE_ALL_REDUCE"  # "nccl": no symmetric-memory all-reduce

# (group name, device index) -> the registered buffer (uint8, BUFFER_BYTES) and its handle
_BUFFERS: dict[tuple[str, int], torch.Tensor] = {}
_HANDLES: dict[tuple[str, int], object] = {}
# Whether our float16 one-shot kernel is loaded (set by enable; without it float16 stays on NCCL).
_HALF_KERNEL = False
_WARNED: set[tuple] = set()  # what the op's NCCL fallback has logged (once each)


def enabled_by_env() -> bool:
    value = os.environ.get(ENV, "").strip().lower()
    if value not in ("", "nccl", "symm_mem"):
        raise ValueError(f"{ENV}={value!r}; expected 'nccl' (NCCL only) or 'symm_mem' (the default)")
    return value != "nccl"


def enable(group: dist.ProcessGroup, device: torch.device) -> bool:
    """Allocate and register this rank's symmetric buffer for ``group`` on ``device`` (a collective: every
    rank of the group must call it).  Returns whether the low-latency all-reduce serves ``group`` there;
    False where it cannot: not a CUDA device, one rank, a group without NCCL, the environment says NCCL, or
    torch's symmetric memory is unavailable or fails to register (logged)."""
    device = torch.device(device)
    # NCCL's group: one rank per GPU (a gloo group may put several ranks on one device)
    if (device.type != "cuda" or dist.get_world_size(group) < 2 or "nccl" not in str(dist.get_backend(group))
            or not enabled_by_env()):
        return False
    key = (group.group_name, device.index if device.index is not None else torch.cuda.current_device())
    if key in _BUFFERS:
        return True
    try:
        from torch.distributed import _symmetric_memory as symm_mem

        buf = symm_mem.empty(BUFFER_BYTES, dtype=torch.uint8, device=torch.device("cuda", key[1]))
        handle = symm_mem.rendezvous(buf, group.group_name)
    except Exception as exc:  # no P2P access, a torch built without it: NCCL serves every call
        log.warning("quantfuse: symmetric-memory all-reduce unavailable for group %s (%s: %s); "
                    "NCCL serves every all-reduce", group.group_name, type(exc).__name__, exc)
        return False
    _BUFFERS[key] = buf
    _HANDLES[key] = handle
    global _HALF_KERNEL
    from .kernels.loader import ensure_loaded

    _HALF_KERNEL = ensure_loaded() and hasattr(torch.ops.quantfuse, "_one_shot_all_reduce_cuda")
    log.info("quantfuse: symmetric-memory all-reduce for group %s on cuda:%d (%d ranks; one-shot up to "
             "%d KB, two-shot up to %d KB)", group.group_name, key[1], dist.get_world_size(group),
             ONE_SHOT_MAX_BYTES // 1024, BUFFER_BYTES // 1024)
    return True


def _buffer(group_name: str, device: torch.device) -> torch.Tensor | None:
    return _BUFFERS.get((group_name, device.index if device.index is not None else -1))


def fits(x: torch.Tensor) -> bool:
    """Whether ``symm_all_reduce`` takes ``x`` on a group with a buffer (else NCCL): shape and dtype alone,
    so that under ``torch.compile`` it is a constant of the trace (static shapes) or a guard on the size."""
    if x.dtype == torch.float16 and not _HALF_KERNEL:
        return False
    nbytes = x.numel() * x.element_size()
    most = ONE_SHOT_MAX_BYTES if x.dtype == torch.float16 else BUFFER_BYTES  # no two-shot of our own
    return x.device.type == "cuda" and x.dtype in DTYPES and 0 < nbytes <= most and nbytes % 16 == 0


@torch.library.custom_op("quantfuse::symm_all_reduce", mutates_args=())
def symm_all_reduce(x: torch.Tensor, group_name: str) -> torch.Tensor:
    """The sum of ``x`` over the ranks of ``group_name``, through the group's symmetric buffer (see the
    module doc); ``x`` as ``fits`` says, on a group ``enable`` registered."""
    buf = _buffer(group_name, x.device)
    if buf is None or not fits(x):  # e.g. a module moved to another device after it was sharded
        key = (group_name, str(x.device), x.dtype, tuple(x.shape))
        if key not in _WARNED:
            _WARNED.add(key)
            log.warning("quantfuse.symm_all_reduce: NCCL runs: no symmetric buffer of group %s takes a %s %s "
                        "tensor of shape %s", *key)
        out = x.clone(memory_format=torch.contiguous_format)
        dist.all_reduce(out, group=dist.distributed_c10d._resolve_process_group(group_name))
        return out
    x = x.contiguous()
    if x.dtype == torch.float16:
        handle = _HANDLES[(group_name, x.device.index)]
        return torch.ops.quantfuse._one_shot_all_reduce_cuda(x, buf, handle.buffer_ptrs_dev,
                                                             handle.signal_pad_ptrs_dev, handle.rank,
                                                             handle.world_size)
    staged = buf.view(x.dtype)[: x.numel()].view(x.shape)
    if x.numel() * x.element_size() <= ONE_SHOT_MAX_BYTES:
        return torch.ops.symm_mem.one_shot_all_reduce_copy(staged, x, "sum", group_name)
    staged.copy_(x)
    return torch.ops.symm_mem.two_shot_all_reduce_out(staged, "sum", group_name, torch.empty_like(x))


@symm_all_reduce.register_fake
def _(x: torch.Tensor, group_name: str) -> torch.Tensor:
    return torch.empty_like(x, memory_format=torch.contiguous_format)


__all__ = ["BUFFER_BYTES", "ENV", "ONE_SHOT_MAX_BYTES", "enable", "fits", "symm_all_reduce"]
