"""Packers and reference quantized modules."""

from __future__ import annotations

import copy
import io

import pytest
import torch
import torch._dynamo.testing
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

import compile_backend.ops as ops
from compile_backend.derived.held_parameter import HeldParameter
from compile_backend.quantize import (
    AWQLinear,
    W8A8Linear,
    W8A16Linear,
    awq_pack,
    awq_unpack_values,
    held_tensors,
    quantize_model,
    quantize_weight_awq,
    quantize_weight_fp8,
    quantize_weight_int8,
    set_tensors,
)


@settings(max_examples=40, deadline=None)
@given(rows=st.integers(1, 9), packs=st.integers(1, 6), seed=st.integers(0, 2**31 - 1))
def test_awq_pack_unpack_is_identity(rows, packs, seed):
    values = torch.randint(0, 16, (rows, 8 * packs), dtype=torch.int32, generator=torch.Generator().manual_seed(seed))
    packed = awq_pack(values)
    assert packed.shape == (rows, packs) and packed.dtype == torch.int32
    assert torch.equal(awq_unpack_values(packed), values)


def test_awq_pack_rejects_out_of_range():
    with pytest.raises(ValueError, match=r"\[0, 15\]"):
        awq_pack(torch.full((1, 8), 16, dtype=torch.int32))
    with pytest.raises(ValueError, match="N % 8"):
        awq_pack(torch.zeros(1, 7, dtype=torch.int32))


@pytest.mark.parametrize("per_channel", [True, False])
def test_int8_weights_within_half_a_step(per_channel):
    w = torch.randn(48, 64) * 0.05
    q, s = quantize_weight_int8(w, per_channel)
    step = s.unsqueeze(1) if per_channel else s
    assert q.dtype == torch.int8
    assert ((q.float() * step - w).abs() <= step / 2 + 1e-7).all()


@pytest.mark.parametrize("per_channel", [True, False])
def test_fp8_weights_within_half_a_step(per_channel):
    w = torch.randn(48, 64) * 0.05
    q, s = quantize_weight_fp8(w, per_channel)
    scale = s.unsqueeze(1) if per_channel else s
    x = w / scale
    # e4m3 has 3 mantissa bits: the spacing around |x| is 2**(floor(log2|x|) - 3) (subnormals: 2**-9).
    spacing = torch.exp2(torch.floor(torch.log2(x.abs().clamp(min=2**-6))) - 3)
    assert ((q.float() - x).abs() <= spacing / 2 + 1e-7).all()


@pytest.mark.parametrize("group_size", [32, 64, 128, 256])
def test_awq_weights_within_half_a_step(group_size):
    N, K = 64, 256
    w = torch.randn(N, K) * 0.05
    qweight, qzeros, scales = quantize_weight_awq(w, group_size, torch.float32)
    deq = ops.awq_dequantize_reference(qweight, scales.half(), qzeros, group_size).float()
    # Compare in float32 on the float32 scales: the half-step bound is about rounding-to-nearest.
    q = awq_unpack_values(qweight).float()
    z = awq_unpack_values(qzeros).float().repeat_interleave(group_size, 0)
    s = scales.repeat_interleave(group_size, 0)
    assert (((q - z) * s - w.t()).abs() <= s / 2 + 1e-6).all()
    assert deq.shape == (K, N)


def test_awq_linear_from_state_dict_matches_original():
    lin = nn.Linear(128, 64).half()
    mod = AWQLinear.from_linear(lin, group_size=64)
    state = {f"layer.{k}": v for k, v in mod.state_dict().items()}
    loaded = AWQLinear.from_state_dict(state, prefix="layer.")
    assert loaded.group_size == 64
    x = torch.randn(3, 128).half()
    assert torch.equal(loaded(x), mod(x))
    with pytest.raises(ValueError, match=r"group_size 32 but 'layer.scales' \(shape \(2, 64\)\) implies 64"):
        AWQLinear.from_state_dict(state, prefix="layer.", group_size=32)
    with pytest.raises(KeyError, match="qzeros"):
        AWQLinear.from_state_dict({"qweight": state["layer.qweight"], "scales": state["layer.scales"]})


W8A8_VARIANTS = [
    dict(weight_dtype=torch.int8),
    dict(weight_dtype=torch.int8, per_channel=False, per_token=False),
    dict(weight_dtype=torch.int8, symmetric=False),
    dict(weight_dtype=torch.int8, symmetric=False, per_token=False),
    dict(weight_dtype=torch.float8_e4m3fn),
    dict(weight_dtype=torch.float8_e4m3fn, per_channel=False, per_token=False),
]


@pytest.mark.parametrize("kw", W8A8_VARIANTS, ids=str)
def test_w8a8_linear_is_close_to_float(kw):
    torch.manual_seed(0)
    lin = nn.Linear(256, 96)
    mod = W8A8Linear.from_linear(lin, out_dtype=torch.float32, **kw)
    x = torch.randn(4, 7, 256)
    ref, out = lin(x), mod(x)
    assert out.shape == ref.shape
    err = ((out - ref).norm() / ref.norm()).item()
    # int8 per-token/per-channel: ~1% relative error; fp8 e4m3 (3 mantissa bits): a few %.
    assert err < (0.02 if kw["weight_dtype"] == torch.int8 else 0.06), err


def test_w8a8_linear_static_calibration():
    torch.manual_seed(0)
    lin = nn.Linear(64, 32)
    x = torch.randn(16, 64)
    for symmetric in (True, False):
        mod = W8A8Linear.from_linear(lin, dynamic=False, per_token=False, symmetric=symmetric,
                                     out_dtype=torch.float32, calibration=x)
        assert ((mod(x) - lin(x)).norm() / lin(x).norm()) < 0.03
    with pytest.raises(ValueError, match="calibration"):
        W8A8Linear.from_linear(lin, dynamic=False, per_token=False)


def test_w8a8_linear_matches_scaled_mm_op():
    # The module's math is the op's: quantize, then one scaled_mm call.
    torch.manual_seed(0)
    mod = W8A8Linear.from_linear(nn.Linear(64, 32), out_dtype=torch.float32)
    x = torch.randn(5, 64)
    q, scale, _ = mod.quantize_input(x)
    out = torch.ops.quantfuse.scaled_mm(q, mod.weight.t(), scale, mod.weight_scale, torch.float32, mod.bias)
    torch.testing.assert_close(out, mod(x), rtol=1e-5, atol=1e-5)


STATIC_VARIANTS = [dict(weight_dtype=torch.int8, dynamic=False, per_token=False, symmetric=symmetric)
                   for symmetric in (True, False)]


