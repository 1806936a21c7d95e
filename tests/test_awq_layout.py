"""One layout per AWQ weight: ``AWQLinear`` holds ``qweight`` in the kernels' fragment layout and speaks
the documented AWQ layout ``[K, N/8]`` on the way in and out (``ops/awq_gemm.py``, ``quantize/modules.py``)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from compile_backend.derived import HeldParameter
from compile_backend.ops.awq_gemm import (
    awq_from_fragments,
    awq_layout,
    awq_to_fragments,
    fragment_layout,
    pack_fragments,
    unpack_fragments,
)
from compile_backend.quantize import AWQLinear, awq_pack, quantize_weight_awq


def _layer(k=128, n=192, seed=0, dtype=torch.float16):
    torch.manual_seed(seed)
    lin = nn.Linear(k, n)
    return lin, AWQLinear.from_linear(lin, group_size=32, dtype=dtype)


def test_fragment_layout_is_the_kernel_index_map():
    """Word ((s·K/16 + kt)·32 + lane)·4 + j, nibble i holds W[k, n] at the kernel's k and n
    (csrc/awq_gemm/awq_gemm_kernels.cu, awq_repack_kernel), and the conversions invert each other."""
    K, N = 64, 192
    values = torch.randint(0, 16, (K, N), dtype=torch.int32, generator=torch.Generator().manual_seed(1))
    words = pack_fragments(values)
    assert words.shape == (N // 64, K // 16, 32, 4) and words.dtype == torch.int32
    flat = words.flatten()
    for o in range(0, flat.numel(), 37):
        j, lane, kt, strip = o & 3, (o >> 2) & 31, (o >> 7) % (K // 16), (o >> 7) // (K // 16)
        for i in range(8):
            k = kt * 16 + 4 * (lane & 3) + (i >> 2) + 2 * (j & 1)
            n = strip * 64 + (2 * (j >> 1) + (i & 1)) * 16 + (lane >> 2) + 8 * ((i >> 1) & 1)
            assert (int(flat[o]) >> (4 * i)) & 0xF == int(values[k, n])
    assert torch.equal(unpack_fragments(words), values)
    packed = awq_pack(values)
    assert torch.equal(awq_to_fragments(packed), words) and torch.equal(awq_from_fragments(words), packed)
    assert awq_layout(packed) is packed and fragment_layout(words) is words
    with pytest.raises(ValueError, match="fragment layout needs K % 16 == 0 and N % 64 == 0"):
        pack_fragments(values[:, :40])


def test_state_dict_round_trip_in_the_awq_layout():
    lin, layer = _layer()
    qweight, qzeros, scales = quantize_weight_awq(lin.weight, 32, torch.float16)
    assert layer.qweight.shape == (3, 8, 32, 4)  # held: the fragment layout
    state = layer.state_dict()
    assert torch.equal(state["qweight"], qweight) and state["qweight"].is_contiguous()  # out: the AWQ layout
    assert torch.equal(state["qzeros"], qzeros) and torch.equal(state["scales"], scales)
    assert layer.state_dict(keep_vars=True)["qweight"] is layer.qweight  # the held tensors as they are
    for assign in (False, True):
        fresh = AWQLinear(128, 192, group_size=32)
        fresh.load_state_dict(state, assign=assign)
        assert type(fresh.qweight) is HeldParameter and torch.equal(fresh.qweight, layer.qweight), assign
        assert torch.equal(fresh.awq_qweight(), qweight)
    again = AWQLinear.from_state_dict(state)
    assert torch.equal(again.qweight, layer.qweight)
    x = torch.randn(3, 128, dtype=torch.float16)
    assert torch.equal(again(x), layer(x))
    # The held layout itself loads too (a state dict made with keep_vars, a module's tensors).
    fresh = AWQLinear(128, 192, group_size=32)
    fresh.load_state_dict(layer.state_dict(keep_vars=True))
    assert torch.equal(fresh.qweight, layer.qweight)


def test_wrong_awq_shape_names_the_layout():
    _, layer = _layer()
    state = layer.state_dict()
    state["qweight"] = state["qweight"][:64]
    with pytest.raises(RuntimeError, match=r"qweight: the AWQ-layout qweight has shape \(64, 24\); this layer "
                                           r"takes \[K, N/8\] = \[128, 24\]"):
        AWQLinear(128, 192, group_size=32).load_state_dict(state)


def test_shapes_without_a_fragment_layout_hold_the_awq_layout():
    lin, layer = _layer(k=128, n=40)
    assert layer.qweight.shape == (128, 5)
    qweight, _, _ = quantize_weight_awq(lin.weight, 32, torch.float16)
    assert torch.equal(layer.state_dict()["qweight"], qweight) and torch.equal(layer.awq_qweight(), qweight)


def test_writes_through_the_held_tensor_are_what_the_layer_computes():
    _, layer = _layer(seed=2)
    _, other = _layer(seed=3)
    x = torch.randn(2, 128, dtype=torch.float16)
    layer.qweight.copy_(other.qweight)
    layer.qzeros.data.copy_(other.qzeros)
    layer.scales.copy_(other.scales)
    layer.bias.copy_(other.bias)
    assert torch.equal(layer(x), other(x))
    assert torch.equal(layer.state_dict()["qweight"], other.state_dict()["qweight"])
