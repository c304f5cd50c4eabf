"""Collectives that fail with a word instead of hanging.

Every fprep call that talks to other ranks (``prepare``, ``save``, ``load``, ``export_full``,
``unwrap``, ``backward``, ``all_reduce_gradients``, ``clip_grad_norm``, ``gather_for_metrics``,
``gather``, ``pad_across_processes``, ``main_process_first``) runs inside ``collective``::

    from fprep.collectives import collective

    with collective("fprep.save", state.config.timeout_s):   # the default group
        ...  # torch.distributed collectives, as many as the call needs

On entry each rank of the group writes an *arrival* key (the call's name) to the group's store
(the c10d TCPStore the group was created with) under a per-group sequence number, and waits at
most ``timeout_s`` for every other rank's key. A rank that never arrives, or one that arrived at a
different fprep call, is named in a ``CollectiveError`` raised on every rank that did arrive --
before any backend collective starts, so neither gloo nor nccl is left waiting. Inside the block,
a collective that fails (a peer killed, a backend timeout) becomes a ``CollectiveError`` naming
the call and the ranks that are lost, chained to torch's error. The probe that finds them
(``probe_world``) asks the whole job, not the group whose collective failed: under a mesh a
rank's dp and tp peers differ, and a live rank blocked in a collective with a survivor shows
it is alive by its heartbeat (``fprep.peers``), so every survivor names the same lost ranks.

A missing rank that has called ``end_training`` or exited (``fprep.peers`` status) is named at
once; every store wait runs under a deadline of its own (``fprep.peers.bounded``: a frozen store
host blocks torch's store calls without end); after a mismatch every rank acknowledges having
read the others' calls before any raises, so the store's host cannot leave first.

``arrive=False`` skips the arrival wait, for calls made every step (a gradient all-reduce): no
store traffic and no bookkeeping unless a collective fails, when the same probe names the
lost ranks.

The first contact of a launch (``first_contact``, used by ``connect`` and by ``prepare``'s plan
agreement) waits at most ``min(timeout_s, FIRST_CONTACT_S)`` for every rank to reach the
launcher's store at ``MASTER_ADDR:MASTER_PORT`` and names the ranks that did not.

A single process, an uninitialized default group and torch's ``fake`` backend (no real peers)
skip all of this: the block runs as it is.

A new collective fprep function wraps its body once (not each tensor), naming itself as users
call it and passing the group its collectives run over (None: the default group)::

    def all_reduce_mean(state, tensor):
        with collective("fprep.all_reduce_mean", state.config.timeout_s, group, arrive=False):
            ...

Use ``arrive=True`` (the default) for calls made now and then (a checkpoint, an evaluation),
``arrive=False`` for calls made every step; a ``PrepError`` raised inside passes unchanged.
"""

from __future__ import annotations

import contextlib
import datetime
import json
import os
import re
import time
import weakref
from collections.abc import Iterator, Sequence
from typing import Any

import torch.distributed as dist
from torch._C._distributed_c10d import TCPStore  # torch.distributed re-exports it untyped

from fprep.errors import CollectiveError, PrepError, TopologyError
from fprep.peers import BEAT_S, StoreSilent, beats, bounded, statuses, store_of

#: The longest a launch waits for every rank to reach the launcher's store (seconds), unless
#: ``PrepConfig.timeout_s`` is shorter. Documented in docs/training.md.
FIRST_CONTACT_S = 300.0
#: How long ranks that saw a collective fail wait for each other to report (seconds), unless
#: ``timeout_s`` is shorter: the ranks that do not report within it are named as lost.
PROBE_S = 10.0
#: How long the probe may take beyond ``PROBE_S`` when the store's host does not answer (frozen).
PROBE_GRACE_S = 1.0
#: How long an arrival may take beyond its wait before the store's host is taken for frozen.
STORE_GRACE_S = 2.0
_STATUS_EVERY_S = 0.25  # how often a waiting rank looks for ranks that ended or exited
_POLL_MAX_S = 0.05  # the longest pause between two looks at the store while waiting
_GONE = {"ended": "has already called fprep.end_training", "exited": "has exited"}

_PREFIX = "fprep/"
_sequences: weakref.WeakKeyDictionary[Any, int] = weakref.WeakKeyDictionary()


