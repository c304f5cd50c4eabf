"""The README stays true: its commands match CI, and its Python examples run."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()


def _blocks(lang: str) -> list[str]:
    return re.findall(rf"```{lang}\n(.*?)```", README, flags=re.S)


def test_quick_start_is_two_commands_and_ci_runs_the_test_command() -> None:
    bash = [b.strip() for b in _blocks("bash")[:2]]
    setup, tests = bash
    assert "torch==2.13.0" in setup and "fprep " in setup
    ci = (ROOT / ".ci" / "run").read_text().strip().splitlines()
    assert ci[-1] == tests, "the README's test command must be the last line of .ci/run"


def test_ci_pins_torch() -> None:
    assert "torch==2.13.0" in (ROOT / ".ci" / "run").read_text()


@pytest.mark.parametrize("index", range(len(_blocks("python"))))
def test_python_examples_run(index: int) -> None:
    code = _blocks("python")[index]
    if "fprep.prepare(" in code and "import" not in code:
        pytest.skip("one-line illustration")
    namespace: dict[str, object] = {"__name__": f"readme_example_{index}"}
    exec(compile(code, f"README.md[python {index}]", "exec"), namespace)
    for name, value in list(namespace.items()):
        if name.startswith("test_") and callable(value):
            value()  # hypothesis-decorated examples run their property here
