"""The quantfuse backend: registration, pass installation, fallbacks, end to end on CPU."""

from __future__ import annotations

import subprocess
import sys
import warnings
from importlib.metadata import entry_points

import pytest
import torch
from torch._inductor import config as inductor_config
from torch._inductor.custom_graph_pass import CustomGraphPass

import compile_backend.backend as backend
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


def test_failed_pass_compile_falls_back_with_one_warning(monkeypatch):
    calls = []

    def flaky_compile_fx(gm, example_inputs, config_patches=None):
        with_passes = any(s in config_patches for s in make_graph_passes())
        calls.append(with_passes)
        if with_passes:
            raise RuntimeError("pass exploded")
        return gm.forward

    monkeypatch.setattr("torch._inductor.compile_fx.compile_fx", flaky_compile_fx)
    monkeypatch.setattr(backend, "_warned", set())
    x, w = torch.randn(4, 8), torch.randn(8, 8)
    torch._dynamo.reset()
    with pytest.warns(RuntimeWarning, match="falling back to Inductor without them"):
        out = torch.compile(_f, backend="quantfuse")(x, w)
    torch.testing.assert_close(out, _f(x, w))
    assert calls == [True, False]
    # fallback=False re-raises instead.
    torch._dynamo.reset()
    with pytest.raises(Exception, match="pass exploded"):
        torch.compile(_f, backend="quantfuse", options={"fallback": False})(x, w)


def test_failed_inductor_runs_eager(monkeypatch):
    def broken_compile_fx(gm, example_inputs, config_patches=None):
        raise RuntimeError("inductor exploded")

    monkeypatch.setattr("torch._inductor.compile_fx.compile_fx", broken_compile_fx)
    monkeypatch.setattr(backend, "_warned", set())
    x, w = torch.randn(4, 8), torch.randn(8, 8)
    torch._dynamo.reset()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out = torch.compile(_f, backend="quantfuse")(x, w)
    torch.testing.assert_close(out, _f(x, w))
    messages = [str(w.message) for w in caught]
    assert any("without them" in m for m in messages) and any("running it in eager" in m for m in messages)


@pytest.mark.compile
def test_compiled_quantized_model_matches_eager():
    """The foundation's end-to-end check: a quantize_model model compiles and matches eager."""
    from compile_backend.llama import tiny_llama
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
