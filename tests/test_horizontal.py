"""Linears that share an input, merged into one quantfuse op over concatenated weights
(passes/horizontal.py, quantfuse::concat_weights).

* CPU (CI): a 2-layer Hugging Face Llama quantized with ``quantize_model`` (int8, int8-asym,
  fp8 with per-tensor weight scales, AWQ): the generated code holds 6 fused ops fewer (q/k/v
  -> 1 and gate/up -> 1 per layer); the logits are bit-exact to the unmerged compile (the
  reference implementations compute each output column the same way whatever N: W8A8 sums
  exactly and rounds once from the same float32 epilogue, and a broadcast per-tensor scale is
  the same float32 number; AWQ computes each column's float32 dot product over K in one
  order) and close to eager; weight updates after compiling (``copy_``, ``load_state_dict``)
  are seen by the next call; ops that differ in what they must share are left apart, with the
  reason where a weight is not a graph input; the concatenated weights never have their
  memory reused by Inductor.
* GPU: the same models on CUDA with CUDA graphs (``mode="reduce-overhead"``) from the first
  call, the concatenated weights made once (derived-value cache), and a weight update without
  CUDA graphs.
"""

from __future__ import annotations

import re

import pytest
import torch
from torch import nn
from torch._inductor.utils import run_and_get_code

from compile_backend import ops
from compile_backend.passes import collecting_report
from compile_backend.quantize import AWQLinear, W8A8Linear, quantize_model

transformers = pytest.importorskip("transformers")

pytestmark = pytest.mark.compile

CUDA = torch.cuda.is_available()
CACHES_OFF = {"fx_graph_cache": False}
FUSED_OP = re.compile(r"torch\.ops\.quantfuse\.(scaled_mm|scaled_mm_azp|awq_gemm)\.default\(")
# q/k/v become one op and gate/up one op in each of the 2 layers.
MERGED_AWAY = 2 * (2 + 1)


def tiny_llama(hidden=128, intermediate=256, dtype=torch.float32, device="cpu"):
    cfg = transformers.LlamaConfig(
        vocab_size=64, hidden_size=hidden, intermediate_size=intermediate, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64, attn_implementation="sdpa",
        tie_word_embeddings=False, initializer_range=0.1)
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(cfg).to(device=device, dtype=dtype).eval()


def compile_run(model, inputs: tuple, horizontal: bool, cudagraphs: bool = False):
    """(compiled callable, its first result, the generated code, the report).  ``cudagraphs``:
    Inductor's CUDA graphs, as mode="reduce-overhead" gives them (torch.compile takes a mode or
    options, not both)."""
    torch._dynamo.reset()
    options = {"horizontal": horizontal, **CACHES_OFF, **({"triton.cudagraphs": True} if cudagraphs else {})}
    compiled = torch.compile(model, backend="quantfuse", options=options)
    with collecting_report() as report, torch._functorch.config.patch(enable_autograd_cache=False):
        out, code = run_and_get_code(compiled, *inputs)
    return compiled, out, "\n".join(code), report


def fused_ops(code: str) -> int:
    return len(FUSED_OP.findall(code))


def rel_err(got, ref) -> float:
    got, ref = got.float(), ref.float()
    return float((got - ref).norm() / ref.norm())


def never_reused(code: str) -> None:
    """No buffer holding a concat_weights result is freed for reuse or written in place: Inductor
    names the op's result (``bufY = bufX``, X the fallback call, whose own name it may drop) and
    frees a reusable buffer with ``del bufY`` or hands it over with ``... = bufY; del bufY  # reuse``."""
    calls = set(re.findall(r"(buf\d+) = torch\.ops\.quantfuse\.concat_weights\.default\(", code))
    assert calls, "no concat_weights in the generated code"
    results = {a for a, b in re.findall(r"(buf\d+) = (buf\d+)\n", code) if b in calls} or calls
    for line in code.splitlines():
        for name in results:
            assert not re.search(rf"\bdel {name}\b", line), line
        for name in calls | results:
            assert not re.search(rf"\b{name}\b.*# reuse", line), line


