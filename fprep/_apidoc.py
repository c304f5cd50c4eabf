"""Write docs/api.md: every name in ``fprep.__all__`` with its signature and summary.

Run ``python -m fprep._apidoc > docs/api.md`` after changing the public API;
tests/test_api_doc.py checks that the page is what this prints, so it cannot drift.

A summary is the first sentence of the docstring. A function without one (the ``init_*``
transitions) takes its module's, a type alias or constant the ``#:`` comment above its
definition. Default values are written without memory addresses, so the page is the same on
every run.
"""

from __future__ import annotations

import ast
import importlib
import importlib.util
import inspect
import re
import sys
from pathlib import Path
from typing import Any

import fprep
from fprep.errors import PrepError

HEADER = """# API reference

Every public name of `fprep` (`fprep.__all__`): its signature and the first sentence of its
documentation. The pages linked from the [index](index.md) explain how they fit together.
This page is generated: `python -m fprep._apidoc > docs/api.md` writes it, and
`tests/test_api_doc.py` checks that it is what the generator prints now.
"""

_SECTIONS = (
    ("functions", "Functions"),
    ("classes", "Classes"),
    ("errors", "Errors"),
    ("values", "Types and constants"),
)
_ADDRESS = re.compile(r"<(function|class|built-in function) ([\w.]+)(?: at 0x[0-9a-f]+)?>")
_MODULE_PATH = re.compile(r"\b(?:[a-z_][a-z0-9_]*\.)+([A-Z]\w*)")
#: a sentence ends at a full stop followed by a space, except in "e.g." and "i.e."
_SENTENCE = re.compile(r"(.+?(?<!e\.g)(?<!i\.e)\.)(\s|$)")


def _kind(obj: Any) -> str:
    if inspect.isclass(obj):
        return "errors" if issubclass(obj, PrepError) else "classes"
    if inspect.isfunction(obj):
        return "functions"
    return "values"


def _signature(name: str, obj: Any) -> str:
    if _kind(obj) == "values":
        return f"{name} = {_short(_plain(repr(obj)))}"
    if _kind(obj) == "errors":
        signature = inspect.signature(PrepError.__init__)
        signature = signature.replace(parameters=list(signature.parameters.values())[1:])
    else:
        signature = inspect.signature(obj, follow_wrapped=False)
    if inspect.isclass(obj):
        signature = signature.replace(return_annotation=inspect.Signature.empty)
    params = [
        p.replace(annotation=_as_written(p.annotation)) for p in signature.parameters.values()
    ]
    signature = signature.replace(
        parameters=params, return_annotation=_as_written(signature.return_annotation)
    )
    return f"{name}{_plain(str(signature))}"


class _Written(str):
    """An annotation kept as the source wrote it (``inspect`` would quote a string one)."""

    __slots__ = ()

    def __repr__(self) -> str:
        return str(self)


def _as_written(annotation: Any) -> Any:
    return _Written(annotation) if isinstance(annotation, str) else annotation


def _plain(text: str) -> str:
    """``text`` without memory addresses: ``<function init_core at 0x7f..>`` -> ``init_core``."""
    return _ADDRESS.sub(lambda m: m.group(2).rsplit(".", 1)[-1], text)


def _short(text: str) -> str:
    """A type's repr without module paths: ``fprep.state.PrepState`` -> ``PrepState``."""
    return _MODULE_PATH.sub(lambda m: m.group(1), text)


def _summary(name: str, obj: Any, origin: str) -> str:
    doc = obj.__doc__ if _kind(obj) != "values" else None
    if inspect.isclass(obj) and doc and doc.startswith(f"{obj.__name__}("):
        doc = None  # a dataclass's generated docstring: its signature again
    if not doc and inspect.isfunction(obj):
        doc = sys.modules[obj.__module__].__doc__
        doc = doc.removeprefix(f"{name}:") if doc else doc
    if not doc and _kind(obj) == "values":
        doc = _comment_above(name, origin)
    if not doc:
        return "(undocumented)"
    paragraph = " ".join(inspect.cleandoc(doc).split("\n\n")[0].split())
    match = _SENTENCE.match(paragraph)
    sentence = match.group(1) if match else paragraph
    return sentence[:1].upper() + sentence[1:]


def _comment_above(name: str, module: str) -> str | None:
    """The ``#:`` comment lines right above ``name``'s assignment in ``module``, following
    re-exports (``from fprep.apply.steps import Step`` in ``fprep.apply``)."""
    source = Path(importlib.import_module(module).__file__ or "").read_text()
    lines = source.splitlines()
    for node in ast.parse(source).body:
        if isinstance(node, ast.ImportFrom) and any(a.name == name for a in node.names):
            relative = "." * node.level + (node.module or "")
            anchor = importlib.import_module(module).__package__ or module
            origin = importlib.util.resolve_name(relative, anchor)
            return _comment_above(name, origin)
        targets = (
            [node.target]
            if isinstance(node, ast.AnnAssign)
            else node.targets
            if isinstance(node, ast.Assign)
            else []
        )
        if any(isinstance(t, ast.Name) and t.id == name for t in targets):
            above: list[str] = []
            row = node.lineno - 2
            while row >= 0 and lines[row].lstrip().startswith("#:"):
                above.insert(0, lines[row].lstrip()[2:].strip())
                row -= 1
            return " ".join(above) or None
    return None


def _origins() -> dict[str, str]:
    """Where ``fprep/__init__.py`` imports each public name from (``fprep`` if defined there)."""
    tree = ast.parse(Path(fprep.__file__ or "").read_text())
    out: dict[str, str] = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("fprep"):
            for alias in node.names:
                out[alias.asname or alias.name] = node.module
    return out


def render() -> str:
    """The page, as ``python -m fprep._apidoc`` prints it."""
    origins = _origins()
    rows: dict[str, list[str]] = {key: [] for key, _ in _SECTIONS}
    for name in sorted(fprep.__all__, key=str.lower):
        obj = getattr(fprep, name)
        origin = origins.get(name, "fprep")
        summary = _summary(name, obj, origin)
        rows[_kind(obj)].append(f"- `{_signature(name, obj)}`\n\n  {summary}\n")
    parts = [HEADER]
    for key, title in _SECTIONS:
        if rows[key]:
            parts.append(f"## {title}\n\n" + "\n".join(rows[key]))
    return "\n".join(parts)


def main() -> None:
    sys.stdout.write(render())


if __name__ == "__main__":
    main()
