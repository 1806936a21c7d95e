"""No import cycle in the package: the graph of its modules' own import statements.

Every ``import`` / ``from ... import`` in a module counts, those inside functions and under
``TYPE_CHECKING`` included (a lazy import that closes a cycle is still a cycle a reader has to
untangle).  ``passes/`` is installed as ``compile_backend.passes`` and is read as such.  An edge
goes to the module named; ``from pkg import name`` goes to ``pkg.name`` where that is a module of
the package, else to ``pkg``.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# Package name -> its folder in the checkout.
PACKAGES = {"compile_backend": ROOT / "compile_backend", "compile_backend.passes": ROOT / "passes"}


def modules(packages: dict[str, Path]) -> dict[str, Path]:
    """Dotted module name -> file, for every .py file of ``packages`` (a package's __init__ under its own name)."""
    found = {}
    for name, folder in packages.items():
        for path in sorted(folder.rglob("*.py")):
            parts = list(path.relative_to(folder).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            found[".".join([name, *parts])] = path
    return found


def imports(name: str, path: Path, known: dict[str, Path]) -> set[str]:
    """The modules of ``known`` that ``name`` (at ``path``) imports."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    edges = set()

    def add(target: str) -> None:
        # The module itself, else the nearest enclosing module of the package (``a.b.func``).
        while target and target not in known:
            target = target.rpartition(".")[0]
        if target and target != name:
            edges.add(target)

    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            for alias in node.names:
                add(alias.name)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[: len(base) - (node.level - 1)]
                source = ".".join(base + ([node.module] if node.module else []))
            else:
                source = node.module or ""
            for alias in node.names:
                submodule = f"{source}.{alias.name}"
                add(submodule if submodule in known else source)
    return edges


def import_graph(packages: dict[str, Path]) -> dict[str, set[str]]:
    known = modules(packages)
    return {name: imports(name, path, known) for name, path in known.items()}


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan), each sorted."""
    index, low, stack, on_stack, found = {}, {}, [], set(), []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_no_import_cycle():
    graph = import_graph(PACKAGES)
    assert len(graph) > 40, sorted(graph)  # every module was read
    found = cycles(graph)
    described = ["; ".join(f"{m} -> {sorted(graph[m] & set(c))}" for m in c) for c in found]
    assert not found, "import cycles:\n" + "\n".join(described)


def test_graph_reads_every_import_form(tmp_path):
    """The graph sees relative, absolute and lazy (in-function) imports, and finds the cycle they close."""
    pkg = tmp_path / "pkg"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "a.py").write_text("from . import b\n")
    (pkg / "b.py").write_text("from .sub.c import thing\n")
    (pkg / "sub" / "__init__.py").write_text("")
    (pkg / "sub" / "c.py").write_text("def thing():\n    import pkg.a\n")
    (pkg / "d.py").write_text("from .sub import c\nimport torch\n")
    graph = import_graph({"pkg": pkg})
    assert graph["pkg.a"] == {"pkg.b"}
    assert graph["pkg.b"] == {"pkg.sub.c"}
    assert graph["pkg.sub.c"] == {"pkg.a"}
    assert graph["pkg.d"] == {"pkg.sub.c"}
    assert cycles(graph) == [["pkg.a", "pkg.b", "pkg.sub.c"]]
    (pkg / "sub" / "c.py").write_text("def thing():\n    pass\n")
    assert cycles(import_graph({"pkg": pkg})) == []
