"""``quantfuse::rms_norm_ordered`` and ``add_rms_norm_ordered`` (compile_backend/ops/rms_norm_ordered.py)
and their pass (passes/rms_norm_ordered.py): transformers' RMSNorm stored in an act-order layer's
input order.

CPU: the references are transformers' ``LlamaRMSNorm`` followed by ``AWQLinear``'s scatter, bit for bit;
bad arguments raise naming the argument; schema and fake agree (``opcheck``); the pass rewrites the
RMSNorms before an act-order model's q/k/v and gate/up (with the residual add where there is one) into
the ops, leaves every near-miss as traced, and the model computes what it computes without the pass.
The Triton kernel runs on a CPU through Triton's interpreter where Triton is installed.  GPU: the kernel
against float64 and against the reference, in a CUDA graph.
"""

from __future__ import annotations

import pytest
import torch
from conftest import assert_interpreted_ok, needs_triton

from compile_backend.ops import QuantfuseInputError
from compile_backend.ops.rms_norm_ordered import add_reference, reference

transformers = pytest.importorskip("transformers")

rms_norm_ordered = torch.ops.quantfuse.rms_norm_ordered
add_rms_norm_ordered = torch.ops.quantfuse.add_rms_norm_ordered


def make(shape=(3, 1, 96), dtype=torch.float16, device="cpu", seed=0):
    """``(x, residual, weight, eps, order)``."""
    g = torch.Generator().manual_seed(seed)
    K = shape[-1]
    x, residual = (torch.randn(*shape, generator=g).to(dtype).to(device) for _ in range(2))
    weight = (1 + 0.1 * torch.randn(K, generator=g)).to(dtype).to(device)
    order = torch.randperm(K, generator=g).to(device)
    return x, residual, weight, 1e-5, order


def transformers_form(s, weight, eps, order):
    """transformers' LlamaRMSNorm of ``s``, then AWQLinear's scatter by ``order``."""
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    norm = LlamaRMSNorm(s.shape[-1], eps=eps).to(s.device, s.dtype)
    with torch.no_grad():
        norm.weight.copy_(weight)
        n = norm(s)
    return torch.empty_like(n).index_copy_(-1, order, n)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_references_are_transformers_rms_norm_then_the_scatter(dtype):
    x, residual, weight, eps, order = make(dtype=dtype)
    assert torch.equal(reference(x, weight, eps, order), transformers_form(x, weight, eps, order))
    out, s = add_reference(x, residual, weight, eps, order)
    assert torch.equal(s, x + residual)
    assert torch.equal(out, transformers_form(x + residual, weight, eps, order))
    # Each value is at its place: out[..., order[i]] is the normalized value i.
    n = transformers_form(x, weight, eps, torch.arange(x.shape[-1]))
    assert torch.equal(reference(x, weight, eps, order)[..., order], n)


@pytest.mark.parametrize("change, match", [
    (lambda a: {0: a[0].float()}, "'x' must be float16 or bfloat16"),
    (lambda a: {1: a[1][..., :-1]}, "'residual' must be x's shape"),
    (lambda a: {2: a[2].float()}, "'weight' must be"),
    (lambda a: {2: a[2][:-1]}, "'weight' must be"),
    (lambda a: {3: -1.0}, "'eps' must be a float >= 0"),
    (lambda a: {4: a[4].float()}, "'order' must be int32 or int64"),
    (lambda a: {4: a[4][:-1]}, "'order' must be int32 or int64"),
])
def test_bad_arguments_are_named(change, match):
    args = list(make())
    for i, t in change(args).items():
        args[i] = t
    x, residual, weight, eps, order = args
    with pytest.raises(QuantfuseInputError, match=match):
        add_rms_norm_ordered(x, residual, weight, eps, order)
    if "residual" not in match:
        with pytest.raises(QuantfuseInputError, match=match):
            rms_norm_ordered(x, weight, eps, order)


