"""``compile_backend.explain``: fused subgraphs and unfused quantized-looking matmuls, with reasons."""

from __future__ import annotations

import importlib
import logging

import pytest
import torch
import torch.nn.functional as F

import compile_backend
from compile_backend.quantize import W8A8Linear

explain_module = importlib.import_module("compile_backend.explain")  # the module, not the function

pytestmark = pytest.mark.compile

K, N = 32, 24


class Mixed(torch.nn.Module):
    """One fusable W8A8 layer, one near-miss (per-group activation scales), one float layer."""

    def __init__(self):
        super().__init__()
        gen = torch.Generator().manual_seed(0)
        self.fused = W8A8Linear.from_linear(torch.nn.Linear(K, N), out_dtype=torch.float32)
        self.register_buffer("w", torch.randint(-128, 128, (N, N), dtype=torch.int8, generator=gen))
        self.register_buffer("w_scale", torch.rand(N, 1, generator=gen) * 1e-2)
        self.dense = torch.nn.Linear(N, N)

    def forward(self, x):
        h = self.fused(x)
        # Per-group activation quantization (groups of 8 along K): not expressible as scale_a.
        g = h.reshape(-1, N // 8, 8)
        s = g.abs().amax(-1, keepdim=True) / 127
        q = (g / s).round().clamp(-128, 127).to(torch.int8)
        h2 = F.linear((q.float() * s).reshape(-1, N), self.w.float() * self.w_scale)
        return self.dense(torch.relu(h2))


def test_explain_lists_fused_and_unfused_with_reasons(caplog):
    model = Mixed().eval()
    x = torch.randn(5, K, generator=torch.Generator().manual_seed(1))
    with caplog.at_level(logging.INFO, logger="quantfuse"):
        report = compile_backend.explain(model, x)
    assert report.counts() == {"scaled_mm": 1}
    (fused,) = report.fused
    assert fused.form == "dequant-addmm" and "per-token x per-channel" in fused.detail
    # The near-miss is reported with the failed check; the float layer is not a candidate.
    (unfused,) = report.unfused
    assert unfused.target in ("mm.default", "addmm.default"), unfused
    # Groups of 8 along K look per-token on the [5, 3, 8] view; the reshape back to [5, 24]
    # (which merges the groups into one row) is what the checks reject.
    assert "does not match activation of shape [5, 3, 8]" in unfused.reason, unfused.reason
    text = str(report)
    assert "fused    scaled_mm" in text and "unfused" in text and "does not match activation" in text
    # The report also goes to the quantfuse logger.
    assert any("fused 1 subgraph(s), left 1 candidate(s)" in r.getMessage() for r in caplog.records)


# --------------------------------------------------------------------------- repeatable, no trace


class _Layers(torch.nn.Module):
    """Two fusable W8A8 layers; with ``graph_break`` Dynamo compiles them as two graphs."""

    def __init__(self, graph_break=False):
        super().__init__()
        torch.manual_seed(0)
        self.a = W8A8Linear.from_linear(torch.nn.Linear(K, N), out_dtype=torch.float32)
        self.b = W8A8Linear.from_linear(torch.nn.Linear(N, N), out_dtype=torch.float32)
        self.graph_break = graph_break

    def forward(self, x):
        h = self.a(x)
        if self.graph_break:
            torch._dynamo.graph_break()
        return self.b(h)


def _user_compile_report(model, x):
    """What the user's own ``torch.compile(model, backend="quantfuse")`` fuses on its first call."""
    from compile_backend.passes import collecting_report

    compiled = torch.compile(model, backend="quantfuse", options={"fx_graph_cache": False})
    with collecting_report() as report:
        out = compiled(x)
    return report, out


def _cache_entries(*codes):
    from torch._dynamo.eval_frame import _debug_get_cache_entry_list

    return sum(len(_debug_get_cache_entry_list(c)) for c in codes)


@pytest.mark.parametrize("graph_break", [False, True], ids=["one-graph", "graph-break"])
def test_explain_is_repeatable_and_leaves_no_trace(graph_break):
    """Ten explain() calls report the same fusions each time (more than Dynamo's recompile limit
    of 8 per code object); afterwards the user's own compile still fuses everything."""
    model = _Layers(graph_break).eval()
    x = torch.randn(5, K, generator=torch.Generator().manual_seed(1))
    torch._dynamo.reset()
    user_codes = (type(model).forward.__code__, W8A8Linear.forward.__code__)
    with torch.no_grad():
        reports = [compile_backend.explain(model, x) for _ in range(10)]
        assert [dict(r.counts()) for r in reports] == [{"scaled_mm": 2}] * 10
        # Nothing explain compiled is left on the model's code for a later compile to find.
        assert _cache_entries(*user_codes) == 0
        report, out = _user_compile_report(model, x)
        expected = model(x)
    torch._dynamo.reset()
    assert report.counts() == {"scaled_mm": 2}, str(report)
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("graph_break", [False, True], ids=["one-graph", "graph-break"])
def test_explain_leaves_the_users_compiled_model_alone(graph_break):
    """explain() after the user compiled the model: the user's compiled model keeps its
    compiled code (no recompile on its next call) and its results."""
    model = _Layers(graph_break).eval()
    x = torch.randn(5, K, generator=torch.Generator().manual_seed(2))
    torch._dynamo.reset()
    compiles = []

    def counting(gm, example_inputs):
        compiles.append(gm)
        return compile_backend.quantfuse(gm, example_inputs, options={"fx_graph_cache": False})

    compiled = torch.compile(model, backend=counting)
    with torch.no_grad():
        first = compiled(x)
        for _ in range(9):
            if graph_break and not explain_module._supports_isolate_recompiles():
                # Without recompile regions (torch < 2.12) the resumed frames run the user's
                # compiled code: explain says so instead of reporting less silently.
                with pytest.warns(RuntimeWarning, match="graph break may be missing"):
                    compile_backend.explain(model, x)
            else:
                assert compile_backend.explain(model, x).counts() == {"scaled_mm": 2}
        again = compiled(x)
    torch._dynamo.reset()
    assert len(compiles) == (2 if graph_break else 1)
    torch.testing.assert_close(again, first, rtol=0, atol=0)


# --------------------------------------------------------------------------- other libraries' opaque ops

_lib = torch.library.Library("qf_test_otherlib", "DEF")
_lib.define("packed_gemm(Tensor x, Tensor qweight, Tensor scales) -> Tensor")


@torch.library.impl(_lib, "packed_gemm", "CPU")
def _packed_gemm(x, qweight, scales):
    return x @ (qweight.to(x.dtype) * scales)


@torch.library.register_fake("qf_test_otherlib::packed_gemm")
def _packed_gemm_fake(x, qweight, scales):
    return x.new_empty((x.shape[0], qweight.shape[1]))


def test_opaque_op_reading_packed_weights_is_reported_with_the_way_to_fused_kernels():
    """Another library's custom op on int32 weights (GPTQModel's exllama / marlin kernels): reported as
    opaque, pointing to from_pretrained; a custom op on float tensors only is not a candidate."""

    class Layer(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.register_buffer("qweight", torch.randint(0, 15, (K, N), dtype=torch.int32))
            self.register_buffer("scales", torch.rand(N))

        def forward(self, x):
            return torch.ops.qf_test_otherlib.packed_gemm(x, self.qweight, self.scales)

    report = compile_backend.explain(Layer(), torch.randn(4, K))
    (unfused,) = report.unfused
    assert unfused.target == "qf_test_otherlib.packed_gemm.default" or "packed_gemm" in unfused.target, unfused
    assert "opaque custom op" in unfused.reason and "from_pretrained" in unfused.reason, unfused.reason
    assert report.fused == []


def test_explain_says_how_awq_weights_were_made():
    """Round-to-nearest is not activation-aware: explain() notes which AWQ layers quantize_model made so."""
    from compile_backend.quantize import quantize_model

    torch.manual_seed(0)
    model = quantize_model(torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.Linear(64, 64)).half(), "awq-g32")
    report = compile_backend.explain(model, torch.randn(3, 64, dtype=torch.float16))
    (note,) = report.notes
    assert "2 layer(s) quantized round-to-nearest" in note and "calibration=" in note
    assert "note     awq: 2 layer(s)" in str(report)
    model[0].made_by = "the AWQ search (calibrated)"
    assert compile_backend.explain(model, torch.randn(3, 64, dtype=torch.float16)).notes == [
        "awq: 1 layer(s) quantized round-to-nearest by quantize_model (no calibration data: not "
        "activation-aware; quantize_model(..., calibration=...) runs the AWQ search)",
        "awq: 1 layer(s) quantized by the AWQ search (calibrated)"]
