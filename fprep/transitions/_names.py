"""Helpers for naming things in errors: 'did you mean' for FQNs."""

from __future__ import annotations

import difflib
from collections.abc import Iterable


def suggest(name: str, candidates: Iterable[str]) -> str:
    """'Did you mean ...?' for a near miss, else a few of the valid names."""
    names = list(candidates)
    close = difflib.get_close_matches(name, names, n=1, cutoff=0.6)
    if close:
        return f"Did you mean {close[0]!r}?"
    shown = [n for n in names if n][:5]
    more = ", ..." if len([n for n in names if n]) > 5 else ""
    return f"Names start like: {', '.join(map(repr, shown))}{more}." if shown else ""
