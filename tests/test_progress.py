"""Progress lines for long work: shown only when enabled and slow enough."""

from __future__ import annotations

import io
import threading
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


def test_counts_from_many_threads_are_never_lost() -> None:
    """Checkpoint files are written and verified on several threads that all advance one bar.
    (Under the GIL the increments rarely race; the lock makes the total a guarantee, also on
    free-threaded builds.)"""
    out = io.StringIO()
    per_thread, threads = 20_000, 8
    with Progress("fprep: verify", per_thread * threads, out=out, enabled=True, after_s=0.0) as p:

        def work() -> None:
            for _ in range(per_thread):
                p.advance()

        workers = [threading.Thread(target=work) for _ in range(threads)]
        for w in workers:
            w.start()
        for w in workers:
            w.join()
    assert p.done == per_thread * threads
    final = out.getvalue().rstrip("\n").split("\r")[-1]
    assert final.startswith("fprep: verify [" + "#" * 24 + "] 160000/160000 ")


def test_bytes_are_shown_in_kb_mb_or_gb() -> None:
    for total, shown in (
        (5_300, "5.3/5.3 kB"),
        (252_000_000, "252.0/252.0 MB"),
        (3e9, "3.0/3.0 GB"),
    ):
        out = io.StringIO()
        with Progress("fprep: save", int(total), out=out, enabled=True, after_s=0.0, unit="B") as p:
            p.advance(int(total))
        assert out.getvalue().rstrip("\n").split("\r")[-1].split("] ")[1].startswith(shown + " ")
