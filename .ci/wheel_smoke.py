"""Smoke test of an installed quantfuse wheel: ``python wheel_smoke.py [WHEEL]``.

Run it from outside the repository, with a Python where the wheel (and torch) is
installed, so that the source checkout is not importable.  It checks that the
package comes from site-packages with its kernel sources, that a W8A8 model
compiles with ``backend="quantfuse"`` (found through the entry point), matches
eager and has its quantized matmul fused; with WHEEL given, that the wheel file
carries compile_backend/csrc.
"""

from __future__ import annotations

import sys
import zipfile
from pathlib import Path


def check_wheel(wheel: Path) -> None:
    names = zipfile.ZipFile(wheel).namelist()
    csrc = [n for n in names if n.startswith("compile_backend/csrc/")]
    kernels = [n for n in csrc if n.endswith((".cu", ".cpp"))]
    assert kernels, f"{wheel.name}: no kernel sources under compile_backend/csrc/"
    assert any(n.endswith((".h", ".cuh")) for n in csrc), f"{wheel.name}: no headers under compile_backend/csrc/"
    for package in ("compile_backend/__init__.py", "compile_backend/passes/__init__.py"):
        assert package in names, f"{wheel.name}: {package} missing"
    print(f"wheel_smoke: {wheel.name}: {len(names)} files, {len(kernels)} kernel sources, "
          f"{wheel.stat().st_size / 1e6:.2f} MB")


def main(argv: list[str]) -> int:
    if argv:
        check_wheel(Path(argv[0]))

    import torch

    import compile_backend
    from compile_backend.kernels import loader as kernels
    from compile_backend.quantize import W8A8Linear

    where = Path(compile_backend.__file__).resolve()
    checkout = (where.parents[1] / "pyproject.toml").exists()
    assert not checkout and "site-packages" in where.parts, f"compile_backend not imported from an install: {where}"
    assert kernels.csrc_dir() == where.parent / "csrc", kernels.csrc_dir()
    assert kernels.sources(), "the installed package has no kernel sources"

    torch.manual_seed(0)
    model = torch.nn.Sequential(
        W8A8Linear.from_linear(torch.nn.Linear(64, 32), out_dtype=torch.float32),
        torch.nn.ReLU(),
        W8A8Linear.from_linear(torch.nn.Linear(32, 16), out_dtype=torch.float32),
    ).eval()
    x = torch.randn(4, 64)
    with torch.no_grad():
        expected = model(x)
        got = torch.compile(model, backend="quantfuse", options={"fallback": False})(x)
    torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-4)
    counts = compile_backend.explain(model, x).counts()
    assert sum(counts.values()) >= 1, f"nothing fused: {counts}"
    print(f"wheel_smoke: ok (compile_backend {compile_backend.__version__} from {where.parent}, "
          f"torch {torch.__version__}, fused {counts})")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
