"""How the CUDA kernels in ``csrc/`` are compiled, shared by every build of them.

``setup.py`` (the ahead-of-time build into ``compile_backend/_C``), ``kernels/loader.py``
(the JIT build at first use) and ``.ci/compile_csrc.py`` (CI's compile-only
check) take their sources, flags and include directories from here, so the
three compile the same thing.  This module imports nothing beyond the standard
library: ``setup.py`` loads it by path, before torch or this package can be
imported.
"""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

SOURCE_SUFFIXES = (".cu", ".cpp")
# What a wheel's prebuilt library is compiled for: A100-class GPUs (sm_80 code also runs on
# sm_86/sm_89) and Hopper (wgmma and TMA need the arch-specific sm_90a target).
DEFAULT_ARCH_LIST = "8.0;9.0a"
# The prebuilt library (``compile_backend/_C*.so``) and the record written next to it:
# which torch it was built against and for which architectures.
PREBUILT_NAME = "_C"
PREBUILT_INFO = "_C_build.json"


def list_sources(root: Path, only: list[str] | None = None) -> list[Path]:
    """The kernel sources under ``root`` (``csrc/``), sorted; ``only``: path prefixes relative
    to ``root`` (a family folder, or some of its files) to restrict them to."""
    return sorted(
        p for p in Path(root).rglob("*")
        if p.suffix in SOURCE_SUFFIXES
        and (only is None or any(p.relative_to(root).as_posix().startswith(f) for f in only))
    )


def cutlass_include_dirs() -> list[str]:
    """CUTLASS headers from the ``nvidia-cutlass`` package, located without importing it
    (``QUANTFUSE_CUTLASS_INCLUDE``, a path list, overrides)."""
    override = os.environ.get("QUANTFUSE_CUTLASS_INCLUDE")
    if override:
        return override.split(os.pathsep)
    spec = importlib.util.find_spec("cutlass_library")
    if spec is None or not spec.submodule_search_locations:
        return []
    root = Path(next(iter(spec.submodule_search_locations))) / "source"
    dirs = [root / "include", root / "tools" / "util" / "include"]
    return [str(d) for d in dirs if d.is_dir()]


def cuda_wheel_include_dirs(torch_dir: str | Path, cuda_home: str | Path | None) -> list[str]:
    """Headers of the CUDA libraries (cuSPARSE, cuBLAS, ...) that torch's headers include, from
    the ``nvidia`` packages a pip-installed CUDA torch depends on, for a CUDA toolkit that has
    nvcc and the runtime but not those libraries' headers; empty where the toolkit has them.
    They go after the toolkit's own include directory."""
    if cuda_home is not None and (Path(cuda_home) / "include" / "cusparse.h").is_file():
        return []
    nvidia = Path(torch_dir).resolve().parent / "nvidia"
    return [str(d) for d in sorted(nvidia.glob("*/include")) if (d / "cusparse.h").is_file()]


def _torch_version() -> str:
    import torch

    return torch.__version__


def cxx_standard(torch_version: str | None = None) -> str:
    """torch 2.14's headers need C++20; 2.11-2.13 build as C++17."""
    major, minor = (int(v) for v in (torch_version or _torch_version()).split(".")[:2])
    return "c++20" if (major, minor) >= (2, 14) else "c++17"


# CUTLASS calls cuTensorMapEncodeTiled directly, under the name csrc/common/tma_driver.cpp
# defines: it looks the driver function up once, where CUTLASS would on every TMA descriptor.
DRIVER_DEFINES = [
    "-DCUTLASS_ENABLE_DIRECT_CUDA_DRIVER_CALL=1",
    "-DcuTensorMapEncodeTiled=quantfuse_cuTensorMapEncodeTiled",
]


def cxx_flags(torch_version: str | None = None) -> list[str]:
    """Host compiler flags for the ``.cpp`` sources."""
    return ["-O3", f"-std={cxx_standard(torch_version)}", *DRIVER_DEFINES]


def nvcc_flags(torch_version: str | None = None) -> list[str]:
    """nvcc flags for the ``.cu`` sources (the architectures come from TORCH_CUDA_ARCH_LIST)."""
    return [
        "-O3",
        f"-std={cxx_standard(torch_version)}",
        "--expt-relaxed-constexpr",
        "--expt-extended-lambda",
        "-DCUTLASS_ENABLE_TENSOR_CORE_MMA=1",
        *DRIVER_DEFINES,
        "-U__CUDA_NO_HALF_OPERATORS__",
        "-U__CUDA_NO_HALF_CONVERSIONS__",
        "-U__CUDA_NO_BFLOAT16_OPERATORS__",
        "-U__CUDA_NO_BFLOAT16_CONVERSIONS__",
    ]


def arch_list_for(capability: tuple[int, int]) -> str:
    """TORCH_CUDA_ARCH_LIST entry for a GPU: Hopper needs the arch-specific 90a target
    for wgmma and TMA; older GPUs build for their own arch."""
    major, minor = capability
    return f"{major}.{minor}a" if (major, minor) == (9, 0) else f"{major}.{minor}"


def arch_list_runs_on(arch_list: str, capability: tuple[int, int]) -> bool:
    """Whether code built for ``arch_list`` (TORCH_CUDA_ARCH_LIST syntax) runs on a GPU of
    ``capability``: machine code for sm_XY runs on sm_XZ with Z >= Y, arch-specific targets
    (``9.0a``) only on their own arch; ``+PTX`` entries run on anything newer."""
    major, minor = capability
    for entry in arch_list.replace(",", ";").replace(" ", ";").split(";"):
        entry = entry.strip()
        if not entry:
            continue
        ptx = entry.endswith("+PTX")
        entry = entry.removesuffix("+PTX")
        specific = entry.endswith("a")
        e_major, e_minor = (int(v) for v in entry.rstrip("af").split(".")[:2])
        if specific:
            if (e_major, e_minor) == (major, minor):
                return True
            continue
        if ptx and (major, minor) >= (e_major, e_minor):
            return True
        if e_major == major and minor >= e_minor:
            return True
    return False
