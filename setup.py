"""Packaging of quantfuse (metadata in pyproject.toml).

Default: a pure-Python wheel.  It carries the csrc/ sources as
``compile_backend/csrc``, so the kernels can be built at first use (JIT); it
needs neither nvcc nor torch to build.

``QUANTFUSE_BUILD_CUDA=1``: the kernels are compiled ahead of time into the
wheel, one library ``compile_backend/_C*.so`` (TORCH_LIBRARY registrations only;
loaded with ``torch.ops.load_library``, not imported).  It needs torch (a CUDA
build, the one the wheel will run with), nvcc (``CUDA_HOME``), ninja and the
``nvidia-cutlass`` package at build time, hence ``--no-build-isolation``::

    QUANTFUSE_BUILD_CUDA=1 pip wheel --no-build-isolation --no-deps .

``TORCH_CUDA_ARCH_LIST`` (default ``8.0;9.0a``) chooses the architectures and
``MAX_JOBS`` the parallel compile jobs.
"""

from __future__ import annotations

import importlib.util
import json
import os
import sys
from pathlib import Path

from setuptools import find_packages, setup
from setuptools.command.build_py import build_py

ROOT = Path(__file__).resolve().parent
CSRC = "csrc"
CSRC_PATTERNS = ["**/*.cu", "**/*.cuh", "**/*.cpp", "**/*.h", "**/*.hpp"]


def _build_config():
    """compile_backend/kernels/build_config.py, loaded by path: importing the package needs torch."""
    path = ROOT / "compile_backend" / "kernels" / "build_config.py"
    spec = importlib.util.spec_from_file_location("_quantfuse_build_config", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def packages() -> tuple[list[str], dict[str, str]]:
    """Every package under compile_backend/, passes/ installed as compile_backend.passes, and
    csrc/ as the data package compile_backend.csrc."""
    found = find_packages(include=["compile_backend", "compile_backend.*"])
    found += ["compile_backend.passes"] + ["compile_backend.passes." + p for p in find_packages("passes")]
    found.append("compile_backend.csrc")
    return found, {"compile_backend.passes": "passes", "compile_backend.csrc": CSRC}


class BuildPy(build_py):
    """No __init__.py in compile_backend.csrc: it is a folder of kernel sources, not a module."""

    def check_package(self, package, package_dir):
        if package == "compile_backend.csrc":
            return None
        return super().check_package(package, package_dir)


def _fail(message: str):
    sys.exit(f"setup.py: QUANTFUSE_BUILD_CUDA=1: {message}")


def cuda_extension():
    """The ``compile_backend._C`` extension and the build_ext command that builds it."""
    try:
        import torch
        from torch.utils import cpp_extension
    except ImportError:
        _fail("torch is not importable; install a CUDA build of torch and build with --no-build-isolation")
    if torch.version.cuda is None:
        _fail(f"torch {torch.__version__} is not a CUDA build")
    if cpp_extension.CUDA_HOME is None:
        _fail("no CUDA toolkit found (set CUDA_HOME, or put nvcc on PATH)")
    config = _build_config()
    cutlass = config.cutlass_include_dirs()
    if not cutlass:
        _fail("the CUTLASS headers were not found: pip install nvidia-cutlass (or set QUANTFUSE_CUTLASS_INCLUDE)")
    sources = config.list_sources(ROOT / CSRC)
    if not sources:
        _fail(f"no kernel sources under {ROOT / CSRC}")
    os.environ.setdefault("TORCH_CUDA_ARCH_LIST", config.DEFAULT_ARCH_LIST)
    os.environ.setdefault("MAX_JOBS", str(os.cpu_count() or 1))
    print(
        f"setup.py: building compile_backend._C from {len(sources)} sources for TORCH_CUDA_ARCH_LIST="
        f"{os.environ['TORCH_CUDA_ARCH_LIST']} (torch {torch.__version__}, CUDA {torch.version.cuda}, "
        f"MAX_JOBS={os.environ['MAX_JOBS']})",
        flush=True,
    )
    extension = cpp_extension.CUDAExtension(
        name="compile_backend." + config.PREBUILT_NAME,
        sources=[s.relative_to(ROOT).as_posix() for s in sources],
        include_dirs=[str(ROOT / CSRC), *cutlass],
        extra_compile_args={
            "cxx": config.cxx_flags(torch.__version__),
            "nvcc": config.nvcc_flags(torch.__version__),
        },
    )
    extension.include_dirs += config.cuda_wheel_include_dirs(Path(torch.__file__).parent, cpp_extension.CUDA_HOME)

    class BuildExt(cpp_extension.BuildExtension):
        """Builds with ninja, and records next to the library what it was built for."""

        def run(self):
            super().run()
            info = {
                "torch": torch.__version__,
                "cuda": torch.version.cuda,
                "arch_list": os.environ["TORCH_CUDA_ARCH_LIST"],
            }
            out_dir = Path(self.get_ext_fullpath(extension.name)).parent
            (out_dir / config.PREBUILT_INFO).write_text(json.dumps(info, indent=1) + "\n")

        def get_outputs(self):
            info = str(Path(self.get_ext_fullpath(extension.name)).parent / config.PREBUILT_INFO)
            return [*super().get_outputs(), info]

    return extension, BuildExt.with_options(use_ninja=True)


package_list, package_dir = packages()
kwargs = {}
if os.environ.get("QUANTFUSE_BUILD_CUDA") == "1":
    ext, build_ext = cuda_extension()
    kwargs = {"ext_modules": [ext], "cmdclass": {"build_py": BuildPy, "build_ext": build_ext}}
else:
    kwargs = {"cmdclass": {"build_py": BuildPy}}

setup(
    packages=package_list,
    package_dir=package_dir,
    package_data={"compile_backend.csrc": CSRC_PATTERNS},
    **kwargs,
)