@pytest.mark.parametrize("kw", W8A8_VARIANTS + STATIC_VARIANTS, ids=str)
@pytest.mark.parametrize("out_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("bias", [True, False])
def test_w8a8_forward_op_computes_the_form(kw, out_dtype, bias):
    """What eager CUDA inference runs (forward_op: one fused op call) is the function the
    dequantize-then-matmul form computes, for every scheme: the op's reference implementation
    runs here, with the operands forward_op hands it (a wrong scale axis, zero point or bias would
    be off by the output's own size)."""
    torch.manual_seed(1)
    lin = nn.Linear(128, 48, bias=bias)
    x = torch.randn(2, 5, 128)
    calibration = x if not kw.get("dynamic", True) else None
    mod = W8A8Linear.from_linear(lin, out_dtype=out_dtype, calibration=calibration, **kw)
    form = mod(x)  # on CPU forward writes the form
    op = mod.forward_op(x.reshape(-1, 128)).reshape(form.shape)
    assert op.dtype == form.dtype == out_dtype
    # float32 sums of the dequantized form against exact integer (fp8: float64) sums: the outputs
    # differ by the output dtype's rounding of values within float32 rounding of each other.
    tol = dict(rtol=1e-5, atol=1e-5) if out_dtype == torch.float32 else dict(rtol=1.6e-2, atol=1e-2)
    torch.testing.assert_close(op, form, **tol)


@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("group_size", [32, -1])
def test_awq_forward_op_computes_the_form(bias, group_size):
    torch.manual_seed(2)
    mod = AWQLinear.from_linear(nn.Linear(128, 64, bias=bias), group_size=group_size, dtype=torch.bfloat16)
    x = torch.randn(3, 4, 128, dtype=torch.bfloat16)
    form = mod(x)
    op = mod.forward_op(x.reshape(-1, 128)).reshape(form.shape)
    assert op.dtype == form.dtype == torch.bfloat16
    # the form rounds the product, then adds the bias; the op rounds once
    torch.testing.assert_close(op.float(), form.float(), rtol=1.6e-2, atol=2e-2)


@pytest.mark.gpu
@pytest.mark.compile
@pytest.mark.parametrize("scheme", ["int8", "int8-asym", "fp8-rowwise", "awq-g128", "w8a16"])
def test_eager_cuda_inference_calls_the_op(scheme, monkeypatch):
    """On CUDA, eager inference runs forward_op (the fused op); a call autograd records, and a
    traced one, write the form, which the passes fuse when compiling."""
    from compile_backend.passes import collecting_report

    model = quantize_model(nn.Sequential(nn.Linear(256, 256)).to("cuda", torch.float16), scheme)
    cls, calls = type(model[0]), []
    op_forward = cls.forward_op
    monkeypatch.setattr(cls, "forward_op", lambda self, x2: calls.append(tuple(x2.shape)) or op_forward(self, x2))
    x = torch.randn(2, 3, 256, device="cuda", dtype=torch.float16)
    with torch.no_grad():
        y = model(x)
    assert calls == [(6, 256)] and y.shape == (2, 3, 256) and y.dtype == torch.float16
    form = model(x.clone().requires_grad_())
    assert len(calls) == 1
    torch.testing.assert_close(y, form.detach(), rtol=2e-2, atol=2e-2)
    torch._dynamo.reset()
    with torch.no_grad(), collecting_report() as report:
        compiled = torch.compile(model, backend="quantfuse", options={"fx_graph_cache": False})(x)
    assert len(calls) == 1 and len(report.fused) == 1 and not report.unfused, report
    torch.testing.assert_close(compiled, y, rtol=2e-2, atol=2e-2)


def test_quantize_model_swaps_linears_and_skips_lm_head():
    from compile_backend.models.llama import tiny_llama

    model = quantize_model(tiny_llama(), "int8")
    kinds = {type(m).__name__ for n, m in model.named_modules() if n.endswith("_proj")}
    assert kinds == {"W8A8Linear"}
    assert isinstance(model.lm_head, nn.Linear)
    awq = quantize_model(tiny_llama(dtype=torch.float16), "awq-g64")
    assert all(m.group_size == 64 for m in awq.modules() if isinstance(m, AWQLinear))
    with pytest.raises(ValueError, match="scheme 'int3'"):
        quantize_model(tiny_llama(), "int3")


def test_quantize_model_lm_head_opt_in():
    """``lm_head=``: the head quantized with its own scheme (the body's is another), never searched; a head
    tied to the embedding gets its own copy; a bad or absent head raises, leaving the model unchanged."""
    from compile_backend.models.llama import tiny_llama

    model = quantize_model(tiny_llama(), "int8", lm_head="w8a16")
    assert isinstance(model.lm_head, W8A16Linear)
    assert {type(m) for n, m in model.named_modules() if n.endswith("_proj")} == {W8A8Linear}
    tied = tiny_llama()
    tied.lm_head.weight = tied.embed.weight
    embed = tied.embed.weight
    quantize_model(tied, "w8a16", lm_head="int8")
    assert isinstance(tied.lm_head, W8A8Linear) and tied.embed.weight is embed
    # the head's scheme may also be the body's: the head is quantized as it would be alone
    same = quantize_model(tiny_llama(), "w8a16", lm_head="w8a16")
    alone = W8A16Linear.from_linear(tiny_llama().lm_head)
    assert isinstance(same.lm_head, W8A16Linear) and torch.equal(same.lm_head.weight, alone.weight)
    fresh = tiny_llama()
    head = fresh.lm_head
    with pytest.raises(ValueError, match="lm_head 'int3'"):
        quantize_model(fresh, "int8", lm_head="int3")
    with pytest.raises(ValueError, match="no nn.Linear named 'lm_head'"):
        quantize_model(nn.Sequential(nn.Linear(16, 16)), "int8", lm_head="w8a16")
    assert fresh.lm_head is head and all(type(m) is not W8A8Linear for m in fresh.modules())


@pytest.mark.compile
def test_awq_in_a_float32_model_runs_eager_and_compiled():
    """AWQ layers of a float32 model take and give float32 (computing in float16 between the
    casts), so the model runs, eagerly and compiled with every layer fused, close to float32."""
    from compile_backend.models.llama import tiny_llama
    from compile_backend.passes import collecting_report

    dense = tiny_llama()
    model = quantize_model(tiny_llama(), "awq-g32")
    layers = [m for m in model.modules() if isinstance(m, AWQLinear)]
    assert layers and all(m.out_dtype == torch.float32 and m.scales.dtype == torch.float16 for m in layers)
    tokens = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        want, eager = dense(tokens), model(tokens)
        torch._dynamo.reset()
        with collecting_report() as report, torch._functorch.config.patch(enable_autograd_cache=False):
            compiled = torch.compile(model, backend="quantfuse", options={"fx_graph_cache": False})(tokens)
    assert eager.dtype == compiled.dtype == torch.float32
    assert len(report.fused) == len(layers), str(report)
    rel = float((compiled - eager).norm() / eager.norm())
    assert rel < 1e-2, rel
    # 4-bit weights of a random model: about 12% per layer (16% measured on the logits)
    assert float((eager - want).norm() / want.norm()) < 0.25


def _awq_dequantized(qweight, qzeros, scales, group_size):
    """[N, K] float32 dequantization from the packed tensors (the op's arithmetic, in float32)."""
    q = awq_unpack_values(qweight).float()
    z = awq_unpack_values(qzeros).float().repeat_interleave(group_size, 0)
    return ((q - z) * scales.float().repeat_interleave(group_size, 0)).t()


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_awq_all_zero_and_constant_groups(dtype):
    # Pruned or padded channels: a float16 scale floor of 1e-8 rounds to 0 and 0/0 broke packing;
    # a constant group must come back as the constant (rounded to dtype), zeros as exact zeros.
    N, K, G = 16, 256, 32
    w = torch.randn(N, K, generator=torch.Generator().manual_seed(0)) * 0.05
    w[:, 0:32] = 0.0
    w[:8, 32:64] = 0.3
    w[8:, 32:64] = -1e-3
    w[:, 64:96] = 7.0
    w[:4, 96:128] = -2.5e-5  # a float16 subnormal: below the smallest normal scale, quantizes to 0
    w[4:, 96:128] = 65504.0 if dtype == torch.float16 else 1e30
    qweight, qzeros, scales = quantize_weight_awq(w, G, dtype)
    assert (scales >= torch.finfo(dtype).tiny).all() and torch.isfinite(scales).all()
    deq = _awq_dequantized(qweight, qzeros, scales, G)
    exact = w.to(dtype).float()
    assert torch.equal(deq[:, :96], exact[:, :96])
    tiny = torch.zeros(4, 32) if dtype == torch.float16 else exact[:4, 96:128]  # bfloat16 holds -2.5e-5
    assert torch.equal(deq[:4, 96:128], tiny)
    assert torch.equal(deq[4:, 96:128], exact[4:, 96:128])
    # The random groups stay within half a step, plus what rounding the scale to dtype moves
    # the top of the range (up to 15 steps times the scale's relative rounding).
    s = scales.float().repeat_interleave(G, 0).t()
    bound = s * (0.5 + 15 * torch.finfo(dtype).eps)
    assert ((deq[:, 128:] - w[:, 128:]).abs() <= bound[:, 128:]).all()
    # Through the module and quantize_model, on a layer whose first group is all zeros.
    lin = nn.Linear(K, N).to(dtype)
    with torch.no_grad():
        lin.weight[:, :G] = 0
    mod = AWQLinear.from_linear(lin, group_size=G, dtype=dtype)
    assert torch.equal(mod.dequantized_weight()[:G], torch.zeros(G, N, dtype=dtype))
    model = quantize_model(nn.Sequential(lin), "awq-g32")
    assert isinstance(model[0], AWQLinear)


def test_awq_groups_that_do_not_straddle_zero():
    # All-positive (or all-negative) groups: the range is widened to include 0, so a zero
    # point in [0, 15] describes it and every value is within half a step.
    w = torch.rand(8, 64, generator=torch.Generator().manual_seed(1)) * 0.01 + 1.0
    w[4:] *= -1
    qweight, qzeros, scales = quantize_weight_awq(w, 32, torch.float32)
    deq = _awq_dequantized(qweight, qzeros, scales, 32)
    s = scales.repeat_interleave(32, 0).t()
    assert ((deq - w).abs() <= s / 2 + 1e-6).all()


def test_awq_weights_beyond_the_scale_range_raise():
    w = torch.full((8, 32), 1e6)
    w[0, 0] = -1e6
    with pytest.raises(ValueError, match="beyond torch.float16's range"):
        quantize_weight_awq(w, 32, torch.float16)


# --------------------------------------------------------------------------- all-or-nothing conversion


def test_quantize_model_is_all_or_nothing():
    # The second layer's K = 48 is not divisible by the group size 32: nothing may be converted.
    first, second = nn.Linear(64, 16), nn.Linear(48, 16)
    model = nn.Sequential(first, nn.Sequential(nn.ReLU(), second))
    with pytest.raises(ValueError, match=r"layer '1\.1' .*group_size 32 does not divide in_features 48.*unchanged"):
        quantize_model(model, "awq-g32")
    assert model[0] is first and model[1][1] is second


def test_quantize_model_shares_the_replacement_of_a_shared_linear():
    shared = nn.Linear(32, 16)
    model = nn.Module()
    model.a, model.b = nn.Sequential(shared), nn.Sequential(shared)
    quantize_model(model, "int8")
    assert isinstance(model.a[0], W8A8Linear) and model.a[0] is model.b[0]


# --------------------------------------------------------------------------- dtype conversions keep quantized storage


def _bits(t):
    return t.view(torch.uint8) if t.dtype == torch.float8_e4m3fn else t


@pytest.mark.parametrize("kw", W8A8_VARIANTS + [dict(weight_dtype=torch.int8, dynamic=False, per_token=False,
                                                     symmetric=False)], ids=str)
@pytest.mark.parametrize("convert", ["to", "half", "bfloat16", "float"])
def test_w8a8_dtype_conversion_changes_only_the_activation_dtype(kw, convert):
    torch.manual_seed(0)
    lin = nn.Linear(64, 32)
    calibration = torch.randn(8, 64) if kw.get("dynamic", True) is False else None
    mod = W8A8Linear.from_linear(lin, out_dtype=torch.float32, calibration=calibration, **kw)
    mod.bias = None
    before = {k: v.clone() for k, v in mod.state_dict().items()}
    reference = W8A8Linear.from_linear(lin, out_dtype=torch.float32, calibration=calibration, **kw)
    reference.bias = None
    target = {"to": torch.bfloat16, "half": torch.float16, "bfloat16": torch.bfloat16, "float": torch.float32}[convert]
    converted = mod.to(torch.bfloat16) if convert == "to" else getattr(mod, convert)()
    assert converted is mod and mod.out_dtype == target
    for name, value in mod.state_dict().items():
        assert value.dtype == before[name].dtype, name
        assert torch.equal(_bits(value), _bits(before[name])), name
    x = torch.randn(3, 64).to(target)
    torch.testing.assert_close(mod(x), reference(x.float()).to(target), rtol=0, atol=0)


def test_w8a8_bias_follows_the_activation_dtype():
    mod = W8A8Linear.from_linear(nn.Linear(32, 16), out_dtype=torch.float32)
    bias = mod.bias.clone()
    mod.bfloat16()
    assert mod.bias.dtype == torch.bfloat16 and torch.equal(mod.bias, bias.to(torch.bfloat16))
    assert mod.weight.dtype == torch.int8 and mod.weight_scale.dtype == torch.float32


def test_quantized_modules_still_move_between_devices():
    w8 = W8A8Linear.from_linear(nn.Linear(32, 16), weight_dtype=torch.float8_e4m3fn, out_dtype=torch.float16)
    awq = AWQLinear.from_linear(nn.Linear(64, 16).half(), group_size=32)
    for mod in (w8, awq):
        dtypes = {k: v.dtype for k, v in mod.state_dict().items()}
        mod.to("meta", torch.bfloat16)
        assert all(v.device.type == "meta" for v in mod.state_dict().values())
        assert mod.out_dtype == torch.bfloat16
        mod.to_empty(device="cpu")
        assert all(v.device.type == "cpu" for v in mod.state_dict().values())
        if mod is w8:
            assert {k: v.dtype for k, v in mod.state_dict().items()} == {**dtypes, "bias": torch.bfloat16}
        else:  # bfloat16 is an AWQ activation dtype: scales and bias follow it
            assert {k: v.dtype for k, v in mod.state_dict().items()} == {
                **dtypes, "scales": torch.bfloat16, "bias": torch.bfloat16}


def test_awq_dtype_conversions():
    torch.manual_seed(0)
    mod = AWQLinear.from_linear(nn.Linear(64, 16).half(), group_size=32)
    original = {k: v.clone() for k, v in mod.state_dict().items()}
    x = torch.randn(3, 64).half()
    y16 = mod(x)
    # float32 is not an AWQ format dtype: scales and bias stay float16, the layer casts around them.
    mod.float()
    assert mod.out_dtype == torch.float32
    assert all(torch.equal(v, original[k]) and v.dtype == original[k].dtype for k, v in mod.state_dict().items())
    out = mod(x.float())
    assert out.dtype == torch.float32 and torch.equal(out, y16.float())
    # float16 -> bfloat16 converts the scales and bias (rounding them), the packed weights stay.
    mod.bfloat16()
    assert mod.out_dtype == torch.bfloat16 and mod.scales.dtype == torch.bfloat16
    assert torch.equal(mod.scales, original["scales"].to(torch.bfloat16))
    assert torch.equal(mod.bias, original["bias"].to(torch.bfloat16))
    assert torch.equal(mod.qweight, original["qweight"]) and torch.equal(mod.qzeros, original["qzeros"])
    xb = x.to(torch.bfloat16)
    expected = xb @ mod.dequantized_weight() + mod.bias
    assert torch.equal(mod(xb), expected)
    assert "dtype=torch.bfloat16" in repr(mod)


def test_a_failed_conversion_leaves_the_module_as_it_was():
    mod = W8A8Linear.from_linear(nn.Linear(32, 16), out_dtype=torch.float32)
    before = {k: v.clone() for k, v in mod.state_dict().items()}

    def half_unless_bias(t):
        if t.dim() == 1 and t.shape[0] == 16 and t.dtype == torch.float32 and t is mod.bias:
            raise RuntimeError("conversion failed")
        return t.half() if t.is_floating_point() else t

    with pytest.raises(RuntimeError, match="conversion failed"):
        mod._apply(half_unless_bias)
    assert mod.out_dtype == torch.float32
    for name, value in mod.state_dict().items():
        assert value.dtype == before[name].dtype and torch.equal(value, before[name]), name


# --------------------------------------------------------------------------- AWQ validation


@pytest.mark.parametrize("group_size", [-4, 48, 1.5])
def test_awq_linear_rejects_bad_group_sizes(group_size):
    with pytest.raises(ValueError, match=rf"group_size {group_size!r}; expected a positive divisor of in_features 128"):
        AWQLinear(128, 64, group_size=group_size)


def _awq_state():
    torch.manual_seed(0)
    return AWQLinear.from_linear(nn.Linear(128, 64).half(), group_size=32).state_dict()


@pytest.mark.parametrize("key, value, match", [
    ("scales", lambda s: s["scales"][:3], r"'m\.scales' has shape \(3, 64\).*K/group_size rows, a divisor of K = 128"),
    ("scales", lambda s: s["scales"][:0], r"'m\.scales' has shape \(0, 64\).*K/group_size rows"),
    ("scales", lambda s: s["scales"][:, :32], r"'m\.scales' has shape \(4, 32\).*N = 64"),
    ("scales", lambda s: s["scales"].float(), r"'m\.scales' .*float16 or bfloat16"),
    ("qzeros", lambda s: s["qzeros"][:2], r"'m\.qzeros' has shape \(2, 8\).*\(4, 8\)"),
    ("qweight", lambda s: s["qweight"].float(), r"'m\.qweight' .*int32"),
    ("bias", lambda s: s["bias"][:8], r"'m\.bias' has shape \(8,\).*N = 64"),
    ("g_idx", lambda s: torch.randperm(128, generator=torch.Generator().manual_seed(0)) // 32,
     r"'m\.g_idx' assigns input channels to groups out of order"),
])
def test_awq_from_state_dict_names_the_bad_key(key, value, match):
    state = _awq_state()
    state[key] = value(state)
    with pytest.raises(ValueError, match=match):
        AWQLinear.from_state_dict({f"m.{k}": v for k, v in state.items()}, prefix="m.")


def test_awq_from_state_dict_accepts_an_in_order_g_idx():
    state = _awq_state()
    state["g_idx"] = torch.arange(128, dtype=torch.int32) // 32
    mod = AWQLinear.from_state_dict(state)
    assert mod.group_size == 32 and torch.equal(mod.scales, state["scales"])


# --------------------------------------------------------------------------- held tensors: writes through .data


def _w8a8_holding_all() -> W8A8Linear:
    """Static asymmetric activations: weight, weight_scale, bias, input_scale and input_zero_point."""
    torch.manual_seed(0)
    return W8A8Linear.from_linear(
        nn.Linear(64, 32),
        dynamic=False,
        per_token=False,
        symmetric=False,
        out_dtype=torch.float32,
        calibration=torch.randn(8, 64),
    )


def _awq_holding_all() -> AWQLinear:
    torch.manual_seed(0)
    return AWQLinear.from_linear(nn.Linear(64, 32).half(), group_size=32)


def _w8a16_holding_all() -> W8A16Linear:
    torch.manual_seed(0)
    return W8A16Linear.from_linear(nn.Linear(64, 32), dtype=torch.float32)


HOLDERS = {"w8a8": _w8a8_holding_all, "awq": _awq_holding_all, "w8a16": _w8a16_holding_all}
HELD_NAMES = {
    "w8a8": ("weight", "weight_scale", "bias", "input_scale", "input_zero_point"),
    "awq": ("qweight", "qzeros", "scales", "bias"),
    "w8a16": ("weight", "weight_scale", "bias"),
}


def _other(t: torch.Tensor) -> torch.Tensor:
    """A new tensor like ``t`` whose every element differs from ``t``'s."""
    t = t.detach()
    return (t.float() * 2 + 1).to(t.dtype) if t.is_floating_point() else t ^ 5


def _first(t: torch.Tensor) -> torch.Tensor:
    """``t[0]``, a view (of a 0-d tensor, its one element)."""
    return t[0] if t.dim() else t.view(1)[0]


def _assert_held(mod: nn.Module) -> None:
    """Every tensor ``mod`` holds is a frozen HeldParameter whose ``.data`` shares its version counter."""
    held = {name: t for name, t in held_tensors(mod).items() if t is not None}
    assert held
    for name, t in held.items():
        assert type(t) is HeldParameter and not t.requires_grad, (name, type(t), t.requires_grad)
        version = t._version
        t.data.view(-1)[:1].copy_(t.detach().view(-1)[:1].clone())  # the same value, written
        assert t._version > version, f"{name}: a write through .data is not seen"


@pytest.mark.parametrize("holder, name", [(h, n) for h, names in HELD_NAMES.items() for n in names])
def test_writes_through_data_bump_the_version(holder, name):
    """Values derived from weights are cached per version counter: a write through ``.data`` (the
    loaders' idiom), or through a view of it, bumps the held tensor's."""
    t = getattr(HOLDERS[holder](), name)
    new = _other(t)
    version = t._version
    t.data.copy_(new)
    assert t._version > version and torch.equal(t, new)
    version = t._version
    _first(t.data).fill_(3)
    assert t._version > version and bool((_first(t) == 3).all())


@pytest.mark.parametrize("holder", HOLDERS)
def test_assigning_data_replaces_it(holder):
    """``.data = other`` still gives the parameter ``other``'s storage; later writes through ``.data``
    are seen."""
    mod = HOLDERS[holder]()
    for name in HELD_NAMES[holder]:
        t = getattr(mod, name)
        other = _other(t)
        t.data = other
        assert getattr(mod, name) is t and type(t) is HeldParameter
        assert t.data_ptr() == other.data_ptr() and torch.equal(t, other)
        newer, version = _other(other), t._version
        t.data.copy_(newer)
        assert t._version > version and torch.equal(t, newer)


def _reload(obj, weights_only: bool):
    buffer = io.BytesIO()
    torch.save(obj, buffer)
    buffer.seek(0)
    return torch.load(buffer, weights_only=weights_only)


def _loaded_into_new(mod: nn.Module, state: dict, assign: bool = False) -> nn.Module:
    new = HOLDERS[{W8A8Linear: "w8a8", AWQLinear: "awq", W8A16Linear: "w8a16"}[type(mod)]]()
    new.load_state_dict(state, assign=assign)
    return new


def _replace_each(mod: nn.Module, make) -> nn.Module:
    for name, t in list(held_tensors(mod).items()):
        if t is not None:
            make(mod, name, t)
    return mod


def _set_as_accelerate_does(mod, name, t):
    mod._parameters[name] = type(t)(_other(t), requires_grad=False)


# Every way a quantized module's tensors are put in: path name -> fn(module) -> the module holding them.
PLACEMENTS = {
    "set_tensors": lambda m: set_tensors(m, **{n: _other(t) for n, t in held_tensors(m).items() if t is not None}),
    "set_tensors-parameter": lambda m: set_tensors(
        m, **{n: nn.Parameter(_other(t), requires_grad=False) for n, t in held_tensors(m).items() if t is not None}
    ),
    "setattr": lambda m: _replace_each(m, lambda m, n, t: setattr(m, n, _other(t))),
    "setattr-parameter": lambda m: _replace_each(
        m, lambda m, n, t: setattr(m, n, nn.Parameter(_other(t), requires_grad=False))
    ),
    "accelerate": lambda m: _replace_each(m, _set_as_accelerate_does),
    "load_state_dict": lambda m: _loaded_into_new(m, {k: _other(v) for k, v in m.state_dict().items()}),
    "load_state_dict-assign": lambda m: _loaded_into_new(
        m, {k: _other(v) for k, v in m.state_dict().items()}, assign=True
    ),
    "load_state_dict-parameters-assign": lambda m: _loaded_into_new(
        m, {k: nn.Parameter(_other(v), requires_grad=False) for k, v in m.state_dict().items()}, assign=True
    ),
    "to-meta-to_empty": lambda m: m.to("meta").to_empty(device="cpu"),
    "to-device-and-dtype": lambda m: m.to("meta", torch.bfloat16).to_empty(device="cpu"),
    "to-cpu": lambda m: m.to("cpu"),
    "to-dtype": lambda m: m.to(torch.bfloat16),
    "half": lambda m: m.half(),
    "bfloat16": lambda m: m.bfloat16(),
    "float": lambda m: m.float(),
    "deepcopy": copy.deepcopy,
    "save-module": lambda m: _reload(m, weights_only=False),
    "save-state_dict": lambda m: _loaded_into_new(m, _reload(m.state_dict(), weights_only=True)),
    "save-state_dict-keep_vars": lambda m: _loaded_into_new(
        m, _reload(m.state_dict(keep_vars=True), weights_only=True), assign=True
    ),
}
CONVERSIONS = (
    "load_state_dict",
    "load_state_dict-assign",
    "to-meta-to_empty",
    "to-device-and-dtype",
    "to-cpu",
    "to-dtype",
    "half",
    "bfloat16",
    "float",
)


@pytest.fixture(params=["default", "swap", "overwrite"])
def conversion_mode(request):
    """torch.__future__'s ways for nn.Module._apply and load_state_dict to put converted tensors in:
    ``.data =`` (default), ``swap_tensors``, or a new nn.Parameter."""
    setters = {
        "swap": torch.__future__.set_swap_module_params_on_conversion,
        "overwrite": torch.__future__.set_overwrite_module_params_on_conversion,
    }
    setter = setters.get(request.param)
    if setter is not None:
        setter(True)
    yield request.param
    if setter is not None:
        setter(False)


@pytest.mark.parametrize("holder", HOLDERS)
@pytest.mark.parametrize("how", PLACEMENTS)
def test_every_placement_holds_held_parameters(holder, how):
    mod = HOLDERS[holder]()
    _assert_held(mod)
    _assert_held(PLACEMENTS[how](mod))


@pytest.mark.parametrize("holder", HOLDERS)
@pytest.mark.parametrize("how", CONVERSIONS)
def test_conversions_hold_held_parameters_in_every_mode(holder, how, conversion_mode):
    _assert_held(PLACEMENTS[how](HOLDERS[holder]()))


def test_swapping_conversions_keep_the_held_objects():
    """Under swap_tensors the converted tensors keep their identity (what swapping is for), and their class."""
    torch.__future__.set_swap_module_params_on_conversion(True)
    try:
        mod = _w8a8_holding_all()
        weight, bias = mod.weight, mod.bias
        mod.half()  # the int8 weight is kept, the float32 bias converted
        assert mod.weight is weight and mod.bias is bias and bias.dtype == torch.float16
        mod.load_state_dict({k: _other(v) for k, v in mod.state_dict().items()})
        assert mod.weight is weight and mod.bias is bias
    finally:
        torch.__future__.set_swap_module_params_on_conversion(False)
    _assert_held(mod)


def test_a_plain_parameter_becomes_held_without_a_copy():
    mod = _awq_holding_all()
    plain = nn.Parameter(torch.ones_like(mod.scales), requires_grad=False)
    mod.scales = plain
    held = mod.scales
    assert type(held) is HeldParameter and held.data_ptr() == plain.data_ptr()
    version = held._version
    plain.add_(1)  # a write through the parameter it was made from is seen: they share the counter
    assert held._version > version and torch.equal(held, torch.full_like(held, 2))
    set_tensors(mod, scales=held)
    assert mod.scales is held
    again = HeldParameter(held, requires_grad=False)  # its own class, which nn.Parameter's constructor refuses
    assert type(again) is HeldParameter and again.data_ptr() == held.data_ptr() and again is not held
    assert repr(held).startswith("HeldParameter containing:\ntensor(")
    _assert_held(mod)


def test_held_tensors_pickle_as_held_parameters():
    """state_dict() holds plain tensors (a checkpoint loads without this package); pickled held
    tensors come back held, also through the weights-only unpickler."""
    mod = _w8a8_holding_all()
    assert all(type(v) is torch.Tensor for v in mod.state_dict().values())
    state = _reload(mod.state_dict(keep_vars=True), weights_only=True)
    assert list(state) == list(mod.state_dict())
    for name, t in state.items():
        assert type(t) is HeldParameter and not t.requires_grad and torch.equal(t, getattr(mod, name)), name
        version = t._version
        t.data.copy_(_other(t))
        assert t._version > version
    trainable = _reload(HeldParameter(torch.randn(3)), weights_only=True)
    assert type(trainable) is HeldParameter and trainable.requires_grad


@pytest.mark.parametrize("holder", HOLDERS)
def test_functional_call_leaves_the_held_tensors_in_place(holder):
    mod = HOLDERS[holder]()
    before = dict(mod._parameters)
    replaced = {n: _other(t) for n, t in before.items() if t is not None}
    x = torch.randn(3, 64, dtype=mod.bias.dtype)
    want = set_tensors(copy.deepcopy(mod), **replaced)(x)
    assert torch.equal(torch.func.functional_call(mod, replaced, (x,)), want)
    assert all(mod._parameters[n] is t for n, t in before.items())
    _assert_held(mod)


def _rel_err(got: torch.Tensor, ref: torch.Tensor) -> float:
    got, ref = got.float(), ref.float()
    return float((got - ref).norm() / ref.norm())


@pytest.mark.compile
@pytest.mark.parametrize("scheme", ["int8-asym", "awq-g32"])
def test_compiled_model_sees_writes_through_data(scheme):
    """Compiled once, in one graph; writes through ``.data`` after compiling recompile nothing, and the
    next call computes with the new weights: the values derived from them (the merged q/k/v weights,
    the column sums of asymmetric int8 weights; on CPU cached by ``ops.concat_weights.concat_cache`` and
    ``ops.scaled_mm_azp.colsum_cache``) are made again, as their version counters changed."""
    from compile_backend.models.llama import LlamaConfig, tiny_llama

    dtype = torch.float16 if scheme.startswith("awq") else torch.float32
    cfg = LlamaConfig(vocab_size=64, hidden_size=128, intermediate_size=256, num_layers=1)
    model = quantize_model(tiny_llama(cfg, dtype=dtype), scheme)
    tokens = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(1))
    gen = torch.Generator().manual_seed(2)
    torch._dynamo.reset()
    counter = torch._dynamo.testing.CompileCounterWithBackend("quantfuse")
    compiled = torch.compile(model, backend=counter, fullgraph=True)
    with torch.no_grad():
        before = compiled(tokens)
        block = model.layers[0]
        for layer in (block.attn.q_proj, block.mlp.gate_proj, block.mlp.down_proj):  # merged, merged, alone
            if isinstance(layer, AWQLinear):
                layer.qweight.data.copy_(
                    torch.randint(-(2**31), 2**31 - 1, layer.qweight.shape, generator=gen, dtype=torch.int32)
                )
            else:
                layer.weight.data.copy_(torch.randint(-128, 128, layer.weight.shape, generator=gen, dtype=torch.int8))
        with torch._dynamo.config.patch(error_on_recompile=True):
            after = compiled(tokens)
        want = copy.deepcopy(model)(tokens)
    assert counter.frame_count == 1
    assert not torch.equal(after, before)
    assert _rel_err(after, want) < 5e-2, _rel_err(after, want)


