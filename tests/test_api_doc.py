"""docs/api.md is what ``python -m fprep._apidoc`` prints now: every name of ``fprep.__all__``,
once, with its signature and a summary, and no other. Regenerate it after changing the public
API: ``python -m fprep._apidoc > docs/api.md``."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import fprep
from fprep import _apidoc

PAGE = Path(__file__).resolve().parents[1] / "docs" / "api.md"


def test_the_page_is_what_the_generator_prints() -> None:
    assert PAGE.read_text() == _apidoc.render(), (
        "docs/api.md is out of date: run python -m fprep._apidoc > docs/api.md"
    )


def test_the_page_lists_every_public_name_once_and_nothing_else() -> None:
    entries = re.findall(r"^- `(\w+)", _apidoc.render(), flags=re.MULTILINE)
    assert sorted(entries) == sorted(fprep.__all__)
    assert len(entries) == len(set(entries))


def test_every_entry_has_a_summary_and_no_memory_address() -> None:
    page = _apidoc.render()
    assert "(undocumented)" not in page
    assert not re.search(r" at 0x[0-9a-f]+", page)
    for entry in page.split("\n- `")[1:]:
        signature, _, summary = entry.partition("\n\n  ")
        assert summary.strip(), signature


def test_the_command_prints_the_page() -> None:
    env = {**os.environ, "PYTHONPATH": str(PAGE.parents[1])}
    done = subprocess.run(
        [sys.executable, "-m", "fprep._apidoc"], capture_output=True, text=True, env=env, check=True
    )
    assert done.stdout == _apidoc.render()
