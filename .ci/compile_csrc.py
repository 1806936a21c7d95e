"""Compile every csrc/ source with nvcc, compile only, against torch's CUDA headers.

CI has no GPU; this catches a kernel that does not compile.  Run it with a
Python whose torch is a CUDA build (torch 2.14.1 from local disk on CI's
machine).  Targets: sm_90a (what an H100 builds) and sm_80 (A100 class).
Sources, flags and CUTLASS headers come from compile_backend/kernels/build_config.py,
as for setup.py's ahead-of-time build and the JIT build, so nothing is compiled with
flags of its own: device code goes through cicc and ptxas for each target as in a real
build, which is what catches inline-asm and ptxas errors.  Arguments (path prefixes
under csrc/) restrict it to some sources.

Where the time goes (nvcc --time on the CUTLASS units): cicc takes 70-85%, about 70% of
that in its front end, which instantiates CUTLASS for the device (-fdevice-syntax-only stops
after it), the rest in its optimiser; ptxas takes under a second per kernel, the host side
(cudafe++, g++) the remainder.  Turning device optimisation down does not help (cicc -O0 or
-O1, or --Ofast-compile=max, leave PTX that ptxas takes minutes over; --Ofast-compile=mid or
min and -Xcicc -O2 gain nothing), nor does the host's -O level.  So what is cut is repeated
work:

* The sources that only instantiate kernels of one family header (a macro line per file:
  ``QF_SM90_ENTRY`` / ``QF_AWQ_SM90_INSTANTIATE`` for CUTLASS 3.x Hopper kernels,
  ``QF_SM80_ENTRY`` for CUTLASS 2.x ones) spend nearly all their time parsing and
  instantiating CUTLASS, once per file.  Each such group of a folder is compiled as one
  translation unit that includes all of its files: every instantiation is still compiled, the
  headers are parsed once (the 14 AWQ tile files: about 340 s of CPU for both targets,
  against 65 s a file for sm_90a alone).  Groups are not merged further: the AWQ unit's cicc
  already peaks near 13 GB.  A Hopper group's kernel bodies compile for sm_90a alone (the
  ``Sm90Only`` / ``EnableSm90Only`` wrappers); its unit is compiled for every target in one
  nvcc call, so the sm_80 pass checks the wrapper of every instantiation and shares the host
  pass with sm_90a.  Every other source is compiled on its own.
* Units run longest first (CPU time of the last run, kept in the cache folder, else an
  estimate), as many at once as the machine has cores (MAX_JOBS overrides; one nvcc call is
  single-threaded), and only while their peak memory fits beside the running ones in 90% of
  the memory available (QUANTFUSE_CI_MEMORY_GB overrides): the AWQ unit's cicc peaks at
  about 13 GB, a scaled_mm Hopper unit's at 9 GB.
* A unit that compiled before with the same command, compiler, torch, CUTLASS and the same
  content of every csrc/ file it can include (found by following ``#include`` lines,
  whatever ``#if`` they sit under) is not compiled again: a marker per unit under
  ``$QUANTFUSE_CI_CACHE`` (default ``~/.cache/quantfuse-ci``, outside the clone; ``off``
  disables it).  Only successes are recorded, so a failing unit is compiled every time.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import importlib.util
import json
import os
import re
import subprocess
import sys
import sysconfig
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor, as_completed
from pathlib import Path

import torch
from torch.utils import cpp_extension

ROOT = Path(__file__).resolve().parents[1]
CSRC = ROOT / "csrc"
# Loaded by path (importing the package would need its dependencies); where it lives now, or
# where it lived before compile_backend/ was split into subpackages.
_BUILD_CONFIG = next((p for p in (ROOT / "compile_backend" / "kernels" / "build_config.py",
                                  ROOT / "compile_backend" / "build_config.py") if p.is_file()), None)
if _BUILD_CONFIG is None:
    sys.exit("compile_csrc: compile_backend/kernels/build_config.py not found")
_spec = importlib.util.spec_from_file_location("_quantfuse_build_config", _BUILD_CONFIG)
build_config = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(build_config)

ARCHES = os.environ.get("QUANTFUSE_CI_ARCHES", "90a,80").split(",")


INSTANTIATION_MACROS = {"sm90": ("QF_SM90_ENTRY(", "QF_AWQ_SM90_INSTANTIATE("), "sm80": ("QF_SM80_ENTRY(",)}
INCLUDE = re.compile(r'^\s*#\s*include\s*[<"]([^>"]+)[>"]', re.M)
COMPUTED_INCLUDE = re.compile(r'^\s*#\s*include\s*[^<"\s]', re.M)


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
    of a folder (see the module doc), then every other source on its own."""
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
        grouped.append((unit, members, ARCHES))
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


