"""The AWQ pattern family (passes/awq_gemm.py): unpack → − zeros → × scales → matmul (+ bias) into awq_gemm.

Most tests run the passes on the graph Inductor's custom slots receive (Dynamo +
AOTAutograd with Inductor's decompositions, no code generation) and run the
rewritten graph eagerly; two tests go through ``torch.compile(backend="quantfuse")``.

``trace`` below is private rather than ``tests/pass_helpers.apply_passes``:
that helper deep-copies the graph module inside the compile's fake mode, which
fails for graphs holding lifted tensor constants (AWQLinear's shift table is
one).  ``graph_str`` and ``count_calls`` are the shared ones.
"""

from __future__ import annotations

import functools
import itertools
from dataclasses import dataclass
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from expecttest import TestCase
from pass_helpers import apply_passes, count_calls, graph_str
from torch import nn

from compile_backend.ops import AWQ_ORDER
from compile_backend.passes import FusionReport, collecting_report
from compile_backend.passes.fx_helpers import VIEWS
from compile_backend.passes.report import noted_reasons
from compile_backend.quantize import AWQLinear, set_tensors

aten = torch.ops.aten
AWQ_GEMM = torch.ops.quantfuse.awq_gemm.default
UNPACK_OPS = (aten.__rshift__.Tensor, aten.bitwise_right_shift.Tensor, aten.bitwise_and.Scalar)
K, N = 256, 64
AWQ_REVERSE_ORDER = (0, 4, 1, 5, 2, 6, 3, 7)  # AutoAWQ's name for the gather that undoes the packing


# --------------------------------------------------------------------------- tracing


@dataclass
class Traced:
    before: str  # graph_str of the graph as traced
    after: torch.fx.GraphModule
    report: FusionReport
    output: Any
    expected: Any

    def count(self, *targets) -> int:
        return count_calls(self.after, *targets)

    def reasons(self) -> list[str]:
        mms = [n for n in self.after.graph.nodes if n.target == aten.mm.default]
        return [r for n in mms for r in noted_reasons(n)]


def trace(fn, *args, dynamic=False, stage="joint") -> Traced:
    """``pass_helpers.apply_passes`` with the AWQ family alone; ``before`` as printed text.

    ``stage="reshape"`` first rewrites views into reshapes (``view_to_reshape``,
    what Inductor does before the post-grad slots): the patterns must match that
    form as well.
    """
    r = apply_passes(fn, *args, dynamic=dynamic, families=("awq_gemm",), stage=stage)
    torch._dynamo.reset()
    return Traced(graph_str(r.before), r.after, r.report, r.output, r.expected)


def assert_output_close(out, expected):
    """The fused op accumulates in float32 and rounds once (bias included); eager rounds the
    matmul to the activation dtype and then adds the bias, a second rounding.  So the two may
    differ by about two units in the last place of the largest output."""
    assert out.dtype == expected.dtype and out.shape == expected.shape
    scale = expected.abs().max().item()
    torch.testing.assert_close(out, expected, rtol=0, atol=4 * torch.finfo(out.dtype).eps * scale)


# --------------------------------------------------------------------------- the modules users have


def awq_tensor(awq: AWQLinear, name: str) -> torch.Tensor:
    """``awq``'s tensor ``name`` as other libraries' modules hold it: ``qweight`` in the AWQ layout."""
    return awq.awq_qweight() if name == "qweight" else getattr(awq, name)


def awq_params(group_size: int, dtype, bias: bool, seed: int = 0, k: int = K, n: int = N):
    torch.manual_seed(seed)
    return AWQLinear.from_linear(nn.Linear(k, n, bias=bias), group_size=group_size, dtype=dtype)


class AutoAWQLinear(nn.Module):
    """AutoAWQ's formulation of the same layer (same buffers as AWQLinear).

    ``reorder``: "full" gathers the [K, N] unpacked columns with a length-N index built
    from the reverse order (AutoAWQ); "chunk" gathers a [K*N/8, 8] view with the 8-entry
    order; None leaves the columns in the shift order (a *different* bit order).
    ``order`` is the 8-entry gather order, ``shift_bits`` / ``mask`` the unpack's step and
    mask, ``expand`` how zeros and scales reach [K, N], ``zero_point`` what is subtracted;
    ``zeros_reorder=False`` leaves the zero points' columns in packing order (a near miss).
    """

    def __init__(self, awq: AWQLinear, *, reorder="full", order=AWQ_REVERSE_ORDER, shift_bits=4, mask=15,
                 expand="repeat_interleave", zero_point="packed", zeros_reorder=True):
        super().__init__()
        for name in ("qweight", "qzeros", "scales", "bias"):
            self.register_buffer(name, awq_tensor(awq, name))
        self.group_size = awq.group_size
        self.reorder, self.order, self.shift_bits, self.mask = reorder, list(order), shift_bits, mask
        self.expand, self.zero_point, self.zeros_reorder = expand, zero_point, zeros_reorder

    def unpack(self, packed, reorder=True):
        shifts = torch.arange(0, 32, self.shift_bits, device=packed.device)
        values = torch.bitwise_right_shift(packed[:, :, None], shifts[None, None, :]).to(torch.int8)
        values = values.view(packed.shape[0], -1)
        if reorder and self.reorder == "full":
            index = torch.arange(values.shape[-1], dtype=torch.int32, device=packed.device)
            index = index.view(-1, 8)[:, self.order].view(-1)
            values = values[:, index]
        elif reorder and self.reorder == "chunk":
            values = values.view(-1, 8)[:, self.order].view(packed.shape[0], -1)
        return torch.bitwise_and(values, self.mask)

    def groups(self, t):
        if self.expand == "repeat_interleave":
            return t.repeat_interleave(self.group_size, dim=0)
        if self.expand == "expand":
            g, n = t.shape
            return t[:, None, :].expand(g, self.group_size, n).reshape(g * self.group_size, n)
        return t  # broadcasting: per-channel only

    def forward(self, x):
        w = self.unpack(self.qweight)
        if self.zero_point == "packed":
            w = w - self.groups(self.unpack(self.qzeros, self.zeros_reorder))
        elif self.zero_point == "scalar":
            w = w - 8
        w = w * self.groups(self.scales)
        y = torch.matmul(x, w)
        return y if self.bias is None else y + self.bias


