"""Error messages quoted in docs/ and the messages fprep's source can produce, for test_docs.

``quoted_messages`` reads every backtick span in a table column headed "example message" of a
docs page. ``message_templates`` parses fprep/ with ``ast`` and returns, for every construction
of a ``PrepError`` subclass, the strings ``str(error)`` can be: the message argument followed by
the ``hint=`` (f-string placeholders, variables the parser cannot follow and calls become
wildcards; implicit and ``+`` concatenation, ``IfExp`` branches, module constants, local string
variables and ``.strip()`` are followed). A message built by a helper from its parameters
(``_fail(owner, name, message, hint)``, ``os_failure(error, doing, path, ...)``) is expanded at
every call of the helper with the caller's arguments, so the quote is checked against the text
of the real raise site, not against a template of placeholders only.

A quote matches a template when the template's literal text appears exactly and the quote's own
text fills its wildcards; ``…`` in a quote can only stand in a wildcard's place, except a final
``…``, which stands for the rest of the message (the quote is then a prefix).
"""

from __future__ import annotations

import ast
import functools
import itertools
import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import fprep.errors

ROOT = Path(__file__).resolve().parents[1]
SOURCE = ROOT / "fprep"
DOCS = ROOT / "docs"
ELLIPSIS = "…"

#: Names of the classes whose construction is a raise site.
ERROR_CLASSES = frozenset(
    name
    for name, obj in vars(fprep.errors).items()
    if isinstance(obj, type) and issubclass(obj, fprep.errors.PrepError)
)
#: A template is text (literal) and ``None`` (a wildcard); while expanding, a ``Param`` too.
#: Templates with fewer literal letters than this match too much to tell anything apart.
MIN_LETTERS = 6
#: A quote must line up with this many letters of a template's literal text (or all of them).
ANCHOR_LETTERS = 12
#: ... and, in a quote that starts or ends with ``…``, with this share of the quote's letters.
ANCHOR_SHARE = 1 / 3
#: At most this many alternatives per expression (``IfExp`` chains multiply).
MAX_ALTERNATIVES = 256


@dataclass(frozen=True)
class Param:
    """A placeholder for a parameter of the function that builds the message."""

    name: str


Part = str | None | Param
Template = tuple[Part, ...]


@dataclass(frozen=True)
class Quote:
    page: str
    line: int
    text: str
    with_hint: bool  # the column says "(then hint)": the quote is str(error), not the message

    @property
    def where(self) -> str:
        return f"docs/{self.page}:{self.line}"


@dataclass(frozen=True)
class Site:
    """One error construction (or one expansion of a helper's), with what ``str`` can give."""

    where: str
    templates: tuple[Template, ...]  # str(error): the message, a space and the hint
    messages: tuple[Template, ...]  # error.message alone


# -- quotes -----------------------------------------------------------------------------------
def _cells(row: str) -> list[str]:
    return [c.strip() for c in re.split(r"(?<!\\)\|", row.strip().strip("|"))]


def quoted_messages(page: Path) -> Iterator[Quote]:
    """Every backtick span in a column whose header says "example message"."""
    column: int | None = None
    with_hint = in_table = False
    for number, line in enumerate(page.read_text().splitlines(), start=1):
        if not line.startswith("|"):
            in_table = False
            continue
        cells = _cells(line)
        if not in_table:  # a table's first row is its header
            in_table = True
            headers = [i for i, c in enumerate(cells) if "example message" in c]
            column = headers[0] if headers else None
            with_hint = column is not None and "then hint" in cells[column]
            continue
        if column is None or set(line) <= set("|-: ") or column >= len(cells):
            continue
        for text in re.findall(r"`([^`]+)`", cells[column]):
            yield Quote(page.name, number, text, with_hint)


# -- templates --------------------------------------------------------------------------------
def _join(*parts: Template) -> Template:
    out: list[Part] = []
    for part in itertools.chain.from_iterable(parts):
        if part == "":
            continue
        if isinstance(part, str) and out and isinstance(out[-1], str):
            out[-1] += part
        elif part is None and out and out[-1] is None:
            continue
        else:
            out.append(part)
    return tuple(out)


