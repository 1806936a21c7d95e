"""``quantize/act_order.py``: a gated MLP's ``down_proj`` act-order moved into ``gate_proj`` / ``up_proj``
output columns, kept only where the module's output is unchanged."""

from __future__ import annotations

import logging

import torch
from torch import nn

from compile_backend.quantize import AWQLinear
from compile_backend.quantize.act_order import columns_permuted, fold_mlp_orders

H, INTER, G = 64, 128, 32


def act_order_layer(K: int, N: int, seed: int, perm: torch.Tensor | None = None) -> AWQLinear:
    """An ``AWQLinear`` from random 4-bit integers, with ``perm`` (random when not given) as act-order."""
    gen = torch.Generator().manual_seed(seed)
    layer = AWQLinear.from_linear(nn.Linear(K, N, bias=True), group_size=G)
    order = torch.randperm(K, generator=gen).to(torch.int32) if perm is None else perm
    state = {k: v for k, v in layer.state_dict().items()}
    state["qweight"] = layer.awq_qweight()
    state["scales"] = (torch.rand(K // G, N, generator=gen) * 0.02 + 0.01).to(torch.float16)
    state["bias"] = torch.randn(N, generator=gen).to(torch.float16)
    return AWQLinear.from_state_dict({**state, "perm": order})


class GatedMLP(nn.Module):
    def __init__(self, shared: bool = True):
        super().__init__()
        perm = torch.randperm(H, generator=torch.Generator().manual_seed(1)).to(torch.int32)
        self.gate_proj = act_order_layer(H, INTER, 2, perm)
        self.up_proj = act_order_layer(H, INTER, 3, perm if shared else None)
        self.down_proj = act_order_layer(INTER, H, 4)

    def forward(self, x):
        return self.down_proj(nn.functional.silu(self.gate_proj(x)) * self.up_proj(x))


class NotElementwise(GatedMLP):
    """Uses down_proj's input other than elementwise in gate's and up's outputs (a reversal of features)."""

    def forward(self, x):
        return self.down_proj((nn.functional.silu(self.gate_proj(x)) * self.up_proj(x)).flip(-1))


def probe(module):
    x = torch.randn(5, H, generator=torch.Generator().manual_seed(9)).to(torch.float16)
    with torch.no_grad():
        return module(x).float()


def test_columns_permuted_moves_output_columns():
    layer = act_order_layer(H, INTER, 5)
    order = torch.randperm(INTER, generator=torch.Generator().manual_seed(6))
    x = torch.randn(3, H, generator=torch.Generator().manual_seed(7)).to(torch.float16)
    with torch.no_grad():
        assert torch.equal(columns_permuted(layer, order)(x), layer(x)[:, order])
    assert columns_permuted(layer, order).perm.data_ptr() == layer.perm.data_ptr()  # its input's order, shared


def test_fold_drops_down_proj_gather_and_keeps_the_output():
    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.mlp = GatedMLP()

        def forward(self, x):
            return self.mlp(x)

    block = Block()
    before = probe(block)
    orders = [m.perm.data_ptr() for m in (block.mlp.gate_proj, block.mlp.up_proj)]
    assert fold_mlp_orders(block) == ["mlp"]
    assert block.mlp.down_proj.perm is None
    # gate's and up's own orders are the tensors they held, not copies (checkpoints/gptq.py shares one
    # between the layers that read one activation, and horizontal.py merges those)
    assert [m.perm.data_ptr() for m in (block.mlp.gate_proj, block.mlp.up_proj)] == orders
    after = probe(block)
    assert torch.allclose(after, before, rtol=0, atol=16 * 2**-10 * before.abs().max().item())
    assert fold_mlp_orders(block) == []  # nothing left to fold


def test_fold_left_alone_where_the_output_would_move(caplog):
    mlp = NotElementwise()
    before, perms = probe(mlp), [m.perm for m in (mlp.gate_proj, mlp.up_proj, mlp.down_proj)]
    with caplog.at_level(logging.INFO, logger="quantfuse"):
        assert fold_mlp_orders(mlp) == []
    assert "keeps down_proj's activation gather" in caplog.text and "moved by" in caplog.text
    assert [m.perm for m in (mlp.gate_proj, mlp.up_proj, mlp.down_proj)] == perms
    assert torch.equal(probe(mlp), before)


def test_fold_keeps_a_float32_models_output_dtype():
    mlp = GatedMLP().float()  # the layers keep float16 scales and compute in them, casting to float32
    before = probe(mlp)
    assert fold_mlp_orders(mlp) == [""]
    assert all(getattr(mlp, n).out_dtype == torch.float32 for n in ("gate_proj", "up_proj", "down_proj"))
    x = torch.randn(5, H, generator=torch.Generator().manual_seed(9))
    with torch.no_grad():
        assert mlp(x).dtype == torch.float32
    assert torch.allclose(probe(mlp), before, rtol=0, atol=16 * 2**-10 * before.abs().max().item())


def test_fold_needs_the_three_awq_layers():
    mlp = GatedMLP(shared=False)
    mlp.up_proj = nn.Linear(H, INTER).half()
    assert fold_mlp_orders(mlp) == [] and mlp.down_proj.perm is not None
