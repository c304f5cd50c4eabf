"""Running one command-line command: a ``PrepError`` becomes one line and exit status 2.

Shared by ``fprep`` (fprep.cli) and ``python -m fprep.demo`` (fprep.demo), so that neither
imports the other.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable

from fprep.errors import PrepError


def run_command(func: Callable[[argparse.Namespace], int], args: argparse.Namespace) -> int:
    """``func(args)``'s exit status; a ``PrepError`` is printed as ``fprep: error: ...`` (2)."""
    try:
        return func(args)
    except PrepError as e:
        print(f"fprep: error: {e}", file=sys.stderr)
        return 2
    except BrokenPipeError:  # e.g. `fprep plan ... | head`: the reader left; not an error
        # Point stdout at /dev/null so the interpreter's final flush does not fail again.
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        return 0