class ExpandAWQLinear(AWQLinear):
    """AWQLinear with the groups expanded by view/expand instead of repeat_interleave, holding
    ``qweight`` in the AWQ layout (as other libraries' modules do)."""

    def dequantized_weight(self):
        from compile_backend.ops import awq_unpack

        G, (groups, n) = self.group_size, self.scales.shape
        z = awq_unpack(self.qzeros)[:, None, :].expand(groups, G, n).reshape(-1, n)
        s = self.scales.unsqueeze(1).expand(-1, G, -1).reshape(groups * G, n)
        return (awq_unpack(self.qweight) - z).to(self.scales.dtype) * s


def make_module(form: str, group_size: int, dtype, bias: bool) -> nn.Module:
    awq = awq_params(group_size, dtype, bias)
    if form == "AWQLinear":
        return awq
    if form == "AWQLinear-expand":
        mod = ExpandAWQLinear(K, N, group_size=group_size, bias=bias, dtype=dtype)
        mod.load_state_dict(awq.state_dict())
        return set_tensors(mod, qweight=awq.awq_qweight())
    if form == "AutoAWQ":
        return AutoAWQLinear(awq)
    if form == "AutoAWQ-chunk-expand":
        return AutoAWQLinear(awq, reorder="chunk", expand="expand")
    if form == "AutoAWQ-broadcast":  # per-channel zeros and scales [1, N], no expansion at all
        return AutoAWQLinear(awq, expand="broadcast")
    raise ValueError(form)


def activations(dim: int, dtype, seed: int = 1):
    torch.manual_seed(seed)
    return torch.randn((6, K) if dim == 2 else (2, 3, K), dtype=dtype)


def assert_fused(t: Traced, group_size: int, form: str):
    assert t.count(AWQ_GEMM) == 1, graph_str(t.after)
    assert t.count(aten.mm.default, aten.addmm.default, *UNPACK_OPS) == 0, graph_str(t.after)
    (fused,) = t.report.fused
    assert fused.family == "awq_gemm"
    assert fused.form == ("autoawq_reorder" if form.startswith("AutoAWQ") else
                          "awq_dequantize_op" if form == "AWQLinear" else "awq_shift_table")
    node = next(n for n in t.after.graph.nodes if n.target == AWQ_GEMM)
    assert node.args[4] == (K if group_size == -1 else group_size)
    assert_output_close(t.output, t.expected)


# --------------------------------------------------------------------------- before / after