def _tol(scheme: str) -> float:
    # Dynamic activation quantization re-rounds every layer's input: fp8's 3 mantissa bits make
    # compiled-vs-eager differences of several percent (plain Inductor shows the same).
    return 0.15 if scheme.startswith("fp8") else 5e-2


# --------------------------------------------------------------------------- CPU: a Hugging Face Llama

CPU_SCHEMES = {"int8": torch.float32, "int8-asym": torch.float32, "fp8": torch.float32, "awq-g32": torch.float16}


def _update_weights(model, scheme: str, how: str) -> None:
    """Change one q/k/v member and one gate/up member in place (``copy_``) or through ``load_state_dict``."""
    g = torch.Generator().manual_seed(7 if how == "copy_" else 8)
    names = (["model.layers.0.self_attn.k_proj", "model.layers.1.mlp.up_proj"])
    targets = {}
    for name in names:
        mod = model.get_submodule(name)
        if isinstance(mod, AWQLinear):
            targets[f"{name}.qweight"] = torch.randint(-2**31, 2**31 - 1, mod.qweight.shape, generator=g,
                                                       dtype=torch.int32)
        elif mod.weight.dtype == torch.int8:
            targets[f"{name}.weight"] = torch.randint(-127, 128, mod.weight.shape, generator=g, dtype=torch.int8)
        else:
            targets[f"{name}.weight"] = (torch.randn(mod.weight.shape, generator=g) * 100).to(mod.weight.dtype)
    if how == "copy_":
        for key, value in targets.items():
            module, attr = key.rsplit(".", 1)
            getattr(model.get_submodule(module), attr).copy_(value)
    else:
        state = model.state_dict()
        state.update(targets)
        model.load_state_dict(state)


