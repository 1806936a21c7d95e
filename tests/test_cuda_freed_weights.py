"""GPU tests of compile_backend/derived/freed_weights.py with the derived-value cache
(csrc/common/derived_cache.cpp): the values made from a weight are freed as the weight is, with
no later call of ours in between; values made from such values (the repacked layout of a
concatenation) go with them.

Skipped without CUDA.
"""

from __future__ import annotations

import gc

import pytest
import torch
from conftest import awq_layout_held
from torch import nn

from compile_backend.derived import freed_weights
from compile_backend.quantize import quantize_model

pytestmark = pytest.mark.gpu


def allocated() -> int:
    """Bytes held by live tensors.  A derived value is made on a side stream and recorded on the
    caller's, so the allocator frees its block only once it has processed that stream's event (at
    its next allocation, or here: ``empty_cache`` processes the events first)."""
    gc.collect()
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    return torch.cuda.memory_allocated()


def test_concatenation_goes_with_its_parts(cuda_kernels):
    parts = [torch.randint(-128, 128, (n, 4096), dtype=torch.int8, device="cuda") for n in (4096, 1024, 1024)]
    part_bytes = sum(p.nbytes for p in parts)
    freed_weights.watch(parts)  # as a compiled graph taking them does
    out = torch.ops.quantfuse.concat_weights(parts, 0)
    assert out.shape == (6144, 4096)
    del out  # the cache keeps its own reference
    before = allocated()
    del parts
    freed = before - allocated()
    assert freed >= 2 * part_bytes, (freed, part_bytes)  # the parts and their concatenation


def test_awq_module_takes_its_layouts_along(cuda_kernels):
    """An AWQ-layout linear's repacked (decode) and prepared (Hopper prefill) layouts are freed with it,
    not at the cache's next miss."""
    torch.manual_seed(0)
    model = quantize_model(nn.Sequential(nn.Linear(4096, 4096, bias=False)).to("cuda", torch.float16), "awq")
    layer = awq_layout_held(model[0])
    weight_bytes = sum(t.nbytes for t in (layer.qweight, layer.scales, layer.qzeros))
    del layer
    with torch.no_grad():
        model(torch.randn(1, 4096, device="cuda", dtype=torch.float16))  # decode: the repacked layout
        model(torch.randn(128, 4096, device="cuda", dtype=torch.float16))  # prefill (Hopper: prepared)
    before = allocated()
    del model
    freed = before - allocated()
    # the weights and at least the repacked layout (as large as qweight)
    assert freed >= weight_bytes + 4096 * 4096 // 2, (freed, weight_bytes)