@pytest.mark.gpu
@pytest.mark.compile
@pytest.mark.parametrize("scheme", ["int8-asym", "awq-g128"])
def test_compiled_cuda_model_sees_writes_through_data(scheme):
    """On CUDA the values derived from weights (the column sums of an asymmetric int8 weight, AWQ's
    repacked layouts) are cached in C++ per weight and version counter: after a write through
    ``.data`` the compiled model computes what a model built with the new weights computes."""
    torch.manual_seed(0)
    model = quantize_model(nn.Sequential(nn.Linear(256, 256)).to("cuda", torch.float16), scheme)
    layer = model[0]
    # Positive activations: per-token zero points far from 0, so that the column sums weigh in.
    # A decode and a prefill shape: the AWQ kernels for each read their own derived layouts.
    xs = [torch.rand(m, 256, device="cuda", dtype=torch.float16) + 0.5 for m in (4, 64)]
    torch._dynamo.reset()
    compiled = torch.compile(model, backend="quantfuse", options={"fx_graph_cache": False})
    with torch.no_grad():
        before = [compiled(x).clone() for x in xs]  # derived values of the old weight made and cached
        if scheme == "int8-asym":
            new = torch.randint(-128, 128, layer.weight.shape, dtype=torch.int8, device="cuda")
            layer.weight.data.copy_(new)
        else:
            new, _, _ = quantize_weight_awq(torch.randn(256, 256, device="cuda") * 0.05, layer.group_size)
            layer.qweight.data.copy_(new)
        fresh = copy.deepcopy(model)
        for x, old in zip(xs, before):
            got, want = compiled(x), fresh(x)
            assert not torch.equal(got, old)
            torch.testing.assert_close(got, want, rtol=2e-2, atol=2e-2)


