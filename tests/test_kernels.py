"""The CUDA extension loader and dispatch, on a machine without a GPU."""

from __future__ import annotations

import logging
import subprocess
import sys

import pytest
import torch

from compile_backend import kernels


@pytest.fixture
def fresh_loader(monkeypatch):
    monkeypatch.setattr(kernels, "_state", {"status": "unloaded", "error": None, "kernels": None, "library": None})
    monkeypatch.setattr(kernels, "_families", dict(kernels._families))
    monkeypatch.setattr(kernels, "prebuilt_library", lambda: None)  # as in a source checkout
    return kernels


def test_cpu_machine_does_nothing_and_prints_nothing():
    # A fresh interpreter: importing, running every op on CPU, and asking the loader print nothing.
    code = (
        "import torch, compile_backend\n"
        "from compile_backend import kernels\n"
        "a = torch.randint(-5, 5, (3, 16), dtype=torch.int8)\n"
        "torch.ops.quantfuse.scaled_mm(a, a.t(), torch.ones(1), torch.ones(1), torch.float32)\n"
        "assert kernels.ensure_loaded() is (torch.cuda.is_available() and kernels.status()['status'] == 'loaded')\n"
        "print(kernels.status()['status'])\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    if not torch.cuda.is_available():
        # Whatever torch itself prints on import (e.g. a missing-NumPy warning) is not ours.
        torch_alone = subprocess.run([sys.executable, "-c", "import torch"], capture_output=True, text=True,
                                     timeout=300)
        assert out.stdout.strip() == "absent"
        assert out.stderr == torch_alone.stderr


def test_unsupported_input_runs_reference_with_debug_reason(fresh_loader, caplog):
    fresh_loader.register("scaled_mm", lambda *a, **k: "K = 24 is not a multiple of 16", lambda *a, **k: 1 / 0)
    with caplog.at_level(logging.DEBUG, logger="quantfuse.kernels"):
        assert fresh_loader.try_cuda("scaled_mm", (), {}) is None
    assert "scaled_mm: reference runs: K = 24 is not a multiple of 16" in caplog.text


def test_build_failure_warns_once_then_references_run(fresh_loader, monkeypatch, caplog):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    attempts = []

    def failing_build():
        attempts.append(1)
        raise RuntimeError("nvcc not found")

    monkeypatch.setattr(fresh_loader, "build", failing_build)
    fresh_loader.register("awq_gemm", lambda *a, **k: None, lambda *a, **k: 1 / 0)
    with pytest.warns(RuntimeWarning, match="could not be built or loaded.*nvcc not found"):
        assert fresh_loader.try_cuda("awq_gemm", (), {}) is None
    with caplog.at_level(logging.DEBUG, logger="quantfuse.kernels"):
        import warnings

        with warnings.catch_warnings():
            warnings.simplefilter("error")  # a second warning would fail here
            assert fresh_loader.try_cuda("awq_gemm", (), {}) is None
    assert attempts == [1]
    assert "CUDA extension not available" in caplog.text
    assert fresh_loader.status()["status"] == "failed"


def test_supported_input_launches_kernel(fresh_loader, monkeypatch):
    monkeypatch.setattr(fresh_loader, "ensure_loaded", lambda: True)
    fresh_loader.register("awq_dequantize", lambda x: None, lambda x: x + 1)
    assert fresh_loader.try_cuda("awq_dequantize", (41,), {}) == 42


def test_arch_flags():
    assert kernels.arch_list_for((9, 0)) == "9.0a"
    assert kernels.arch_list_for((8, 0)) == "8.0"
    assert kernels.arch_list_for((8, 9)) == "8.9"
    flags = kernels.nvcc_flags()
    assert f"-std={kernels.cxx_standard()}" in flags


def test_sources_subset_and_cutlass_override(monkeypatch, tmp_path):
    root = tmp_path / "csrc"
    for family in ("scaled_mm", "awq_gemm"):
        (root / family).mkdir(parents=True)
        (root / family / f"{family}.cu").write_text("")
        (root / family / "notes.md").write_text("")
    monkeypatch.setattr(kernels, "csrc_dir", lambda: root)
    assert [p.name for p in kernels.sources()] == ["awq_gemm.cu", "scaled_mm.cu"]
    monkeypatch.setenv("QUANTFUSE_CSRC_ONLY", "awq_gemm")
    assert [p.name for p in kernels.sources()] == ["awq_gemm.cu"]
    assert kernels.extension_name() == "quantfuse_C_awq_gemm"
    (root / "scaled_mm" / "scaled_mm_sm80.cu").write_text("")
    monkeypatch.setenv("QUANTFUSE_CSRC_ONLY", "scaled_mm/scaled_mm_sm80,awq_gemm")
    assert [p.name for p in kernels.sources()] == ["awq_gemm.cu", "scaled_mm_sm80.cu"]
    assert kernels.extension_name() == "quantfuse_C_awq_gemm_scaled_mm_scaled_mm_sm80"
    monkeypatch.setenv("QUANTFUSE_CUTLASS_INCLUDE", "/x/include")
    assert kernels.cutlass_include_dirs() == ["/x/include"]
