"""Linears that share an input stored as views of one merged tensor (compile_backend/quantize/merged.py),
on the CPU: which parts ``concat_weights`` finds side by side (``adjacent_view``; on CUDA it then reads
them without a copy: tests/test_cuda_merged_storage.py), the documented format on the way out, writes."""

from __future__ import annotations

import pytest
import torch

import compile_backend
from compile_backend.models.llama import LlamaConfig, tiny_llama
from compile_backend.ops.concat_weights import adjacent_view
from compile_backend.quantize import AWQLinear, W8A8Linear, held_tensors, quantize_model, share_input_storage

CONCAT = torch.ops.quantfuse.concat_weights


def _model(scheme: str, seed: int = 0, hidden: int = 128):
    """A one-layer Llama; at hidden 128 every AWQ projection's N is a multiple of 64 (qweight in the
    fragment layout), at 64 the k/v projections' is not."""
    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=64, hidden_size=hidden, intermediate_size=2 * hidden, num_layers=1, num_heads=4,
                      num_kv_heads=2)
    model = tiny_llama(cfg).to(torch.float16 if scheme.startswith("awq") else torch.float32).eval()
    return quantize_model(model, scheme), cfg


def _layer(model):
    return model.layers[0]


def _bases(tensors):
    return {t.untyped_storage().data_ptr() for t in tensors}


# --------------------------------------------------------------------------- adjacent views


def test_adjacent_slices_concatenate_as_a_view():
    whole = torch.arange(6 * 4, dtype=torch.int32).reshape(6, 4)
    rows = [whole[0:1], whole[1:4], whole[4:6]]
    view = adjacent_view(rows, 0)
    assert view is not None and view.data_ptr() == whole.data_ptr() and torch.equal(view, whole)
    cols = [whole[:, 0:1], whole[:, 1:4]]
    assert torch.equal(adjacent_view(cols, 1), whole)
    assert torch.equal(adjacent_view(cols, -1), whole)
    assert torch.equal(CONCAT(rows, 0), whole)
    vec = torch.arange(10.0)
    assert adjacent_view([vec[:3], vec[3:]], 0, [3, 7]).data_ptr() == vec.data_ptr()


@pytest.mark.parametrize("case", ["order", "gap", "other-tensor", "strides", "broadcast"])
def test_parts_that_are_not_adjacent_are_copied(case):
    whole = torch.arange(24.0).reshape(6, 4)
    parts, sizes = [whole[0:2], whole[2:6]], None
    if case == "order":
        parts = parts[::-1]
    elif case == "gap":
        parts = [whole[0:2], whole[3:6]]
    elif case == "other-tensor":
        parts = [whole[0:2], whole[2:6].clone()]
    elif case == "strides":
        parts = [whole[0:2], whole.t().contiguous().t()[2:6]]
    elif case == "broadcast":
        parts, sizes = [whole.reshape(-1)[:1], whole.reshape(-1)[1:4]], [2, 3]
    expected = torch.cat([p.reshape(-1).expand(n) for p, n in zip(parts, sizes)] if sizes else list(parts), 0)
    assert torch.equal(CONCAT(parts, 0, sizes), expected)
    assert adjacent_view(parts, 0, sizes) is None


# --------------------------------------------------------------------------- quantize_model


@pytest.mark.parametrize("scheme,hidden", [("int8", 128), ("fp8-rowwise", 128), ("awq-g32", 128), ("awq-g32", 64)])
def test_projections_that_share_an_input_are_views_of_one_tensor(scheme, hidden):
    model, _ = _model(scheme, hidden=hidden)
    attn, mlp = _layer(model).attn, _layer(model).mlp
    names = ("qweight", "qzeros", "scales") if scheme.startswith("awq") else ("weight", "weight_scale")
    for group in ((attn.q_proj, attn.k_proj, attn.v_proj), (mlp.gate_proj, mlp.up_proj)):
        for name in names:
            # N is the first dimension of W8A8's tensors and of AWQ's qweight in the fragment layout,
            # the columns of AWQ's qzeros, scales and a qweight in the AWQ layout: a group whose
            # members are not all whole strips of 64 columns (hidden 64: k/v) holds that one.
            held = held_tensors(group[0])[name]
            dim = 1 if scheme.startswith("awq") and (name != "qweight" or held.dim() == 2) else 0
            if name == "qweight":
                assert held.dim() == (2 if hidden == 64 and group[0] is attn.q_proj else 4)
            parts = [held_tensors(m)[name] for m in group]
            assert len(_bases(parts)) == 1, name
            merged = adjacent_view(parts, dim)
            assert merged is not None and merged.data_ptr() == parts[0].data_ptr(), name
            assert torch.equal(merged, torch.cat([p.clone() for p in parts], dim))
    # o_proj and down_proj read other inputs: their own tensors.
    others = [attn.o_proj, mlp.down_proj]
    first = held_tensors(others[0])["qweight" if scheme.startswith("awq") else "weight"]
    assert first.untyped_storage().nbytes() == first.numel() * first.element_size()


