"""The AWQ pass's GPTQ reading (passes/awq_gemm.py): a matmul whose weight is a GPTQ 4-bit dequantization
written in torch ops fuses into ``gptq_to_awq`` (the conversion, once per weight) and ``awq_gemm``.

The layers are written the way the libraries write them, so that the tests need neither package:
GPTQModel's ``TorchQuantLinear`` (what transformers' GPTQ gives with ``backend="torch"``: shift tables held
as buffers, nibbles cast to int8, ``scales[g_idx] * (weight - zeros[g_idx])``, v2 zero points) and AutoGPTQ's
torch forms (v1 zero points: ``zeros + 1`` then the mask, through ``g_idx`` or by reshaping the weight into
its groups).
"""

from __future__ import annotations

import pytest
import torch
from awq_data import check_close
from pass_helpers import apply_passes, count_calls, graph_str
from test_pass_awq_gemm import assert_output_close
from torch import nn

import compile_backend
from compile_backend.ops import QuantfuseInputError
from compile_backend.ops.awq_gemm import GPTQ_SHIFTS

aten = torch.ops.aten
AWQ_GEMM = torch.ops.quantfuse.awq_gemm.default
GPTQ_TO_AWQ = torch.ops.quantfuse.gptq_to_awq.default
K, N = 256, 64


# --------------------------------------------------------------------------- GPTQ layers in torch form


def _int32(words: torch.Tensor) -> torch.Tensor:
    return (words - ((words >> 31) << 32)).to(torch.int32)


