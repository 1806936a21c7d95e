"""compile_backend.derived.tensor_cache: values derived from tensors, computed once per tensor
(weight_colsum's CPU implementation uses it; on CUDA the kernels' library keeps its own cache,
csrc/common/derived_cache.*, tested in test_cuda_dispatch.py)."""

from __future__ import annotations

import gc

import torch

from compile_backend.derived.tensor_cache import TensorCache


def test_hit_for_the_same_data_and_miss_after_in_place_write():
    cache = TensorCache()
    w = torch.arange(12, dtype=torch.float32).reshape(3, 4)
    first = cache.get((w,), lambda: w.sum(0))
    assert cache.get((w,), lambda: w.sum(0) * 0) is first  # served, not recomputed
    # another tensor object over the same data hits too
    assert cache.get((w.view(3, 4),), lambda: w.sum(0) * 0) is first
    assert cache.stats == {"computed": 1, "hits": 2}
    w[0, 0] = 100.0  # in-place write: the version counter moves
    second = cache.get((w,), lambda: w.sum(0))
    assert second is not first and second[0].item() == 100.0 + 4 + 8
    assert cache.stats == {"computed": 2, "hits": 2}


def test_every_source_and_the_extra_key_count():
    cache = TensorCache()
    a, b = torch.ones(4), torch.ones(4)
    v = cache.get((a, b), lambda: a + b, extra=(128,))
    assert cache.get((a, b), lambda: a - b, extra=(64,)) is not v  # other extra: other entry
    b.mul_(2)  # the second source changes
    assert torch.equal(cache.get((a, b), lambda: a + b, extra=(128,)), torch.full((4,), 3.0))
    assert cache.get((a, b.clone()), lambda: a * 0, extra=(128,)).sum().item() == 0  # other data


def test_entry_dropped_with_its_tensor_and_views_differ_by_geometry():
    cache = TensorCache()
    w = torch.randn(8, 8)
    top = w[:4]
    cache.get((w,), w.sum)
    cache.get((top,), top.sum)  # a different view of the same storage: its own entry
    assert len(cache) == 2
    del top  # (a view keeps its base alive, not the other way round)
    gc.collect()
    assert len(cache) == 1
    assert cache.get((w,), w.mean) is not None and cache.stats["hits"] == 1
    del w
    gc.collect()
    assert len(cache) == 0
    cache.get((torch.ones(2),), lambda: 0)
    cache.clear()
    assert len(cache) == 0 and cache.stats == {"computed": 0, "hits": 0}
