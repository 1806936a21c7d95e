"""Packaging invariants, cheap enough for every run: what setup.py ships, that the three builds
of csrc/ (setup.py, the JIT build, CI's compile check) share their flags, and how the loader
chooses between a prebuilt library and the JIT build.  CI also builds the wheel, installs it
into a fresh environment and compiles a model with it (.ci/wheel_smoke.py)."""

from __future__ import annotations

import importlib.util
import json
import logging
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from compile_backend.kernels import build_config
from compile_backend.kernels import loader as kernels

ROOT = Path(__file__).resolve().parents[1]


def _setup_packages() -> tuple[list[str], dict[str, str]]:
    """setup.py's package list, asked of setup.py itself (without building anything)."""
    code = (
        "import runpy, setuptools, sys\n"
        "seen = {}\n"
        "setuptools.setup = lambda **kw: seen.update(kw)\n"
        "sys.argv = ['setup.py', '--name']\n"
        "runpy.run_path('setup.py', run_name='__main__')\n"
        "print(repr((seen['packages'], seen['package_dir'], seen['package_data'])))\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "QUANTFUSE_BUILD_CUDA"}
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, env=env, timeout=120)
    assert out.returncode == 0, out.stderr
    packages, package_dir, package_data = eval(out.stdout.strip().splitlines()[-1])
    assert package_data == {"compile_backend.csrc": ["**/*.cu", "**/*.cuh", "**/*.cpp", "**/*.h", "**/*.hpp"]}
    return packages, package_dir


def _package_dirs() -> dict[str, Path]:
    """Every folder with an __init__.py under compile_backend/ and passes/, by installed name."""
    found = {}
    for top, name in ((ROOT / "compile_backend", "compile_backend"), (ROOT / "passes", "compile_backend.passes")):
        for init in top.rglob("__init__.py"):
            rel = init.parent.relative_to(top).parts
            if "__pycache__" not in rel:
                found[".".join((name, *rel))] = init.parent
    return found


def test_setup_ships_every_package_and_the_kernel_sources():
    packages, package_dir = _setup_packages()
    assert set(_package_dirs()) <= set(packages), sorted(set(_package_dirs()) - set(packages))
    assert package_dir == {"compile_backend.passes": "passes", "compile_backend.csrc": "csrc"}
    assert "compile_backend.csrc" in packages
    # The patterns cover every file under csrc/ the kernels are built from.
    suffixes = {p.suffix for p in (ROOT / "csrc").rglob("*") if p.is_file()}
    assert suffixes <= {".cu", ".cuh", ".cpp", ".h", ".hpp"}, suffixes


def test_distribution_name_extras_and_entry_point():
    tomllib = pytest.importorskip("tomllib")
    meta = tomllib.loads((ROOT / "pyproject.toml").read_text())
    project = meta["project"]
    assert project["name"] == "quantfuse"
    assert project["entry-points"]["torch_dynamo_backends"] == {"quantfuse": "compile_backend.backend:quantfuse"}
    assert {"dev", "hf", "cuda"} <= set(project["optional-dependencies"])
    # Packages come from setup.py only: a list in pyproject would override its discovery.
    assert "packages" not in meta.get("tool", {}).get("setuptools", {})


def test_build_config_imports_without_torch():
    code = (
        "import importlib.util, sys\n"
        "spec = importlib.util.spec_from_file_location('bc', 'compile_backend/kernels/build_config.py')\n"
        "m = importlib.util.module_from_spec(spec); spec.loader.exec_module(m)\n"
        "assert 'torch' not in sys.modules\n"
        "print(m.nvcc_flags('2.14.1')[1], m.cxx_standard('2.13.0'))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["-std=c++20", "c++17"]


def test_tma_encode_is_renamed_to_a_defined_function():
    """CUTLASS calls cuTensorMapEncodeTiled directly under the name the build gives it: every
    source is compiled with the rename, and csrc defines a function of that name."""
    defines = dict(d.removeprefix("-D").split("=", 1) for d in build_config.DRIVER_DEFINES)
    assert defines["CUTLASS_ENABLE_DIRECT_CUDA_DRIVER_CALL"] == "1"
    name = defines["cuTensorMapEncodeTiled"]
    for flags in (build_config.nvcc_flags("2.11.0"), build_config.cxx_flags("2.14.1")):
        assert all(d in flags for d in build_config.DRIVER_DEFINES), flags
    source = (ROOT / "csrc" / "common" / "tma_driver.cpp").read_text()
    assert f'extern "C" CUresult {name}(' in source


def test_jit_build_and_setup_share_flags():
    assert kernels.nvcc_flags() == build_config.nvcc_flags(torch.__version__)
    assert kernels.cxx_standard() == build_config.cxx_standard(torch.__version__)
    assert build_config.cxx_flags(torch.__version__) == ["-O3", f"-std={kernels.cxx_standard()}",
                                                        *build_config.DRIVER_DEFINES]
    assert kernels.sources() == build_config.list_sources(ROOT / "csrc")
    assert build_config.cxx_standard("2.14.0+cu130") == "c++20"
    assert build_config.cxx_standard("2.11.0") == "c++17"
    assert build_config.DEFAULT_ARCH_LIST == "8.0;9.0a"


@pytest.mark.parametrize(
    "arch_list, capability, runs",
    [
        ("8.0;9.0a", (9, 0), True),
        ("8.0;9.0a", (8, 0), True),
        ("8.0;9.0a", (8, 9), True),  # sm_80 code runs on sm_89
        ("8.0;9.0a", (10, 0), False),  # 9.0a is arch-specific, 8.0 has no PTX
        ("8.0;9.0a", (7, 5), False),
        ("9.0a", (8, 0), False),
        ("8.6", (8, 0), False),
        ("8.0+PTX", (12, 0), True),
        ("8.0 9.0", (9, 0), True),
    ],
)
def test_arch_list_runs_on(arch_list, capability, runs):
    assert build_config.arch_list_runs_on(arch_list, capability) is runs


@pytest.fixture
def prebuilt(isolated_loader, tmp_path, monkeypatch):
    """A fake prebuilt library next to a fake package, on a fake Hopper GPU."""
    library = tmp_path / "_C.cpython-311-x86_64-linux-gnu.so"
    library.write_bytes(b"")
    os.utime(library, (4e9, 4e9))  # newer than every source: built after the checkout's last change
    info = {"torch": torch.__version__.split("+")[0] + "+cu130", "cuda": "13.0", "arch_list": "8.0;9.0a"}
    (tmp_path / build_config.PREBUILT_INFO).write_text(json.dumps(info))
    monkeypatch.setattr(kernels, "prebuilt_library", lambda: library)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a: (9, 0))
    monkeypatch.delenv("QUANTFUSE_JIT", raising=False)
    monkeypatch.delenv("QUANTFUSE_CSRC_ONLY", raising=False)
    loaded, built = [], []
    monkeypatch.setattr(torch.ops, "load_library", loaded.append)
    monkeypatch.setattr(kernels, "build", lambda: built.append(1) or True)
    return library, loaded, built