@pytest.mark.parametrize("scheme", list(CPU_SCHEMES))
def test_llama_merged(scheme):
    model = quantize_model(tiny_llama(dtype=CPU_SCHEMES[scheme]), scheme)
    ids = torch.randint(0, 64, (1, 8), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        eager = model(ids).logits
        _, plain, plain_code, _ = compile_run(model, (ids,), horizontal=False)
        compiled, merged, code, report = compile_run(model, (ids,), horizontal=True)

    assert fused_ops(code) == fused_ops(plain_code) - MERGED_AWAY, code
    assert fused_ops(plain_code) == 14
    assert [len(m.members) for m in report.merged] == [3, 2, 3, 2], str(report)
    assert not report.not_merged, str(report)
    assert "merged 4 group(s)" in str(report)
    never_reused(code)
    assert torch.equal(merged.logits, plain.logits), (merged.logits - plain.logits).abs().max()
    assert rel_err(merged.logits, eager) < _tol(scheme)

    # Weight updates after compiling are seen by the next call (the concatenation is made again).
    if scheme in ("int8", "awq-g32"):
        for how in ("copy_", "load_state_dict"):
            before = compiled(ids).logits
            _update_weights(model, scheme, how)
            with torch.no_grad():
                after, ref = compiled(ids).logits, model(ids).logits
            assert not torch.equal(after, before), how
            assert rel_err(after, ref) < _tol(scheme), how


# --------------------------------------------------------------------------- CPU: what is left apart


class SharedInput(nn.Module):
    """Quantized linears reading one input."""

    def __init__(self, *linears):
        super().__init__()
        self.linears = nn.ModuleList(linears)

    def forward(self, x):
        return tuple(lin(x) for lin in self.linears)


def _w8a8(n, k=64, seed=0, **kw) -> W8A8Linear:
    torch.manual_seed(seed)
    return W8A8Linear.from_linear(nn.Linear(k, n), **kw)


def _merge_case(case: str):
    if case == "per-tensor-scales":  # different per-tensor weight scales: broadcast per channel, merged
        return SharedInput(_w8a8(32, per_channel=False, out_dtype=torch.float32),
                           _w8a8(48, seed=1, per_channel=False, out_dtype=torch.float32)), 1
    if case == "out-dtypes":
        return SharedInput(_w8a8(32, out_dtype=torch.float32), _w8a8(48, seed=1, out_dtype=torch.bfloat16)), 2
    if case == "weight-dtypes":  # int8 and fp8 weights quantize the input differently
        return SharedInput(_w8a8(32, out_dtype=torch.float32),
                           _w8a8(48, seed=1, weight_dtype=torch.float8_e4m3fn, out_dtype=torch.float32)), 2
    if case == "bias-in-one":
        lin = _w8a8(48, seed=1, out_dtype=torch.float32)
        lin.bias = None
        return SharedInput(_w8a8(32, out_dtype=torch.float32), lin), 2
    raise AssertionError(case)


@pytest.mark.parametrize("case", ["per-tensor-scales", "out-dtypes", "weight-dtypes", "bias-in-one"])
def test_members_that_differ(case):
    model, ops_left = _merge_case(case)
    x = torch.randn(4, 64, generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        eager = model(x)
        _, plain, _, _ = compile_run(model, (x,), horizontal=False)
        _, merged, code, report = compile_run(model, (x,), horizontal=True)
    assert fused_ops(code) == ops_left, code
    assert len(report.merged) == (1 if ops_left == 1 else 0), str(report)
    for got, want, ref in zip(merged, plain, eager):
        assert got.dtype == ref.dtype and got.shape == ref.shape
        assert torch.equal(got, want)
        assert rel_err(got, ref) < 1e-2


def test_weight_computed_in_the_graph_is_not_merged():
    """A weight made in the graph would be concatenated anew on every call: left apart, with the reason."""
    a = torch.randint(-127, 128, (4, 64), dtype=torch.int8)
    w1, w2 = (torch.randint(-127, 128, (n, 64), dtype=torch.int8) for n in (32, 48))
    sa, s1, s2 = torch.rand(4), torch.rand(32), torch.rand(48)

    def fn(a, sa, w1, s1, w2, s2):
        y1 = torch.ops.quantfuse.scaled_mm(a, w1.t(), sa, s1, torch.float32)
        y2 = torch.ops.quantfuse.scaled_mm(a, torch.flip(w2, [0]).t(), sa, s2, torch.float32)
        y3 = torch.ops.quantfuse.scaled_mm(a, w2.t(), sa, s2, torch.float32)
        return y1, y2, y3

    inputs = (a, sa, w1, s1, w2, s2)
    _, out, code, report = compile_run(fn, inputs, horizontal=True)
    assert fused_ops(code) == 2, code  # y1 and y3 merged, y2 alone
    assert [m.detail for m in report.merged] == ["N = 32+48"], str(report)
    assert len(report.not_merged) == 1 and "computed in the graph" in report.not_merged[0].detail, str(report)
    for got, want in zip(out, fn(*inputs)):
        assert torch.equal(got, want)


def test_explain_reports_merged_groups_and_option_checked():
    import compile_backend

    model = SharedInput(_w8a8(32, out_dtype=torch.float32), _w8a8(48, seed=1, out_dtype=torch.float32))
    x = torch.randn(4, 64)
    with torch.no_grad():
        report = compile_backend.explain(model, x)
    assert len(report.merged) == 1 and report.merged[0].family == "scaled_mm", str(report)
    assert "merged   scaled_mm" in str(report)
    torch._dynamo.reset()
    with pytest.raises(Exception, match="option 'horizontal' is 'yes'; expected True or False"):
        torch.compile(model, backend="quantfuse", options={"horizontal": "yes"})(x)


def test_concat_weights_op():
    """The op's contract: torch.cat, or 1-D with per-part extents (a 1-element part broadcast);
    the CPU implementation serves one tensor until a part changes in place."""
    w1, w2 = torch.randn(3, 4), torch.randn(2, 4)
    first = torch.ops.quantfuse.concat_weights([w1, w2], 0)
    assert torch.equal(first, torch.cat([w1, w2])) and torch.ops.quantfuse.concat_weights([w1, w2], 0) is first
    w2.mul_(2)
    again = torch.ops.quantfuse.concat_weights([w1, w2], 0)
    assert again is not first and torch.equal(again, torch.cat([w1, w2]))
    s, v = torch.tensor(2.0), torch.arange(3.0)
    assert torch.ops.quantfuse.concat_weights([s, v], 0, [2, 3]).tolist() == [2.0, 2.0, 0.0, 1.0, 2.0]
    with pytest.raises(ops.QuantfuseInputError, match=r"'parts\[1\]'.*except in dim 0"):
        torch.ops.quantfuse.concat_weights([w1, torch.randn(2, 5)], 0)
    with pytest.raises(ops.QuantfuseInputError, match=r"'parts\[1\]'.*1 element or sizes\[1\] = 4"):
        torch.ops.quantfuse.concat_weights([s, v], 0, [2, 4])
    with pytest.raises(ops.QuantfuseInputError, match=r"'parts\[1\]'.*dtype"):
        torch.ops.quantfuse.concat_weights([w1, w2.double()], 0)


# --------------------------------------------------------------------------- GPU

GPU_SCHEMES = ["int8", "int8-asym", "fp8", "fp8-rowwise", "awq-g128"]


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU")
@pytest.mark.parametrize("scheme", GPU_SCHEMES)
def test_llama_merged_cuda_graphs(scheme):
    """CUDA graphs from the first call: every call equals the unmerged compile's (W8A8 int8:
    exactly, the int32 sums are exact and the epilogue the same; others within the kernels'
    accumulation-order differences) and is close to eager; the concatenated weights are made
    once, outside the graphs' pools."""
    model = quantize_model(tiny_llama(hidden=256, intermediate=512, dtype=torch.float16, device="cuda"), scheme)
    ids = torch.randint(0, 64, (1, 8), generator=torch.Generator().manual_seed(1)).cuda()
    with torch.no_grad():
        eager = model(ids).logits
        _, plain, plain_code, _ = compile_run(model, (ids,), horizontal=False, cudagraphs=True)
        plain = plain.logits.clone()
        torch.ops.quantfuse._derived_cache_clear()
        compiled, first, code, report = compile_run(model, (ids,), horizontal=True, cudagraphs=True)
        first = first.logits.clone()
        made = torch.ops.quantfuse._derived_cache_stats()[0]
        later = [compiled(ids).logits.clone() for _ in range(3)]
    assert fused_ops(code) == fused_ops(plain_code) - MERGED_AWAY, code
    assert len(report.merged) == 4, str(report)
    assert torch.ops.quantfuse._derived_cache_stats()[0] == made, "derived values made again on replay"
    for out in (first, *later):
        if scheme in ("int8", "int8-asym"):
            assert torch.equal(out, plain)
        else:
            assert rel_err(out, plain) < _tol(scheme)
        assert rel_err(out, eager) < _tol(scheme)


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU")
@pytest.mark.parametrize("scheme", ["int8", "awq-g128"])
def test_weight_update_cuda(scheme):
    """Without CUDA graphs, copy_ and load_state_dict after compiling are seen by the next call
    (graphs captured before a weight changes keep the old values: docs/DESIGN.md)."""
    model = quantize_model(tiny_llama(hidden=256, intermediate=512, dtype=torch.float16, device="cuda"), scheme)
    ids = torch.randint(0, 64, (1, 8), generator=torch.Generator().manual_seed(1)).cuda()
    with torch.no_grad():
        compiled, _, _, report = compile_run(model, (ids,), horizontal=True)
        assert len(report.merged) == 4, str(report)
        for how in ("copy_", "load_state_dict"):
            before = compiled(ids).logits.clone()
            _update_weights(model, scheme, how)
            after, ref = compiled(ids).logits, model(ids).logits
            assert not torch.equal(after, before), how
            assert rel_err(after, ref) < _tol(scheme), how
