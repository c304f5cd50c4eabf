"""Asynchronous saves: stage in the foreground, write and publish on a background thread.

``fprep.save(..., wait=False)`` runs ``writing.collect`` in the caller's thread: arguments
checked, non-tensor state encoded as JSON data, every tensor to write copied into this model's
host buffers (``staging.py``), RNG states captured, the ``.tmp-*`` directory made, and all
ranks agreed that all of it worked. Training may go on the moment ``save`` returns: the thread
reads nothing live, so nothing done to the live tensors afterwards (by any code, on any thread)
reaches the checkpoint. It then runs ``writing.write_and_publish``: DCP's planning, the writes
and BLAKE3 digests (taken from the bytes written), each rank's files read back and checked
(``verify``), the gather of file records to rank 0, the manifest, the atomic publish (the
same code, and so the same guarantees, as a synchronous save).

Collectives. Those steps need collectives (DCP's plan exchange, the gather of file records,
the agreement on failures), and gloo runs one collective at a time per group, in the order the
ranks issue them: a background thread issuing them on the default group would interleave with
the training loop's (FSDP's all-gathers, DDP's all-reduces) in an order that differs between
ranks, and hang or mix up payloads. Two ways out: run every collective in the foreground and
leave the thread only local writes, with a final agreement at the next save or ``wait``; or give
checkpoint traffic a process group of its own. fprep does the second: a gloo group over all
ranks, created once (a collective on the default group, in the foreground of the first
asynchronous save) and used by nothing else, so the thread's collectives never meet the loop's.
The first way would publish a checkpoint only when the ranks next met (the manifest needs every
rank's digests), so a run saving every hour would publish each checkpoint an hour late; with
the group, a checkpoint is published as soon as its bytes are written, every rank's thread ends
with the same outcome (success, or the same ``CheckpointError``), and ``wait`` is local (it
joins this rank's thread; no collective, so it may be called on some ranks only).

A rank lost while the thread talks to it (killed, crashed) ends the other ranks' threads with a
``CollectiveError`` naming the ranks that no longer answer a short probe of the checkpoint
group's store, as a synchronous save's ``fprep.collectives.collective`` would (the probe has a
tag of its own, the count of asynchronous saves, so it never meets the training loop's calls).

At most one save is in flight per process: the next ``save`` (either kind), ``load`` and the
process's exit (an exit hook of ``threading``'s, which runs before ``atexit``'s) wait for it
first; a failure nobody collected with ``wait`` is raised there (at exit it is printed: an exit
cannot raise). Before ``destroy_process_group``, call ``wait``: the thread needs the process
groups until it is done.
"""

from __future__ import annotations

import atexit
import dataclasses
import os
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch.distributed as dist
from torch import nn

from fprep.checkpoint.asynchronous import staging
from fprep.checkpoint.collective import Group
from fprep.checkpoint.writing import SaveArgs, collect, write_and_publish
from fprep.collectives import PROBE_S, _first_line, is_collective_failure, probe
from fprep.errors import CheckpointError, CollectiveError, PrepError
from fprep.state import PrepState


@dataclasses.dataclass(frozen=True)
class _OwnGroup(Group):
    """``Group`` over the checkpoint process group (all ranks, their usual rank numbers)."""

    pg: Any = None

    def all_gather(self, obj: Any) -> list[Any]:
        if not self.distributed:
            return [obj]
        out: list[Any] = [None] * self.world_size
        dist.all_gather_object(out, obj, group=self.pg)
        return out

    def broadcast(self, obj: Any) -> Any:
        if not self.distributed:
            return obj
        box = [obj if self.rank == 0 else None]
        dist.broadcast_object_list(box, src=0, group=self.pg)
        return box[0]

    def barrier(self) -> None:
        if self.distributed:
            dist.barrier(group=self.pg)


_lock = threading.Lock()
_checkpoint_pg: tuple[Any, Any] | None = None  # (the default group it was made in, the group)


def _own_group(group: Group) -> _OwnGroup:
    """The checkpoint group (made on first use, by every rank: a collective on the default
    group; made again should the default group be replaced)."""
    global _checkpoint_pg
    if not group.distributed:
        return _OwnGroup(False, 0, 1)
    default = dist.distributed_c10d._get_default_group()
    if _checkpoint_pg is None or _checkpoint_pg[0] is not default:
        _checkpoint_pg = (default, dist.new_group(backend="gloo"))
    return _OwnGroup(True, group.rank, group.world_size, _checkpoint_pg[1])