def test_opcheck():
    x, residual, weight, eps, order = make()
    checks = ("test_schema", "test_faketensor")
    torch.library.opcheck(rms_norm_ordered, (x, weight, eps, order), test_utils=checks)
    torch.library.opcheck(add_rms_norm_ordered, (x, residual, weight, eps, order), test_utils=checks)


@pytest.mark.parametrize("name", ["rms_norm_ordered", "add_rms_norm_ordered"])
def test_cuda_kernel_takes_the_schemas_arguments(name):
    """The CUDA implementations accept the schema's arguments as the dispatcher passes them."""
    import inspect

    import compile_backend.ops.rms_norm_ordered as mod

    kernel = {"rms_norm_ordered": mod._cuda, "add_rms_norm_ordered": mod._add_cuda}[name]
    schema = getattr(torch.ops.quantfuse, name).default._schema
    inspect.signature(kernel).bind(*[a.name for a in schema.arguments])


# --------------------------------------------------------------------------- the pass


def _stand_in_for_cuda_graphs(monkeypatch):
    """The ops are written where the graph runs on CUDA as a CUDA graph; on a CPU, say that it does."""
    import compile_backend.passes.rms_norm_ordered as rms_pass

    monkeypatch.setattr(rms_pass, "_takes_op", lambda nodes, on_cuda_graphs: True)


def _act_order_model(tmp_path, in_order_layers=()):
    from test_checkpoints_gptq import write_gptq

    from compile_backend.checkpoints import from_pretrained

    folder, _ = write_gptq(str(tmp_path / "gptq"), fmt="gptq", sym=False, group=32, desc_act=True,
                           in_order_layers=in_order_layers)
    return from_pretrained(folder).eval()


def _compiled_logits(model, ids, **options):
    torch._dynamo.reset()
    with torch.no_grad():
        return torch.compile(model, backend="quantfuse", options=options)(ids).logits


