"""Imports flow one way: no fprep module imports, at run time, a module that imports it back.

Every ``import`` counts, also those inside functions (a lazy import is still an edge); imports
under ``if TYPE_CHECKING:`` do not (types only). Packages' ``__init__`` modules are left out:
they gather their submodules for the public API.
"""

from __future__ import annotations

import ast
from pathlib import Path

import fprep

ROOT = Path(fprep.__file__).parent


def _modules() -> dict[str, Path]:
    out = {}
    for path in ROOT.rglob("*.py"):
        parts = path.relative_to(ROOT.parent).with_suffix("").parts
        if parts[-1] != "__init__":
            out[".".join(parts)] = path
    return out


def _imports(path: Path, known: set[str]) -> set[str]:
    found: set[str] = set()

    class Visitor(ast.NodeVisitor):
        def visit_If(self, node: ast.If) -> None:
            test = node.test
            name = test.id if isinstance(test, ast.Name) else getattr(test, "attr", None)
            if name == "TYPE_CHECKING":
                for child in node.orelse:
                    self.visit(child)
                return
            self.generic_visit(node)

        def visit_Import(self, node: ast.Import) -> None:
            found.update(a.name for a in node.names)

        def visit_ImportFrom(self, node: ast.ImportFrom) -> None:
            if node.level == 0 and node.module:
                found.add(node.module)
                found.update(f"{node.module}.{a.name}" for a in node.names)

    Visitor().visit(ast.parse(path.read_text()))
    return found & known


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
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
                out.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def test_no_module_imports_one_that_imports_it_back() -> None:
    modules = _modules()
    graph = {name: _imports(path, set(modules)) - {name} for name, path in modules.items()}
    assert len(graph) > 50 and graph["fprep.checkpoint.writing"]  # it did read the tree
    assert _cycles(graph) == []


def test_the_check_sees_a_lazy_cycle_and_ignores_type_only_imports(tmp_path: Path) -> None:
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert _cycles(graph) == [["a", "b", "c"]]
    sample = tmp_path / "sample.py"
    sample.write_text(
        "from typing import TYPE_CHECKING\n"
        "if TYPE_CHECKING:\n"
        "    import x.y\n"
        "def f():\n"
        "    import x.z\n"
    )
    assert _imports(sample, {"x.y", "x.z"}) == {"x.z"}


def test_the_layout_package_is_pure() -> None:
    """fprep.layout sits at the bottom, under the transitions: it imports the standard library,
    fprep.errors and itself, never torch (so no process group and no tensor data), also lazily."""
    import sys

    allowed = ("fprep.errors", "fprep.layout")
    for path in sorted((ROOT / "layout").glob("*.py")):
        names: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                names.update(a.name for a in node.names)
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names.add(node.module)
        outside = {
            n
            for n in names
            if n.split(".")[0] not in sys.stdlib_module_names
            and not any(n == a or n.startswith(f"{a}.") for a in allowed)
        }
        assert outside == set(), f"{path.name} imports {sorted(outside)}"
    graph = {name: _imports(path, set(_modules())) for name, path in _modules().items()}
    assert "fprep.layout.mesh" in graph["fprep.transitions.process_group"]