def _product(*choices: list[Template]) -> list[Template]:
    return [_join(*combo) for combo in itertools.product(*choices)][:MAX_ALTERNATIVES]


def _strip(t: Template) -> Template:
    parts = list(t)
    if parts and isinstance(parts[0], str):
        parts[0] = parts[0].lstrip()
    if parts and isinstance(parts[-1], str):
        parts[-1] = parts[-1].rstrip()
    return _join(tuple(parts))


@dataclass
class Scope:
    """Names an expression can refer to: the enclosing function's parameters and string
    variables, and the module's string constants."""

    module: dict[str, list[ast.expr]]
    params: tuple[str, ...] = ()
    locals: dict[str, list[ast.expr]] | None = None


def _assignments(body: list[ast.stmt]) -> dict[str, list[ast.expr]]:
    """``name = value`` in ``body`` (not inside nested functions or classes)."""
    found: dict[str, list[ast.expr]] = {}
    stack: list[ast.AST] = list(body)
    while stack:
        node = stack.pop()
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef | ast.Lambda):
            continue
        if isinstance(node, ast.Assign) and len(node.targets) == 1:
            target = node.targets[0]
            if isinstance(target, ast.Name):
                found.setdefault(target.id, []).append(node.value)
        elif (
            isinstance(node, ast.AnnAssign)
            and isinstance(node.target, ast.Name)
            and node.value is not None
        ):
            found.setdefault(node.target.id, []).append(node.value)
        stack.extend(ast.iter_child_nodes(node))
    return found


def templates(
    expr: ast.expr | None, scope: Scope, seen: frozenset[str] = frozenset()
) -> list[Template]:
    """What ``expr`` can evaluate to, as templates."""
    if expr is None:
        return [()]
    if isinstance(expr, ast.Constant):
        return [(expr.value,)] if isinstance(expr.value, str) else [(None,)]
    if isinstance(expr, ast.JoinedStr):
        pieces: list[list[Template]] = []
        for value in expr.values:
            if isinstance(value, ast.FormattedValue):
                plain = value.conversion == -1 and value.format_spec is None
                pieces.append(templates(value.value, scope, seen) if plain else [(None,)])
            else:
                pieces.append(templates(value, scope, seen))
        return _product(*pieces)
    if isinstance(expr, ast.BinOp) and isinstance(expr.op, ast.Add):
        return _product(templates(expr.left, scope, seen), templates(expr.right, scope, seen))
    if isinstance(expr, ast.IfExp):
        return (templates(expr.body, scope, seen) + templates(expr.orelse, scope, seen))[
            :MAX_ALTERNATIVES
        ]
    if (
        isinstance(expr, ast.Call)
        and isinstance(expr.func, ast.Attribute)
        and expr.func.attr == "strip"
        and not expr.args
    ):
        return [_strip(t) for t in templates(expr.func.value, scope, seen)]
    if isinstance(expr, ast.Subscript | ast.Call):  # a lookup in a module-level dict of strings
        lookup = expr.value if isinstance(expr, ast.Subscript) else expr.func
        if (
            isinstance(expr, ast.Call)
            and isinstance(lookup, ast.Attribute)
            and lookup.attr == "get"
        ):
            lookup = lookup.value
        elif isinstance(expr, ast.Call):
            return [(None,)]
        table = scope.module.get(lookup.id, []) if isinstance(lookup, ast.Name) else []
        if len(table) == 1 and isinstance(table[0], ast.Dict):
            values = [v for v in table[0].values if v is not None]
            if isinstance(expr, ast.Call) and len(expr.args) > 1:
                values.append(expr.args[1])
            return [t for v in values for t in templates(v, scope, seen)][:MAX_ALTERNATIVES]
        return [(None,)]
    if isinstance(expr, ast.Name) and expr.id not in seen:
        name, inner = expr.id, seen | {expr.id}
        if scope.locals and name in scope.locals:
            found = [t for v in scope.locals[name] for t in templates(v, scope, inner)]
            return found[:MAX_ALTERNATIVES]
        if name in scope.params:
            return [(Param(name),)]
        if name in scope.module:
            return [t for v in scope.module[name] for t in templates(v, scope, inner)]
    return [(None,)]