@pytest.mark.parametrize("in_order_layers, rewritten", [((), 4), ((0,), 2)])
def test_pass_stores_the_order_in_the_rms_norm(monkeypatch, tmp_path, in_order_layers, rewritten):
    """Every RMSNorm before an act-order layer's q/k/v or gate/up becomes an op (the first layer's input
    norm without a residual add, the others with it); the logits are as close to eager's as those of the
    compile without it (float16: the sums of squares are added in another order than Inductor's, one
    rounding step apart at most in a normalized value)."""
    from torch._dynamo.utils import counters

    _stand_in_for_cuda_graphs(monkeypatch)
    model = _act_order_model(tmp_path, in_order_layers)
    ids = torch.randint(0, model.config.vocab_size, (2, 5), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        eager = model(ids).logits
    counters.clear()
    without = _compiled_logits(model, ids, rms_norm_ordered=False)
    assert counters["quantfuse"]["rms_norm_ordered"] == 0
    got = _compiled_logits(model, ids)
    assert counters["quantfuse"]["rms_norm_ordered"] == rewritten
    bar = (without - eager).abs().max().item()
    assert (got - eager).abs().max().item() <= 1.5 * bar + 1e-3, ((got - eager).abs().max().item(), bar)


class _Norm(torch.nn.Module):
    """A residual add, transformers' RMSNorm and an act-order layer's scatter, with variants that are not
    that form."""

    def __init__(self, variant, K=64):
        super().__init__()
        self.variant = variant
        self.weight = torch.nn.Parameter(torch.rand(K, dtype=torch.float16) + 0.5, requires_grad=False)
        self.register_buffer("order", torch.randperm(K, generator=torch.Generator().manual_seed(3)))
        self.register_buffer("other_order", torch.randperm(K, generator=torch.Generator().manual_seed(4)))

    def forward(self, a, b):
        s = a + b
        h = s.to(torch.float32)
        variance = h.pow(2).mean(-1, keepdim=True)
        if self.variant == "sum":  # not a mean
            variance = h.pow(2).sum(-1, keepdim=True)
        h = h * torch.rsqrt(variance + 1e-6)
        n = self.weight * h.to(s.dtype)
        if self.variant == "gemma":  # (1 + w): another norm
            n = (1.0 + self.weight) * h.to(s.dtype)
        if self.variant == "float32 result":  # the weight's product in float32
            n = self.weight.float() * h
        first = torch.empty_like(n).index_copy_(-1, self.order, n)
        second_order = self.other_order if self.variant == "two orders" else self.order
        second = torch.empty_like(n).index_copy_(-1, second_order, n)
        extra = n.sum() if self.variant == "n read elsewhere" else 0
        if self.variant == "no scatter":
            return n + s
        return first + second + s + extra


@pytest.mark.parametrize("variant, fused", [
    ("form", 1), ("sum", 0), ("gemma", 0), ("float32 result", 0), ("two orders", 0), ("n read elsewhere", 0),
    ("no scatter", 0),
])
def test_pass_fuses_only_that_form(monkeypatch, variant, fused):
    from torch._dynamo.utils import counters

    _stand_in_for_cuda_graphs(monkeypatch)
    torch._dynamo.reset()
    counters.clear()
    g = torch.Generator().manual_seed(1)
    a, b = (torch.randn(2, 1, 64, generator=g).half() for _ in range(2))
    module = _Norm(variant)
    with torch.no_grad():
        want = module(a, b)
        got = torch.compile(module, backend="quantfuse")(a, b)
    assert counters["quantfuse"]["rms_norm_ordered"] == fused
    torch.testing.assert_close(got.float(), want.float(), rtol=2e-3, atol=2e-2)


def test_pass_leaves_graphs_off_cuda_graphs():
    """Off CUDA graphs (here: a CPU) the form stays as traced."""
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    a, b = (torch.randn(2, 1, 64).half() for _ in range(2))
    with torch.no_grad():
        torch.compile(_Norm("form"), backend="quantfuse")(a, b)
    assert counters["quantfuse"]["rms_norm_ordered"] == 0


# --------------------------------------------------------------------------- the kernel, interpreted on a CPU

@needs_triton
def test_kernel_in_the_triton_interpreter():
    """The kernel run by Triton's interpreter against the references (tests/rms_norm_ordered_cases.py)."""
    assert_interpreted_ok("rms_norm_ordered_cases", timeout=600)


# --------------------------------------------------------------------------- GPU

gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@gpu
@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("shape", [(1, 1, 4096), (8, 1, 4096), (3, 5, 96), (2, 1, 1000)])
def test_gpu_kernel_matches_float64(dtype, shape):
    x, residual, weight, eps, order = make(shape, dtype, "cuda")
    out, s = add_rms_norm_ordered(x, residual, weight, eps, order)
    assert torch.equal(s, x + residual)  # the eager add's rounding
    s64 = s.double()
    want = (weight.double() * s64 * torch.rsqrt(s64.pow(2).mean(-1, keepdim=True) + eps))[..., torch.argsort(order)]
    rel = ((out.double() - want).norm() / want.norm()).item()
    assert rel < (2e-3 if dtype == torch.float16 else 1.6e-2), rel
    ref, _ = add_reference(x, residual, weight, eps, order)
    # The reference's rounding, but for the sum of squares' order: at most one step of the dtype apart.
    step = torch.finfo(dtype).eps * ref.abs().double().clamp_min(1.0)
    assert ((out.double() - ref.double()).abs() <= step).all()
    plain = rms_norm_ordered(x, weight, eps, order.int())
    assert ((plain.double() - reference(x, weight, eps, order).double()).abs()
            <= torch.finfo(dtype).eps * plain.abs().double().clamp_min(1.0)).all()


@gpu
@pytest.mark.gpu
def test_gpu_in_a_cuda_graph():
    x, residual, weight, eps, order = make((2, 1, 4096), torch.float16, "cuda")
    want = add_rms_norm_ordered(x, residual, weight, eps, order)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        got = add_rms_norm_ordered(x, residual, weight, eps, order)
    x.copy_(torch.randn_like(x))
    graph.replay()
    again = add_rms_norm_ordered(x, residual, weight, eps, order)
    assert not torch.equal(again[0], want[0])
    assert torch.equal(got[0], again[0]) and torch.equal(got[1], again[1])