def _seconds(timeout_s: float) -> datetime.timedelta:
    return datetime.timedelta(seconds=max(timeout_s, 0.001))


def _global_ranks(group: Any) -> list[int]:
    return list(dist.get_process_group_ranks(group))


def _next_sequence(group: Any) -> int:
    seq = _sequences.get(group, 0)
    _sequences[group] = seq + 1
    return seq


def _missing(store: Any, keys: Sequence[str], ranks: Sequence[int]) -> list[int]:
    return [r for r, key in zip(ranks, keys, strict=True) if not store.check([key])]


def _await(
    store: Any, keys: Sequence[str], ranks: Sequence[int], timeout_s: float, call: str, status: Any
) -> bool:
    """Whether every key appeared within ``timeout_s`` (False on a timeout). With a ``status``
    store, a missing rank that said it ended or exited is a ``CollectiveError`` at once.

    Polls ``check`` (a timed-out ``store.wait`` logs two warnings each time); runs inside
    ``bounded`` work, since a frozen host blocks ``check`` too."""
    deadline = time.monotonic() + timeout_s
    pause, look = 0.001, 0.0
    while not store.check(list(keys)):
        now = time.monotonic()
        if now >= deadline:
            return False
        if status is not None and now >= look:
            look = now + _STATUS_EVERY_S
            gone = statuses(status, _missing(store, keys, ranks))
            if gone:
                said = "; ".join(f"rank {r} {_GONE.get(w, w)}" for r, w in sorted(gone.items()))
                raise CollectiveError(
                    f"{call} is collective: call it on every rank; {said}.",
                    subject=call,
                    hint=f"Call {call} on every rank, before fprep.end_training and before any "
                    "rank's script ends.",
                )
        time.sleep(min(pause, deadline - now))
        pause = min(2 * pause, _POLL_MAX_S)
    return True


def arrive(
    store: Any,
    call: str,
    tag: str,
    index: int,
    ranks: Sequence[int],
    timeout_s: float,
    status: Any = None,
) -> None:
    """Write this rank's arrival key under ``tag``; wait for every rank's; raise if one is late,
    arrived at another call, or (with a ``status`` store) ended or exited.

    ``index`` is this rank's position in ``ranks`` (global rank numbers, for the message). A
    store that does not answer raises ``StoreSilent`` (within ``timeout_s`` plus
    ``min(timeout_s, PROBE_S) + STORE_GRACE_S``).
    """

    def meet() -> None:
        keys = [f"{_PREFIX}{tag}/{i}" for i in range(len(ranks))]
        store.set(keys[index], call)
        if not _await(store, keys, ranks, timeout_s, call, status):
            missing = _missing(store, keys, ranks)
            raise CollectiveError(
                f"{call} is collective: call it on every rank; ranks {missing} did not arrive "
                f"within {timeout_s:g} s.",
                subject=call,
                hint="Call it on every rank, in the same order on each; if a rank died, see its "
                "log. PrepConfig.timeout_s sets how long ranks wait.",
            )
        calls = [bytes(v).decode() for v in store.multi_get(keys)]
        others = {r: c for r, c in zip(ranks, calls, strict=True) if c != call}
        if others:
            # Every rank raises now, and a rank may exit at once: the store's host (rank 0) must
            # not take the store away before every rank has read what the others called.
            read = [f"{_PREFIX}{tag}/read/{i}" for i in range(len(ranks))]
            store.set(read[index], call)
            _await(store, read, ranks, min(timeout_s, PROBE_S), call, None)
            shown = ", ".join(f"rank {r} called {c}" for r, c in others.items())
            raise CollectiveError(
                f"{call} is collective: call it on every rank; ranks {sorted(others)} arrived at "
                f"another call instead ({shown}).",
                subject=call,
                hint="Call fprep's collective functions on every rank in the same order.",
            )

    bounded(meet, timeout_s + min(timeout_s, PROBE_S) + STORE_GRACE_S)