class SaveHandle:
    """An asynchronous save in flight. ``wait()`` returns the published step directory.

    Returned by ``fprep.save(..., wait=False)`` once every tensor of this rank's state is
    copied into host memory (``staging.py``).
    """

    def __init__(self, root: str, step: int, timeout_s: float = PROBE_S, tag: str = "") -> None:
        self.root = root
        self.step = step
        self._timeout_s = timeout_s
        self._tag = tag  # the same on every rank: where a lost rank is probed for
        self._finished = threading.Event()
        self._path: Path | str | None = None
        self._error: BaseException | None = None
        self._collected = False  # the outcome was handed to someone (wait, or the next save)

    def done(self) -> bool:
        """Whether the background work is over (published or failed); never blocks."""
        return self._finished.is_set()

    def wait(self) -> Path | str:
        """Block until the checkpoint is published; return its step directory.

        Raises the save's ``CheckpointError`` if it failed (on every rank: the ranks agree on
        the outcome). Local: no collective; may be called any number of times.
        """
        self._finished.wait()
        self._collected = True
        if self._error is not None:
            raise self._error
        assert self._path is not None
        return self._path

    def __repr__(self) -> str:
        state = "running" if not self.done() else ("failed" if self._error else "published")
        return f"SaveHandle(step={self.step}, root={str(self.root)!r}, {state})"

    def _run(self, collected: Any, group: _OwnGroup, copied: Callable[[], None]) -> None:
        try:
            copied()  # the device-to-host copies staging enqueued: done before any byte is read
            self._path = write_and_publish(
                collected, group, process_group=group.pg, progress=False, verify=True
            )
        except BaseException as e:  # everything reaches wait(), nothing dies with the thread
            self._error = self._as_error(e, group)
        finally:
            collected.tensors = {}
            self._finished.set()

    def _as_error(self, error: BaseException, group: _OwnGroup) -> BaseException:
        if isinstance(error, PrepError):
            return error
        if group.distributed and is_collective_failure(error):
            return _lost(error, group, self._tag, self._timeout_s)
        return _failed(self.root, error)


def _lost(error: BaseException, group: _OwnGroup, tag: str, timeout_s: float) -> CollectiveError:
    """A collective of the background failed: the ranks that do not answer a probe of the
    checkpoint group's store within ``min(timeout_s, PROBE_S)`` (all others if the store, hosted
    by rank 0, is gone), named in a ``CollectiveError``."""
    entry = dist.distributed_c10d._world.pg_map.get(group.pg)
    ranks = list(range(group.world_size))
    if entry is None:
        lost = [r for r in ranks if r != group.rank]
    else:
        lost = probe(entry[1], "fprep.save", tag, group.rank, ranks, min(timeout_s, PROBE_S))
    who = (
        f"ranks {lost} did not answer (lost, or still waiting elsewhere)"
        if lost
        else "every rank is still there"
    )
    wrapped = CollectiveError(
        f"fprep.save failed in a collective of its background thread (wait=False): {who}. "
        f"torch said: {_first_line(error)}",
        subject="fprep.save",
        hint="The checkpoint was not published; the previous ones are untouched. See the log "
        "of the ranks named; a killed or crashed rank cannot rejoin: restart the job (from the "
        "last checkpoint).",
    )
    wrapped.__cause__ = error
    return wrapped


def _failed(root: str, error: BaseException) -> CheckpointError:
    wrapped = CheckpointError(
        f"saving to {root} failed in the background: {type(error).__name__}: {error}",
        subject=str(root),
        hint="The previous checkpoints are untouched; the next save removes what this one left.",
    )
    wrapped.__cause__ = error
    return wrapped


_in_flight: SaveHandle | None = None
_started = 0  # asynchronous saves started by this process (the same count on every rank)


def settle() -> None:
    """Wait for the save in flight, if any; raise its failure unless ``wait`` already did."""
    global _in_flight
    with _lock:
        handle, _in_flight = _in_flight, None
    if handle is None:
        return
    handle._finished.wait()
    if not handle._collected:
        handle.wait()


def _at_exit() -> None:
    try:
        settle()
    except BaseException as e:  # an exit cannot raise: say it
        import sys

        print(f"fprep: the asynchronous checkpoint save failed: {e}", file=sys.stderr)


_exit_hook = False


def _register_exit(hook: Any) -> None:
    """Run ``hook`` at exit before ``concurrent.futures`` stops taking work (the writer hashes
    on a thread pool): ``threading``'s exit hooks run first, newest first, before the
    interpreter joins threads and long before ``atexit``'s."""
    register = getattr(threading, "_register_atexit", None)
    if register is None:  # pragma: no cover - every CPython fprep supports has it
        atexit.register(hook)
    else:
        register(hook)


def start(
    path: str | os.PathLike[str], state: PrepState, model: nn.Module, args: SaveArgs
) -> SaveHandle:
    """Stage and collect here; write and publish on a background thread (see the module)."""
    global _in_flight, _exit_hook, _started
    settle()
    _started += 1
    tag = f"async-save/{_started}"
    group = Group.of(state)
    own = _own_group(group)  # before collect: a collective on the default group
    stager = staging.stager_for(model)  # every tensor copied into the model's host buffers
    collected = collect(path, state, model, args, stage=stager.stage)
    handle = SaveHandle(str(collected.root), args.step, state.config.timeout_s, tag)
    thread = threading.Thread(
        target=handle._run, args=(collected, own, stager.wait), name="fprep-save", daemon=True
    )
    with _lock:
        _in_flight = handle
        if not _exit_hook:
            _register_exit(_at_exit)
            _exit_hook = True
    thread.start()
    return handle
