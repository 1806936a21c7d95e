"""``t.data`` of a plain tensor that does not require grad shares its version counter
(compile_backend/derived/tensor_data.py), so the caches of values derived from weights see writes through
it, whoever's module holds the weight."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import compile_backend  # noqa: F401  (installs the getter)
from compile_backend.derived import tensor_data
from compile_backend.derived.held_parameter import HeldParameter
from compile_backend.passes import collecting_report


def _plain_tensors():
    yield "int8 tensor", torch.zeros(6, 4, dtype=torch.int8)
    yield "float32 tensor", torch.zeros(6, 4)
    yield "int32 parameter", nn.Parameter(torch.zeros(6, 4, dtype=torch.int32), requires_grad=False)
    yield "float16 parameter", nn.Parameter(torch.zeros(6, 4, dtype=torch.float16), requires_grad=False)
    yield "fp8 tensor", torch.zeros(6, 4, dtype=torch.float8_e4m3fn)
    yield "non-contiguous", torch.zeros(4, 6).t()


@pytest.mark.parametrize("name, t", list(_plain_tensors()), ids=[n for n, _ in _plain_tensors()])
def test_writes_through_data_bump_the_version(name, t):
    version = t._version
    t.data.copy_(torch.ones(t.shape).to(t.dtype))
    assert t._version > version, name
    assert torch.equal(t.float(), torch.ones(t.shape))
    version = t._version
    t.data[0].zero_()  # through a view of the alias
    assert t._version > version, name
    assert float(t.float()[0].abs().sum()) == 0.0


@pytest.mark.parametrize("name, t", list(_plain_tensors()), ids=[n for n, _ in _plain_tensors()])
def test_the_alias_is_torchs_but_for_the_counter(name, t):
    got, want = t.data, tensor_data.TORCH_DATA.__get__(t)
    for attr in ("shape", "dtype", "device", "requires_grad", "is_leaf", "grad_fn", "_base"):
        assert getattr(got, attr) == getattr(want, attr), (name, attr)
    assert type(got) is type(want) is torch.Tensor
    assert got.stride() == want.stride() and got.storage_offset() == want.storage_offset()
    assert got.data_ptr() == want.data_ptr() == t.data_ptr()
    assert not got._is_view()


def test_tensors_that_require_grad_keep_torchs_data():
    """``.data`` exists to write to a tensor autograd tracks without it noticing; that stays so."""
    w = nn.Parameter(torch.ones(3))
    y = (w * w).sum()
    version = w._version
    w.data.mul_(5)
    assert w._version == version
    y.backward()  # saved w changed only through .data: no error, as in torch
    assert torch.equal(w.grad, torch.full((3,), 10.0))


def test_subclasses_keep_torchs_data():
    class Tagged(torch.Tensor):
        pass

    t = torch.zeros(3).as_subclass(Tagged)
    version = t._version
    t.data.add_(1)
    assert t._version == version
    assert torch.equal(t.as_subclass(torch.Tensor), torch.ones(3))


def test_a_write_to_a_saved_tensor_through_data_now_raises_in_backward():
    """The one visible change for other code: autograd saved ``x`` (not requiring grad) for the
    backward of ``w * x``; a write through ``x.data`` afterwards would silently change the
    gradient, and now raises like any in-place write."""
    w = nn.Parameter(torch.ones(3))
    x = torch.full((3,), 2.0)
    y = (w * x).sum()
    x.data.mul_(3)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        y.backward()


def test_assigning_data_is_torchs():
    p = nn.Parameter(torch.zeros(4, dtype=torch.int8), requires_grad=False)
    other = torch.arange(4, dtype=torch.int8)
    p.data = other
    assert type(p) is nn.Parameter and p.data_ptr() == other.data_ptr()
    version = p._version
    p.data.add_(1)
    assert p._version > version and torch.equal(p, torch.arange(1, 5, dtype=torch.int8))
    held = HeldParameter(torch.zeros(4, dtype=torch.int8), requires_grad=False)
    held.data = other
    assert type(held) is HeldParameter and held.data_ptr() == other.data_ptr()


def test_install_is_idempotent():
    getter = torch.Tensor.__dict__["data"]
    tensor_data.install()
    assert torch.Tensor.__dict__["data"] is getter


class ForeignAsymLinear(nn.Module):
    """Another library's asymmetric int8 linear: plain parameters and buffers, no HeldParameter."""

    def __init__(self, weight: torch.Tensor, scale: torch.Tensor):
        super().__init__()
        self.weight = nn.Parameter(weight, requires_grad=False)
        self.register_buffer("weight_scale", scale)

    def forward(self, a, za, sa):
        x = (a.float() - za.float()) * sa
        return F.linear(x, self.weight.float() * self.weight_scale.unsqueeze(-1))


@pytest.mark.compile
@pytest.mark.parametrize("tensor", ("parameter", "buffer"))
def test_compiled_foreign_module_sees_writes_through_data(tensor):
    """The compiled form caches the weight's column sums (``quantfuse.weight_colsum``); a loader's
    write through ``.data`` to the weight or its scale, after compiling, gives the new result."""
    gen = torch.Generator().manual_seed(5)
    m = ForeignAsymLinear(torch.randint(-128, 128, (16, 32), dtype=torch.int8, generator=gen),
                          torch.rand(16, generator=gen) * 0.01 + 1e-3)
    a = torch.randint(-128, 128, (6, 32), dtype=torch.int8, generator=gen)
    za = torch.randint(-20, 20, (6, 1), dtype=torch.int32, generator=gen)
    sa = torch.rand(6, 1, generator=gen) * 0.01 + 1e-3
    torch._dynamo.reset()
    compiled = torch.compile(m, backend="quantfuse", fullgraph=True, options={"fx_graph_cache": False})
    try:
        with torch.no_grad(), collecting_report() as report:
            before = compiled(a, za, sa)
            torch.testing.assert_close(before, m(a, za, sa))
            if tensor == "parameter":
                m.weight.data.copy_(torch.randint(-128, 128, (16, 32), dtype=torch.int8, generator=gen))
            else:
                m.weight_scale.data.mul_(3)
            after = compiled(a, za, sa)
            want = m(a, za, sa)
        assert not torch.equal(after, before)
        torch.testing.assert_close(after, want)
        assert report.counts()["scaled_mm_azp"] == 1, report.counts()
    finally:
        torch._dynamo.reset()