# --- the cache of units that compiled -------------------------------------------------------

def cache_dir() -> Path | None:
    setting = os.environ.get("QUANTFUSE_CI_CACHE", "")
    if setting.lower() in ("off", "0", "no", "false"):
        return None
    if setting:
        return Path(setting)
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "quantfuse-ci"


def _version_line(tool: str) -> str:
    try:
        return subprocess.run([tool, "--version"], capture_output=True, text=True).stdout.strip()
    except OSError:
        return f"{tool}: not found"


def toolchain_id() -> str:
    """What the result depends on outside csrc/: compilers, torch, CUTLASS, Python (their
    headers are pinned by these versions, so the paths they live at can be left out)."""
    try:
        cutlass = importlib.metadata.version("nvidia-cutlass")
    except importlib.metadata.PackageNotFoundError:
        cutlass = "?"
    version_h = [Path(d) / "cutlass" / "version.h" for d in build_config.cutlass_include_dirs()]
    cutlass += "".join(p.read_text() for p in version_h if p.is_file())
    return "\n".join([f"torch {torch.__version__} cuda {torch.version.cuda}", f"nvidia-cutlass {cutlass}",
                      f"python {sys.version}", _version_line("nvcc"), _version_line("c++"),
                      str(cpp_extension.CUDA_HOME)])


def csrc_dependencies(files: list[Path]) -> list[Path]:
    """The csrc/ files that ``files`` include, transitively, following every ``#include`` line
    whatever ``#if`` it sits under (more than the preprocessor would, never less); every csrc/
    file where one is computed by a macro."""
    seen: set[Path] = set()
    stack = [f.resolve() for f in files]
    while stack:
        path = stack.pop()
        if path in seen:
            continue
        seen.add(path)
        text = path.read_text(errors="replace")
        if COMPUTED_INCLUDE.search(text):
            return sorted(p for p in CSRC.rglob("*") if p.is_file())
        for name in INCLUDE.findall(text):
            for base in (path.parent, CSRC):
                candidate = (base / name).resolve()
                if candidate.is_file() and candidate.is_relative_to(CSRC):
                    stack.append(candidate)
                    break
    return sorted(p for p in seen if p.is_relative_to(CSRC))


def unit_key(cmd: list[str], unit: Path, members: list[Path], toolchain: str, out_dir: Path) -> str:
    """A hash of what decides whether the unit compiles, with the paths of this checkout, its
    environment and the scratch folder written as placeholders (a fresh clone elsewhere, or a
    developer's environment with the same versions, finds the same key)."""
    places = sorted({str(ROOT): "<root>", str(out_dir): "<out>", sys.prefix: "<prefix>",
                     sys.base_prefix: "<base>"}.items(), key=lambda kv: -len(kv[0]))

    def placeless(text: str) -> str:
        for path, name in places:
            text = text.replace(path, name)
        return text

    h = hashlib.sha256()
    h.update(toolchain.encode())
    h.update(placeless("\0".join(cmd)).encode())
    h.update(placeless(unit.read_text()).encode())
    for dep in csrc_dependencies(members):
        h.update(f"\0{dep.relative_to(CSRC).as_posix()}\0".encode())
        h.update(hashlib.sha256(dep.read_bytes()).digest())
    return h.hexdigest()


