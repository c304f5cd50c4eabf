"""Progress for long work (materializing big models, checkpoints): a line on stderr.

Silent unless it is worth showing: only on a terminal, only where asked (rank 0 by default in
the callers), and only once the work has taken more than ``after_s`` seconds, so quick calls
and logs stay clean. Dependency-free; no global state. ``advance`` may be called from several
threads (checkpoint files are written and verified in parallel); counts are never lost.
"""

from __future__ import annotations

import sys
import threading
import time
from types import TracebackType
from typing import Literal, TextIO


class Progress:
    """``with Progress("materialize", total) as p: ... p.advance()``

    ``unit="B"``: ``total`` and the counts are bytes, shown in kB, MB or GB.
    """

    def __init__(
        self,
        label: str,
        total: int,
        *,
        out: TextIO | None = None,
        enabled: bool | None = None,
        after_s: float = 1.0,
        width: int = 24,
        unit: Literal["", "B"] = "",
    ) -> None:
        self.label = label
        self.total = max(total, 0)
        self.out = out if out is not None else sys.stderr
        self.enabled = (
            bool(getattr(self.out, "isatty", lambda: False)()) if enabled is None else enabled
        )
        self.after_s = after_s
        self.width = width
        self.unit = unit
        self.done = 0
        self.start = time.perf_counter()
        self._last_draw = 0.0
        self.shown = False
        self._lock = threading.Lock()

    def _line(self) -> str:
        filled = round(self.width * self.done / self.total) if self.total else self.width
        bar = "#" * filled + "." * (self.width - filled)
        elapsed = time.perf_counter() - self.start
        return f"{self.label} [{bar}] {self._count()} {elapsed:5.1f} s"

    def _count(self) -> str:
        if self.unit != "B":
            return f"{self.done}/{self.total}"
        scale, name = (1e9, "GB") if self.total >= 1e9 else (1e6, "MB")
        if self.total < 1e6:
            scale, name = 1e3, "kB"
        return f"{self.done / scale:.1f}/{self.total / scale:.1f} {name}"

    def advance(self, n: int = 1) -> None:
        with self._lock:
            self.done += n
            if not self.enabled:
                return
            now = time.perf_counter()
            if now - self.start < self.after_s or now - self._last_draw < 0.1:
                return
            self._last_draw = now
            self.shown = True
            self.out.write("\r" + self._line())
            self.out.flush()

    def __enter__(self) -> Progress:
        return self

    def __exit__(
        self,
        kind: type[BaseException] | None,
        error: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        with self._lock:
            if self.shown:
                self.out.write("\r" + self._line() + "\n")
                self.out.flush()