def _str_of(message: list[Template], hint: list[Template]) -> list[Template]:
    """``str(error)``: the message, then a space and the hint when there is one."""
    out: list[Template] = []
    for m, h in itertools.product(message, hint):
        stripped = _strip(h)
        if not stripped:
            out.append(m)
        else:
            out.append(_join(m, (" ",), stripped))
            if all(p is None or isinstance(p, Param) for p in stripped):
                out.append(m)  # a hint that is all wildcard may be empty
    return out[:MAX_ALTERNATIVES]


@dataclass
class _Function:
    module: str
    node: ast.FunctionDef | ast.AsyncFunctionDef
    scope: Scope
    is_method: bool

    @property
    def params(self) -> list[ast.arg]:
        a = self.node.args
        return [*a.posonlyargs, *a.args, *a.kwonlyargs]


def _functions(path: Path, tree: ast.Module) -> Iterator[_Function]:
    module = str(path.relative_to(ROOT))
    constants = _assignments([n for n in tree.body if isinstance(n, ast.Assign | ast.AnnAssign)])

    def walk(node: ast.AST, in_class: bool) -> Iterator[_Function]:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef):
                a = child.args
                names = tuple(x.arg for x in [*a.posonlyargs, *a.args, *a.kwonlyargs])
                yield _Function(
                    module, child, Scope(constants, names, _assignments(child.body)), in_class
                )
                yield from walk(child, False)
            else:
                yield from walk(child, isinstance(child, ast.ClassDef))

    yield from walk(tree, False)


def _own_calls(fn: _Function) -> Iterator[ast.Call]:
    """Calls in ``fn``'s body, not in nested functions."""
    stack: list[ast.AST] = list(fn.node.body)
    while stack:
        node = stack.pop()
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.Lambda):
            continue
        if isinstance(node, ast.Call):
            yield node
        stack.extend(ast.iter_child_nodes(node))


def _bind(callee: _Function, call: ast.Call) -> dict[str, ast.expr | None]:
    """Argument expressions of ``call`` by the callee's parameter names (defaults filled in)."""
    a = callee.node.args
    positional = [p.arg for p in [*a.posonlyargs, *a.args]]
    bound: dict[str, ast.expr | None] = dict(
        zip(positional[len(positional) - len(a.defaults) :], a.defaults, strict=True)
    )
    bound.update(
        {p.arg: d for p, d in zip(a.kwonlyargs, a.kw_defaults, strict=True) if d is not None}
    )
    # Arguments beyond the parameters (a *args helper) are left out.
    bound.update(zip(positional[1 if callee.is_method else 0 :], call.args, strict=False))
    bound.update({kw.arg: kw.value for kw in call.keywords if kw.arg is not None})
    return bound


def _substitute(t: Template, values: dict[str, list[Template]]) -> list[Template]:
    choices = [values.get(p.name, [(None,)]) if isinstance(p, Param) else [(p,)] for p in t]
    return _product(*choices)


def _has_params(t: Template) -> bool:
    return any(isinstance(p, Param) for p in t)


def _no_params(t: Template) -> Template:
    return _join(tuple(None if isinstance(p, Param) else p for p in t))


def _letters(t: Template) -> int:
    return sum(_count_letters(p) for p in t if isinstance(p, str))


def _callee_name(call: ast.Call) -> str:
    func = call.func
    return (
        func.id
        if isinstance(func, ast.Name)
        else func.attr
        if isinstance(func, ast.Attribute)
        else ""
    )


