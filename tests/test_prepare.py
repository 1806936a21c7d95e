"""``compile_backend.prepare``: other libraries' AWQ layers (AutoAWQ's formulation, as the AWQ pass's tests
write it) replaced in place by ``AWQLinear``, which holds the kernels' one layout; layers that compute
something else left as they are, with the reason."""

from __future__ import annotations

import logging

import pytest
import torch
from test_pass_awq_gemm import AutoAWQLinear, StackAWQLinear
from torch import nn

import compile_backend
from compile_backend.ops.concat_weights import adjacent_view
from compile_backend.quantize import AWQLinear


class Attention(nn.Module):
    def __init__(self, make):
        super().__init__()
        self.q_proj, self.k_proj, self.v_proj = make(128, 128, 1), make(128, 64, 2), make(128, 64, 3)
        self.o_proj = make(256, 128, 4)

    def forward(self, x):
        return self.o_proj(torch.cat([self.q_proj(x), self.k_proj(x), self.v_proj(x)], -1))


def _awq(k, n, seed, bias=True):
    torch.manual_seed(seed)
    return AWQLinear.from_linear(nn.Linear(k, n, bias=bias), group_size=64, dtype=torch.float16)


def _autoawq(k, n, seed):
    return AutoAWQLinear(_awq(k, n, seed))


def test_autoawq_layers_become_awq_linear_with_one_layout():
    model = Attention(_autoawq)
    originals = {n: {k: v.clone() for k, v in m.state_dict().items()} for n, m in model.named_children()}
    x = torch.randn(2, 5, 128, dtype=torch.float16)
    with torch.no_grad():
        before = model(x)
    assert sorted(compile_backend.prepare(model)) == ["k_proj", "o_proj", "q_proj", "v_proj"]
    for name, m in model.named_children():
        assert type(m) is AWQLinear and m.qweight.dim() == 4, name  # the fragment layout
        state = m.state_dict()
        assert all(torch.equal(state[k], v) for k, v in originals[name].items()), name  # AWQ layout out
    parts = [model.q_proj.qweight, model.k_proj.qweight, model.v_proj.qweight]
    assert adjacent_view(parts, 0) is not None  # q/k/v views of one merged tensor
    with torch.no_grad():
        torch.testing.assert_close(model(x), before, rtol=2e-3, atol=2e-3)
        report = compile_backend.explain(model, x)
        compiled = torch.compile(model, backend="quantfuse")(x)
    assert len(report.fused) == 4 and not report.unfused, str(report)
    assert all(f.form == "awq_dequantize_op" for f in report.fused)
    torch.testing.assert_close(compiled, before, rtol=2e-3, atol=2e-3)
    assert compile_backend.prepare(model) == []  # nothing left to convert


def test_layers_that_compute_something_else_are_left_with_the_reason(caplog):
    class Scaled(nn.Module):  # holds one more tensor: what it computes is not the AWQ linear alone
        def __init__(self):
            super().__init__()
            self.inner = _autoawq(128, 64, 5)
            self.qweight, self.qzeros, self.scales = self.inner.qweight, self.inner.qzeros, self.inner.scales
            self.register_buffer("input_scale", torch.full((128,), 2.0, dtype=torch.float16))

        def forward(self, x):
            return self.inner(x * self.input_scale)

    model = nn.ModuleDict(dict(
        wrong_order=StackAWQLinear(_awq(128, 64, 6), order=range(8)),  # nibbles in another order
        scaled=Scaled(),
        plain=nn.Linear(128, 64),
    ))
    with caplog.at_level(logging.INFO, logger="quantfuse"):
        assert compile_backend.prepare(model) == ["scaled.inner"]
    assert type(model["wrong_order"]) is StackAWQLinear and type(model["scaled"]) is Scaled
    assert "wrong_order (StackAWQLinear) left as it is: its output differs" in caplog.text
    assert "scaled (Scaled) left as it is: also holds input_scale" in caplog.text