class TestGraphBeforeAfter(TestCase):
    def test_awq_linear_3d_bias(self):
        torch.manual_seed(0)
        mod = AWQLinear.from_linear(nn.Linear(64, 16), group_size=32, dtype=torch.float16)
        t = trace(mod, torch.randn(2, 3, 64, dtype=torch.float16))
        self.assertExpectedInline(t.before, """\
input arg0_1: float16[2, 16]
input arg1_1: int32[64, 2]
input arg2_1: int32[2, 2]
input arg3_1: float16[2, 3, 64]
input arg4_1: float16[16]
_tensor_constant0: int32[8] = get_attr _tensor_constant0
lift_fresh_copy: int32[8] = aten.lift_fresh_copy(_tensor_constant0)
unsqueeze: int32[64, 2, 1] = aten.unsqueeze(arg1_1, -1)
rshift: int32[64, 2, 8] = aten.__rshift__.Tensor(unsqueeze, lift_fresh_copy)
bitwise_and: int32[64, 2, 8] = aten.bitwise_and.Scalar(rshift, 15)
view: int32[64, 16] = aten.view(bitwise_and, [64, 16])
_tensor_constant1: int32[8] = get_attr _tensor_constant1
lift_fresh_copy_1: int32[8] = aten.lift_fresh_copy(_tensor_constant1)
unsqueeze_1: int32[2, 2, 1] = aten.unsqueeze(arg2_1, -1)
rshift_1: int32[2, 2, 8] = aten.__rshift__.Tensor(unsqueeze_1, lift_fresh_copy_1)
bitwise_and_1: int32[2, 2, 8] = aten.bitwise_and.Scalar(rshift_1, 15)
view_1: int32[2, 16] = aten.view(bitwise_and_1, [2, 16])
unsqueeze_2: int32[2, 1, 16] = aten.unsqueeze(view_1, 1)
expand: int32[2, 32, 16] = aten.expand(unsqueeze_2, [2, 32, 16])
clone: int32[2, 32, 16] = aten.clone(expand, memory_format=torch.contiguous_format)
view_2: int32[64, 16] = aten.view(clone, [64, 16])
sub: int32[64, 16] = aten.sub.Tensor(view, view_2)
convert_element_type: float16[64, 16] = prims.convert_element_type(sub, float16)
unsqueeze_3: float16[2, 1, 16] = aten.unsqueeze(arg0_1, 1)
expand_1: float16[2, 32, 16] = aten.expand(unsqueeze_3, [2, 32, 16])
clone_1: float16[2, 32, 16] = aten.clone(expand_1, memory_format=torch.contiguous_format)
view_3: float16[64, 16] = aten.view(clone_1, [64, 16])
mul: float16[64, 16] = aten.mul.Tensor(convert_element_type, view_3)
view_4: float16[6, 64] = aten.view(arg3_1, [6, 64])
mm: float16[6, 16] = aten.mm(view_4, mul)
view_5: float16[2, 3, 16] = aten.view(mm, [2, 3, 16])
add: float16[2, 3, 16] = aten.add.Tensor(view_5, arg4_1)
return [add]""")
        self.assertExpectedInline(graph_str(t.after), """\
input arg0_1: float16[2, 16]
input arg1_1: int32[64, 2]
input arg2_1: int32[2, 2]
input arg3_1: float16[2, 3, 64]
input arg4_1: float16[16]
view_4: float16[6, 64] = aten.view(arg3_1, [6, 64])
awq_gemm_default_1: float16[6, 16] = quantfuse.awq_gemm(view_4, arg1_1, arg0_1, arg2_1, 32, arg4_1)
view_default: float16[2, 3, 16] = aten.view(awq_gemm_default_1, [2, 3, 16])
return [view_default]""")
        self.assertEqual(str(t.report).splitlines()[1:],
                         ["  fused    awq_gemm       from awq_shift_table group_size=32 K=64 N=16 float16"])
        assert_output_close(t.output, t.expected)


# --------------------------------------------------------------------------- every variant matches

GROUPS = (32, 64, 128, -1)  # -1: per-channel (group = K)
DTYPES = (torch.float16, torch.bfloat16)


