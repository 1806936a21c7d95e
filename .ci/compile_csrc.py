"""Compile every csrc/ source with nvcc, compile only, against torch's CUDA headers.

CI has no GPU; this catches a kernel that does not compile.  Run it with a
Python whose torch is a CUDA build (torch 2.14.1 from local disk on CI's
machine).  Targets: sm_90a (what an H100 builds) and sm_80 (A100 class).
Sources, flags and CUTLASS headers come from compile_backend/build_config.py,
as for setup.py's ahead-of-time build and the JIT build.

The sources that only instantiate Hopper kernels (``QF_SM90_ENTRY`` /
``QF_AWQ_SM90_INSTANTIATE``: CUTLASS 3.x kernels whose bodies the ``Sm90Only`` /
``EnableSm90Only`` wrappers compile for sm_90a alone) are compiled for sm_90a,
and the first of each family folder also for sm_80: that checks the wrapper the
family's instantiations all go through, which is what the wheel's sm_80 build
of them needs, at a fraction of the time (their sm_80 pass parses CUTLASS once
more to compile empty kernels).  Every other source is compiled for both.
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
import sysconfig
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch
from torch.utils import cpp_extension

ROOT = Path(__file__).resolve().parents[1]
CSRC = ROOT / "csrc"
_spec = importlib.util.spec_from_file_location("_quantfuse_build_config", ROOT / "compile_backend" / "build_config.py")
build_config = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(build_config)

ARCHES = os.environ.get("QUANTFUSE_CI_ARCHES", "90a,80").split(",")


SM90_INSTANTIATIONS = ("QF_SM90_ENTRY(", "QF_AWQ_SM90_INSTANTIATE(")


def instantiates_sm90(source: Path) -> bool:
    text = source.read_text()
    return any(macro in text for macro in SM90_INSTANTIATIONS)


def arches_for(source: Path, hopper_only: set[Path]) -> list[str]:
    """ARCHES, less sm_80 for a Hopper instantiation file that is not the first of its folder."""
    if source not in hopper_only or source == min(s for s in hopper_only if s.parent == source.parent):
        return ARCHES
    return [a for a in ARCHES if not a.startswith("8")] or ARCHES


def command(source: Path, out: Path, arches: list[str] = ARCHES) -> list[str]:
    includes = cpp_extension.include_paths(device_type="cuda") + [str(CSRC)]
    includes += build_config.cutlass_include_dirs()
    includes += build_config.cuda_wheel_include_dirs(Path(torch.__file__).parent, cpp_extension.CUDA_HOME)
    includes.append(sysconfig.get_paths()["include"])
    gencode = [f"-gencode=arch=compute_{a},code=sm_{a}" for a in arches]
    defines = ["-DTORCH_EXTENSION_NAME=quantfuse_C", "-DTORCH_API_INCLUDE_EXTENSION_H", "-D_GLIBCXX_USE_CXX11_ABI=1"]
    compiler = "nvcc" if source.suffix == ".cu" else "c++"
    flags = build_config.nvcc_flags(torch.__version__) + gencode + ["-Xcompiler", "-fPIC"] if compiler == "nvcc" else [
        "-O1", f"-std={build_config.cxx_standard(torch.__version__)}", "-fPIC", *build_config.DRIVER_DEFINES]
    return [compiler, "-c", str(source), "-o", str(out), *defines, *flags, *[f"-I{i}" for i in includes]]


def main() -> int:
    sources = build_config.list_sources(CSRC)
    if not sources:
        print("compile_csrc: no sources under csrc/")
        return 0
    if not build_config.cutlass_include_dirs():
        print("compile_csrc: CUTLASS headers not found (pip install nvidia-cutlass)")
        return 1
    hopper_only = {s for s in sources if instantiates_sm90(s)}
    out_dir = Path(os.environ.get("TMPDIR", "/tmp")) / "quantfuse_ci_objs"
    out_dir.mkdir(parents=True, exist_ok=True)
    jobs = int(os.environ.get("MAX_JOBS", os.cpu_count() or 1))
    print(f"compile_csrc: {len(sources)} sources, arches {ARCHES}, torch {torch.__version__}, {jobs} jobs", flush=True)

    def run(source: Path):
        start = time.monotonic()
        arches = arches_for(source, hopper_only)
        proc = subprocess.run(command(source, out_dir / (source.stem + ".o"), arches), capture_output=True, text=True)
        return source, arches, proc, time.monotonic() - start

    failed = 0
    with ThreadPoolExecutor(jobs) as pool:
        for source, arches, proc, seconds in pool.map(run, sources):
            status = "ok" if proc.returncode == 0 else "FAILED"
            print(f"  {status:6} {source.relative_to(ROOT)} ({','.join(arches)}; {seconds:.0f} s)", flush=True)
            if proc.returncode != 0:
                failed += 1
                print(proc.stdout[-4000:], proc.stderr[-8000:])
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
