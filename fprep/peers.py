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
    """Forget this rank's earlier word (a new group in a reused store), and say ``"exited"``
    when this process ends."""
    store = _world_store()
    if store is None:
        return
    key = f"{STATUS_PREFIX}{dist.get_rank()}"
    with contextlib.suppress(RuntimeError, ValueError):
        bounded(lambda: store.delete_key(key), PUBLISH_S)
    _register_exit()


_registered = threading.Lock()
_hooks: list[Callable[[], None]] = []


def _at_exit() -> None:
    publish("exited")


def _register_exit() -> None:
    with _registered:
        if not _hooks:
            _hooks.append(_at_exit)
            atexit.register(_at_exit)
