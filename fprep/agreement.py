"""Agreement on the plan: every rank learns every other rank's planning outcome before any
effect, and all raise the same error.

Ranks may plan differently (rank 0 holds real weights, the others are on the meta device), so a
plan that fails on one rank only would send the others into ``prepare``'s collectives to wait
for a rank that has already raised. ``agree_on_plan`` exchanges each rank's outcome -- ok and the
strategy chosen, or the error's class, message, subject and hint -- over the job's store (the
default process group's, or the launcher's at first contact: no backend collective, nothing
pickled) and raises on every rank alike. A plan that failed the same way everywhere keeps its own
error; otherwise every rank raises the first failing rank's error, its message prefixed with the
rank. A rank whose plan failed raises its own error when the ranks cannot meet (the others name
it as missing). One store exchange per ``prepare``.
"""

from __future__ import annotations

import os
from typing import Any

import torch.distributed as dist
from returns.result import Failure, Result

import fprep.errors as errors
from fprep.collectives import Site, exchange, first_contact
from fprep.errors import CollectiveError, PrepareError, PrepError
from fprep.state import PrepState
from fprep.topology import Topology

_CALL = "fprep.prepare"


def _outcome(result: Result[PrepState, PrepError]) -> dict[str, Any]:
    if isinstance(result, Failure):
        e = result.failure()
        return {
            "error": type(e).__name__,
            "message": e.message,
            "subject": e.subject,
            "hint": e.hint,
        }
    core = result.unwrap().core
    return {"strategy": None if core is None else core.strategy}


def _error(outcome: dict[str, Any], ranks: list[int]) -> PrepError:
    """The error of the first failing rank, rebuilt (same class, subject and hint)."""
    cls = getattr(errors, str(outcome["error"]), None)
    if not (isinstance(cls, type) and issubclass(cls, PrepError)):
        cls = PrepareError
    others = f" (and on ranks {ranks[1:]})" if len(ranks) > 1 else ""
    message = f"planning failed on rank {ranks[0]}{others}: {outcome['message']}"
    return cls(message, subject=str(outcome["subject"]), hint=str(outcome["hint"]))


def _meeting(
    topology: Topology, timeout_s: float, process_group: Any, mesh: Any
) -> tuple[Any, str, int, list[int]] | None:
    """(store, tag, this rank's index, the ranks taking part), or None when nobody else plans."""
    if topology.world_size <= 1:
        return None
    if dist.is_available() and dist.is_initialized():
        group = process_group
        if group is None and mesh is not None:
            ranks = [int(r) for r in mesh.mesh.flatten().tolist()]
            if ranks != list(range(dist.get_world_size())):
                return None  # a mesh over part of the job: its ranks have no common group here
        site = Site.of(_CALL, group)
        return None if site is None else (site.store, site.tag, site.index, site.ranks)
    if "MASTER_ADDR" in os.environ and "MASTER_PORT" in os.environ:
        store, tag = first_contact(topology.rank, topology.world_size, timeout_s)
        return store, tag, topology.rank, list(range(topology.world_size))
    return None  # connect reports the missing launcher


def agree_on_plan(
    result: Result[PrepState, PrepError],
    topology: Topology,
    timeout_s: float,
    *,
    process_group: Any = None,
    mesh: Any = None,
) -> PrepState:
    """The planned state when every rank planned successfully and alike; else raise the same
    ``PrepError`` on every rank (see the module docs)."""
    mine = _outcome(result)
    try:
        meeting = _meeting(topology, timeout_s, process_group, mesh)
        if meeting is not None:
            store, tag, index, ranks = meeting
            outcomes = exchange(_CALL, store, tag, index, ranks, mine, timeout_s)
    except CollectiveError:
        if isinstance(result, Failure):  # the ranks did not meet, but this one's plan is wrong
            raise result.failure() from None
        raise
    if meeting is None:
        if isinstance(result, Failure):
            raise result.failure()
        return result.unwrap()
    failed = [(r, o) for r, o in zip(ranks, outcomes, strict=True) if "error" in o]
    if failed:
        if len(failed) == len(ranks) and all(o == mine for _, o in failed):
            assert isinstance(result, Failure)
            raise result.failure()  # the same everywhere: the plan's own error
        error = _error(failed[0][1], [r for r, _ in failed])
        if isinstance(result, Failure):
            raise error from result.failure()
        raise error
    strategies = {r: o["strategy"] for r, o in zip(ranks, outcomes, strict=True)}
    if len(set(strategies.values())) > 1:
        shown = ", ".join(f"rank {r}: {s!r}" for r, s in strategies.items())
        raise PrepareError(
            f"the ranks planned different strategies ({shown}); every rank must prepare the "
            "same way.",
            subject="strategy",
            hint="Pass the same PrepConfig on every rank, and build the model the same way.",
        )
    return result.unwrap()
