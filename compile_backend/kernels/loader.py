"""Loads the CUDA kernels in ``csrc/`` (prebuilt, or built at first use).

The loaded library registers the public ops' CUDA implementations (csrc/*/*_dispatch.cpp:
the kernel choice, and the reference with a reason where no kernel takes an input);
``compile_backend.ops`` calls ``ensure_loaded`` at the first CUDA call of an op.

Where the kernels come from, at the first CUDA call (``ensure_loaded``):

* a wheel built with ``QUANTFUSE_BUILD_CUDA=1`` carries them prebuilt, as
  ``compile_backend/_C*.so``, loaded with ``torch.ops.load_library``; nothing
  compiles.  It is used when it was built against this torch version and for
  this GPU's architecture (``_C_build.json`` next to it says which) and, when
  built in place in a source checkout, after the last change to ``csrc/``;
* otherwise (a source checkout, a CPU wheel, another GPU) the sources are
  built with ``torch.utils.cpp_extension`` for the GPU present, cached by
  torch under ``TORCH_EXTENSIONS_DIR``; ``python -m compile_backend.kernels.build``
  builds them ahead of the first call.  ``QUANTFUSE_JIT=1`` skips the prebuilt
  library (kernel development).

The ``quantfuse.kernels`` logger says at INFO which one was used.  If neither
can be loaded, one warning is issued and the reference implementations run from
then on.  Nothing here runs on a machine without CUDA: the CPU path never
calls ``ensure_loaded``.  Sources, flags and include directories are those of
``build_config``, which ``setup.py`` uses too.
"""

from __future__ import annotations

import json
import logging
import os
import re
import sys
import threading
import time
import warnings
from pathlib import Path

import torch

from . import build_config
from .build_config import SOURCE_SUFFIXES, arch_list_for, cutlass_include_dirs  # noqa: F401  (part of this API)

log = logging.getLogger("quantfuse.kernels")

EXTENSION_NAME = "quantfuse_C"


# compile_backend/: where a CUDA wheel's prebuilt library and the installed csrc/ copy live.
PACKAGE_DIR = Path(__file__).resolve().parents[1]
# A source checkout's csrc/, beside the package.
CHECKOUT_CSRC = PACKAGE_DIR.parent / "csrc"

_lock = threading.Lock()
_state = {"status": "unloaded", "error": None, "kernels": None, "library": None}


def csrc_dir() -> Path:
    """The kernel sources: the repository's ``csrc/`` or the copy installed in the package."""
    for candidate in (CHECKOUT_CSRC, PACKAGE_DIR / "csrc"):
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
    return build_config.list_sources(csrc_dir(), selected_families())


def extension_name() -> str:
    only = selected_families()
    if only is None:
        return EXTENSION_NAME
    return EXTENSION_NAME + "_" + "_".join(re.sub(r"\W", "_", f) for f in sorted(only))


def cxx_standard() -> str:
    """The C++ standard for this torch's headers (see ``build_config.cxx_standard``)."""
    return build_config.cxx_standard(torch.__version__)


def nvcc_flags() -> list[str]:
    """nvcc flags shared by the ahead-of-time build, the JIT build and CI's compile-only check."""
    return build_config.nvcc_flags(torch.__version__)


def prebuilt_library() -> Path | None:
    """The library a CUDA wheel carries (``compile_backend/_C*.so``), or None."""
    found = sorted(PACKAGE_DIR.glob(build_config.PREBUILT_NAME + "*.so"))
    return found[0] if found else None


def _public_version(version: str) -> str:
    return version.split("+")[0]


