"""The few collectives a checkpoint needs, and agreement on failures.

A rank that fails while others go on would leave them waiting in the next collective, so every
phase that can fail on one rank ends in ``agree``: all ranks learn whether any failed and raise
the same error. Objects exchanged here come from live processes of the job (never from files).
A rank that is lost, or never calls, is ``fprep.collectives.collective``'s to report: the public
functions in ``fprep.checkpoint`` run inside it.
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch.distributed as dist

from fprep.collectives import is_collective_failure
from fprep.errors import CheckpointError, PrepError
from fprep.state import PrepState


@dataclass(frozen=True)
class Group:
    """Who takes part: the default process group when the plan spans several processes (data
    parallel, tensor parallel, pipeline parallel, or several), else nobody."""

    distributed: bool
    rank: int
    world_size: int

    @classmethod
    def of(cls, state: PrepState) -> Group:
        core = state.core
        # tp without data parallelism plans the strategy "none", yet every rank holds a shard
        tps = state.tensor_parallel
        if (
            core is not None
            and (core.is_distributed or tps is not None or state.pipeline is not None)
            and dist.is_available()
            and dist.is_initialized()
        ):
            return cls(True, dist.get_rank(), dist.get_world_size())
        return cls(False, 0, 1)

    def all_gather(self, obj: Any) -> list[Any]:
        if not self.distributed:
            return [obj]
        out: list[Any] = [None] * self.world_size
        dist.all_gather_object(out, obj)
        return out

    def broadcast(self, obj: Any) -> Any:
        if not self.distributed:
            return obj
        box = [obj if self.rank == 0 else None]
        dist.broadcast_object_list(box, src=0)
        return box[0]

    @contextlib.contextmanager
    def dcp_call(self) -> Iterator[None]:
        """Silence DCP's warning that a single process saves or loads alone (it is intended)."""
        with warnings.catch_warnings():
            if not self.distributed:
                warnings.filterwarnings("ignore", message="torch.distributed is disabled")
            yield

    def barrier(self) -> None:
        if self.distributed:
            dist.barrier()

    def agree(self, error: BaseException | None, payload: Any = None) -> list[Any]:
        """Exchange (error, payload); when any rank failed, raise the first failing rank's
        error on every rank.

        Ranks can fail differently over the same file (one sees it damaged, the next sees it
        replaced or gone a moment later), so each raising its own error would tell one story
        per rank. A rank whose own error differs chains it as the cause. The first failing
        rank raises its own exception object (its traceback); a failure that is not a
        ``PrepError`` reaches the other ranks as a ``CheckpointError`` quoting it.
        """
        portable = None if error is None else _portable(error)
        results = self.all_gather((portable, payload))
        failed = [(r, e) for r, (e, _) in enumerate(results) if e is not None]
        if not failed:
            return [p for _, p in results]
        rank, first = failed[0]
        if rank == self.rank and error is not None:
            raise error
        agreed = (
            first
            if isinstance(first, PrepError)
            else CheckpointError(f"rank {rank} failed: {first}", subject=f"rank {rank}")
        )
        raise agreed from error


def _portable(error: BaseException) -> Any:
    """The error itself when it pickles (PrepErrors do), else its text."""
    if isinstance(error, PrepError):
        return error
    return f"{type(error).__name__}: {error}"


def unwrap_dcp_error(error: BaseException) -> BaseException:
    """The first ``PrepError`` a DCP ``CheckpointException`` carries, else the first failed
    collective (a lost rank: ``fprep.collectives.collective`` names it), else a
    CheckpointError."""
    failures = getattr(error, "failures", None)
    if isinstance(failures, dict):
        excs = [v[0] if isinstance(v, tuple) else v for _, v in sorted(failures.items())]
        for exc in excs:
            if isinstance(exc, PrepError):
                return exc
        for exc in excs:
            if isinstance(exc, BaseException) and is_collective_failure(exc):
                return exc
        details = "; ".join(
            f"rank {r}: {v[0] if isinstance(v, tuple) else v}" for r, v in sorted(failures.items())
        )
        return CheckpointError(f"torch.distributed.checkpoint failed: {details}", subject="dcp")
    return error