def probe(
    store: Any, call: str, tag: str, index: int, ranks: Sequence[int], wait_s: float
) -> list[int]:
    """After a failure: the ranks that do not report within ``wait_s`` (all but us if the
    store itself is gone, or does not answer within ``wait_s + PROBE_GRACE_S``)."""
    keys = [f"{_PREFIX}{tag}/failed/{i}" for i in range(len(ranks))]

    def report() -> list[int]:
        store.set(keys[index], call)
        _await(store, keys, ranks, wait_s, call, None)
        return _missing(store, keys, ranks)

    try:
        return bounded(report, wait_s + PROBE_GRACE_S)
    except (RuntimeError, ValueError):  # the store's host (a rank) is gone, or frozen
        return [r for i, r in enumerate(ranks) if i != index]


#: How many world probes this process has made: the same count on every rank of one failure,
#: so that they meet under one tag (``probe_world``).
_world_probes = [0]


def probe_world(call: str, wait_s: float) -> tuple[list[int], list[int]]:
    """After a failure in any group: ``(lost, elsewhere)`` over the whole job.

    Every rank that saw a collective fail reports under a tag the job's ranks share (their
    count of world probes). A rank that has not reported is *elsewhere* as soon as its
    heartbeat advances (``fprep.peers``: alive, e.g. blocked in a collective with a rank that
    is here), and *lost* when it has said it exited or ended, when a rank that probed before
    found it lost, or when its heartbeat does not move for ``max(wait_s, 3 * BEAT_S)``
    seconds. So every survivor names the same lost ranks, whichever group its collective
    failed in, and no live rank is named. Bounded by that window plus ``PROBE_GRACE_S``: a
    store that is gone or frozen takes its host with it (rank 0, unless the launcher's agent
    hosts the store: then every other rank is named)."""
    store = store_of(dist.group.WORLD)
    me, world = dist.get_rank(), dist.get_world_size()
    others = [r for r in range(world) if r != me]
    tag = f"{_PREFIX}lost/{_world_probes[0]}"
    _world_probes[0] += 1
    window = max(wait_s, 3 * BEAT_S)

    def look() -> tuple[list[int], list[int]]:
        store.set(f"{tag}/{me}", call)
        first = beats(store, others)
        deadline = time.monotonic() + window
        alive: set[int] = set()
        gone: set[int] = set()
        while True:
            reported = {r for r in others if store.check([f"{tag}/{r}"])}
            found = set(_verdict(store, tag)) - reported
            pending = [r for r in others if r not in reported | alive | gone | found]
            if pending:
                now = beats(store, pending)
                alive |= {r for r in pending if r in now and now[r] > first.get(r, 0)}
                gone |= set(statuses(store, [r for r in pending if r not in alive]))
                pending = [r for r in pending if r not in alive | gone]
            if not pending or time.monotonic() >= deadline:
                break
            time.sleep(min(_STATUS_EVERY_S, max(deadline - time.monotonic(), 0.0)))
        lost = sorted(set(pending) | gone | found)
        if lost:
            store.set(f"{tag}/verdict", json.dumps(lost))
        return lost, sorted(alive - reported)

    try:
        return bounded(look, window + PROBE_GRACE_S)
    except (RuntimeError, ValueError):  # the store's host is gone, or frozen
        agent = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
        return ([0] if me != 0 and not agent else others), []


def _verdict(store: Any, tag: str) -> list[int]:
    """The ranks an earlier prober of this failure found lost."""
    key = f"{tag}/verdict"
    if not store.check([key]):
        return []
    return [int(r) for r in json.loads(bytes(store.get(key)))]


def is_collective_failure(error: BaseException) -> bool:
    """A backend error (lost peer, timeout), not a user's error that happened to occur inside."""
    if isinstance(error, PrepError):
        return False
    if isinstance(error, dist.DistError):
        return True
    text = str(error)
    return isinstance(error, RuntimeError) and any(
        mark in text for mark in ("gloo", "Connection closed", "Timed out", "NCCL", "timed out")
    )


