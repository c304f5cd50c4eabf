"""Progress lines for long work: shown only when enabled and slow enough."""

from __future__ import annotations

import io
import time

from fprep.progress import Progress


def test_quiet_when_quick_or_not_a_terminal() -> None:
    out = io.StringIO()  # not a terminal: disabled by default
    with Progress("work", 3, out=out, after_s=0.0) as p:
        for _ in range(3):
            p.advance()
    assert out.getvalue() == ""
    with Progress("work", 3, out=out, enabled=True, after_s=60.0) as p:
        p.advance(3)
    assert out.getvalue() == ""  # finished before it was worth showing


def test_shows_a_bar_and_a_final_line_when_slow() -> None:
    out = io.StringIO()
    with Progress("fprep: materialize", 4, out=out, enabled=True, after_s=0.0) as p:
        for _ in range(4):
            time.sleep(0.11)
            p.advance()
    text = out.getvalue()
    assert "fprep: materialize [" in text and text.endswith("4/4" + text.split("4/4")[-1])
    assert text.rstrip("\n").split("\r")[-1].startswith("fprep: materialize [" + "#" * 24 + "]")
    assert text.endswith("\n")
