"""Dynamo's guards on a compiled model's quantized linears cost no more per call than on ``nn.Linear``.

Every call of a compiled function first evaluates its guards.  Dynamo skips the guards of an
``nn.Module`` subtree whose ``__dict__`` tags are unchanged since the last call (a "tag-safe
root"; ``torch._dynamo.config.use_recursive_dict_tags_for_guards``, on by default in torch 2.11),
but only when everything guarded under it is immutable: tensors, ints, strs, ... (not a
``torch.dtype``).  ``W8A8Linear`` and ``AWQLinear`` are built for that (frozen parameters,
dtypes held by name), so a decoder layer of quantized linears is skipped as one of
``nn.Linear`` is, whatever the number of tensors per linear.

The tests compile the same small model unquantized and quantized, with the recursive dict tags
on, and compare the guard trees: each linear is tag safe, the number of tag-safe roots is the
same, and the guards evaluated per call (those outside tag-safe subtrees) grow by no more per
added layer (a quantized model also guards a fixed few globals its forward reads: constants,
``torch.round``, ...).
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from compile_backend.quantize import AWQLinear, W8A8Linear, held_tensors, quantize_model

pytestmark = pytest.mark.compile

HIDDEN = 64
LINEARS = (nn.Linear, W8A8Linear, AWQLinear)


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.up = nn.Linear(HIDDEN, 2 * HIDDEN, bias=False)
        self.down = nn.Linear(2 * HIDDEN, HIDDEN)

    def forward(self, x):
        return x + self.down(torch.relu(self.up(x)))


class Net(nn.Module):
    def __init__(self, layers):
        super().__init__()
        self.blocks = nn.ModuleList(Block() for _ in range(layers))

    def forward(self, x):
        for block in self.blocks:
            x = block(x)
        return x


def _model(scheme, layers=2):
    torch.manual_seed(0)
    model = Net(layers).eval()
    return model if scheme is None else quantize_model(model, scheme)


def _guard_manager(model, backend="eager"):
    """The root guard manager of ``model``'s compiled forward, after two calls (the second one
    runs the guards against the tags recorded by the first)."""
    torch._dynamo.reset()
    x = torch.randn(2, HIDDEN, generator=torch.Generator().manual_seed(1))
    compiled = torch.compile(model, backend=backend, fullgraph=True)
    with torch.no_grad(), torch._dynamo.config.patch(use_recursive_dict_tags_for_guards=True):
        compiled(x)
        compiled(x)
    entries = torch._dynamo.eval_frame._debug_get_cache_entry_list(Net.forward.__code__)
    assert len(entries) == 1, "recompiled: the guards failed on an unchanged model"
    return entries[0].guard_manager


def _children(node):
    for child in node.get_child_managers():
        if child is not None:
            yield child
    if hasattr(node, "get_key_value_managers"):
        for key, value in node.get_key_value_managers().values():
            yield from (m for m in (key, value) if m is not None)


def _walk(node):
    yield node
    for child in _children(node):
        yield from _walk(child)


def _evaluated(node) -> int:
    """Leaf guards run per call: a tag-safe root whose tag matches costs one check instead of its subtree."""
    if node.is_tag_safe_root():
        return 1
    return len(node.get_leaf_guards()) + sum(_evaluated(c) for c in _children(node))


def _summary(gm):
    nodes = list(_walk(gm.root))
    linears = [n for n in nodes if issubclass(n.get_type_of_guarded_value(), LINEARS)]
    return dict(linears=linears, roots=sum(n.is_tag_safe_root() for n in nodes), evaluated=_evaluated(gm.root))


def _per_layer(scheme) -> int:
    """Guards evaluated per call per added layer (two linears)."""
    two, four = (_summary(_guard_manager(_model(scheme, layers)))["evaluated"] for layers in (2, 4))
    return (four - two) // 2


@pytest.fixture(scope="module")
def unquantized():
    return dict(_summary(_guard_manager(_model(None))), per_layer=_per_layer(None))


@pytest.mark.parametrize("scheme", ["int8", "int8-asym-per-tensor", "fp8", "awq-g32"])
def test_quantized_linears_guard_like_nn_linear(scheme, unquantized):
    model = _model(scheme)
    gm = _guard_manager(model)
    got = _summary(gm)
    assert len(got["linears"]) == len(unquantized["linears"]) == 4
    untagged = [n.get_source() for n in got["linears"] if not n.is_tag_safe()]
    assert not untagged, f"{scheme}: guards of these linears are evaluated on every call: {untagged}"
    assert got["roots"] == unquantized["roots"], (got["roots"], unquantized["roots"])
    assert _per_layer(scheme) <= unquantized["per_layer"], (_per_layer(scheme), unquantized["per_layer"])
    # The held tensors are parameters, not buffers.  (As HeldParameters, not exactly nn.Parameter,
    # they are in Dynamo's per-call no-aliasing check, which leaves the layers tag safe, above.)
    ours = {id(t) for m in model.modules() if isinstance(m, (W8A8Linear, AWQLinear))
            for t in held_tensors(m).values() if t is not None}
    aliasing = " ".join(gm.no_tensor_aliasing_sources)
    assert ours and "_buffers[" not in aliasing, aliasing


def test_quantfuse_backend_guards_like_inductor(unquantized):
    """The same through the real backends: guards come from Dynamo, not from the backend."""
    got = _summary(_guard_manager(_model("int8"), backend="quantfuse"))
    assert all(n.is_tag_safe() for n in got["linears"])
    assert got["roots"] == unquantized["roots"]


def test_changed_dtype_attribute_recompiles():
    """The dtype held by name is still guarded: converting the layer's output dtype recompiles
    (the skipped subtree's tag changes) and the compiled model returns the new dtype."""
    torch._dynamo.reset()
    model = _model("int8")
    x = torch.randn(2, HIDDEN, generator=torch.Generator().manual_seed(1))
    compiled = torch.compile(model, backend="eager", fullgraph=True)
    with torch.no_grad(), torch._dynamo.config.patch(use_recursive_dict_tags_for_guards=True):
        assert compiled(x).dtype == torch.float32
        model.to(torch.bfloat16)
        out = compiled(x.bfloat16())
    assert out.dtype == torch.bfloat16
    assert all(m.out_dtype == torch.bfloat16 for m in model.modules() if isinstance(m, W8A8Linear))
    torch.testing.assert_close(out, model(x.bfloat16()), rtol=0, atol=0)


def test_held_tensors_are_frozen_parameters():
    """What the guard behaviour rests on, and what users see of it: same state_dict keys as
    ever, frozen parameters however a tensor is set, dtypes held by name."""
    from compile_backend.quantize import set_tensors

    mod = W8A8Linear.from_linear(nn.Linear(HIDDEN, 32), out_dtype=torch.float32)
    assert list(mod.state_dict()) == ["weight", "weight_scale", "bias"]
    assert all(isinstance(p, nn.Parameter) and not p.requires_grad for p in mod.parameters())
    mod.weight_scale = mod.weight_scale * 2  # plain assignment, as with a buffer
    set_tensors(mod, bias=torch.ones(32))
    for name in ("weight_scale", "bias"):
        t = getattr(mod, name)
        assert isinstance(t, nn.Parameter) and not t.requires_grad, name
    assert not mod._buffers
    with pytest.raises(KeyError, match="holds no tensor 'scales'"):
        set_tensors(mod, scales=torch.ones(1))
    mod.half()
    assert mod.out_dtype == torch.float16 and mod.bias.dtype == torch.float16 and mod.weight.dtype == torch.int8
    assert mod.__dict__["_out_dtype"] == "float16"  # a str: immutable for Dynamo
    awq = AWQLinear.from_linear(nn.Linear(HIDDEN, 32), group_size=32)
    assert list(awq.state_dict()) == ["qweight", "qzeros", "scales", "bias"]
    assert all(not p.requires_grad for p in awq.parameters())