def test_views_keep_the_documented_format_and_writes_reach_the_merged_tensor():
    """state_dict gives each module's own tensors (the documented format, equal to an unmerged
    model's), load_state_dict writes into the merged tensor, and the merged op reads the write."""
    model, _ = _model("int8", seed=1)
    plain, _ = _model("int8", seed=1)
    for m in plain.modules():  # the same model with each tensor on its own
        if isinstance(m, W8A8Linear):
            for name, t in held_tensors(m).items():
                if t is not None:
                    compile_backend.quantize.set_tensors(m, **{name: t.clone()})
    state, expected = model.state_dict(), plain.state_dict()
    assert state.keys() == expected.keys()
    for k in state:
        assert torch.equal(state[k], expected[k]), k
        # What savers take: contiguous tensors of their own (safetensors refuses shared memory).
        assert state[k].is_contiguous() and state[k].untyped_storage().nbytes() == state[k].nbytes, k
    attn = _layer(model).attn
    weights = lambda: [attn.q_proj.weight, attn.k_proj.weight, attn.v_proj.weight]  # noqa: E731
    merged_before = adjacent_view(weights(), 0)
    new = torch.randint(-127, 127, attn.k_proj.weight.shape, dtype=torch.int8)
    model.load_state_dict({**state, "layers.0.attn.k_proj.weight": new})
    assert torch.equal(attn.k_proj.weight, new)
    merged = adjacent_view(weights(), 0)
    assert merged is not None and merged.data_ptr() == merged_before.data_ptr()
    assert torch.equal(merged[attn.q_proj.out_features:][: new.shape[0]], new)
    assert torch.equal(CONCAT(weights(), 0), merged)


def test_compiled_model_reads_writes_to_one_projection():
    model, cfg = _model("int8", seed=2)
    tokens = torch.randint(0, cfg.vocab_size, (2, 5))
    compiled = torch.compile(model, backend="quantfuse")
    with torch.no_grad():
        torch.testing.assert_close(compiled(tokens), model(tokens), rtol=2e-3, atol=2e-3)
        v = _layer(model).attn.v_proj.weight
        v.copy_(torch.randint(-127, 127, v.shape, dtype=torch.int8))
        torch.testing.assert_close(compiled(tokens), model(tokens), rtol=2e-3, atol=2e-3)


def test_state_dict_of_merged_awq_layers_saves_with_safetensors(tmp_path):
    safetensors_torch = pytest.importorskip("safetensors.torch")
    model, _ = _model("awq-g32", seed=4)
    assert not _layer(model).attn.k_proj.scales.is_contiguous()  # a column slice of the merged tensor
    state = model.state_dict()
    safetensors_torch.save_file(state, str(tmp_path / "m.safetensors"))
    loaded = safetensors_torch.load_file(str(tmp_path / "m.safetensors"))
    assert all(torch.equal(loaded[k], state[k]) for k in state)
    fresh, _ = _model("awq-g32", seed=5)
    fresh.load_state_dict(loaded)
    attn = _layer(fresh).attn
    assert adjacent_view([attn.q_proj.qweight, attn.k_proj.qweight, attn.v_proj.qweight], 0) is not None
    assert state["layers.0.attn.k_proj.qweight"].dim() == 2  # saved in the AWQ layout
    assert torch.equal(attn.k_proj.awq_qweight(), state["layers.0.attn.k_proj.qweight"])


def test_merging_again_after_a_move_and_awq_modules_compute_the_same():
    model, cfg = _model("awq-g32", seed=3)
    tokens = torch.randint(0, cfg.vocab_size, (1, 4))
    with torch.no_grad():
        before = model(tokens)
    attn = _layer(model).attn
    # What a device move does: each view converted on its own.
    for m in (attn.q_proj, attn.k_proj, attn.v_proj):
        for name, t in held_tensors(m).items():
            if t is not None:
                compile_backend.quantize.set_tensors(m, **{name: t.clone()})
    assert len(_bases([attn.q_proj.qweight, attn.k_proj.qweight])) == 2
    mlp_qweight = _layer(model).mlp.gate_proj.qweight.data_ptr()
    assert share_input_storage(model) == 2
    assert len(_bases([attn.q_proj.qweight, attn.k_proj.qweight, attn.v_proj.qweight])) == 1
    assert _layer(model).mlp.gate_proj.qweight.data_ptr() == mlp_qweight  # merged already: left alone
    assert isinstance(attn.q_proj, AWQLinear)
    with torch.no_grad():
        assert torch.equal(model(tokens), before)