def prebuilt_unusable(library: Path) -> str | None:
    """Why the prebuilt library cannot serve this process (None: it can)."""
    if os.environ.get("QUANTFUSE_JIT") == "1":
        return "QUANTFUSE_JIT=1"
    if selected_families() is not None:
        return "QUANTFUSE_CSRC_ONLY is set"
    info_path = library.parent / build_config.PREBUILT_INFO
    try:
        info = json.loads(info_path.read_text())
    except (OSError, ValueError) as exc:
        return f"no readable {info_path.name} ({exc})"
    built_for, running = _public_version(info.get("torch", "?")), _public_version(torch.__version__)
    if built_for != running:
        return f"built against torch {built_for}, running torch {running}"
    checkout_csrc = CHECKOUT_CSRC
    if checkout_csrc.is_dir():  # built in place in a source checkout: stale once a source changes
        built = library.stat().st_mtime
        if any(p.stat().st_mtime > built for p in checkout_csrc.rglob("*") if p.is_file()):
            return f"{checkout_csrc} changed since it was built"
    arch_list = info.get("arch_list", "")
    cap = torch.cuda.get_device_capability()
    if not build_config.arch_list_runs_on(arch_list, cap):
        return f"built for {arch_list!r}, none of which runs on this GPU (sm_{cap[0]}{cap[1]})"
    return None


def build(verbose: bool = False):
    """Compile (JIT) and load the extension for the GPU present; True once loaded."""
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
        extra_cflags=build_config.cxx_flags(torch.__version__),
        extra_cuda_cflags=nvcc_flags(),
        is_python_module=False,
        verbose=verbose,
    )
    sys.stderr.write(f"quantfuse: CUDA kernels ready ({time.monotonic() - start:.0f} s)\n")
    return True


def _load() -> bool:
    """Load the prebuilt library where it can serve, else build from source; raises on failure."""
    library = prebuilt_library()
    prebuilt_error = None
    if library is not None:
        reason = prebuilt_unusable(library)
        if reason is None:
            try:
                torch.ops.load_library(str(library))
            except Exception as exc:  # e.g. a torch or CUDA runtime it was not built against
                prebuilt_error = exc
                log.info("prebuilt CUDA kernels %s failed to load (%r); building from source", library, exc)
            else:
                _state["kernels"], _state["library"] = "prebuilt", str(library)
                log.info("loaded the prebuilt CUDA kernels %s", library)
                return True
        else:
            log.info("prebuilt CUDA kernels %s not used: %s; building from source", library, reason)
    try:
        built = build()
    except Exception as exc:
        if prebuilt_error is not None:
            raise RuntimeError(f"prebuilt library: {prebuilt_error!r}; build from source: {exc!r}") from exc
        raise
    if built:
        _state["kernels"] = "jit"
        log.info("loaded the CUDA kernels built from %s (JIT, %s)", csrc_dir(), extension_name())
    return bool(built)


# Called (under the loader's lock) right before the library is loaded, and after a load
# that did not happen: compile_backend.ops removes its Python CUDA implementations of the
# public ops first, so that the library's C++ ones replace nothing, and puts them back if
# there is no library.
_before_load: list = []
_after_failed_load: list = []


def on_load(before, after_failure) -> None:
    _before_load.append(before)
    _after_failed_load.append(after_failure)


def ensure_loaded() -> bool:
    """True when the kernels are loaded; loads or builds them on first call. Never raises."""
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
        for hook in _before_load:
            hook()
        try:
            _state["status"] = "loaded" if _load() else "absent"
        except Exception as exc:  # any build or load failure: run the references instead
            _state["status"], _state["error"] = "failed", exc
            warnings.warn(
                f"quantfuse: the CUDA extension could not be built or loaded ({exc!r}); "
                "the reference implementations run instead (correct, not fast).",
                RuntimeWarning,
                stacklevel=2,
            )
        if _state["status"] != "loaded":
            for hook in _after_failed_load:
                hook()
    return _state["status"] == "loaded"


def families() -> list[str]:
    """The kernel families (``csrc/`` folders) the kernels are built from: those
    ``QUANTFUSE_CSRC_ONLY`` selects, else every one."""
    only = selected_families()
    if only is not None:
        return sorted(only)
    try:
        root = csrc_dir()
    except FileNotFoundError:
        return []
    return sorted(p.name for p in root.iterdir() if p.is_dir() and p.name != "common")


def status() -> dict:
    """What the loader knows: 'unloaded', 'loaded', 'failed' (with the error) or 'absent'; once
    loaded, which kernels ('prebuilt' with the library's path, or 'jit'); the families built."""
    return {**_state, "families": families()}
