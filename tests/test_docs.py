"""Every Python example in docs/ runs against the current code."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

DOCS = Path(__file__).resolve().parents[1] / "docs"
BLOCKS = [
    (page.name, i, code)
    for page in sorted(DOCS.glob("*.md"))
    for i, code in enumerate(re.findall(r"```python\n(.*?)```", page.read_text(), flags=re.S))
]


@pytest.mark.parametrize(("page", "index", "code"), BLOCKS, ids=[f"{p}[{i}]" for p, i, _ in BLOCKS])
def test_doc_example_runs(page: str, index: int, code: str) -> None:
    if "import " not in code:
        pytest.skip("an illustration, not a program (no imports)")
    namespace: dict[str, object] = {"__name__": f"docs_{page}_{index}"}
    exec(compile(code, f"docs/{page}[python {index}]", "exec"), namespace)
    for name, value in list(namespace.items()):
        if name.startswith("test_") and callable(value):
            value()