@contextlib.contextmanager
def collective(
    call: str, timeout_s: float, group: Any = None, *, arrive: bool = True
) -> Iterator[None]:
    """Run the block as fprep call ``call`` over ``group`` (default: the default group).

    Every rank of the group must enter it; ``timeout_s`` bounds the arrival wait (the group's
    own timeout bounds its collectives). See the module docs. With ``arrive=False`` the group
    may also be created inside the block (``prepare``'s connect).
    """
    site = Site.of(call, group) if arrive else None  # arrive=False: nothing until a failure
    if site is not None:
        site.arrive(timeout_s)
    try:
        yield
    except Exception as e:
        if not is_collective_failure(e):
            raise
        site = site or Site.of(call, group)  # (the group may even have been created in the block)
        if site is None:
            raise
        lost, elsewhere = probe_world(call, min(timeout_s, PROBE_S))
        if lost:
            who = f"ranks {lost} did not answer (lost, or frozen)"
        elif elsewhere:
            who = f"every rank is still there (ranks {elsewhere} alive, in no failed collective)"
        else:
            who = "every rank is still there"
        raise CollectiveError(
            f"{call} failed in a collective{site.where}: {who}. torch said: {_first_line(e)}",
            subject=call,
            hint="See the log of the ranks named; a killed or crashed rank cannot rejoin: "
            "restart the job (from the last checkpoint).",
        ) from e


class Site:
    """One entry of one fprep call into ``collective``: the group's store and a tag that is the
    same on every rank (the group's count of fprep calls so far)."""

    def __init__(self, call: str, group: Any, store: Any) -> None:
        self.call, self.group, self.store = call, group, store
        self.ranks = _global_ranks(group)
        self.index = dist.get_rank(group)
        self.tag = f"c/{_next_sequence(group)}"
        self.where = "" if group is dist.group.WORLD else f" (process group of ranks {self.ranks})"
        self.status = store if group is dist.group.WORLD else store_of(dist.group.WORLD)

    @classmethod
    def of(cls, call: str, group: Any) -> Site | None:
        if not (dist.is_available() and dist.is_initialized()):
            return None
        if group is None or dist.get_world_size(group) == dist.get_world_size():
            group = dist.group.WORLD  # (a mesh's group over every rank): one count for all calls
        store = store_of(group)
        if store is None or dist.get_world_size(group) == 1:
            return None
        return cls(call, group, store)

    def arrive(self, timeout_s: float) -> None:
        try:
            arrive(self.store, self.call, self.tag, self.index, self.ranks, timeout_s, self.status)
        except CollectiveError as e:
            if self.where:
                raise CollectiveError(
                    f"{e.message.rstrip('.')}{self.where}.", subject=e.subject, hint=e.hint
                ) from None
            raise
        except (RuntimeError, ValueError) as e:  # the store's host (rank 0's process) is gone
            raise _store_gone(self.call, e) from e
        # Every rank has passed its previous arrival: drop ours, so keys do not pile up.
        previous = _arrivals.get(self.group)
        if previous is not None:
            with contextlib.suppress(RuntimeError):  # (StoreSilent too: the next call says so)
                bounded(lambda: self.store.delete_key(previous), STORE_GRACE_S)
        _arrivals[self.group] = f"{_PREFIX}{self.tag}/{self.index}"


_arrivals: weakref.WeakKeyDictionary[Any, str] = weakref.WeakKeyDictionary()


def _first_line(error: BaseException) -> str:
    """torch's message, short: its first line, without gloo's source location and advice."""
    lines = str(error).strip().splitlines()
    text = re.sub(r"^\[[^\]]*\.(cc|cpp):\d+\] ", "", lines[0] if lines else "")
    return f"{type(error).__name__}: {text.split(' This is typically caused by')[0]}"


# -- first contact: before any process group exists ----------------------------------------------
_contacts: dict[tuple[str, int, int, int], Any] = {}