# --------------------------------------------------------------------------- W8A16 (int8 weight-only)


def _w8a16_reference(mod: W8A16Linear, x: torch.Tensor) -> torch.Tensor:
    """float64 ``x @ (w_q · s)ᵀ + bias`` of the layer's own tensors."""
    w = mod.weight.double() * mod.weight_scale.double().reshape(-1, 1)
    y = x.double() @ w.t()
    return y if mod.bias is None else y + mod.bias.double()


@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "f32"])
@pytest.mark.parametrize("per_channel", [True, False], ids=["per-channel", "per-tensor"])
def test_w8a16_linear_forward_is_the_form(per_channel, dtype, bias):
    """``forward`` is ``F.linear`` of the weight dequantized in float32 and rounded once to the activation
    dtype (what ``passes/w8a16_gemm.py`` fuses); ``forward_op`` (eager CUDA inference: one ``w8a16_gemm``
    call, its reference here) applies the scale to the float32 sums: both within rounding of the float64
    product of the layer's tensors."""
    torch.manual_seed(3)
    lin = nn.Linear(128, 48, bias=bias)
    mod = W8A16Linear.from_linear(lin, per_channel=per_channel, dtype=dtype)
    q, s = quantize_weight_int8(lin.weight, per_channel)
    assert mod.weight.dtype == torch.int8 and torch.equal(mod.weight, q)
    assert mod.weight_scale.dtype == torch.float32 and torch.equal(mod.weight_scale, s)
    assert mod.weight_scale.shape == ((48,) if per_channel else ())
    x = torch.randn(2, 5, 128).to(dtype)
    w = (q.float() * (s.unsqueeze(1) if per_channel else s)).to(dtype)
    form = mod(x)
    assert form.dtype == dtype and form.shape == (2, 5, 48)
    assert torch.equal(mod.dequantized_weight(), w)
    assert torch.equal(form, F.linear(x, w, None if lin.bias is None else lin.bias.detach().to(dtype)))
    assert torch.equal(mod(x.double()), form)  # an input in another dtype is cast to the layer's
    op = mod.forward_op(x.reshape(-1, 128)).reshape(form.shape)
    assert op.dtype == dtype
    ref = _w8a16_reference(mod, x)
    tol = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=1.6e-2, atol=1e-2)
    torch.testing.assert_close(op.double(), ref, **tol)
    torch.testing.assert_close(form.double(), ref, **tol)
    # int8 round-to-nearest of the float layer: within about 1%
    with torch.no_grad():
        assert _rel_err(form, lin(x.float())) < 2e-2