def gptq_tensors(group: int, sym: bool, act_order: bool, v1: bool, seed: int = 0, k: int = K, n: int = N):
    """(q [K, N], z [K/G, N], s, g_idx, bias) of a GPTQ layer and its packed (qweight, qzeros).  v1 stores
    each zero point minus one, so its zero points are 1..15 (a 0 would borrow from the next nibble)."""
    G = k if group == -1 else group
    gen = torch.Generator().manual_seed(seed)
    q = torch.randint(0, 16, (k, n), generator=gen)
    z = torch.full((k // G, n), 8) if sym else torch.randint(1 if v1 else 0, 16, (k // G, n), generator=gen)
    s = (torch.rand(k // G, n, generator=gen) * 2e-2 + 1e-3).half()
    g_idx = torch.arange(k) // G
    if act_order:
        g_idx = g_idx[torch.randperm(k, generator=gen)]
    bias = torch.randn(n, generator=gen).half()
    shifts = torch.tensor(GPTQ_SHIFTS, dtype=torch.int64)
    qweight = _int32((q.reshape(k // 8, 8, n) << shifts[None, :, None]).sum(1))
    stored = (z - 1) if v1 else z
    qzeros = _int32((stored.reshape(k // G, n // 8, 8) << shifts).sum(-1))
    return dict(q=q, z=z, s=s, g_idx=g_idx.to(torch.int32), bias=bias, qweight=qweight, qzeros=qzeros, G=G)


class GPTQModelTorchLinear(nn.Module):
    """GPTQModel's ``TorchQuantLinear`` forward (``gptqmodel/nn_modules/qlinear/torch.py`` and
    ``PackableQuantLinear.dequantize_weight``): shift tables ``wf_unsqueeze_zero [1, 1, 8]`` and
    ``wf_unsqueeze_neg_one [1, 8, 1]`` as non-persistent buffers, the shifted words cast to int8 before
    ``& 15``, ``scales[g_idx] * (weight - zeros[g_idx])``, the activation flattened to 2-D, the bias
    added in place.  Zero points as stored (v2, what GPTQModel holds in memory).  ``wf`` replaces the
    shifts (a near miss)."""

    def __init__(self, t: dict, wf=GPTQ_SHIFTS):
        super().__init__()
        for name in ("qweight", "qzeros", "g_idx", "bias"):
            self.register_buffer(name, t[name])
        self.register_buffer("scales", t["s"])
        wf = torch.tensor(list(wf), dtype=torch.int32).unsqueeze(0)
        self.register_buffer("wf_unsqueeze_zero", wf.unsqueeze(0), persistent=False)
        self.register_buffer("wf_unsqueeze_neg_one", wf.unsqueeze(-1), persistent=False)
        self.out_features = t["s"].shape[1]

    def dequantize_weight(self):
        zeros = torch.bitwise_right_shift(torch.unsqueeze(self.qzeros, 2).expand(-1, -1, 8),
                                          self.wf_unsqueeze_zero).to(torch.int8)
        zeros = torch.bitwise_and(zeros, 15).reshape(self.scales.shape)
        weight = torch.bitwise_and(torch.bitwise_right_shift(torch.unsqueeze(self.qweight, 1).expand(-1, 8, -1),
                                                             self.wf_unsqueeze_neg_one).to(torch.int8), 15)
        weight = weight.reshape(weight.shape[0] * weight.shape[1], weight.shape[2])
        return self.scales[self.g_idx.long()] * (weight - zeros[self.g_idx.long()])

    def forward(self, x):
        out_shape = x.shape[:-1] + (self.out_features,)
        x = x.reshape(-1, x.shape[-1])
        out = torch.matmul(x, self.dequantize_weight().to(x.dtype)).reshape(out_shape)
        if self.bias is not None:
            out.add_(self.bias)
        return out


class AutoGPTQTorchLinear(nn.Module):
    """AutoGPTQ's torch forms of a v1 layer: shifts from a ``wf`` table, ``zeros + 1`` before the mask;
    ``grouped=False`` gathers by ``g_idx`` (its ``qlinear_cuda`` torch path), ``grouped=True`` reshapes the
    weight into ``[K/G, G, N]`` and broadcasts zeros and scales (``qlinear_cuda_old``: groups in order).
    ``input_scale`` multiplies the weight's rows by a per-input-channel vector (a near miss)."""

    def __init__(self, t: dict, grouped=False, input_scale=None):
        super().__init__()
        for name in ("qweight", "qzeros", "g_idx", "bias"):
            self.register_buffer(name, t[name])
        self.register_buffer("scales", t["s"])
        self.register_buffer("wf", torch.tensor(GPTQ_SHIFTS, dtype=torch.int32).unsqueeze(0), persistent=False)
        self.register_buffer("input_scale", input_scale)
        self.group_size, self.grouped = t["G"], grouped

    def forward(self, x):
        zeros = torch.bitwise_right_shift(torch.unsqueeze(self.qzeros, 2).expand(-1, -1, 8),
                                          self.wf.unsqueeze(0)).to(torch.int16)
        zeros = torch.bitwise_and(zeros + 1, 15)
        weight = torch.bitwise_right_shift(torch.unsqueeze(self.qweight, 1).expand(-1, 8, -1),
                                           self.wf.unsqueeze(-1)).to(torch.int16)
        weight = torch.bitwise_and(weight, 15)
        if self.grouped:
            zeros = zeros.reshape(-1, 1, zeros.shape[1] * zeros.shape[2])
            scales = self.scales.reshape(-1, 1, self.scales.shape[-1])
            weight = weight.reshape(-1, self.group_size, weight.shape[2])
            weight = (scales * (weight - zeros)).reshape(-1, scales.shape[-1])
        else:
            zeros = zeros.reshape(self.scales.shape)
            weight = weight.reshape(weight.shape[0] * weight.shape[1], weight.shape[2])
            weight = self.scales[self.g_idx.long()] * (weight - zeros[self.g_idx.long()])
        if self.input_scale is not None:
            weight = weight * self.input_scale[:, None]
        return torch.matmul(x, weight.to(x.dtype)) + self.bias


FORMS = {
    "gptqmodel-v2": (GPTQModelTorchLinear, False, {}),
    "autogptq-v1-g_idx": (AutoGPTQTorchLinear, True, {}),
    "autogptq-v1-grouped": (AutoGPTQTorchLinear, True, {"grouped": True}),
}


def make(form: str, group: int, sym: bool, act_order: bool, seed: int = 0, **kw):
    cls, v1, extra = FORMS[form]
    t = gptq_tensors(group, sym, act_order, v1, seed)
    return cls(t, **extra, **kw), t


def reference64(x: torch.Tensor, t: dict):
    """float64 ``x @ W`` of the layer's integers and its error scale: ``W = (q - z[g]) * s[g]`` rounded once
    to float16 (the op's dequantization), plus the bias."""
    g = t["g_idx"].long()
    w = ((t["q"] - t["z"][g]).half() * t["s"][g]).double()
    x64 = x.reshape(-1, x.shape[-1]).double()
    ref = x64 @ w + t["bias"].double()
    return ref, x64.abs() @ w.abs() + t["bias"].double().abs()


def assert_fused(r, t: dict, x: torch.Tensor, form: str, perm: bool):
    assert count_calls(r.after, AWQ_GEMM) == 1 and count_calls(r.after, GPTQ_TO_AWQ) == 1, graph_str(r.after)
    assert count_calls(r.after, aten.mm.default, aten.addmm.default, aten.bitwise_right_shift.Tensor) == 0
    (fused,) = r.report.fused
    assert (fused.family, fused.form) == ("awq_gemm", "gptq_v1" if FORMS[form][1] else "gptq_v2"), r.report
    (op,) = [n for n in r.after.graph.nodes if n.target == AWQ_GEMM]
    assert op.args[4] == t["G"] and op.args[5] is not None  # the bias folded in
    # Act-order: x gathered by the conversion's perm in the graph (Inductor computes it where x is made).
    assert len(op.args) < 7 or op.args[6] is None, graph_str(r.after)
    gathers = [n for n in r.after.graph.nodes if n.target in (aten.index.Tensor, aten.index_select.default)]
    assert (len(gathers) == 1 and op.args[0] is gathers[0]) if perm else not gathers, graph_str(r.after)
    assert_output_close(r.output, r.expected)
    ref, mag = reference64(x, t)
    check_close(r.output.reshape(ref.shape), ref, mag, x.dtype, form)


# --------------------------------------------------------------------------- every variant fuses


@pytest.mark.parametrize("form", ["gptqmodel-v2", "autogptq-v1-g_idx"])
@pytest.mark.parametrize("group", [32, 64, 128, -1])
@pytest.mark.parametrize("sym", [True, False], ids=["sym", "asym"])
@pytest.mark.parametrize("act_order", [False, True], ids=["in-order", "act-order"])
def test_gptq_variants_fuse(form, group, sym, act_order):
    """A g_idx is a graph input here, its values unknown when compiling: the op reads x gathered by the
    conversion's perm, the identity where the groups are in order."""
    mod, t = make(form, group, sym, act_order)
    x = torch.randn(2, 3, K, generator=torch.Generator().manual_seed(1)).half()
    assert_fused(apply_passes(mod, x, families=("awq_gemm",)), t, x, form, perm=True)


@pytest.mark.parametrize("group", [32, -1])
def test_groups_by_reshape_fuse_without_perm(group):
    """AutoGPTQ's grouped form reads no g_idx: the groups are in order and the op takes no perm."""
    mod, t = make("autogptq-v1-grouped", group, sym=False, act_order=False)
    x = torch.randn(5, K, generator=torch.Generator().manual_seed(2)).half()
    assert_fused(apply_passes(mod, x, families=("awq_gemm",)), t, x, "autogptq-v1-grouped", perm=False)


def test_gradients_equal_eager():
    """Under grad mode (an activation that requires grad) the forward is fused and the backward stays eager's."""
    mod, t = make("gptqmodel-v2", 64, sym=False, act_order=True)
    x = torch.randn(4, K, generator=torch.Generator().manual_seed(3)).half().requires_grad_()
    r = apply_passes(mod, x, families=("awq_gemm",), grad=True)
    assert count_calls(r.forward, AWQ_GEMM) == 1 and count_calls(r.forward, aten.mm.default) == 0
    assert_output_close(r.output, r.expected)
    g = torch.randn(r.output.shape, generator=torch.Generator().manual_seed(4)).half()
    (got,) = torch.autograd.grad(r.output, x, g)
    (want,) = torch.autograd.grad(r.expected, x, g)
    torch.testing.assert_close(got, want, rtol=0, atol=0)


@pytest.mark.compile
def test_compiled_layer_and_explain():
    """Through torch.compile(backend="quantfuse"): the generated code converts and calls awq_gemm, and
    explain() reports the layer fused."""
    mod, t = make("gptqmodel-v2", 32, sym=False, act_order=True)
    x = torch.randn(3, K, generator=torch.Generator().manual_seed(5)).half()
    report = compile_backend.explain(mod, x)
    assert [f.form for f in report.fused] == ["gptq_v2"] and not report.unfused, str(report)
    torch._dynamo.reset()
    with torch.no_grad():
        y = torch.compile(mod, backend="quantfuse", options={"fx_graph_cache": False})(x)
        assert_output_close(y, mod(x))
    torch._dynamo.reset()


@pytest.mark.compile
def test_freezing_keeps_the_fused_op():
    """Freezing does not fold the GPTQ dequantization into a dense weight: the joint slot fuses it first."""
    from test_pass_awq_gemm import _compile

    mod, t = make("gptqmodel-v2", 64, sym=True, act_order=True)
    x = torch.randn(4, K, generator=torch.Generator().manual_seed(6)).half()
    (y,), code, report, _ = _compile(mod, [x], freezing=True)
    assert report.counts()["awq_gemm"] == 1, str(report)
    assert "torch.ops.quantfuse.awq_gemm.default(" in code and "extern_kernels.mm" not in code
    with torch.no_grad():
        assert_output_close(y, mod(x))


# --------------------------------------------------------------------------- near misses


def assert_left_alone(r, reason: str):
    assert count_calls(r.after, AWQ_GEMM, GPTQ_TO_AWQ) == 0 and r.report.fused == [], graph_str(r.after)
    assert graph_str(r.before) == graph_str(r.after), "a near miss must leave the graph unchanged"
    torch.testing.assert_close(r.output, r.expected, rtol=0, atol=0)
    assert any(reason in u.reason for u in r.report.unfused), str(r.report)


class ArangeShifts(GPTQModelTorchLinear):
    """The shifts computed in the forward (graph constants) instead of held: ``order`` as given."""

    def __init__(self, t, order):
        super().__init__(t)
        self.order = list(order)

    def forward(self, x):
        wf = torch.tensor(self.order, dtype=torch.int32)
        self.wf_unsqueeze_zero, self.wf_unsqueeze_neg_one = wf[None, None, :], wf[None, :, None]
        return super().forward(x)


def test_near_miss_wrong_bit_order():
    """Rows read the nibbles of their word from the top down: another bit order than GPTQ's."""
    _, t = make("gptqmodel-v2", 64, sym=False, act_order=False)
    mod = ArangeShifts(t, order=range(28, -4, -4))
    r = apply_passes(mod, torch.randn(3, K).half(), families=("awq_gemm",))
    assert_left_alone(r, "bit order: rows 0..7 read bits [28, 24")


def test_near_miss_scaled_weight_rows():
    """The weight's rows multiplied by a per-input-channel vector: the weight reads one more tensor."""
    t = gptq_tensors(64, sym=False, act_order=False, v1=True)
    mod = AutoGPTQTorchLinear(t, input_scale=torch.rand(K).half() + 0.5)
    r = apply_passes(mod, torch.randn(3, K).half(), families=("awq_gemm",))
    assert_left_alone(r, "the weight also reads")


def test_scaled_activation_still_fuses():
    """An input scale applied to the activation stays outside the weight: the matmul is still GPTQ's."""
    mod, t = make("gptqmodel-v2", 64, sym=True, act_order=True)
    scale = torch.rand(K).half() + 0.5
    r = apply_passes(lambda x: mod(x * scale), torch.randn(3, K).half(), families=("awq_gemm",))
    assert count_calls(r.after, AWQ_GEMM) == 1
    assert_output_close(r.output, r.expected)


def test_near_miss_mismatched_shapes():
    """Per-channel zero points ([1, N/8], broadcast over the groups) with grouped scales: no group count
    fits both, so the tensors are not GPTQ's (nor AWQ's)."""
    t = gptq_tensors(64, sym=False, act_order=False, v1=True)
    t["qzeros"] = t["qzeros"][:1].clone()
    r = apply_passes(AutoGPTQTorchLinear(t, grouped=True), torch.randn(3, K).half(), families=("awq_gemm",))
    assert_left_alone(r, "with one group count")


# --------------------------------------------------------------------------- the conversion op


def test_gptq_to_awq_refuses_what_it_cannot_convert():
    """A shift table other than the matched one, uneven groups, and a v1 stored zero point of 15."""
    t = gptq_tensors(64, sym=False, act_order=True, v1=False)
    op = torch.ops.quantfuse.gptq_to_awq
    bad_table = torch.tensor(GPTQ_SHIFTS[::-1], dtype=torch.int32)
    with pytest.raises(QuantfuseInputError, match="shift_tables"):
        op(t["qweight"], t["qzeros"], t["g_idx"], 64, False, [bad_table])
    with pytest.raises(QuantfuseInputError, match="g_idx"):
        op(t["qweight"], t["qzeros"], torch.zeros(K, dtype=torch.int32), 64, False, [])
    with pytest.raises(QuantfuseInputError, match="v1 zero points"):
        op(t["qweight"], torch.full_like(t["qzeros"], -1), None, 64, True, [])


def test_gptq_to_awq_made_once_per_weight():
    from compile_backend.ops.awq_gemm import gptq_cache

    t = gptq_tensors(32, sym=False, act_order=True, v1=False)
    gptq_cache.clear()
    first = torch.ops.quantfuse.gptq_to_awq(t["qweight"], t["qzeros"], t["g_idx"], 32, False, [])
    again = torch.ops.quantfuse.gptq_to_awq(t["qweight"], t["qzeros"], t["g_idx"], 32, False, [])
    assert all(a is b for a, b in zip(first, again)) and gptq_cache.stats == {"computed": 1, "hits": 1}
    t["qweight"].add_(1)  # an in-place write makes the value again
    torch.ops.quantfuse.gptq_to_awq(t["qweight"], t["qzeros"], t["g_idx"], 32, False, [])
    assert gptq_cache.stats["computed"] == 2


# --------------------------------------------------------------------------- a Hugging Face model


@pytest.mark.compile
@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_llama_with_gptq_torch_layers_generates_as_eager(device, request):
    """A 2-layer LlamaForCausalLM whose linears are GPTQModel torch layers (act-order in layer 1), compiled
    with backend="quantfuse": every linear fused, ``generate`` tokens equal to eager's; on a GPU in
    ``reduce-overhead`` mode (CUDA graphs from the first call: the converted weights are made outside
    the graphs' memory pool)."""
    pytest.importorskip("transformers")
    if device == "cuda":
        request.getfixturevalue("cuda_kernels")
    import transformers
    from test_checkpoints_gptq import LINEARS
    from test_e2e_hf import assert_tokens_match, compiled_generate, eager_generate, prompt, tiny_causal_lm


    model = tiny_causal_lm(dtype=torch.float16)
    seed = 10
    for i, layer in enumerate(model.model.layers):
        for parent in (layer.self_attn, layer.mlp):
            for name, lin in list(parent.named_children()):
                if not isinstance(lin, nn.Linear):
                    continue
                seed += 1
                t = gptq_tensors(32, sym=False, act_order=i == 1, v1=False, seed=seed,
                                 k=lin.in_features, n=lin.out_features)
                t["s"] = (t["s"].float() * 0.3).half()  # keep the activations of the random model in range
                t["bias"] = None
                setattr(parent, name, GPTQModelTorchLinear(t))
    model.to(device)
    ids = prompt(model.config.vocab_size, device)
    ref_tokens, ref_logits = eager_generate(model, ids)

    config = transformers.CompileConfig(backend="quantfuse", mode="default" if device == "cpu" else "reduce-overhead")
    config._compile_all_devices = True  # transformers compiles on accelerators only unless told

    def only_awq(report, graphs):
        assert report.counts() == {"awq_gemm": LINEARS * graphs}, str(report)

    ((tokens, logits),) = compiled_generate(model, ids, config, LINEARS, "GPTQ torch layers", check=only_awq)
    assert_tokens_match(tokens, logits, ref_tokens, ref_logits, what="GPTQ torch layers")
    torch._dynamo.reset()

