"""Running one command-line command: a ``PrepError`` becomes one line and exit status 2.

Shared by ``fprep`` (fprep.cli) and ``python -m fprep.demo`` (fprep.demo), so that neither
imports the other. Anything else a command raises is a bug in fprep: it too is one line
(``fprep: internal error in fprep: ...``) and exit status 2, with the traceback printed only
under ``--debug`` or the environment variable ``FPREP_DEBUG=1``, for the report.
"""

from __future__ import annotations

import argparse
import os
import sys
import traceback
from collections.abc import Callable

from fprep.errors import PrepError

#: The environment variable that keeps the traceback of an internal error (any value but
#: "", "0").
DEBUG_ENV = "FPREP_DEBUG"


def debugging(args: argparse.Namespace) -> bool:
    """``--debug`` was passed, or ``FPREP_DEBUG`` is set (not to "" or "0")."""
    return bool(getattr(args, "debug", False)) or os.environ.get(DEBUG_ENV, "") not in ("", "0")


def run_command(func: Callable[[argparse.Namespace], int], args: argparse.Namespace) -> int:
    """``func(args)``'s exit status; a ``PrepError`` is printed as ``fprep: error: ...`` (2),
    any other exception as ``fprep: internal error in fprep: ...`` (2; see the module docs)."""
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
    except Exception as e:
        debug = debugging(args)
        if debug:
            traceback.print_exc(file=sys.stderr)
        where = "" if debug else f" (the traceback: run again with --debug or {DEBUG_ENV}=1)"
        text = " ".join(str(e).split()) or "(no message)"
        print(
            f"fprep: internal error in fprep: {type(e).__name__}: {text}; please report it, "
            f"with the command line and `fprep --version`{where}.",
            file=sys.stderr,
        )
        return 2
