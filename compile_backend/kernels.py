"""Builds and loads the CUDA extension in ``csrc/``, and dispatches ops to it.

Each kernel family registers, under its op's name, a ``supports`` function
(returns ``None`` when the kernel takes the inputs, else the reason it cannot)
and a ``launch`` function.  ``try_cuda`` is called by the ops' CUDA
implementation: it returns the kernel's result, or ``None`` so that the
reference runs, with a debug log line saying why.

The extension is built at first use with ``torch.utils.cpp_extension`` (cached
by torch under ``TORCH_EXTENSIONS_DIR``; ``python -m compile_backend.build``
prebuilds it).  If it cannot be built or loaded, one warning is issued and the
reference implementations run from then on.  Nothing here runs on a machine
without CUDA: the CPU path never reaches ``try_cuda``.
"""

from __future__ import annotations

import importlib.util
import logging
import os
import re
import sys
import threading
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

log = logging.getLogger(__name__)

EXTENSION_NAME = "quantfuse_C"
SOURCE_SUFFIXES = (".cu", ".cpp")


@dataclass(frozen=True)
class KernelFamily:
    supports: Callable[..., str | None]
    launch: Callable[..., torch.Tensor]


_families: dict[str, KernelFamily] = {}
_lock = threading.Lock()
_state = {"status": "unloaded", "error": None}


_capabilities: dict[int, tuple[int, int]] = {}


def capability(device: torch.device) -> tuple[int, int]:
    """The CUDA device's compute capability, cached (the dispatch asks on every call)."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    cap = _capabilities.get(index)
    if cap is None:
        cap = _capabilities[index] = torch.cuda.get_device_capability(index)
    return cap


_ops_present: dict[str, bool] = {}


def op_built(name: str) -> bool:
    """Whether the loaded extension registered ``quantfuse.<name>`` (cached once it has)."""
    if not _ops_present.get(name):
        _ops_present[name] = hasattr(torch.ops.quantfuse, name)
    return _ops_present[name]


def register(op_name: str, supports, launch) -> None:
    """Make ``launch`` the CUDA path of ``quantfuse.<op_name>`` where ``supports`` allows."""
    _families[op_name] = KernelFamily(supports, launch)


def csrc_dir() -> Path:
    """The kernel sources: the repository's ``csrc/`` or the installed copy."""
    for candidate in (Path(__file__).resolve().parents[1] / "csrc", Path(__file__).parent / "csrc"):
        if candidate.is_dir():
            return candidate
    raise FileNotFoundError("quantfuse: no csrc/ directory next to the package")


def selected_families() -> list[str] | None:
    """``QUANTFUSE_CSRC_ONLY=awq_gemm,scaled_mm/scaled_mm_sm80`` restricts the build to the
    csrc/ sources whose path relative to csrc/ starts with one of those prefixes (a family
    folder, or some of its files); for kernel development, unset in normal use."""
    only = os.environ.get("QUANTFUSE_CSRC_ONLY")
    return [f for f in only.split(",") if f] if only else None


def sources() -> list[Path]:
    root = csrc_dir()
    only = selected_families()
    return sorted(
        p for p in root.rglob("*")
        if p.suffix in SOURCE_SUFFIXES
        and (only is None or any(p.relative_to(root).as_posix().startswith(f) for f in only))
    )


def extension_name() -> str:
    only = selected_families()
    if only is None:
        return EXTENSION_NAME
    return EXTENSION_NAME + "_" + "_".join(re.sub(r"\W", "_", f) for f in sorted(only))


def cutlass_include_dirs() -> list[str]:
    """CUTLASS headers from the ``nvidia-cutlass`` package, located without importing it."""
    override = os.environ.get("QUANTFUSE_CUTLASS_INCLUDE")
    if override:
        return override.split(os.pathsep)
    spec = importlib.util.find_spec("cutlass_library")
    if spec is None or not spec.submodule_search_locations:
        return []
    root = Path(next(iter(spec.submodule_search_locations))) / "source"
    dirs = [root / "include", root / "tools" / "util" / "include"]
    return [str(d) for d in dirs if d.is_dir()]