@functools.cache
def message_templates() -> tuple[Site, ...]:
    """Every raise site in fprep/ with the strings ``str(error)`` can be there."""
    functions = [
        fn
        for path in sorted(SOURCE.rglob("*.py"))
        for fn in _functions(path, ast.parse(path.read_text(), filename=str(path)))
    ]
    defined = {(fn.module, fn.node.name) for fn in functions}
    calls: dict[str, list[tuple[_Function, ast.Call]]] = {}
    for fn in functions:
        for call in _own_calls(fn):
            calls.setdefault(_callee_name(call), []).append((fn, call))

    # (where, the function the text is built in, [str(error) forms, message forms], depth)
    pending: list[tuple[str, _Function, list[list[Template]], int]] = []
    for fn in functions:
        for call in _own_calls(fn):
            keywords = {k.arg: k.value for k in call.keywords}
            if _callee_name(call) in ERROR_CLASSES and call.args:
                text = call.args[0]
            elif "message" in keywords and "hint" in keywords:
                text = keywords["message"]  # an error kept as data, raised later (plan notes)
            else:
                continue
            message = templates(text, fn.scope)
            forms = [_str_of(message, templates(keywords.get("hint"), fn.scope)), message]
            pending.append((f"{fn.module}:{call.lineno}", fn, forms, 0))

    sites: list[Site] = []
    while pending:
        where, fn, forms, depth = pending.pop()
        # Calls of this helper: from its own module, or from modules without a namesake.
        callers = [
            (caller, call)
            for caller, call in calls.get(fn.node.name, [])
            if caller.module == fn.module or (caller.module, fn.node.name) not in defined
        ]
        if any(_has_params(t) for form in forms for t in form) and callers and depth < 3:
            for caller, call in callers:
                values = {n: templates(e, caller.scope) for n, e in _bind(fn, call).items()}
                expanded = [[s for t in form for s in _substitute(t, values)] for form in forms]
                pending.append(
                    (f"{where} via {caller.module}:{call.lineno}", caller, expanded, depth + 1)
                )
            continue
        # PrepError strips str(error); a wildcard for what no parameter pinned down.
        full, message = (
            tuple(
                dict.fromkeys(
                    t for t in (_strip(_no_params(t)) for t in form) if _letters(t) >= MIN_LETTERS
                )
            )
            for form in forms
        )
        if full or message:
            sites.append(Site(where, full, message))
    return tuple(sites)


# -- matching ---------------------------------------------------------------------------------
def matches(template: Template, text: str) -> bool:
    """Whether the source ``template`` can print ``text`` (see the module docstring)."""
    prefix, suffix = text.endswith(ELLIPSIS), text.startswith(ELLIPSIS)
    text = text[len(ELLIPSIS) if suffix else 0 : -len(ELLIPSIS) if prefix else None]
    parts: list[str | None] = [p for p in template if not isinstance(p, Param)]
    literals = [p for p in parts if p]
    if not (suffix or prefix) and not all(p in text for p in literals):
        return False  # cheap: a whole quote holds every literal part
    starts = [parts]
    if suffix:  # the quote starts inside the template's literal text
        head = text[:8]
        starts = [
            [p[k:], *parts[i + 1 :]]
            for i, p in enumerate(parts)
            if p
            for k in range(len(p))
            if p.startswith(head[: len(p) - k], k)
        ]
    needed = min(ANCHOR_LETTERS, _letters(template))
    if prefix or suffix:  # a wildcard could take the whole end: the literal text must show
        needed = max(needed, _count_letters(text) * ANCHOR_SHARE)
    return any(_anchored(start, text, prefix) >= needed for start in starts)


def _anchored(parts: list[str | None], text: str, prefix: bool) -> int:
    """The most letters of the template's literal text that a match of ``text`` lines up with
    (-1: no match). A match that leaves everything to wildcards proves nothing."""
    first = parts[0] if parts else None
    if isinstance(first, str) and not (
        text.startswith(first) or (prefix and first.startswith(text))
    ):
        return -1

    @functools.cache
    def go(i: int, j: int) -> int:
        if prefix and j == len(text):
            return 0
        if i == len(parts):
            return 0 if j == len(text) else -1
        part = parts[i]
        if part is None:
            return max(go(i + 1, k) for k in range(j, len(text) + 1))
        if prefix and len(text) - j < len(part):
            return _count_letters(text[j:]) if part.startswith(text[j:]) else -1
        if not text.startswith(part, j):
            return -1
        rest = go(i + 1, j + len(part))
        return rest + _count_letters(part) if rest >= 0 else -1

    return go(0, 0)


def _count_letters(text: str) -> int:
    return sum(ch.isalpha() for ch in text)


def render(template: Template) -> str:
    return "".join(ELLIPSIS if p is None else p if isinstance(p, str) else "{?}" for p in template)