def test_w8a16_linear_state_dict_round_trip():
    torch.manual_seed(0)
    mod = W8A16Linear.from_linear(nn.Linear(64, 32).to(torch.bfloat16))
    sd = mod.state_dict()
    assert list(sd) == ["weight", "weight_scale", "bias"]
    assert [v.dtype for v in sd.values()] == [torch.int8, torch.float32, torch.bfloat16]
    x = torch.randn(3, 64).to(torch.bfloat16)
    want = mod(x)
    again = W8A16Linear.from_state_dict({f"layer.{k}": v for k, v in sd.items()}, prefix="layer.")
    fresh = W8A16Linear(64, 32, dtype=torch.bfloat16)
    fresh.load_state_dict(sd)
    column = W8A16Linear.from_state_dict({**sd, "weight_scale": sd["weight_scale"].reshape(32, 1)})  # [N, 1]
    for other in (again, fresh, column):
        assert other.out_dtype == torch.bfloat16 and other.per_channel
        got = other.state_dict()
        assert all(torch.equal(got[k], v) and got[k].dtype == v.dtype for k, v in sd.items())
        assert torch.equal(other(x), want)
    assert repr(mod) == "W8A16Linear(64, 32, per_channel=True, dtype=torch.bfloat16, bias=True)"
    # the activation dtype: asked for, else the bias's, else a half scale's (a scale in neither float32 nor
    # the activation dtype is held in float32, exactly)
    half = {"weight": sd["weight"], "weight_scale": sd["weight_scale"].half()}
    layer = W8A16Linear.from_state_dict(half)
    assert layer.out_dtype == torch.float16 and layer.weight_scale.dtype == torch.float16 and layer.bias is None
    assert "scale_dtype=torch.float16" in repr(layer)
    layer = W8A16Linear.from_state_dict(half, dtype=torch.bfloat16)
    assert layer.weight_scale.dtype == torch.float32 and torch.equal(layer.weight_scale, half["weight_scale"].float())
    layer = W8A16Linear.from_state_dict({"weight": sd["weight"], "weight_scale": torch.tensor([0.01])},
                                        dtype=torch.float32)
    assert not layer.per_channel and layer.weight_scale.shape == () and layer.out_dtype == torch.float32