def test_prebuilt_library_is_loaded_and_nothing_builds(prebuilt, caplog):
    library, loaded, built = prebuilt
    with caplog.at_level(logging.INFO, logger="quantfuse"):
        assert kernels.ensure_loaded()
    assert loaded == [str(library)] and built == []
    assert kernels.status()["kernels"] == "prebuilt" and kernels.status()["library"] == str(library)
    assert f"loaded the prebuilt CUDA kernels {library}" in caplog.text


@pytest.mark.parametrize(
    "change, reason",
    [
        ({"torch": "2.9.0+cu128"}, "built against torch 2.9.0"),
        ({"arch_list": "8.0"}, "built for '8.0', none of which runs on this GPU (sm_90)"),
        (None, "no readable _C_build.json"),
        ("QUANTFUSE_JIT", "QUANTFUSE_JIT=1"),
        ("stale", "csrc changed since it was built"),
    ],
)
def test_prebuilt_library_not_used_builds_from_source(prebuilt, monkeypatch, caplog, change, reason):
    library, loaded, built = prebuilt
    info_path = library.parent / build_config.PREBUILT_INFO
    if change is None:
        info_path.unlink()
    elif change == "QUANTFUSE_JIT":
        monkeypatch.setenv("QUANTFUSE_JIT", "1")
    elif change == "stale":
        os.utime(library, (1, 1))
    else:
        info_path.write_text(json.dumps({**json.loads(info_path.read_text()), **change}))
    with caplog.at_level(logging.INFO, logger="quantfuse"):
        assert kernels.ensure_loaded()
    assert loaded == [] and built == [1]
    assert kernels.status()["kernels"] == "jit"
    assert "not used: " in caplog.text and reason in caplog.text, caplog.text


def test_prebuilt_library_that_fails_to_load_falls_back_to_jit_then_warns_once(prebuilt, monkeypatch):
    from compile_backend import ops

    library, loaded, built = prebuilt
    registrations = ops.library._bootstrap_lib

    def failing_load(path):
        raise OSError("undefined symbol: _ZN3c10")

    def failing_build():
        raise RuntimeError("nvcc not found")

    monkeypatch.setattr(torch.ops, "load_library", failing_load)
    monkeypatch.setattr(kernels, "build", failing_build)
    with pytest.warns(RuntimeWarning, match="prebuilt library: OSError.*undefined symbol.*nvcc not found"):
        assert not kernels.ensure_loaded()
    assert kernels.status()["status"] == "failed"
    assert not kernels.ensure_loaded()  # no second attempt, no second warning
    # The simulated failure left this process's own CUDA registrations alone (on a GPU machine, a
    # bootstrap put back over the loaded kernels would recurse on every later CUDA call).
    assert ops.library._bootstrap_lib is registrations


def test_loggers_are_under_quantfuse():
    # Configuring the "quantfuse" logger covers every logger the package uses.
    stray = set()
    for path in [*(ROOT / "compile_backend").rglob("*.py"), *(ROOT / "passes").rglob("*.py")]:
        for call in re.findall(r"logging\.getLogger\(([^)]*)\)", path.read_text()):
            if not re.fullmatch(r"""["']quantfuse(\.\w+)*["']""", call.strip()):
                stray.add(path.relative_to(ROOT).as_posix())
    assert kernels.log.name == "quantfuse.kernels"
    assert not stray, sorted(stray)


def test_build_config_loaded_by_path_is_the_package_module():
    path = ROOT / "compile_backend" / "kernels" / "build_config.py"
    spec = importlib.util.spec_from_file_location("bc_by_path", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    assert module.nvcc_flags("2.13.0") == build_config.nvcc_flags("2.13.0")
    assert module.PREBUILT_NAME == "_C"
