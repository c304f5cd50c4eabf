"""Running the command line as users do: ``python -m fprep`` in a fresh process."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Mapping
from pathlib import Path

from fprep.topology import LAUNCHER_VARIABLES

ROOT = Path(__file__).resolve().parents[1]


def run_fprep(
    cwd: Path, *argv: str, env: Mapping[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    """``python -m fprep ARGV`` in ``cwd``, with this checkout's fprep importable; ``env``
    replaces the launcher variables of this process's environment (they are dropped)."""
    base = {k: v for k, v in os.environ.items() if k not in LAUNCHER_VARS}
    path = f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"
    command = [sys.executable, "-m", "fprep", *argv]
    full_env = {**base, **(env or {}), "PYTHONPATH": path}
    return subprocess.run(
        command,
        capture_output=True,
        stdin=subprocess.DEVNULL,
        text=True,
        env=full_env,
        cwd=cwd,
        timeout=300,
    )


#: What a launcher sets; a test's own environment must not leak into a child's launch.
LAUNCHER_VARS = frozenset(LAUNCHER_VARIABLES)


def assert_one_line_error(result: subprocess.CompletedProcess[str], *needles: str) -> None:
    """Exit status 2, one line ``fprep: error: ...`` holding every needle, no traceback."""
    err = result.stderr
    assert result.returncode == 2, (result.returncode, err)
    assert "Traceback" not in err, err
    assert err.startswith("fprep: error: ") and len(err.strip().splitlines()) == 1, err
    for needle in needles:
        assert needle in err, (needle, err)
    assert result.stdout == ""