@pytest.mark.parametrize("key, value, match", [
    ("weight", lambda s: s["weight"].float(), r"'m\.weight' has shape \(32, 64\), dtype torch.float32; expected a "
                                              r"non-empty 2-D int8 tensor"),
    ("weight_scale", lambda s: s["weight_scale"][:5], r"'m\.weight_scale' has shape \(5,\).*N = 32 elements"),
    ("weight_scale", lambda s: s["weight_scale"].double(), r"'m\.weight_scale' .*float32, float16 or bfloat16"),
    ("bias", lambda s: s["bias"][:8], r"'m\.bias' has shape \(8,\).*N = 32"),
])
def test_w8a16_from_state_dict_names_the_bad_key(key, value, match):
    state = W8A16Linear.from_linear(nn.Linear(64, 32), dtype=torch.float16).state_dict()
    state[key] = value(state)
    with pytest.raises(ValueError, match=match):
        W8A16Linear.from_state_dict({f"m.{k}": v for k, v in state.items()}, prefix="m.")


def test_w8a16_linear_rejects_bad_arguments():
    with pytest.raises(KeyError, match="weight_scale"):
        W8A16Linear.from_state_dict({"weight": torch.zeros(4, 4, dtype=torch.int8)})
    with pytest.raises(ValueError, match=r"dtype torch.float64; expected torch.float16, torch.bfloat16 or torch"):
        W8A16Linear(64, 32, dtype=torch.float64)
    with pytest.raises(ValueError, match=r"scale_dtype torch.float16; expected torch.float32 or the activation dtype"):
        W8A16Linear(64, 32, dtype=torch.bfloat16, scale_dtype=torch.float16)
    with pytest.raises(ValueError, match=r"in_features 0; expected a positive integer"):
        W8A16Linear(0, 32)