def _write_atomic(path: Path, text: str) -> None:
    """Write a cache file; a cache that cannot be written costs time, never the check."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
        tmp.write_text(text)
        os.replace(tmp, path)
    except OSError as e:
        print(f"compile_csrc: cache not written ({e})", flush=True)


# --- running them ----------------------------------------------------------------------------

def targets(unit: Path, arches: list[str]) -> str:
    return ",".join(arches) if unit.suffix == ".cu" else "host"


def unit_label(unit: Path, arches: list[str]) -> str:
    name = unit.relative_to(CSRC).as_posix() if unit.is_relative_to(CSRC) else unit.name
    return f"{name} [{targets(unit, arches)}]"


def estimate(unit: Path, members: list[Path], arches: list[str]) -> tuple[float, float]:
    """(CPU seconds, peak GB) where no earlier run measured the unit, from CI's measurements:
    an instantiation file adds about 25 s and 1 GB (AWQ tile) or 1.5 GB (scaled_mm) for
    CUTLASS 3.x, 20 s and 0.5 GB for CUTLASS 2.x; any other kernel source about 60 s and 1 GB,
    a host source 20 s and 1.5 GB."""
    if unit.suffix != ".cu":
        return 20.0, 1.5
    text = members[0].read_text()
    seconds, gb = ((25.0, 1.0) if "QF_AWQ_SM90_INSTANTIATE(" in text else
                   (25.0, 1.5) if "QF_SM90_ENTRY(" in text else
                   (20.0 * len(arches), 0.5) if "QF_SM80_ENTRY(" in text else (None, None))
    return (20.0 + seconds * len(members), 0.5 + gb * len(members)) if seconds else (60.0, 1.0)


def available_gb() -> float:
    try:
        meminfo = Path("/proc/meminfo").read_text()
        return int(re.search(r"^MemAvailable:\s+(\d+) kB", meminfo, re.M).group(1)) / 2**20
    except (OSError, AttributeError):
        return float("inf")


def run_unit(cmd: list[str], scratch: Path) -> tuple[int, str, str, float, float, float]:
    """(exit status, stdout, stderr, wall seconds, CPU seconds of the compiler and its children,
    the largest resident memory of one of them in GB)."""
    start = time.monotonic()
    with tempfile.TemporaryFile(dir=scratch) as out, tempfile.TemporaryFile(dir=scratch) as err:
        proc = subprocess.Popen(cmd, stdout=out, stderr=err, stdin=subprocess.DEVNULL)
        _, status, usage = os.wait4(proc.pid, 0)
        proc.returncode = os.waitstatus_to_exitcode(status)
        out.seek(0)
        err.seek(0)
        stdout, stderr = out.read().decode(errors="replace"), err.read().decode(errors="replace")
    cpu, peak_gb = usage.ru_utime + usage.ru_stime, usage.ru_maxrss / 2**20
    return proc.returncode, stdout, stderr, time.monotonic() - start, cpu, peak_gb


def failure_excerpt(stdout: str, stderr: str) -> str:
    """The error lines first (CUTLASS's warnings can bury them), then the end of the output."""
    lines = (stdout + "\n" + stderr).splitlines()
    errors = [ln for ln in lines if re.search(r"\berror\b|fatal|^Killed|signal", ln, re.I)]
    tail = "\n".join(lines)[-6000:]
    return "\n".join(["--- error lines:", *errors[:60], "--- end of output:", tail])


def main(argv: list[str]) -> int:
    sources = build_config.list_sources(CSRC, argv or None)
    if not sources:
        print("compile_csrc: no sources under csrc/" + (f" matching {argv}" if argv else ""))
        return 1 if argv else 0
    if not build_config.cutlass_include_dirs():
        print("compile_csrc: CUTLASS headers not found (pip install nvidia-cutlass)")
        return 1
    cache = cache_dir()
    record_file = cache / "units.json" if cache else None
    try:
        record = json.loads(record_file.read_text()) if record_file else {}
    except (OSError, ValueError):
        record = {}
    jobs = int(os.environ.get("MAX_JOBS") or len(os.sched_getaffinity(0)))
    # Units start only while the peaks of those running fit in this (the AWQ unit's cicc takes
    # about 13 GB, a scaled_mm Hopper unit's 9 GB); one runs alone whatever it needs.
    budget_gb = float(os.environ.get("QUANTFUSE_CI_MEMORY_GB") or 0.9 * available_gb())
    toolchain = toolchain_id() if cache else ""
    started = time.monotonic()

    with tempfile.TemporaryDirectory(prefix="quantfuse_ci_") as scratch_name:
        out_dir = Path(scratch_name)
        units = compile_units(sources, out_dir)
        work, cached = [], []
        for unit, members, arches in units:
            label = unit_label(unit, arches)
            cmd = command(unit, out_dir / f"{unit.stem}_{'_'.join(arches)}.o", arches)
            key = unit_key(cmd, unit, members, toolchain, out_dir) if cache else None
            marker = cache / "ok" / key[:2] / key if cache else None
            seen = record.get(label)
            cost = (seen["cpu_s"], seen["peak_gb"]) if isinstance(seen, dict) else estimate(unit, members, arches)
            item = (label, unit, members, arches, cmd, marker, cost)
            (cached if marker is not None and marker.is_file() else work).append(item)
        work.sort(key=lambda it: -it[6][0])
        print(f"compile_csrc: {len(sources)} sources in {len(units)} units, arches {ARCHES}, "
              f"torch {torch.__version__}, {jobs} jobs within {budget_gb:.0f} GB; "
              f"{len(cached)} units unchanged since they compiled "
              f"({cache if cache else 'no cache'}), {len(work)} to compile", flush=True)

        def named(members: list[Path]) -> str:
            first = members[0].relative_to(ROOT)
            if len(members) == 1:
                return str(first)
            folders = sorted({str(m.parent.relative_to(ROOT)) for m in members})
            return f"{first} and {len(members) - 1} more of {' and '.join(folders)} in one unit"

        for _, unit, members, arches, _, _, _ in cached:
            print(f"  cached {named(members)} ({targets(unit, arches)})", flush=True)

        failed = 0
        pending, running = list(work), {}
        with ThreadPoolExecutor(max(1, jobs)) as pool:
            while pending or running:
                # Longest first; past one that would not fit in memory beside those running.
                for item in list(pending):
                    if len(running) >= jobs:
                        break
                    if running and sum(it[6][1] for it in running.values()) + item[6][1] > budget_gb:
                        continue
                    pending.remove(item)
                    running[pool.submit(run_unit, item[4], out_dir)] = item
                future = next(as_completed(running))
                label, unit, members, arches, _, marker, _ = running.pop(future)
                returncode, stdout, stderr, wall, cpu, peak_gb = future.result()
                status = "ok" if returncode == 0 else "FAILED"
                print(f"  {status:6} {named(members)} ({targets(unit, arches)}; {wall:.0f} s, {cpu:.0f} s CPU, "
                      f"{peak_gb:.1f} GB)", flush=True)
                if returncode != 0:
                    failed += 1
                    print(f"--- exit status {returncode}", failure_excerpt(stdout, stderr), sep="\n", flush=True)
                else:
                    record[label] = {"cpu_s": round(cpu, 1), "peak_gb": round(peak_gb, 1)}
                    if marker is not None:
                        _write_atomic(marker, json.dumps({"unit": label, "cpu_seconds": round(cpu, 1),
                                                          "date": time.strftime("%Y-%m-%d %H:%M:%S")}))
        if record_file is not None and work:
            _write_atomic(record_file, json.dumps(record, indent=1, sort_keys=True))
    print(f"compile_csrc: {len(work) - failed} compiled, {len(cached)} cached, {failed} failed "
          f"in {time.monotonic() - started:.0f} s", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
