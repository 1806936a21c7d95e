"""Compile every csrc/ source with nvcc, compile only, against torch's CUDA headers.

CI has no GPU; this catches a kernel that does not compile.  Run it with a
Python whose torch is a CUDA build (torch 2.14.1 from local disk on CI's
machine).  Targets: sm_90a (what an H100 builds) and sm_80 (A100 class).
Sources, flags and CUTLASS headers come from compile_backend/build_config.py,
as for setup.py's ahead-of-time build and the JIT build.

The sources that only instantiate kernels of one family header (a macro line per file:
``QF_SM90_ENTRY`` / ``QF_AWQ_SM90_INSTANTIATE`` for CUTLASS 3.x Hopper kernels,
``QF_SM80_ENTRY`` for CUTLASS 2.x ones) spend nearly all their compile time parsing and
instantiating CUTLASS, once per file.  Here each such group of a folder is compiled as one
translation unit that includes all of its files: every instantiation is still compiled, the
headers are parsed once (on CI's 2 cores, the 14 AWQ tile files take about 500 s against
1400 s one by one).  A Hopper group's kernel bodies compile for sm_90a alone (the
``Sm90Only`` / ``EnableSm90Only`` wrappers), so its unit is compiled for sm_90a and the first
file of the group also for sm_80, which checks the wrapper every instantiation goes through.
Every other source is compiled on its own for both.
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


INSTANTIATION_MACROS = {"sm90": ("QF_SM90_ENTRY(", "QF_AWQ_SM90_INSTANTIATE("), "sm80": ("QF_SM80_ENTRY(",)}


def instantiation_kind(source: Path) -> str | None:
    """"sm90" or "sm80" for a file holding nothing but includes and instantiation macro lines of
    that kind, else None."""
    lines = [ln.strip() for ln in source.read_text().splitlines()]
    code = [ln for ln in lines if ln and not ln.startswith("//") and not ln.startswith("#include")]
    for kind, macros in INSTANTIATION_MACROS.items():
        if code and all(ln.startswith(macros) for ln in code):
            return kind
    return None


def compile_units(sources: list[Path], out_dir: Path) -> list[tuple[Path, list[Path], list[str]]]:
    """(unit to compile, the sources it covers, arches): one unit per group of instantiation files
    (see the module doc), first since they take longest, then every other source on its own."""
    groups: dict[tuple[Path, str], list[Path]] = {}
    units = []
    for source in sources:
        kind = instantiation_kind(source)
        if kind is None:
            units.append((source, [source], ARCHES))
        else:
            groups.setdefault((source.parent, kind), []).append(source)
    grouped = []
    for (folder, kind), members in sorted(groups.items()):
        members.sort()
        unit = members[0]
        if len(members) > 1:
            unit = out_dir / f"{folder.name}_{kind}_instantiations.cu"
            unit.write_text("".join(f'#include "{m}"\n' for m in members))
        hopper = [a for a in ARCHES if not a.startswith("8")] or ARCHES
        grouped.append((unit, members, hopper if kind == "sm90" else ARCHES))
        if kind == "sm90" and hopper != ARCHES:
            grouped.append((members[0], [members[0]], [a for a in ARCHES if a.startswith("8")]))
    return grouped + units


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
    out_dir = Path(os.environ.get("TMPDIR", "/tmp")) / "quantfuse_ci_objs"
    out_dir.mkdir(parents=True, exist_ok=True)
    units = compile_units(sources, out_dir)
    jobs = int(os.environ.get("MAX_JOBS", os.cpu_count() or 1))
    print(f"compile_csrc: {len(sources)} sources in {len(units)} units, arches {ARCHES}, torch {torch.__version__}, "
          f"{jobs} jobs", flush=True)

    def run(unit_item):
        unit, members, arches = unit_item
        start = time.monotonic()
        obj = out_dir / f"{unit.stem}_{'_'.join(arches)}.o"
        proc = subprocess.run(command(unit, obj, arches), capture_output=True, text=True)
        return members, arches, proc, time.monotonic() - start

    def named(members: list[Path]) -> str:
        first = members[0].relative_to(ROOT)
        return str(first) if len(members) == 1 else f"{first} and {len(members) - 1} more of {first.parent} in one unit"

    failed = 0
    with ThreadPoolExecutor(jobs) as pool:
        for members, arches, proc, seconds in pool.map(run, units):
            status = "ok" if proc.returncode == 0 else "FAILED"
            print(f"  {status:6} {named(members)} ({','.join(arches)}; {seconds:.0f} s)", flush=True)
            if proc.returncode != 0:
                failed += 1
                print(proc.stdout[-4000:], proc.stderr[-8000:])
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
