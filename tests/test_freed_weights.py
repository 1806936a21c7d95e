"""compile_backend/derived/freed_weights.py on the CPU: which tensors get a finalizer, that each gets one,
and that it asks the cache to drop the values made from its tensor once that tensor is freed,
for our quantized modules' weights and for the integer tensors a compiled graph takes.  (The
GPU side, values actually freed: tests/test_cuda_freed_weights.py.)"""

from __future__ import annotations

import gc

import pytest
import torch
from torch import nn

from compile_backend.derived import freed_weights
from compile_backend.quantize import quantize_model


@pytest.fixture
def on_cpu(monkeypatch):
    """Every integer/fp8 tensor counts as watchable (CPU ones too); the TensorImpls whose values
    the finalizers ask to drop are recorded instead."""
    dropped = []
    monkeypatch.setattr(freed_weights, "watchable",
                        lambda t: isinstance(t, torch.Tensor) and t.dtype in freed_weights.WEIGHT_DTYPES)
    monkeypatch.setattr(freed_weights, "drop_values_of", dropped.append)
    return dropped


def test_only_integer_or_fp8_cuda_tensors_are_watchable():
    assert not freed_weights.watchable(torch.zeros(2, dtype=torch.int8))  # a CPU tensor: no GPU cache
    assert not freed_weights.watchable(torch.zeros(2, dtype=torch.float16, device="meta"))
    assert not freed_weights.watchable("not a tensor")


def test_one_finalizer_per_tensor_fired_when_freed(on_cpu):
    w = torch.zeros(4, 4, dtype=torch.int8)
    impl = w._cdata
    assert freed_weights.watch([w, w, torch.zeros(3)]) == 1  # the float tensor is not a weight
    assert freed_weights.watch([w]) == 0
    assert on_cpu == []
    del w
    gc.collect()
    assert on_cpu == [impl]
    assert freed_weights.watch([]) == 0


def test_quantized_module_weights_are_watched(on_cpu):
    model = nn.Sequential(nn.Linear(64, 32), nn.Linear(32, 16))
    quantize_model(model, "int8")
    impls = {model[0].weight._cdata, model[1].weight._cdata}
    assert on_cpu == []
    del model
    gc.collect()
    assert impls <= set(on_cpu), (impls, on_cpu)


@pytest.mark.parametrize("move", ["to", "to, swapping", "data"])
def test_weights_that_become_watchable_in_place_are_watched(monkeypatch, on_cpu, move):
    """A model quantized on the CPU, then moved to the GPU: ``.to("cuda")`` (nn.Module._apply sets
    ``.data`` of the tensor kept in place, or under ``set_swap_module_params_on_conversion`` swaps
    a new tensor into it) or a loader's ``.data = t``.  Its weights become
    watchable only then, as the same objects.  Here watchability is switched on before the
    move, which stays on the CPU."""
    cpu_watchable = freed_weights.watchable
    monkeypatch.setattr(freed_weights, "watchable", lambda t: False)
    model = quantize_model(nn.Sequential(nn.Linear(128, 64, bias=False)), "awq")
    held = model[0].qweight
    monkeypatch.setattr(freed_weights, "watchable", cpu_watchable)
    if move.startswith("to"):
        swap = torch.__future__.get_swap_module_params_on_conversion()
        torch.__future__.set_swap_module_params_on_conversion(move == "to, swapping")
        try:
            model.to("cpu")
        finally:
            torch.__future__.set_swap_module_params_on_conversion(swap)
        assert model[0].qweight is held  # kept in place, as on a move to the GPU
    else:
        held.data = held.detach().clone()
    impl = held._cdata
    del model, held
    gc.collect()
    assert impl in on_cpu, on_cpu


def test_tensors_inside_a_wrapper_subclass_are_watched(on_cpu):
    """torchao's quantized weight is a tensor subclass in the weight's dtype; our ops receive the
    int8 tensor inside it."""
    from torchao.quantization import Int8DynamicActivationInt8WeightConfig, quantize_

    lin = nn.Linear(64, 32)
    quantize_(lin, Int8DynamicActivationInt8WeightConfig())
    assert not freed_weights.watchable(lin.weight)  # float32 outside
    assert freed_weights.watch([lin.weight]) >= 1
    assert on_cpu == []
    del lin
    gc.collect()
    assert on_cpu, "no finalizer fired for the int8 data inside torchao's weight"


class ForeignInt8(nn.Module):
    """Another library's int8 linear: plain buffers, its own dequantize-then-matmul forward."""

    def __init__(self):
        super().__init__()
        self.register_buffer("weight", torch.randint(-128, 128, (16, 32), dtype=torch.int8))
        self.register_buffer("scale", torch.rand(16) + 0.5)

    def forward(self, x):
        return x @ (self.weight.to(torch.float32) * self.scale[:, None]).t()


def test_compiled_graph_inputs_are_watched(on_cpu):
    torch._dynamo.reset()
    model = ForeignInt8()
    impl = model.weight._cdata
    with torch.no_grad():
        torch.compile(model, backend="quantfuse")(torch.randn(2, 32))
    torch._dynamo.reset()
    assert impl not in on_cpu
    del model
    gc.collect()
    assert impl in on_cpu, on_cpu
