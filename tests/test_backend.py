"""The quantfuse backend: registration, pass installation, fallbacks, end to end on CPU."""

from __future__ import annotations

import gc
import logging
import subprocess
import sys
from importlib.metadata import entry_points

import pytest
import torch
from torch._inductor import config as inductor_config
from torch._inductor.custom_graph_pass import CustomGraphPass

import compile_backend.backend as backend
from compile_backend.kernels import pdl
from compile_backend.passes import make_graph_passes


def test_entry_point_is_declared():
    eps = entry_points(group="torch_dynamo_backends")
    assert "quantfuse" in eps.names
    assert eps["quantfuse"].value == "compile_backend.backend:quantfuse"


def test_backend_name_resolves_without_import():
    # A fresh interpreter that never imports compile_backend still finds the backend by name.
    code = (
        "import sys, torch\n"
        "from torch._dynamo.backends.registry import lookup_backend\n"
        "assert 'compile_backend' not in sys.modules\n"
        "fn = lookup_backend('quantfuse')\n"
        "print(fn.__module__, fn.__name__)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["compile_backend.backend", "quantfuse"]


class _Recorder(CustomGraphPass):
    def __init__(self, uuid="recorder"):
        self.calls, self._uuid = 0, uuid

    def __call__(self, graph):
        self.calls += 1

    def uuid(self):
        return self._uuid


def test_install_passes_fills_empty_slots():
    ours = make_graph_passes()
    patches = backend.install_passes({"max_autotune": False}, ours)
    for slot, p in ours.items():
        assert patches[slot] is p
    assert patches["max_autotune"] is False


def test_install_passes_keeps_existing_pass(monkeypatch):
    slot = next(iter(make_graph_passes()))
    theirs = _Recorder()
    ours = {slot: _Recorder("ours")}
    with inductor_config.patch({slot: theirs}):
        assert backend.install_passes({slot: [theirs]}, ours)[slot] == [ours[slot], theirs]
        # Inductor 2.13+ takes a list per slot; on 2.11-2.12 (one pass per slot) both run, chained.
        monkeypatch.setattr(backend, "_slot_accepts_list", lambda: True)
        assert backend.install_passes({}, ours)[slot] == [ours[slot], theirs]
        monkeypatch.setattr(backend, "_slot_accepts_list", lambda: False)
        chained = backend.install_passes({}, ours)[slot]
        assert isinstance(chained, CustomGraphPass)
        chained(torch.fx.Graph())
        assert ours[slot].calls == 1 and theirs.calls == 1  # ours first, then theirs
        assert chained.uuid() == ("quantfuse-chain", "ours", "recorder")
    assert getattr(inductor_config, slot) is None  # global config untouched


def test_slot_list_support_matches_inductor():
    from torch._inductor import custom_graph_pass

    assert backend._slot_accepts_list() == hasattr(custom_graph_pass, "get_custom_graph_passes")


def test_pass_uuid_tracks_sources():
    a, b = make_graph_passes(), make_graph_passes({"families": ("scaled_mm",)})
    slot = next(iter(a))
    assert a[slot].uuid() == make_graph_passes()[slot].uuid()
    assert a[slot].uuid() != b[slot].uuid()


def _f(x, w):
    return torch.relu(x @ w) + 1


def test_options_reach_inductor_and_global_config_is_untouched(monkeypatch):
    seen = {}

    def fake_compile_fx(gm, example_inputs, config_patches=None):
        seen.update(config_patches)
        return gm.forward

    monkeypatch.setattr("torch._inductor.compile_fx.compile_fx", fake_compile_fx)
    x, w = torch.randn(4, 8), torch.randn(8, 8)
    torch._dynamo.reset()
    out = torch.compile(_f, backend="quantfuse", options={"max_autotune": True, "families": ["scaled_mm"]})(x, w)
    torch.testing.assert_close(out, _f(x, w))
    assert seen["max_autotune"] is True
    assert "families" not in seen  # ours, not Inductor's
    slots = make_graph_passes({"families": ("scaled_mm",)})
    assert all(seen[s].uuid() == p.uuid() for s, p in slots.items())
    assert all(getattr(inductor_config, s) is None for s in slots)


def _fallbacks():
    return dict(torch._dynamo.utils.counters[backend.COUNTERS])


@pytest.fixture(autouse=True)
def _clear_fallback_counts():
    torch._dynamo.utils.counters.pop(backend.COUNTERS, None)


def test_failed_pass_compile_falls_back_visibly_each_time(monkeypatch, caplog):
    calls = []

    def flaky_compile_fx(gm, example_inputs, config_patches=None):
        with_passes = any(s in config_patches for s in make_graph_passes())
        calls.append(with_passes)
        if with_passes:
            raise RuntimeError("pass exploded")
        return gm.forward

    monkeypatch.setattr("torch._inductor.compile_fx.compile_fx", flaky_compile_fx)
    x, w = torch.randn(4, 8), torch.randn(8, 8)
    torch._dynamo.reset()
    # Two compiles, two records and two counts: not one warning per process.
    with caplog.at_level(logging.WARNING, logger=backend.log.name):
        for _ in range(2):
            torch._dynamo.reset()
            out = torch.compile(_f, backend="quantfuse")(x, w)
            torch.testing.assert_close(out, _f(x, w))
    assert calls == [True, False, True, False]
    records = [r for r in caplog.records if "falling back to Inductor without them" in r.getMessage()]
    assert len(records) == 2 and all(r.levelno == logging.WARNING for r in records)
    assert "pass exploded" in records[0].getMessage()
    assert _fallbacks() == {"fallback_inductor": 2}
    # fallback=False re-raises instead, and counts nothing.
    torch._dynamo.reset()
    with pytest.raises(Exception, match="pass exploded"):
        torch.compile(_f, backend="quantfuse", options={"fallback": False})(x, w)
    assert _fallbacks() == {"fallback_inductor": 2}


def test_failed_inductor_runs_eager_and_says_so(monkeypatch, caplog):
    def broken_compile_fx(gm, example_inputs, config_patches=None):
        raise RuntimeError("inductor exploded")

    monkeypatch.setattr("torch._inductor.compile_fx.compile_fx", broken_compile_fx)
    x, w = torch.randn(4, 8), torch.randn(8, 8)
    torch._dynamo.reset()
    with caplog.at_level(logging.WARNING, logger=backend.log.name):
        out = torch.compile(_f, backend="quantfuse")(x, w)
    torch.testing.assert_close(out, _f(x, w))
    messages = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert any("without them" in m for m in messages) and any("running it in eager" in m for m in messages)
    assert _fallbacks() == {"fallback_inductor": 1, "fallback_eager": 1}


@pytest.mark.parametrize("options, match", [
    ({"max_autotunez": True}, r"unknown option 'max_autotunez' \(did you mean 'max_autotune'"),
    ({"famillies": ["scaled_mm"]}, r"unknown option 'famillies' \(did you mean 'families'"),
    ({"not_a_setting": 1},
     r"unknown option 'not_a_setting'.*\['passes', 'families', 'horizontal', 'gqa_decode', 'rms_norm_ordered', "
     r"'fallback', 'pdl'\].*'max_autotune'"),
    ({"families": ["scaled_mn"]}, r"unknown pattern families \['scaled_mn'\].*'scaled_mm_azp', 'scaled_mm', 'awq_gemm"),
    ({"families": 3}, r"option 'families' is 3"),
    ({"passes": "yes"}, r"option 'passes' is 'yes'; expected True or False"),
    ({"fallback": None}, r"option 'fallback' is None"),
    ({"pdl": 1}, r"option 'pdl' is 1; expected True or False"),
    ({"max_autotune": "yes"}, r"option 'max_autotune' is 'yes' \(str\); Inductor's max_autotune takes bool"),
])
def test_bad_options_raise_before_compiling(monkeypatch, options, match):
    # A typo must not look like a failed compile (eager, no fusion): it raises, like Inductor's own check.
    compiled = []
    monkeypatch.setattr("torch._inductor.compile_fx.compile_fx",
                        lambda gm, example_inputs, config_patches=None: compiled.append(1) or gm.forward)
    torch._dynamo.reset()
    with pytest.raises(Exception, match=match):
        torch.compile(_f, backend="quantfuse", options=options)(torch.randn(4, 8), torch.randn(8, 8))
    assert compiled == [] and _fallbacks() == {}


def test_option_spellings_inductor_accepts(monkeypatch):
    seen = {}

    def fake_compile_fx(gm, example_inputs, config_patches=None):
        seen.update(config_patches)
        return gm.forward

    monkeypatch.setattr("torch._inductor.compile_fx.compile_fx", fake_compile_fx)
    torch._dynamo.reset()
    options = {"max-autotune": True, "triton.cudagraphs": False, "families": "scaled_mm"}
    torch.compile(_f, backend="quantfuse", options=options)(torch.randn(4, 8), torch.randn(8, 8))
    assert seen["max_autotune"] is True and seen["triton.cudagraphs"] is False  # dashes read as underscores
    slots = make_graph_passes({"families": ("scaled_mm",)})  # one family name, not its letters
    assert all(seen[s].uuid() == p.uuid() for s, p in slots.items())


@pytest.mark.compile
def test_compiled_quantized_model_matches_eager():
    """The foundation's end-to-end check: a quantize_model model compiles and matches eager."""
    from compile_backend.models.llama import tiny_llama
    from compile_backend.quantize import quantize_model

    model = quantize_model(tiny_llama(), "int8")
    tokens = torch.randint(0, model.cfg.vocab_size, (2, 12), generator=torch.Generator().manual_seed(0))
    torch._dynamo.reset()
    with torch.no_grad():
        eager = model(tokens)
        compiled = torch.compile(model, backend="quantfuse", options={"fallback": False})(tokens)
    # Fused ops accumulate int8 products exactly where eager dequantizes to float32 first:
    # both are float32-accurate, so they agree to float32 rounding amplified through 2 layers.
    torch.testing.assert_close(compiled, eager, rtol=1e-3, atol=1e-3)


class _GraphOps:
    """Stands in for the C++ ops the CUDA-graph guard calls (csrc/common/derived_cache.cpp)."""

    def __init__(self, stale=False):
        self.calls, self.stale = [], stale

    def _derived_graph_enter(self, graph):
        self.calls.append(("enter", graph))
        if self.stale:
            raise RuntimeError("that weight has changed since")

    def _derived_graph_exit(self):
        self.calls.append(("exit",))

    def _derived_graph_forget(self, graph):
        self.calls.append(("forget", graph))


def test_cuda_graph_compiles_are_guarded(monkeypatch):
    """With CUDA graphs (mode="reduce-overhead") the compiled graph runs between the derived-value
    cache's graph_enter and graph_exit; without them it is Inductor's own callable."""
    from compile_backend.derived import captured_graphs

    monkeypatch.setattr("torch._inductor.compile_fx.compile_fx", lambda gm, inputs, config_patches=None: gm.forward)
    gm = torch.fx.symbolic_trace(torch.nn.ReLU())
    plain = backend.quantfuse(gm, [torch.randn(2)])
    guarded = backend.quantfuse(gm, [torch.randn(2)], mode="reduce-overhead")
    assert plain == gm.forward
    assert guarded.__module__ == captured_graphs.__name__
    with inductor_config.patch({"triton.cudagraphs": True}):
        assert backend.quantfuse(gm, [torch.randn(2)]).__module__ == captured_graphs.__name__
    assert captured_graphs.uses_cuda_graphs({"triton.cudagraphs": False}) is False


def test_cuda_graph_guard_enters_checks_and_exits(monkeypatch):
    """The guard: nothing to check until the kernels are loaded; then every call enters its
    graph's id (which raises, without running the graph, when a weight it captured derived
    values of has changed) and exits after, also when the graph raises; the record of a graph
    that is gone is dropped."""
    from compile_backend.derived import captured_graphs
    from compile_backend.kernels import loader as kernels

    ran = []

    def graph(x):
        ran.append(x)
        if x is None:
            raise ValueError("the graph failed")
        return x + 1

    ops = _GraphOps()
    monkeypatch.setattr(torch.ops, "quantfuse", ops)
    monkeypatch.setitem(kernels._state, "status", "absent")
    run = captured_graphs.guard_derived_reads(graph)
    assert run(1) == 2 and ops.calls == []
    monkeypatch.setitem(kernels._state, "status", "loaded")
    assert run(2) == 3
    (_, graph_id), exit_call = ops.calls
    assert exit_call == ("exit",)
    with pytest.raises(ValueError, match="the graph failed"):
        run(None)
    assert ops.calls[-2:] == [("enter", graph_id), ("exit",)]
    other = captured_graphs.guard_derived_reads(graph)
    other(3)
    assert ops.calls[-2][1] != graph_id  # each compiled graph has its own id
    ops.stale, ran[:] = True, []
    with pytest.raises(RuntimeError, match="changed since"):
        run(4)
    assert ran == [] and ops.calls[-1] == ("enter", graph_id)
    del run, other
    gc.collect()
    assert ("forget", graph_id) in ops.calls


def _fake_cuda_inputs():
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        return [torch.empty(4, device="cuda")]


@pytest.mark.parametrize("case, capability, env, patches, wanted, expected", [
    ("CUDA graphs on sm_90", (9, 0), None, {"triton.cudagraphs": True}, True, True),
    ("option pdl=False", (9, 0), None, {"triton.cudagraphs": True}, False, None),
    ("QUANTFUSE_PDL=0", (9, 0), "0", {"triton.cudagraphs": True}, True, None),
    ("no CUDA graphs", (9, 0), None, {"triton.cudagraphs": False}, True, None),
    ("sm_80", (8, 0), None, {"triton.cudagraphs": True}, True, None),
    ("the user's own setting", (9, 0), None, {"triton.cudagraphs": True, "triton.enable_pdl": False}, True, False),
])
def test_pdl_patch(monkeypatch, case, capability, env, patches, wanted, expected):
    """Inductor's ``triton.enable_pdl`` is set only for CUDA graphs on sm_90+, unless the option, the
    environment or the user's own patch says otherwise."""
    from torch._inductor import config as inductor_config

    if not hasattr(inductor_config.triton, "enable_pdl"):
        pytest.skip("this torch's Inductor has no triton.enable_pdl")
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability)
    if env is None:
        monkeypatch.delenv(pdl.ENV, raising=False)
    else:
        monkeypatch.setenv(pdl.ENV, env)
    out = backend.with_pdl(dict(patches), _fake_cuda_inputs(), wanted)
    assert out.get("triton.enable_pdl") is expected, case
    assert "triton.enable_pdl" not in backend.with_pdl(dict(patches), [torch.empty(4)], wanted) or \
        patches.get("triton.enable_pdl") is not None, f"{case}: CPU inputs"


def test_pdl_env_checked(monkeypatch):
    monkeypatch.setenv(pdl.ENV, "off")
    with pytest.raises(ValueError, match="QUANTFUSE_PDL='off'; expected '0'"):
        pdl.allowed_by_env()
