"""One saver per checkpoint root: an exclusive ``flock`` on ``root/.lock``.

Publishing, rotation and the removal of stale ``.tmp-*`` directories each assume that nothing
else changes the root meanwhile; two savers sharing a root broke all three (a cleanup deleting
the other's directory while it was being renamed into place published incomplete checkpoints).
So a save takes the root's lock first (rank 0, for the whole job) and keeps it until it has
published and rotated. The lock is not waited for: a second saver is refused at once with a
``CheckpointError`` naming the holder (its pid, host and start time, which each holder writes
into the lock file once it holds the lock), because two jobs saving into one root is a mistake
to fix, not a race to win. The kernel releases the lock when its holder exits, however it dies,
so a killed save never blocks the next one; and whoever holds the lock knows that every
``.tmp-*`` directory in the root is a leftover (``layout.clean_stale``).

The lock file stays (removing it would let two savers lock two different files). ``flock`` works
on local file systems and on NFS (Linux maps it to a POSIX lock there).
"""

from __future__ import annotations

import fcntl
import os
import socket
import time
from pathlib import Path

from fprep.errors import CheckpointError

LOCK = ".lock"
_LINE = 200  # the holder line, padded to a fixed size


def _holder(fd: int) -> str:
    """Who holds the lock, as its lock file says. A holder writes its line right after locking;
    a file without one (the very first holder, a moment after it locked) is read again briefly."""
    for _ in range(50):
        text = os.pread(fd, _LINE + 1, 0).decode("utf-8", "replace").strip()
        if text:
            return text
        time.sleep(0.001)
    return "a process that has not said which yet"


class RootLock:
    """The held lock of one root; ``release`` (or leaving the ``with`` block) gives it back."""

    def __init__(self, root: Path, fd: int) -> None:
        self.root = root
        self._fd: int | None = fd

    def release(self) -> None:
        fd, self._fd = self._fd, None
        if fd is not None:
            os.close(fd)  # releases the flock (the holder line stays: the next holder rewrites it)

    def __enter__(self) -> RootLock:
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()


def lock_root(root: Path) -> RootLock:
    """Take ``root``'s lock (creating ``root`` if needed), or raise ``CheckpointError`` naming the
    process that holds it."""
    root.mkdir(parents=True, exist_ok=True)
    path = root / LOCK
    flags = os.O_RDWR | os.O_CREAT | getattr(os, "O_CLOEXEC", 0) | getattr(os, "O_NOFOLLOW", 0)
    fd = os.open(path, flags, 0o644)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = _holder(fd)
            raise CheckpointError(
                f"another save into {root} is in progress ({holder}).",
                subject=str(root),
                hint="One job saves into a checkpoint root at a time: let that save finish, or "
                "save into another directory. The lock goes away with the process holding it.",
            ) from None
        stamp = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
        line = f"pid {os.getpid()} on {socket.gethostname()} since {stamp}".encode()
        os.pwrite(fd, line.ljust(_LINE) + b"\n", 0)  # one write of a fixed size: never torn
    except BaseException:
        os.close(fd)
        raise
    return RootLock(root, fd)