def test_act_order_and_malformed_candidates_are_left(caplog):
    act = _autoawq(128, 64, 7)
    act.register_buffer("g_idx", torch.arange(128).flip(0) // 64)
    odd = _autoawq(128, 64, 8)
    odd.scales = odd.scales[:, :32]
    model = nn.ModuleDict(dict(act=act, odd=odd))
    with caplog.at_level(logging.INFO, logger="quantfuse"):
        assert compile_backend.prepare(model) == []
    assert "groups the input channels out of order" in caplog.text and "are neither AWQ's" in caplog.text


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_dtypes_kept(dtype):
    torch.manual_seed(9)
    src = AWQLinear.from_linear(nn.Linear(128, 64), group_size=32, dtype=dtype)
    model = nn.Sequential(AutoAWQLinear(src))
    assert compile_backend.prepare(model) == ["0"]
    assert model[0].scales.dtype == dtype and model[0].group_size == 32


# --------------------------------------------------------------------------- GPTQ layers in torch form


class TorchGPTQLinear(nn.Module):
    """GPTQModel's torch kernel (``TorchQuantLinear``, what transformers' GPTQ gives with
    ``backend="torch"``), its dequantization as written there: ``qweight [K/8, N]`` packed along K,
    ``qzeros [G, N/8]`` along N (v1: each zero point minus one, ``v1=True``), ``g_idx`` per input channel,
    ``W = scales[g_idx] * (q - z[g_idx])``."""

    def __init__(self, q, z, s, g_idx, bias=None, v1=False):
        super().__init__()
        K, N = q.shape
        shifts = torch.arange(0, 32, 4, dtype=torch.int64)
        words = (q.to(torch.int64).reshape(K // 8, 8, N) << shifts[None, :, None]).sum(1)
        stored_z = z - 1 if v1 else z
        zwords = ((stored_z.to(torch.int64) & 0xF).reshape(z.shape[0], N // 8, 8) << shifts).sum(-1)
        as_int32 = lambda w: (w - ((w >> 31) << 32)).to(torch.int32)  # noqa: E731
        self.register_buffer("qweight", as_int32(words))
        self.register_buffer("qzeros", as_int32(zwords))
        self.register_buffer("scales", s)
        self.register_buffer("g_idx", g_idx.to(torch.int32))
        self.register_buffer("bias", bias)
        self.bits, self.v1 = 4, v1
        self.register_buffer("wf", torch.arange(0, 32, 4, dtype=torch.int32))

    def forward(self, x):
        weight = torch.bitwise_and(torch.bitwise_right_shift(self.qweight.unsqueeze(1), self.wf[None, :, None]), 15)
        weight = weight.reshape(-1, weight.shape[-1])
        zeros = torch.bitwise_and(torch.bitwise_right_shift(self.qzeros.unsqueeze(2), self.wf[None, None, :]), 15)
        zeros = zeros.reshape(self.scales.shape) + (1 if self.v1 else 0)
        g = self.g_idx.long()
        w = self.scales[g] * (weight - zeros[g]).to(self.scales.dtype)
        out = x @ w
        return out if self.bias is None else out + self.bias


def _gptq(K=128, N=64, G=32, act_order=False, v1=False, bias=True, seed=0):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randint(0, 16, (K, N), generator=gen)
    z = torch.randint(1 if v1 else 0, 16, (K // G, N), generator=gen)  # v1 cannot store a zero point of 0
    s = (torch.rand(K // G, N, generator=gen) * 1e-2 + 1e-3).half()
    g_idx = torch.arange(K) // G
    if act_order:
        g_idx = g_idx[torch.randperm(K, generator=gen)]
    b = torch.randn(N, generator=gen).half() if bias else None
    return TorchGPTQLinear(q, z, s, g_idx, b, v1=v1)


@pytest.mark.parametrize("act_order", [False, True], ids=["in-order", "act-order"])
@pytest.mark.parametrize("v1", [False, True], ids=["v2", "v1"])
def test_gptq_torch_layers_become_awq_linear(act_order, v1):
    model = nn.Sequential(_gptq(act_order=act_order, v1=v1), nn.ReLU(), _gptq(K=64, N=128, G=64, seed=1))
    x = torch.randn(4, 128, dtype=torch.float16)
    with torch.no_grad():
        before = model(x)
    assert compile_backend.prepare(model) == ["0", "2"]
    first = model[0]
    assert type(first) is AWQLinear and first.qweight.dim() == 4 and (first.perm is not None) == act_order
    with torch.no_grad():
        torch.testing.assert_close(model(x), before, rtol=1e-3, atol=1e-3)
        report = compile_backend.explain(model, x)
    assert len(report.fused) == 2 and not report.unfused, str(report)


def test_gptq_of_other_widths_is_left(caplog):
    layer = _gptq()
    layer.bits = 8
    with caplog.at_level(logging.INFO, logger="quantfuse"):
        assert compile_backend.prepare(nn.Sequential(layer)) == []
    assert "8-bit GPTQ" in caplog.text
