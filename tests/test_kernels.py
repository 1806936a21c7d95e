"""The CUDA kernels' loader, and the ops' way to the reference where no kernel runs, on a
machine without a GPU."""

from __future__ import annotations

import logging
import subprocess
import sys

import pytest
import torch

from compile_backend import ops
from compile_backend.kernels import loader as kernels


@pytest.fixture
def fresh_loader(isolated_loader, monkeypatch):
    monkeypatch.setattr(isolated_loader, "prebuilt_library", lambda: None)  # as in a source checkout
    return isolated_loader


def test_cpu_machine_does_nothing_and_prints_nothing():
    # A fresh interpreter: importing, running every op on CPU, and asking the loader print nothing.
    code = (
        "import torch, compile_backend\n"
        "from compile_backend.kernels import loader as kernels\n"
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


def _w8a8(K=32):
    a = torch.randint(-5, 5, (3, K), dtype=torch.int8)
    return a, torch.randint(-5, 5, (8, K), dtype=torch.int8).t(), torch.ones(1), torch.ones(1), torch.float32


def test_reference_with_a_reason_logs_it_at_debug(caplog):
    """Where no kernel takes an input, the C++ dispatch calls quantfuse::_<op>_reference with the
    reason: it is logged on quantfuse.ops and the reference's result returned."""
    args = _w8a8(24)
    with caplog.at_level(logging.DEBUG, logger="quantfuse.ops"):
        out = torch.ops.quantfuse._scaled_mm_reference(*args, None, "K = 24 is not a multiple of 16")
    assert "quantfuse.scaled_mm: reference runs: K = 24 is not a multiple of 16" in caplog.text
    assert torch.equal(out, ops.scaled_mm_reference(*args))
    # a malformed input raises the op's error from there
    a, b, sa, sb, out_dtype = args
    with pytest.raises(ops.QuantfuseInputError, match="scale_a"):
        torch.ops.quantfuse._scaled_mm_reference(a, b, torch.ones(2), sb, out_dtype, None, "a reason")


def test_build_failure_warns_once_then_references_run(fresh_loader, monkeypatch, caplog):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    attempts = []

    def failing_build():
        attempts.append(1)
        raise RuntimeError("nvcc not found")

    monkeypatch.setattr(fresh_loader, "build", failing_build)
    with pytest.warns(RuntimeWarning, match="could not be built or loaded.*nvcc not found"):
        assert not fresh_loader.ensure_loaded()
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a second warning would fail here
        assert not fresh_loader.ensure_loaded()
        # The ops' CUDA bootstrap (the implementation a CUDA call meets before the kernels are
        # loaded) asks the loader, which says no: the reference runs, with the reason logged.
        args = _w8a8()
        with caplog.at_level(logging.DEBUG, logger="quantfuse.ops"):
            out = ops.library._cuda_bootstrap("scaled_mm")(*args)
    assert attempts == [1]
    assert fresh_loader.status()["status"] == "failed"
    assert "quantfuse.scaled_mm: reference runs: the CUDA kernels are not available" in caplog.text
    assert torch.equal(out, ops.scaled_mm_reference(*args))


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
    (root / "common").mkdir()
    monkeypatch.setattr(kernels, "csrc_dir", lambda: root)
    assert [p.name for p in kernels.sources()] == ["awq_gemm.cu", "scaled_mm.cu"]
    assert kernels.status()["families"] == ["awq_gemm", "scaled_mm"]
    monkeypatch.setenv("QUANTFUSE_CSRC_ONLY", "awq_gemm")
    assert [p.name for p in kernels.sources()] == ["awq_gemm.cu"]
    assert kernels.status()["families"] == ["awq_gemm"]
    assert kernels.extension_name() == "quantfuse_C_awq_gemm"
    (root / "scaled_mm" / "scaled_mm_sm80.cu").write_text("")
    monkeypatch.setenv("QUANTFUSE_CSRC_ONLY", "scaled_mm/scaled_mm_sm80,awq_gemm")
    assert [p.name for p in kernels.sources()] == ["awq_gemm.cu", "scaled_mm_sm80.cu"]
    assert kernels.extension_name() == "quantfuse_C_awq_gemm_scaled_mm_scaled_mm_sm80"
    monkeypatch.setenv("QUANTFUSE_CUTLASS_INCLUDE", "/x/include")
    assert kernels.cutlass_include_dirs() == ["/x/include"]
