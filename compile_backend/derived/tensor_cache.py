"""A cache of values derived from tensors (repacked weights, column sums), made once per
weight and never per call.

An entry is keyed by where its source tensors' data lives (data pointer, shape, strides,
dtype, device), so any tensor object viewing the same data finds it.  It is
served only while each source's version counter is unchanged (an in-place write anywhere
in the storage bumps it) and the tensors it was made from are alive; it is dropped when
the first of them is freed, so memory reused by a new tensor never hits.  Values made
while a CUDA graph is being captured are not kept (their memory belongs to the graph's
pool).

CUDA graphs: CUDA-graph trees warm a graph up with every allocation of the calling thread
routed into the graph's private pool, and refuse to record when a pool block outlives the
warm-up without being an output.  So a value of CUDA sources is made on a worker thread, on a
side stream ordered after the caller's, which allocates from the ordinary pool (as
csrc/common/derived_cache.h does for the kernels' layouts).
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Callable, Sequence

import torch


def _where(t: torch.Tensor) -> tuple:
    # data_ptr() includes the storage offset; ~1 µs per tensor on the host, paid per call
    return (t.data_ptr(), t.shape, t.stride(), t.dtype, t.device)


def _made_outside_graph_pool(make: Callable[[], object], device: torch.device):
    """``make()`` on a worker thread (the allocator routes only the calling thread into a CUDA-graph
    pool), on a side stream after the caller's; the caller's stream waits for it, and the values'
    memory is marked as used there."""
    caller = torch.cuda.current_stream(device)
    grad = torch.is_grad_enabled()
    result: dict[str, object] = {}

    def work():
        try:
            with torch.cuda.device(device), torch.set_grad_enabled(grad):
                side = torch.cuda.Stream(device)
                side.wait_stream(caller)
                with torch.cuda.stream(side):
                    result["value"] = make()
                caller.wait_stream(side)
        except BaseException as exc:  # raised again on the caller's thread
            result["error"] = exc

    worker = threading.Thread(target=work, name="quantfuse-derived")
    worker.start()
    worker.join()
    if "error" in result:
        raise result["error"]
    value = result["value"]
    for t in value if isinstance(value, (tuple, list)) else (value,):
        if isinstance(t, torch.Tensor) and t.is_cuda:
            t.record_stream(caller)
    return value


class TensorCache:
    def __init__(self) -> None:
        self._entries: dict[tuple, tuple] = {}
        self._lock = threading.Lock()
        # how many values were computed and how many were served from the cache (tests read it)
        self.stats = {"computed": 0, "hits": 0}

    def get(self, tensors: Sequence[torch.Tensor], make: Callable[[], object], extra: tuple = ()):
        """The cached value for ``tensors`` (and the hashable ``extra``), else ``make()``'s."""
        key = tuple(_where(t) for t in tensors) + extra
        versions = tuple(t._version for t in tensors)
        entry = self._entries.get(key)
        if entry is not None:
            refs, e_versions, value = entry
            if e_versions == versions and all(r() is not None for r in refs):
                self.stats["hits"] += 1
                return value
        if torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
            self.stats["computed"] += 1
            return make()  # part of the graph: made again on every replay
        device = tensors[0].device
        value = make() if device.type != "cuda" else _made_outside_graph_pool(make, device)
        self.stats["computed"] += 1
        with self._lock:
            if key not in self._entries:
                weakref.finalize(tensors[0], self._drop, key)
            self._entries[key] = (tuple(weakref.ref(t) for t in tensors), versions, value)
        return value

    def __len__(self) -> int:
        return len(self._entries)

    def _drop(self, key: tuple) -> None:
        with self._lock:
            self._entries.pop(key, None)

    def clear(self) -> None:
        """Drops every entry and zeroes the counts."""
        with self._lock:
            self._entries.clear()
            self.stats.update(computed=0, hits=0)
