"""Helpers for naming things in errors: 'did you mean' for FQNs."""

from __future__ import annotations

import difflib
from collections.abc import Iterable


def suggest(name: str, candidates: Iterable[str]) -> str:
    close = difflib.get_close_matches(name, list(candidates), n=1, cutoff=0.6)
    return f"Did you mean {close[0]!r}?" if close else ""