def arch_list_for(capability: tuple[int, int]) -> str:
    """TORCH_CUDA_ARCH_LIST entry for a GPU: Hopper needs the arch-specific 90a target
    for wgmma and TMA; older GPUs build for their own arch."""
    major, minor = capability
    return f"{major}.{minor}a" if (major, minor) == (9, 0) else f"{major}.{minor}"


def cxx_standard() -> str:
    """torch 2.14's headers need C++20; 2.11-2.13 build as C++17."""
    major, minor = (int(v) for v in torch.__version__.split(".")[:2])
    return "c++20" if (major, minor) >= (2, 14) else "c++17"


def nvcc_flags() -> list[str]:
    """nvcc flags shared by the runtime build and CI's compile-only check."""
    return [
        "-O3",
        f"-std={cxx_standard()}",
        "--expt-relaxed-constexpr",
        "--expt-extended-lambda",
        "-DCUTLASS_ENABLE_TENSOR_CORE_MMA=1",
        "-U__CUDA_NO_HALF_OPERATORS__",
        "-U__CUDA_NO_HALF_CONVERSIONS__",
        "-U__CUDA_NO_BFLOAT16_OPERATORS__",
        "-U__CUDA_NO_BFLOAT16_CONVERSIONS__",
    ]


def build(verbose: bool = False):
    """Compile and load the extension for the GPU present; returns the loaded library path."""
    from torch.utils import cpp_extension

    srcs = sources()
    if not srcs:
        return None
    includes = [str(csrc_dir())] + cutlass_include_dirs()
    if not os.environ.get("TORCH_CUDA_ARCH_LIST"):
        os.environ["TORCH_CUDA_ARCH_LIST"] = arch_list_for(torch.cuda.get_device_capability())
    os.environ.setdefault("MAX_JOBS", str(os.cpu_count() or 1))
    sys.stderr.write(
        f"quantfuse: building CUDA kernels ({len(srcs)} sources, arch "
        f"{os.environ['TORCH_CUDA_ARCH_LIST']}, MAX_JOBS={os.environ['MAX_JOBS']}); "
        "first use only, the result is cached...\n"
    )
    start = time.monotonic()
    cpp_extension.load(
        name=extension_name(),
        sources=[str(s) for s in srcs],
        extra_include_paths=includes,
        extra_cflags=["-O3", f"-std={cxx_standard()}"],
        extra_cuda_cflags=nvcc_flags(),
        is_python_module=False,
        verbose=verbose,
    )
    sys.stderr.write(f"quantfuse: CUDA kernels ready ({time.monotonic() - start:.0f} s)\n")
    return True


def ensure_loaded() -> bool:
    """True when the extension is loaded; builds it on first call. Never raises."""
    if _state["status"] == "loaded":
        return True
    if _state["status"] in ("failed", "absent"):
        return False
    with _lock:
        if _state["status"] != "unloaded":
            return _state["status"] == "loaded"
        if not torch.cuda.is_available() or os.environ.get("QUANTFUSE_DISABLE_CUDA") == "1":
            _state["status"] = "absent"
            return False
        try:
            _state["status"] = "loaded" if build() else "absent"
        except Exception as exc:  # any build or load failure: run the references instead
            _state["status"], _state["error"] = "failed", exc
            warnings.warn(
                f"quantfuse: the CUDA extension could not be built or loaded ({exc!r}); "
                "the reference implementations run instead (correct, not fast).",
                RuntimeWarning,
                stacklevel=2,
            )
    return _state["status"] == "loaded"


def try_cuda(op_name: str, args: tuple, kwargs: dict):
    """The kernel's result for a CUDA call of ``quantfuse.<op_name>``, or None."""
    family = _families.get(op_name)
    if family is None:
        log.debug("%s: no CUDA kernel registered; reference runs", op_name)
        return None
    reason = family.supports(*args, **kwargs)
    if reason is not None:
        log.debug("%s: reference runs: %s", op_name, reason)
        return None
    if not ensure_loaded():
        log.debug("%s: reference runs: CUDA extension not available", op_name)
        return None
    return family.launch(*args, **kwargs)


def status() -> dict:
    """What the loader knows: 'unloaded', 'loaded', 'failed' (with the error) or 'absent'."""
    return {"status": _state["status"], "error": _state["error"], "families": sorted(_families)}