def test_w8a16_dtype_conversions():
    """The int8 weight and a float32 scale keep their dtypes; bias and out_dtype follow the conversion; a
    scale held in the activation dtype stays with it, and becomes float32 (exactly) when it changes."""
    torch.manual_seed(0)
    mod = W8A16Linear.from_linear(nn.Linear(64, 32), dtype=torch.float32)
    before = {k: v.clone() for k, v in mod.state_dict().items()}
    for convert, target in (("half", torch.float16), ("bfloat16", torch.bfloat16), ("float", torch.float32),
                            ("to", torch.bfloat16)):
        converted = mod.to(target) if convert == "to" else getattr(mod, convert)()
        assert converted is mod and mod.out_dtype == target and mod.bias.dtype == target
        assert torch.equal(mod.weight, before["weight"]) and mod.weight.dtype == torch.int8
        assert torch.equal(mod.weight_scale, before["weight_scale"]) and mod.weight_scale.dtype == torch.float32
    assert torch.equal(mod.bias, before["bias"].half().bfloat16())  # rounded by .half(), then by .bfloat16()
    x = torch.randn(3, 64)
    xb = x.to(torch.bfloat16)
    assert torch.equal(mod(xb), F.linear(xb, mod.dequantized_weight(), mod.bias))
    half = W8A16Linear.from_state_dict({k: v.half() if v.is_floating_point() else v for k, v in before.items()})
    assert half.out_dtype == half.weight_scale.dtype == torch.float16
    scale = half.weight_scale.clone()
    half.half()
    assert half.weight_scale.dtype == torch.float16
    half.bfloat16()
    assert half.out_dtype == torch.bfloat16 and half.weight_scale.dtype == torch.float32
    assert torch.equal(half.weight_scale, scale.float())
    # a dtype the op does not take: the form, in it
    mod.double()
    assert mod.out_dtype == torch.float64 and mod.weight_scale.dtype == torch.float32
    assert torch.equal(mod(x.double()), F.linear(x.double(), mod.dequantized_weight(), mod.bias))


