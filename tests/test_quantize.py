"""Packers and reference quantized modules."""

from __future__ import annotations

import copy
import io

import pytest
import torch
import torch._dynamo.testing
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

import compile_backend.ops as ops
from compile_backend.derived.held_parameter import HeldParameter
from compile_backend.quantize import (
    AWQLinear,
    W8A8Linear,
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
@pytest.mark.parametrize("scheme", ["int8", "int8-asym", "fp8-rowwise", "awq-g128"])
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


HOLDERS = {"w8a8": _w8a8_holding_all, "awq": _awq_holding_all}
HELD_NAMES = {
    "w8a8": ("weight", "weight_scale", "bias", "input_scale", "input_zero_point"),
    "awq": ("qweight", "qzeros", "scales", "bias"),
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
    new = HOLDERS["w8a8" if isinstance(mod, W8A8Linear) else "awq"]()
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