@pytest.mark.parametrize("form", ["AWQLinear", "AutoAWQ"])
@pytest.mark.parametrize("group_size", GROUPS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_groups_and_dtypes(form, group_size, dtype):
    t = trace(make_module(form, group_size, dtype, bias=True), activations(3, dtype))
    assert_fused(t, group_size, form)


@pytest.mark.parametrize("form", ["AWQLinear", "AutoAWQ"])
@pytest.mark.parametrize(("dim", "bias", "dynamic"), list(itertools.product((2, 3), (False, True), (False, True))))
def test_shapes_bias_dynamic(form, dim, bias, dynamic):
    t = trace(make_module(form, 64, torch.float16, bias), activations(dim, torch.float16), dynamic=dynamic)
    assert_fused(t, 64, form)
    (node,) = [n for n in t.after.graph.nodes if n.target == AWQ_GEMM]
    assert (len(node.args) == 6 and node.args[5] is not None) == bias
    if dynamic:  # the batch really is symbolic in the graph the pass rewrote
        assert any(isinstance(s, torch.SymInt) and not isinstance(s.node.maybe_as_int(), int)
                   for s in node.meta["val"].shape)


@pytest.mark.parametrize(("form", "group_size"), [
    ("AWQLinear-expand", 32), ("AutoAWQ-chunk-expand", 128), ("AutoAWQ-broadcast", -1)])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_other_formulations(form, group_size, dtype):
    t = trace(make_module(form, group_size, dtype, bias=True), activations(3, dtype), dynamic=True)
    assert_fused(t, group_size, form)


@pytest.mark.parametrize("form", ["AWQLinear", "AutoAWQ"])
def test_reshape_form(form):
    """The graph as the post-grad slots see it (aten.reshape instead of aten.view) matches too."""
    t = trace(make_module(form, 128, torch.bfloat16, bias=True), activations(3, torch.bfloat16), stage="reshape")
    assert "aten.reshape" in t.before and "aten.view(" not in t.before
    assert_fused(t, 128, form)


def test_two_layers_and_a_residual_add():
    """Each layer fuses; an add of a [.., N] residual is not folded in as a bias."""
    a, b = (awq_params(64, torch.float16, bias=False, seed=s, k=K, n=K) for s in (2, 3))

    def two(x):
        h = a(x)
        return b(h) + h

    t = trace(two, activations(3, torch.float16))
    assert t.count(AWQ_GEMM) == 2 and t.count(aten.mm.default) == 0
    assert t.count(aten.add.Tensor) == 1
    assert all(len(n.args) == 5 for n in t.after.graph.nodes if n.target == AWQ_GEMM)
    assert_output_close(t.output, t.expected)


# --------------------------------------------------------------------------- act-order: the gather before the op


def act_order(layer: AWQLinear, seed: int = 5, perm: torch.Tensor | None = None) -> AWQLinear:
    """``layer`` as a GPTQ act-order checkpoint loads it: its rows in a random input-channel order."""
    state = {k: v for k, v in layer.state_dict().items() if v is not None}
    perm = torch.randperm(layer.in_features, generator=torch.Generator().manual_seed(seed)) if perm is None else perm
    return AWQLinear.from_state_dict({**state, "perm": perm}, group_size=layer.group_size)


def _gathers(t: Traced) -> int:
    return t.count(aten.index.Tensor, aten.index_select.default)


SCATTERS = (aten.index_put.default, aten.index_copy.default)


def _scatter_of(node) -> bool:
    """Whether ``node`` puts its input in an act-order layer's order (``AWQLinear.forward``'s scatter by
    ``perm_inverse`` into an empty tensor)."""
    return node.target in SCATTERS and node.args[0].target in (aten.empty.memory_format, aten.empty_like.default)


def _no_perm(op) -> bool:
    return len(op.args) < 7 or op.args[6] is None


@pytest.mark.parametrize(("dim", "bias", "dynamic"), [(2, False, False), (3, True, False), (3, True, True)])
def test_act_order_scatter_stays_before_the_op(dim, bias, dynamic):
    """An act-order layer's input order (a scatter by ``perm_inverse``) stays in the graph before the fused
    op: Inductor computes it in the kernel that produces x (an op-level gather is a kernel of its own).
    One scatter feeding the op, no gather, the op without ``perm``."""
    layer = act_order(awq_params(64, torch.float16, bias=bias))
    t = trace(layer, activations(dim, torch.float16), dynamic=dynamic)
    ops = [n for n in t.after.graph.nodes if n.target == AWQ_GEMM]
    assert len(ops) == 1 and _no_perm(ops[0]), graph_str(t.after)
    scatters = [n for n in t.after.graph.nodes if _scatter_of(n)]
    assert len(scatters) == 1 and _gathers(t) == 0, graph_str(t.after)
    x = ops[0].args[0]
    assert x is scatters[0] or (x.target in VIEWS and x.args[0] is scatters[0]), graph_str(t.after)
    assert_output_close(t.output, t.expected)


def test_act_order_scatter_is_the_gather():
    """``AWQLinear``'s scatter by ``perm_inverse`` gives ``x.index_select(-1, perm)`` exactly; layers sharing a
    ``perm`` share its inverse, which follows ``perm`` through ``load_state_dict`` and device moves."""
    from compile_backend.quantize.modules import inverse_order

    a = act_order(awq_params(64, torch.float16, bias=False))
    x = torch.randn(3, K, dtype=torch.float16)
    assert torch.equal(torch.empty_like(x).index_copy_(-1, a.perm_inverse, x), x.index_select(-1, a.perm))
    assert a.perm_inverse.dtype == torch.int64 and inverse_order(a.perm) is a.perm_inverse
    b = act_order(awq_params(64, torch.float16, bias=False, seed=2), perm=a.perm)
    set_tensors(b, perm=a.perm)
    assert b.perm_inverse is a.perm_inverse
    other = torch.randperm(K, generator=torch.Generator().manual_seed(3)).to(torch.int32)
    b.load_state_dict({**b.state_dict(), "perm": other})
    assert torch.equal(b.perm_inverse[other.long()], torch.arange(K))
    assert "perm_inverse" not in b.state_dict()
    held, inverse = b.perm, b.perm_inverse
    b._apply(torch.clone)  # as a CPU -> CUDA move does: new data in the same parameter object, same version
    assert b.perm is held and b.perm_inverse is not inverse and inverse_order(b.perm) is b.perm_inverse
    assert torch.equal(b.perm_inverse, inverse)
    b.to("meta")
    assert b.perm_inverse.device.type == "meta" and inverse_order(b.perm) is b.perm_inverse


def test_act_order_shared_order_merged_once():
    """q/k/v-style layers with one shared order: one scatter of the shared activation, one merged op."""
    layers = [awq_params(64, torch.float16, bias=False, seed=s) for s in (1, 2, 3)]
    perm = torch.randperm(K, generator=torch.Generator().manual_seed(9))
    a, b, c = (act_order(m, perm=perm) for m in layers)
    b.perm, c.perm = a.perm, a.perm  # one tensor, as checkpoints/gptq.py gives them

    def qkv(x):
        return a(x), b(x), c(x)

    r = apply_passes(qkv, activations(3, torch.float16))
    ops = [n for n in r.after.graph.nodes if n.target == AWQ_GEMM]
    assert len(ops) == 1 and _no_perm(ops[0]), graph_str(r.after)
    assert sum(map(_scatter_of, r.after.graph.nodes)) == 1, graph_str(r.after)
    assert count_calls(r.after, aten.index.Tensor, aten.index_select.default) == 0, graph_str(r.after)
    for out, want in zip(r.output, r.expected):
        assert_output_close(out, want)


def test_gather_of_another_dimension_stays():
    """A gather that is not of K (here of the tokens) is not the op's ``perm``: it stays before the op."""
    layer = awq_params(64, torch.float16, bias=False)
    rows = torch.tensor([2, 0, 1])

    def gathered(x):
        return layer(x.index_select(1, rows))

    t = trace(gathered, activations(3, torch.float16))
    ops = [n for n in t.after.graph.nodes if n.target == AWQ_GEMM]
    assert len(ops) == 1 and _no_perm(ops[0]) and _gathers(t) == 1
    assert_output_close(t.output, t.expected)


def test_act_order_op_is_the_gathered_op():
    """``awq_gemm(x, ..., perm)`` is ``awq_gemm(x[:, perm], ...)`` exactly, and so are its gradients (to x,
    scattered back by the order, and to the scales)."""
    layer = act_order(awq_params(64, torch.float16, bias=True))
    x = activations(2, torch.float16).requires_grad_()
    x2 = x.detach().clone().requires_grad_()
    scales = layer.scales.detach().clone().requires_grad_()
    scales2 = scales.detach().clone().requires_grad_()
    args = (layer.qweight, layer.qzeros, layer.group_size)
    y = torch.ops.quantfuse.awq_gemm(x, args[0], scales, args[1], args[2], layer.bias, layer.perm)
    y2 = torch.ops.quantfuse.awq_gemm(x2.index_select(1, layer.perm), args[0], scales2, args[1], args[2], layer.bias)
    assert torch.equal(y, y2)
    g = torch.randn(y.shape, generator=torch.Generator().manual_seed(4)).to(y.dtype)
    y.backward(g)
    y2.backward(g)
    assert torch.equal(x.grad, x2.grad) and torch.equal(scales.grad, scales2.grad)
    with pytest.raises(ValueError, match="argument 'perm'.*permutation of range"):
        torch.ops.quantfuse.awq_gemm(x, args[0], scales, args[1], args[2], None, layer.perm[:-1])


# --------------------------------------------------------------------------- near misses stay as they are


def assert_left_alone(t: Traced, reason: str | None = None):
    assert t.count(AWQ_GEMM) == 0 and t.report.fused == [], graph_str(t.after)
    assert t.count(aten.mm.default) == 1
    assert t.before == graph_str(t.after), "a near miss must leave the graph unchanged"
    torch.testing.assert_close(t.output, t.expected, rtol=0, atol=0)
    if reason is not None:
        assert any(reason in r for r in t.reasons()), t.reasons()
        # ... and the report (compile_backend.explain) gives that reason for the matmul left alone.
        assert any(reason in u.reason for u in t.report.unfused), t.report


def near_miss(**kw):
    return AutoAWQLinear(awq_params(64, torch.float16, bias=True), **kw)


NEAR_MISSES = {
    # sequential shifts 0, 4, ..., 28 with no reorder: another bit order than AWQ's
    "sequential-bit-order": (dict(reorder=None), "bit order"),
    "identity-reorder": (dict(order=range(8)), "bit order"),
    "reversed-reorder": (dict(order=range(7, -1, -1)), "bit order"),
    "chunk-identity-reorder": (dict(reorder="chunk", order=range(8)), "bit order"),
    "no-zero-point": (dict(zero_point=None), None),
    "scalar-zero-point": (dict(zero_point="scalar"), "zero point is not a 4-bit unpack"),
    "3-bit-mask": (dict(mask=7), "mask is 7"),
    "8-bit-mask": (dict(mask=255), "mask is 255"),
}


@pytest.mark.parametrize("case", NEAR_MISSES)
def test_near_miss(case):
    kw, reason = NEAR_MISSES[case]
    assert_left_alone(trace(near_miss(**kw), activations(3, torch.float16)), reason)


@pytest.mark.parametrize(("step", "count", "mask", "reason"), [
    (3, 8, 15, "bit order"),  # 8 values at 3-bit steps, 4-bit mask: overlapping fields
    (2, 16, 3, "8 values"),  # 2-bit packing, 16 values per int32
])
def test_shifts_that_are_not_4bit(step, count, mask, reason):
    torch.manual_seed(4)
    groups, words = K // 64, N // count
    qweight = torch.randint(-(2**31), 2**31 - 1, (K, words), dtype=torch.int32)
    qzeros = torch.randint(-(2**31), 2**31 - 1, (groups, words), dtype=torch.int32)
    scales = torch.rand(groups, N, dtype=torch.float16) / 64

    def unpack(p):
        shifts = torch.arange(0, step * count, step, dtype=torch.int32)
        return ((p.unsqueeze(-1) >> shifts) & mask).reshape(p.shape[0], -1)

    def f(x):
        w = (unpack(qweight) - unpack(qzeros).repeat_interleave(64, dim=0)).to(torch.float16)
        return x @ (w * scales.repeat_interleave(64, dim=0))

    assert_left_alone(trace(f, activations(2, torch.float16)), reason)


def test_zeros_and_scales_grouped_differently():
    mod = awq_params(64, torch.float16, bias=False)
    qweight = mod.awq_qweight()  # the AWQ layout, as other libraries' modules hold it

    def f(x):
        from compile_backend.ops import awq_unpack

        z = awq_unpack(mod.qzeros)[:1]  # per-channel zeros ([1, N], broadcast) with grouped scales
        w = (awq_unpack(qweight) - z).to(torch.float16) * mod.scales.repeat_interleave(64, dim=0)
        return x @ w

    assert_left_alone(trace(f, activations(2, torch.float16)))


def test_unsigned_subtraction():
    """uint8 (w - z) wraps around below zero in the graph; the fused op would not, so leave it."""
    from compile_backend.ops import awq_unpack

    mod = awq_params(64, torch.float16, bias=False)
    qweight = mod.awq_qweight()  # the AWQ layout, as other libraries' modules hold it

    def f(x):
        w = awq_unpack(qweight).to(torch.uint8)
        z = awq_unpack(mod.qzeros).to(torch.uint8).repeat_interleave(64, dim=0)
        return x @ ((w - z).to(torch.float16) * mod.scales.repeat_interleave(64, dim=0))

    assert_left_alone(trace(f, activations(2, torch.float16)), "wraps around")


def test_float32_activations():
    mod = awq_params(64, torch.float16, bias=False)
    mod.scales = mod.scales.float()
    x = activations(2, torch.float32)
    t = trace(mod, x)
    assert_left_alone(t, "activations are torch.float32")


def test_dequantized_weight_used_twice():
    """The dequantized weight is also an output: replacing the matmul would not remove it, so leave it."""
    mod = awq_params(32, torch.bfloat16, bias=False)

    def f(x):
        w = mod.dequantized_weight()
        return x @ w, w

    t = trace(f, activations(2, torch.bfloat16))
    assert t.count(AWQ_GEMM) == 0 and t.count(aten.mm.default) == 1
    for out, exp in zip(t.output, t.expected):
        torch.testing.assert_close(out, exp, rtol=0, atol=0)


# --------------------------------------------------------------------------- other libraries and hand-written forms


class TorchAwqLinear(nn.Module):
    """transformers' AWQ layer (``AwqConfig`` with ``backend="torch_awq"``: gptqmodel's ``AwqTorchLinear``),
    its forward written out in plain torch so the test needs neither package.

    The activation is flattened to 2-D; each int32 tensor is unpacked column-wise (``q[:, :, None]``
    shifted by an int64 ``arange(0, 32, 4)``, viewed to ``[R, N]``, ``& 15``) and cut to the scales'
    N columns (a no-op slice: ``aten.alias`` in the graph), reordered by AutoAWQ's reverse order and
    masked again; groups by ``repeat_interleave``; ``(w - z) * s`` in int64 then the scales' dtype;
    matmul, ``+ bias``, reshape back.  ``zeros_shift`` rolls the unpacked zero points by that many
    columns (a near miss).
    """

    def __init__(self, awq: AWQLinear, zeros_shift: int = 0):
        super().__init__()
        for name in ("qweight", "qzeros", "scales", "bias"):
            self.register_buffer(name, awq_tensor(awq, name))
        self.group_size, self.zeros_shift = awq.group_size, zeros_shift

    @staticmethod
    def _unpack(q, count):
        shifts = torch.arange(0, 32, 4, device=q.device)
        nibbles = torch.bitwise_right_shift(q[:, :, None], shifts[None, None, :])
        return (nibbles.view(q.shape[0], -1) & 15)[..., :count]

    @staticmethod
    def _reorder(t):
        index = torch.arange(t.shape[-1], dtype=torch.int32, device=t.device).view(-1, 8)
        return t[:, index[:, AWQ_REVERSE_ORDER].view(-1)]

    def forward(self, x):
        n = self.scales.shape[-1]
        out_shape = x.shape[:-1] + (n,)
        x2 = x.reshape(-1, x.shape[-1])
        w = self._reorder(self._unpack(self.qweight, n)) & 15
        z = self._reorder(self._unpack(self.qzeros, n)) & 15
        if self.zeros_shift:
            z = torch.cat([z[:, self.zeros_shift:], z[:, :self.zeros_shift]], dim=1)
        g = self.group_size
        w = ((w - z.repeat_interleave(g, 0)) * self.scales.repeat_interleave(g, 0)).to(x2.dtype).contiguous()
        y = torch.matmul(x2, w)
        if self.bias is not None:
            y = y + self.bias
        return y.reshape(out_shape)


class StackAWQLinear(nn.Module):
    """The AWQ dequantization as one might write it by hand: the nibbles unpacked by
    ``torch.stack([(p >> 4 * r) & 0xF for r in order], -1).reshape(R, N)``.

    ``groups``: "view" expands the groups by viewing the weight as ``[K/G, G, N]`` and broadcasting the
    ``[K/G, 1, N]`` zeros and scales; "repeat_interleave" as AWQLinear; "shifted" moves every group
    boundary of the scales down by one row; "tile" repeats the scales instead of interleaving them;
    "zeros-tile" does that to the zero points.  ``linear``: ``F.linear`` of the transposed weight
    (an ``addmm`` for a 2-D activation).
    """

    def __init__(self, awq: AWQLinear, *, order=AWQ_ORDER, groups="view", linear=False):
        super().__init__()
        for name in ("qweight", "qzeros", "scales", "bias"):
            self.register_buffer(name, awq_tensor(awq, name))
        self.order, self.groups, self.linear = tuple(order), groups, linear

    def unpack(self, p):
        return torch.stack([(p >> (4 * r)) & 0xF for r in self.order], -1).reshape(p.shape[0], -1)

    def weight(self):
        w, z, s = self.unpack(self.qweight), self.unpack(self.qzeros), self.scales
        groups, n = s.shape
        if self.groups == "view":
            return ((w.view(groups, -1, n) - z[:, None, :]) * s[:, None, :]).reshape(-1, n)
        g = w.shape[0] // groups
        z, s_rows = z.repeat_interleave(g, 0), s.repeat_interleave(g, 0)
        if self.groups == "shifted":
            s_rows = torch.cat([s_rows[:1], s_rows[:-1]])
        elif self.groups == "tile":
            s_rows = s.repeat(g, 1)
        elif self.groups == "zeros-tile":
            z = self.unpack(self.qzeros).repeat(g, 1)
        return (w - z) * s_rows

    def forward(self, x):
        if self.linear:
            return F.linear(x, self.weight().t(), self.bias)
        return x @ self.weight() + self.bias


class GroupIndexAWQLinear(nn.Module):
    """Groups expanded by gathering rows with a group index ``arange(K) // G`` (the ``g_idx`` of
    GPTQ-style code): ``index_select`` for the zero points, ``scales[g_idx]`` for the scales.
    ``divisor`` replaces G in the index (a near miss)."""

    def __init__(self, awq: AWQLinear, divisor=None):
        super().__init__()
        for name in ("qweight", "qzeros", "scales", "bias"):
            self.register_buffer(name, awq_tensor(awq, name))
        self.divisor = divisor or awq.group_size

    def forward(self, x):
        from compile_backend.ops import awq_unpack

        g_idx = torch.arange(self.qweight.shape[0], device=x.device) // self.divisor
        s = self.scales[g_idx]
        w = (awq_unpack(self.qweight) - awq_unpack(self.qzeros).index_select(0, g_idx)).to(s.dtype) * s
        return x @ w + self.bias


SEMANTIC_FORMS = {
    "transformers-torch-awq": (TorchAwqLinear, "autoawq_reorder"),
    "stack-view-broadcast": (StackAWQLinear, "nibble_stack"),
    "stack-linear-transposed": (functools.partial(StackAWQLinear, groups="repeat_interleave", linear=True),
                                "nibble_stack"),
}


@pytest.mark.parametrize("form", SEMANTIC_FORMS)
@pytest.mark.parametrize(("group_size", "dtype", "dim"), [
    (64, torch.float16, 3), (128, torch.bfloat16, 2), (-1, torch.float16, 2)])
def test_semantic_forms(form, group_size, dtype, dim):
    """Each form fuses into the op AWQLinear's graph gives, with the same output bit for bit."""
    make, form_name = SEMANTIC_FORMS[form]
    awq = awq_params(group_size, dtype, bias=True)
    x = activations(dim, dtype)
    t = trace(make(awq), x)
    assert t.count(AWQ_GEMM) == 1, graph_str(t.after)
    assert t.count(aten.mm.default, aten.addmm.default, *UNPACK_OPS, aten.bitwise_right_shift.Tensor) == 0
    (fused,) = t.report.fused
    assert (fused.family, fused.form) == ("awq_gemm", form_name)
    node = next(n for n in t.after.graph.nodes if n.target == AWQ_GEMM)
    assert node.args[4] == (K if group_size == -1 else group_size) and node.args[5] is not None
    reference = trace(awq, x)
    assert reference.count(AWQ_GEMM) == 1
    assert torch.equal(t.output, reference.output)
    assert_output_close(t.output, t.expected)


def test_transformers_graph_is_the_one_described():
    """The reproduced layer's graph holds what kept it unfused before: an alias from the no-op slice
    and the mask applied twice to each tensor."""
    t = trace(TorchAwqLinear(awq_params(64, torch.float16, bias=True)), activations(3, torch.float16))
    assert t.before.count("aten.alias(") == 2 and t.before.count("aten.bitwise_and.Scalar(") == 4
    assert t.count(AWQ_GEMM) == 1


SEMANTIC_NEAR_MISSES = {
    "stack-sequential-nibbles": (dict(order=range(8)), "bit order: columns 0..7 read bits [0, 4, 8"),
    "stack-two-nibbles-swapped": (dict(order=(0, 4, 1, 5, 2, 6, 7, 3)), "bit order"),
    "shifted-group-boundary": (dict(groups="shifted"), "row 0 of group 1, column 0 is scaled by scales[0, 0]"),
    "scales-tiled": (dict(groups="tile"), "another group or column of the scales"),
    "zeros-tiled": (dict(groups="zeros-tile"), "the zero points are read from another column or group"),
}


@pytest.mark.parametrize("case", SEMANTIC_NEAR_MISSES)
def test_semantic_near_miss(case):
    kw, reason = SEMANTIC_NEAR_MISSES[case]
    assert_left_alone(trace(StackAWQLinear(awq_params(64, torch.float16, bias=True), **kw),
                            activations(3, torch.float16)), reason)


@pytest.mark.parametrize(("divisor", "reason"), [
    (None, None), (128, "the zero points are read from another column or group")])
def test_group_index_arithmetic_probed_at_small_sizes(monkeypatch, divisor, reason):
    """``arange(K) // G`` holds G as a value: probed at small sizes (the real sizes are not allowed
    here), its literal is read as the group size there; ``// 2G`` stays a near miss."""
    from compile_backend.passes import awq_gemm, dequant_probe

    monkeypatch.setattr(dequant_probe, "REAL_SIZE_LIMIT", 0)
    monkeypatch.setattr(awq_gemm, "_VERDICTS", {})
    t = trace(GroupIndexAWQLinear(awq_params(64, torch.float16, bias=True), divisor), activations(3, torch.float16))
    if reason is None:
        assert t.count(AWQ_GEMM) == 1 and [f.form for f in t.report.fused] == ["group_index"]
        assert_output_close(t.output, t.expected)
    else:
        assert_left_alone(t, reason)


def test_zero_point_from_the_wrong_column():
    """transformers' layer with the zero points rolled by one column: each column subtracts its
    neighbour's zero point."""
    mod = TorchAwqLinear(awq_params(64, torch.float16, bias=False), zeros_shift=1)
    t = trace(mod, activations(2, torch.float16))
    assert t.count(AWQ_GEMM) == 0 and t.report.fused == []
    assert any("the zero points are read from another column or group" in u.reason for u in t.report.unfused)
    torch.testing.assert_close(t.output, t.expected, rtol=0, atol=0)


def test_autoawq_zeros_left_in_packing_order():
    """AutoAWQ's form reordering the weight's columns but not the zero points' columns."""
    mod = AutoAWQLinear(awq_params(64, torch.float16, bias=True), zeros_reorder=False)
    assert_left_alone(trace(mod, activations(3, torch.float16)),
                      "the zero points are read from another column or group")


def test_lookup_by_value_is_not_a_reorder():
    """A gather whose indices are the unpacked nibbles (a table lookup) is outside what the probe decides."""
    mod = awq_params(64, torch.float16, bias=False)
    qweight = mod.awq_qweight()  # the AWQ layout, as other libraries' modules hold it

    def f(x):
        from compile_backend.ops import awq_unpack

        w = torch.arange(16, dtype=torch.int32)[awq_unpack(qweight)]
        z = awq_unpack(mod.qzeros).repeat_interleave(64, dim=0)
        return x @ ((w - z).to(torch.float16) * mod.scales.repeat_interleave(64, dim=0))

    assert_left_alone(trace(f, activations(2, torch.float16)), "gathers by indices computed from")


def test_near_miss_reason_in_explain():
    """explain() gives the probe's reason for the layer it leaves unfused."""
    import compile_backend

    model = StackAWQLinear(awq_params(64, torch.float16, bias=True), order=range(8))
    report = compile_backend.explain(model, activations(3, torch.float16), options={"families": ("awq_gemm",)})
    assert report.fused == []
    (unfused,) = report.unfused
    assert "awq_gemm: bit order" in unfused.reason, str(report)


# --------------------------------------------------------------------------- through torch.compile


def _compile(mod, xs, **options):
    """Compile with the quantfuse backend (AWQ family only), return (outputs, generated code, report, compiles)."""
    from unittest import mock

    from torch._inductor.graph import GraphLowering

    from compile_backend.backend import quantfuse

    compiles, code = [], []

    def backend(gm, example_inputs):
        compiles.append(gm)
        # No FX graph cache: on a cache hit the passes do not run, and the report would be empty.
        return quantfuse(gm, example_inputs, options={"families": ("awq_gemm",), "fallback": False,
                                                      "fx_graph_cache": False, **options})

    torch._dynamo.reset()
    compiled = torch.compile(mod, backend=backend, dynamic=True)
    with torch.no_grad(), collecting_report() as report, \
            mock.patch.object(GraphLowering, "save_output_code", code.append):
        outs = [compiled(x) for x in xs]
    torch._dynamo.reset()
    return outs, "\n".join(code), report, len(compiles)


@pytest.mark.compile
def test_compile_calls_awq_gemm_dynamic_batch():
    """Generated code calls quantfuse.awq_gemm and no longer unpacks or runs the mm; five batch
    sizes with dynamic=True compile at most twice."""
    mod = make_module("AutoAWQ", 128, torch.float16, bias=True)
    xs = [torch.randn(b, 3, K, dtype=torch.float16) for b in (1, 2, 3, 5, 8)]
    outs, code, report, compiles = _compile(mod, xs)
    assert "torch.ops.quantfuse.awq_gemm.default(" in code
    for unfused in ("extern_kernels.mm", "extern_kernels.addmm", "bitwise_and", "rshift", ">>"):
        assert unfused not in code, unfused
    assert compiles <= 2
    assert report.counts()["awq_gemm"] >= 1
    with torch.no_grad():
        for x, y in zip(xs, outs):
            assert_output_close(y, mod(x))


@pytest.mark.compile
def test_compile_with_freezing_keeps_the_fused_op():
    """Freezing would constant-fold the dequantization into a dense weight; the joint-graph slot fuses first."""
    mod = make_module("AWQLinear", 64, torch.bfloat16, bias=True)
    x = torch.randn(4, K, dtype=torch.bfloat16)
    (y,), code, report, _ = _compile(mod, [x], freezing=True)
    assert "torch.ops.quantfuse.awq_gemm.default(" in code and "extern_kernels.mm" not in code
    assert report.counts()["awq_gemm"] == 1
    with torch.no_grad():
        assert_output_close(y, mod(x))


@pytest.mark.parametrize("form", ["AWQLinear-expand", "AutoAWQ", "AutoAWQ-chunk-expand"])
def test_formulations_compute_the_awq_layer(form):
    """The test's hand-written formulations are the same layer as AWQLinear (eager, no passes)."""
    ref = make_module("AWQLinear", 64, torch.float16, bias=True)
    x = activations(3, torch.float16)
    with torch.no_grad():
        torch.testing.assert_close(make_module(form, 64, torch.float16, bias=True)(x), ref(x), rtol=0, atol=0)
    broadcast = make_module("AutoAWQ-broadcast", -1, torch.float16, bias=True)
    with torch.no_grad():
        torch.testing.assert_close(broadcast(x), make_module("AWQLinear", -1, torch.float16, bias=True)(x))