@pytest.mark.parametrize("per_channel", [True, False], ids=["per-channel", "per-tensor"])
def test_w8a16_tensor_parallel_shards(per_channel):
    """Column-wise shards hold their rows of the weight, scale (per-channel) and bias and compute their
    outputs; row-wise shards hold their columns of the weight, the whole scale and no bias, and their
    partial products plus the bias (``RowParallelLinear`` adds it once) give the layer's output."""
    from compile_backend.tensor_parallel import _shard_w8a16

    torch.manual_seed(0)
    mod = W8A16Linear.from_linear(nn.Linear(64, 32), per_channel=per_channel, dtype=torch.float32)
    x = torch.randn(3, 64)
    cols = [_shard_w8a16(mod, "m", "colwise", rank, 2) for rank in range(2)]
    rows = [_shard_w8a16(mod, "m", "rowwise", rank, 2) for rank in range(2)]
    for rank, (shard, bias) in enumerate(cols):
        assert bias is None and isinstance(shard, W8A16Linear) and shard.out_features == 16
        assert torch.equal(shard.weight, mod.weight[16 * rank:16 * (rank + 1)])
        assert torch.equal(shard.weight_scale, mod.weight_scale[16 * rank:16 * (rank + 1)] if per_channel
                           else mod.weight_scale)
        assert torch.equal(shard.bias, mod.bias[16 * rank:16 * (rank + 1)])
    for rank, (shard, bias) in enumerate(rows):
        assert bias is mod.bias and shard.bias is None and shard.in_features == 32
        assert torch.equal(shard.weight, mod.weight[:, 32 * rank:32 * (rank + 1)])
        assert torch.equal(shard.weight_scale, mod.weight_scale)
    with torch.no_grad():
        want = mod(x)
        torch.testing.assert_close(torch.cat([s(x) for s, _ in cols], -1), want, rtol=1e-6, atol=1e-6)
        partial = sum(s(x[:, 32 * r:32 * (r + 1)]) for r, (s, _) in enumerate(rows))
        torch.testing.assert_close(partial + mod.bias, want, rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match=r"layer 'm': out_features 32 cannot be split evenly over 3 ranks"):
        _shard_w8a16(mod, "m", "colwise", 0, 3)


@pytest.mark.compile
def test_w8a16_compiled_fuses_every_layer():
    """W8A16 layers per-channel and per-tensor, with and without bias, float32 and bfloat16 scales, 3-D
    activations: ``explain`` counts every one fused, and the compiled model computes eager's output but
    for the form's rounding of each weight element (the op scales the float32 sums instead)."""
    from compile_backend import explain
    from compile_backend.passes import collecting_report

    torch.manual_seed(0)
    bf16 = torch.bfloat16
    half_scale = W8A16Linear.from_linear(nn.Linear(48, 48), dtype=bf16)
    set_tensors(half_scale, weight_scale=half_scale.weight_scale.to(bf16))
    model = nn.Sequential(
        W8A16Linear.from_linear(nn.Linear(64, 48), dtype=bf16), nn.ReLU(), half_scale, nn.ReLU(),
        W8A16Linear.from_linear(nn.Linear(48, 32, bias=False), per_channel=False, dtype=bf16))
    x = torch.randn(2, 3, 64, dtype=bf16)
    with torch.no_grad():
        report = explain(model, x)
        assert report.counts() == {"w8a16_gemm": 3} and not report.unfused, str(report)
        eager = model(x)
        torch._dynamo.reset()
        with collecting_report() as report, torch._functorch.config.patch(enable_autograd_cache=False):
            compiled = torch.compile(model, backend="quantfuse", options={"fx_graph_cache": False})(x)
    assert report.counts() == {"w8a16_gemm": 3}, str(report)
    assert compiled.dtype == bf16 and _rel_err(compiled, eager) < 1e-2, _rel_err(compiled, eager)


def test_quantize_model_w8a16():
    """``quantize_model(..., "w8a16")``: every linear but ``lm_head`` a per-channel ``W8A16Linear`` in the
    model's dtype, q/k/v and gate/up stored as views of one merged tensor; close to the float model."""
    from compile_backend.models.llama import LlamaConfig, tiny_llama

    cfg = LlamaConfig(vocab_size=64, hidden_size=128, intermediate_size=256, num_layers=1)
    dense = tiny_llama(cfg)
    model = quantize_model(tiny_llama(cfg), "w8a16")
    layers = [m for m in model.modules() if isinstance(m, W8A16Linear)]
    assert len(layers) == 7 and isinstance(model.lm_head, nn.Linear)
    assert all(m.out_dtype == torch.float32 and m.per_channel and m.weight_scale.dtype == torch.float32
               for m in layers)
    attn, mlp = model.layers[0].attn, model.layers[0].mlp
    for group in ((attn.q_proj, attn.k_proj, attn.v_proj), (mlp.gate_proj, mlp.up_proj)):
        for name in ("weight", "weight_scale"):
            assert len({getattr(m, name).untyped_storage().data_ptr() for m in group}) == 1, name
    tokens = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert _rel_err(model(tokens), dense(tokens)) < 5e-2
    o_proj = quantize_model(tiny_llama(cfg, dtype=torch.bfloat16), "w8a16").layers[0].attn.o_proj
    assert isinstance(o_proj, W8A16Linear) and o_proj.out_dtype == torch.bfloat16
