"""Store operations that end in time, and what each rank last said about itself.

Deadlines. A c10d ``TCPStore`` whose host process is frozen (``SIGSTOP``, a debugger, a machine
swapping) blocks its clients' ``check``, ``get``, ``wait`` and ``multi_get`` without end: the
client's own timeout bounds none of them (measured: still blocked after 100 s with a 3 s
timeout). ``bounded`` therefore runs store work on a helper thread and stops waiting for it at
its deadline, raising ``StoreSilent``; the thread is left blocked (it holds no lock of ours) and
ends with the process, or as soon as the host answers or dies.

Status. A rank that has reached ``fprep.end_training``, or whose process is exiting, writes
``fprep/status/<global rank>`` (``"ended"`` / ``"exited"``) to the default group's store, so a
rank that waits for it in a collective call says so at once instead of after ``timeout_s``.
``prepare`` clears this rank's word when it joins a group (the store may be reused).

Heartbeat. From then on a daemon thread adds 1 to ``fprep/beat/<global rank>`` every
``BEAT_S`` seconds (one store round trip per rank and second). A rank blocked in a collective
still beats (its backend waits without the GIL), a killed or crashed one does not: that is how
``fprep.collectives`` tells, after a failure, a lost rank from a live one that is busy
elsewhere (``beating``). The thread stops when the default group goes away or is replaced, when
the store fails, and at exit.
"""

from __future__ import annotations

import atexit
import contextlib
import threading
from collections.abc import Callable
from typing import Any, TypeVar

import torch.distributed as dist

T = TypeVar("T")

#: The longest a status write at ``end_training`` or at exit may take (seconds).
PUBLISH_S = 2.0
STATUS_PREFIX = "fprep/status/"
#: How often a rank's heartbeat advances (seconds).
BEAT_S = 1.0
BEAT_PREFIX = "fprep/beat/"


class StoreSilent(RuntimeError):
    """The job's store did not answer within the deadline (its host is frozen or gone)."""


def bounded(work: Callable[[], T], deadline_s: float) -> T:
    """``work()``'s result, or its exception; ``StoreSilent`` when it has not ended within
    ``deadline_s`` seconds."""
    box: dict[str, Any] = {}

    def run() -> None:
        try:
            box["value"] = work()
        except BaseException as e:  # handed to the caller below
            box["error"] = e

    thread = threading.Thread(target=run, name="fprep-store", daemon=True)
    thread.start()
    thread.join(max(deadline_s, 0.0))
    if thread.is_alive():
        raise StoreSilent(f"the job's store did not answer within {deadline_s:.3g} s")
    if "error" in box:
        raise box["error"]
    value: T = box["value"]
    return value


def store_of(group: Any) -> Any:
    """The group's c10d store, or None (no real peers: fake backend, or no store known)."""
    if dist.get_backend(group) == "fake":
        return None
    entry = dist.distributed_c10d._world.pg_map.get(group)
    return None if entry is None else entry[1]


def _world_store() -> Any:
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return None
    return store_of(dist.group.WORLD)


def statuses(store: Any, ranks: list[int]) -> dict[int, str]:
    """What the given global ranks last said about themselves (only those that said anything).
    Runs on the caller's thread: call it inside ``bounded`` work."""
    keys = {r: f"{STATUS_PREFIX}{r}" for r in ranks}
    said = [r for r, key in keys.items() if store.check([key])]
    return {r: bytes(store.get(keys[r])).decode() for r in said}


def publish(word: str) -> bool:
    """Tell the job this rank's ``word`` (``"ended"``, ``"exited"``); best effort, at most
    ``PUBLISH_S``. Whether it was written."""
    store = _world_store()
    if store is None:
        return False
    key = f"{STATUS_PREFIX}{dist.get_rank()}"
    try:
        bounded(lambda: store.set(key, word), PUBLISH_S)
    except (RuntimeError, ValueError):  # the store's host is gone or frozen: nobody to tell
        return False
    return True


def clear() -> None:
    """Forget this rank's earlier word (a new group in a reused store), start its heartbeat,
    and say ``"exited"`` when this process ends."""
    store = _world_store()
    if store is None:
        return
    key = f"{STATUS_PREFIX}{dist.get_rank()}"
    with contextlib.suppress(RuntimeError, ValueError):
        bounded(lambda: store.delete_key(key), PUBLISH_S)
    _register_exit()
    _start_beating(store, dist.get_rank())


def beats(store: Any, ranks: list[int]) -> dict[int, int]:
    """The heartbeat counts of the given global ranks (only those that have one). Runs on the
    caller's thread: call it inside ``bounded`` work."""
    keys = {r: f"{BEAT_PREFIX}{r}" for r in ranks}
    have = [r for r, key in keys.items() if store.check([key])]
    return {r: int(bytes(store.get(keys[r])).decode()) for r in have}


_registered = threading.Lock()  # guards _hooks and _heart
_hooks: list[Callable[[], None]] = []


class _Heart:
    """This rank's heartbeat thread (see the module docs)."""

    def __init__(self, store: Any, rank: int) -> None:
        self.store, self.key = store, f"{BEAT_PREFIX}{rank}"
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, name="fprep-heartbeat", daemon=True)
        self.thread.start()

    def _run(self) -> None:
        while not self.stop.wait(BEAT_S):
            if _world_store() is not self.store:  # the group is gone, or another one is there
                return
            try:
                self.store.add(self.key, 1)
            except Exception:  # the store's host is gone: nobody to tell
                return


_heart: list[_Heart] = []


def _start_beating(store: Any, rank: int) -> None:
    with _registered:
        if _heart and _heart[0].store is store and _heart[0].thread.is_alive():
            return
        if _heart:
            _heart.pop().stop.set()
        try:  # the first beat now: a probe finds the key from the start
            bounded(lambda: store.add(f"{BEAT_PREFIX}{rank}", 1), PUBLISH_S)
        except (RuntimeError, ValueError):  # the store's host is gone or frozen
            return
        _heart.append(_Heart(store, rank))


def _stop_beating() -> None:
    """Stop the heartbeat and wait for it briefly: at interpreter shutdown a thread caught in
    a store call would be torn down inside C++ (``terminate called ...``)."""
    with _registered:
        heart = _heart.pop() if _heart else None
    if heart is not None:
        heart.stop.set()
        heart.thread.join(PUBLISH_S)


def _at_exit() -> None:
    _stop_beating()
    publish("exited")


def _register_exit() -> None:
    with _registered:
        if not _hooks:
            _hooks.append(_at_exit)
            atexit.register(_at_exit)
