"""Every benchmark script accepts ``--quick`` (docs/benchmarks.md promises it for all of them).

Only ``--help`` runs: the benchmarks themselves take minutes."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPTS = sorted(p for p in (ROOT / "benchmarks").glob("*.py") if not p.name.startswith("_"))


def test_every_script_is_listed() -> None:
    assert len(SCRIPTS) >= 7


@pytest.mark.parametrize("script", SCRIPTS, ids=[p.name for p in SCRIPTS])
def test_script_accepts_quick(script: Path) -> None:
    proc = subprocess.run(
        [sys.executable, str(script), "--help"],
        cwd=ROOT,
        env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"},
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "--quick" in proc.stdout, f"{script.name} --help does not offer --quick"