def first_contact(
    rank: int, world_size: int, timeout_s: float, call: str = "fprep.prepare"
) -> tuple[Any, str]:
    """The launcher's store (``MASTER_ADDR:MASTER_PORT``) once every rank has reached it, and a
    key prefix unique to this contact (for ``exchange``).

    Waits at most ``min(timeout_s, FIRST_CONTACT_S)``; raises ``CollectiveError`` naming the
    ranks that did not arrive (or rank 0's address when it cannot be reached). The store is
    kept for ``connect``'s ``init_process_group`` (``take_contact``): a port is bound once.
    """
    host, port = _address()
    key = (host, port, rank, world_size)
    limit = min(timeout_s, FIRST_CONTACT_S)
    store = _contacts.get(key)
    if store is None:
        store = _connect(call, host, port, rank, world_size, limit)
        _contacts[key] = store
    # Each contact (a prepare that failed is tried again) counts, so that it meets under its
    # own keys.
    tag = f"contact/{int(store.add(f'{_PREFIX}contact/count/{rank}', 1))}"
    try:
        arrive(store, call, tag, rank, list(range(world_size)), limit)
    except (RuntimeError, ValueError) as e:
        if not isinstance(e, CollectiveError):
            raise _store_gone(call, e) from e
        raise CollectiveError(
            e.message.replace("did not arrive", f"did not join at {host}:{port}"),
            subject=e.subject,
            hint=f"Start all {world_size} ranks (WORLD_SIZE={world_size}) with the same "
            "MASTER_ADDR / MASTER_PORT. The first contact waits at most "
            f"min(PrepConfig.timeout_s, {FIRST_CONTACT_S:g}) s.",
        ) from None
    return store, tag


def _connect(call: str, host: str, port: int, rank: int, world_size: int, limit: float) -> Any:
    """The launcher's store: hosted here on rank 0 (unless torchrun's agent hosts it)."""
    agent = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"  # torchrun hosts it
    start = time.monotonic()
    try:
        return TCPStore(
            host,
            port,
            world_size,
            is_master=rank == 0 and not agent,
            timeout=_seconds(limit),
            wait_for_workers=False,
            multi_tenant=True,
        )
    except (RuntimeError, ValueError) as e:
        raise CollectiveError(
            f"{call}: rank {rank} could not reach rank 0's store at {host}:{port} within "
            f"{time.monotonic() - start:.0f} s: {_first_line(e)}",
            subject=call,
            hint="Start every rank (rank 0 hosts the store) with the same MASTER_ADDR and "
            "MASTER_PORT; check that rank 0 is running and the port is reachable.",
        ) from e


def _address() -> tuple[str, int]:
    raw = os.environ["MASTER_PORT"]
    try:
        return os.environ["MASTER_ADDR"], int(raw)
    except ValueError:
        raise TopologyError(
            f"Environment variable MASTER_PORT={raw!r} is not a port number.",
            subject="MASTER_PORT",
            hint="Set MASTER_PORT to the same free port (e.g. 29500) on every rank.",
        ) from None


def take_contact(rank: int, world_size: int) -> Any:
    """The store ``first_contact`` made for this launch, handed over (None if there is none)."""
    host, port = _address()
    return _contacts.pop((host, port, rank, world_size), None)


def exchange(
    call: str, store: Any, tag: str, index: int, ranks: Sequence[int], value: Any, timeout_s: float
) -> list[Any]:
    """Every rank's ``value`` (JSON data: the store is a network service, nothing is unpickled)
    in the order of ``ranks``; ``index`` is this rank's position there."""
    keys = [f"{_PREFIX}{tag}/x/{i}" for i in range(len(ranks))]

    def meet() -> tuple[list[int], list[Any]]:
        store.set(keys[index], json.dumps(value))
        if not _await(store, keys, ranks, timeout_s, call, None):
            return _missing(store, keys, ranks), []
        return [], [json.loads(bytes(v)) for v in store.multi_get(keys)]

    try:
        missing, values = bounded(meet, timeout_s + STORE_GRACE_S)
    except (RuntimeError, ValueError) as e:
        raise _store_gone(call, e) from e
    if missing:
        raise CollectiveError(
            f"{call} is collective: call it on every rank; ranks {missing} did not arrive "
            f"within {timeout_s:g} s.",
            subject=call,
            hint=f"Call {call} on every rank.",
        )
    return values


def _store_gone(call: str, error: BaseException) -> CollectiveError:
    if isinstance(error, StoreSilent):
        return CollectiveError(
            f"{call}: the job's store (hosted by rank 0, or by the launcher) does not answer: "
            f"{error}.",
            subject=call,
            hint="Rank 0 (or the launcher's agent) is frozen: stopped (SIGSTOP, Ctrl-Z), held "
            "in a debugger, or its machine is overloaded; see its log, restart the job.",
        )
    return CollectiveError(
        f"{call}: the job's store (hosted by rank 0) cannot be reached: {_first_line(error)}",
        subject=call,
        hint="Rank 0 has probably exited or crashed; see its log.",
    )
