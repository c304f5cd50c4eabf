"""Work across the data-parallel ranks: reduce, barrier, print once, seed, end.

The rest of a ported Accelerate script (``accelerator.reduce``, ``wait_for_everyone``,
``print``, ``set_seed``, ``end_training``) as plain functions over the ``state`` ``prepare``
returned: no global state, so two prepared models in one process never interfere.

The ranks are those the model was prepared over — the process group or DeviceMesh given to
``prepare`` (every dimension of an hsdp mesh), else the whole world — the ranks a prepared data
loader shards over and ``gather_for_metrics`` gathers from. In one process every function is
the single-process answer (a reduce returns the value itself, a barrier returns at once).

Every collective fprep's helpers issue goes through one small function per kind here
(``all_gather``, ``all_reduce``, ``barrier``), each told which public call it serves, so that a
guard (a timeout naming the call and the missing ranks, say) wraps one place per kind.
"""

from __future__ import annotations

import builtins
import contextlib
import math
import numbers
import random
import sys
import time
from typing import Any, Literal, get_args

import torch
import torch.distributed as dist

from fprep.apply.steps import handles_of
from fprep.collectives import collective
from fprep.errors import ConfigError, PrepareError
from fprep.peers import publish
from fprep.state import PrepState, need
from fprep.topology import Topology

ReduceOp = Literal["sum", "mean", "max", "min"]
REDUCE_OPS: tuple[str, ...] = get_args(ReduceOp)
_TORCH_OPS = {"sum": "SUM", "mean": "SUM", "max": "MAX", "min": "MIN"}
_SEED_LIMIT = 2**32  # numpy's seeds are 32-bit


# -- the data-parallel ranks ---------------------------------------------------------------------
def data_parallel_groups(state: PrepState, call: str) -> list[Any] | None:
    """The groups spanning the data-parallel ranks, outermost mesh dimension first; ``None``
    without data parallelism (``CoreState.is_distributed``; one process, or tensor or pipeline
    parallelism alone, whose ranks all read the same batch). A distributed state whose process
    group is gone is a PrepareError, not a silent single-process answer."""
    core = need(state.core, "init_core", call)
    if not core.is_distributed:
        return None
    handles = handles_of(state)
    if handles.mesh is not None:
        return mesh_groups(handles.mesh, call)
    return alive_groups([handles.process_group], call)


def mesh_groups(mesh: Any, call: str) -> list[Any]:
    """Each dimension's group of the DeviceMesh ``mesh``, outermost first, once checked to
    still exist (a mesh whose groups were destroyed cannot even name them)."""
    try:
        groups = [mesh.get_group(dim) for dim in range(mesh.ndim)]
    except (KeyError, RuntimeError, ValueError):
        raise _ended(call) from None
    return alive_groups(groups, call)


def alive_groups(groups: list[Any], call: str) -> list[Any]:
    """``groups``, once checked to still exist: a PrepareError naming ``call`` otherwise."""
    if not all(_alive(g) for g in groups):
        raise _ended(call)
    return groups


def _ended(call: str) -> PrepareError:
    return PrepareError(
        f"{call} needs the process group this model was prepared over, but it no longer "
        "exists (fprep.end_training or destroy_process_group ended it).",
        subject=call,
        hint="Call it before fprep.end_training, or prepare again in the new process group.",
    )


def _alive(group: Any) -> bool:
    if not dist.is_initialized():
        return False
    try:
        dist.get_process_group_ranks(group)  # KeyError once the group is destroyed
    except (KeyError, RuntimeError, ValueError):
        return False
    return True


def group_size(groups: list[Any]) -> int:
    return math.prod(dist.get_world_size(g) for g in groups)


# -- the collectives: one function per kind ------------------------------------------------------
def all_gather(tensor: torch.Tensor, groups: list[Any], *, call: str) -> list[torch.Tensor]:
    """Every rank's ``tensor`` (the same shape on each), in row-major order over ``groups``:
    gathered along the innermost group first, then each outer one. ``call``: the public
    function this serves (for errors)."""
    parts = [tensor]
    for group in reversed(groups):
        stacked = torch.stack(parts)
        out = [torch.empty_like(stacked) for _ in range(dist.get_world_size(group))]
        dist.all_gather(out, stacked, group=group)
        parts = [p for o in out for p in o.unbind(0)]
    return parts


def all_reduce(tensor: torch.Tensor, groups: list[Any], op: str, *, call: str) -> None:
    """Reduce ``tensor`` in place over every rank of ``groups`` (``op``: a ``ReduceOp`` name).

    The groups are orthogonal (a mesh's dimensions), so reducing along each in turn reduces over
    all of them."""
    reduce_op = getattr(dist.ReduceOp, op)
    for group in reversed(groups):
        dist.all_reduce(tensor, op=reduce_op, group=group)


def barrier(groups: list[Any], device: torch.device, *, call: str) -> None:
    """Return once every rank of ``groups`` has arrived.

    A one-element all-reduce on the compute device per group rather than ``dist.barrier``,
    which works on every backend (nccl's barrier has to guess the device). Arriving at the
    outer group's reduce means having passed the inner one, so all ranks have arrived."""
    token = torch.zeros(1, device=device)
    for group in reversed(groups):
        dist.all_reduce(token, group=group)
    released(token)


def released(tensor: torch.Tensor, limit_s: float = 2.0) -> None:
    """Return once no backend thread holds ``tensor`` any more (at most ``limit_s``).

    A collective returns when its result is ready; the backend's worker thread drops its own
    reference to the tensor a moment later. Had Python dropped its reference first, that
    thread would free the tensor's Python object, which needs the GIL; at interpreter shutdown
    (end_training, then the script ends) the thread is killed while holding a C++ destructor,
    and the process aborts with ``terminate called without an active exception``. Waiting here
    leaves the last reference to Python, released on the main thread."""
    deadline = time.monotonic() + limit_s
    pause = 0.0001
    while tensor._use_count() > 1 and time.monotonic() < deadline:  # type: ignore[attr-defined]
        time.sleep(pause)
        pause = min(2 * pause, 0.01)


def guarded(
    state: PrepState, groups: list[Any], call: str, *, arrive: bool
) -> contextlib.AbstractContextManager[None]:
    """``fprep.collectives.collective`` for ``call`` over ``groups``: a rank that never arrives
    (``arrive=True``) or is lost mid-call is a ``CollectiveError`` naming it, not a hang."""
    group = groups[0] if len(groups) == 1 else None  # a mesh: the whole job
    return collective(call, state.config.timeout_s, group, arrive=arrive)


# -- the public helpers --------------------------------------------------------------------------
def reduce(state: PrepState, value: torch.Tensor | float, op: ReduceOp = "sum") -> Any:
    """``value`` reduced over the data-parallel ranks: ``"sum"`` (the default, as in
    Accelerate), ``"mean"``, ``"max"`` or ``"min"``. Call it on every rank.

    A tensor (any shape, the same on every rank) gives a new, detached tensor on the input's
    device; the mean of an integer or bool tensor is floating point, bools sum and average
    as 0 / 1. A Python number gives a Python number (``.item()`` of the result). In one process
    the value comes back as it is (a tensor as a copy).
    """
    if op not in REDUCE_OPS:
        raise ConfigError(
            f"fprep.reduce got op={op!r}; the allowed ops are {', '.join(map(repr, REDUCE_OPS))}.",
            subject="op",
            hint='Pass one of them, e.g. fprep.reduce(state, loss, "mean").',
        )
    raw: object = value  # checked at run time: callers pass anything
    if isinstance(raw, torch.Tensor):
        tensor, number = raw.detach(), False
    elif isinstance(raw, numbers.Real):
        kind = torch.int64 if isinstance(raw, numbers.Integral) else torch.float64  # not float32
        tensor, number = torch.tensor(raw, dtype=kind), True
    else:
        raise ConfigError(
            f"fprep.reduce reduces a tensor or a real number; got a {type(raw).__qualname__}.",
            subject="value",
            hint="Reduce each tensor separately, or convert the value first (torch.tensor(...)).",
        )
    groups = data_parallel_groups(state, "fprep.reduce")
    flag = tensor.dtype == torch.bool
    result = tensor.to(torch.int64) if flag else tensor.clone()  # backends do not reduce bools
    if groups is not None:
        result = result.to(handles_of(state).device)
        with guarded(state, groups, "fprep.reduce", arrive=False):  # made every step
            all_reduce(result, groups, _TORCH_OPS[op], call="fprep.reduce")
        result = result.to(tensor.device)
    if op == "mean":
        if not result.is_floating_point():
            result = result.to(torch.float64 if number else torch.get_default_dtype())
        result = result / (1 if groups is None else group_size(groups))
    elif flag and op != "sum":
        result = result.bool()
    return result.item() if number else result


def wait_for_everyone(state: PrepState) -> None:
    """Return once every data-parallel rank has called it (a barrier); at once in one process."""
    groups = data_parallel_groups(state, "fprep.wait_for_everyone")
    if groups is not None:
        with guarded(state, groups, "fprep.wait_for_everyone", arrive=True):
            barrier(groups, handles_of(state).device, call="fprep.wait_for_everyone")


def is_main_process(state: PrepState) -> bool:
    """Whether this is the job's main process (global rank 0): the one that prints, logs to an
    experiment tracker and writes files that exist once."""
    return state.topology.rank == 0


def print_once(state: PrepState, *args: Any, **kwargs: Any) -> None:
    """``print(*args, **kwargs)`` on the main process only (Accelerate's ``accelerator.print``)."""
    if state.topology.rank == 0:
        builtins.print(*args, **kwargs)


def set_seed(seed: int, state: PrepState | None = None, *, per_rank: bool = False) -> int:
    """Seed Python's ``random``, numpy (when installed), torch on the CPU and every device torch
    seeds with it (CUDA, XPU, MPS), and the prepared device's own generator. Returns the seed used.

    ``per_rank=True`` adds this process's global rank (from ``state``, else from the launcher's
    variables), so that ranks draw different random numbers (dropout, augmentation) — Accelerate's
    ``set_seed(seed, device_specific=True)``. Works before ``prepare`` (no ``state``) too, to
    seed model initialization.
    """
    if isinstance(seed, bool) or not isinstance(seed, int) or seed < 0:
        raise ConfigError(
            f"set_seed needs an int >= 0; got {seed!r}.",
            subject="seed",
            hint="Pass a non-negative int, e.g. fprep.set_seed(0).",
        )
    rank = 0
    if per_rank:
        rank = state.topology.rank if state is not None else Topology.from_env().rank
    used = seed + rank
    if used >= _SEED_LIMIT:
        raise ConfigError(
            f"set_seed got {seed}{f' + rank {rank}' if rank else ''} = {used}; seeds must be "
            f"below 2**32 (numpy's limit).",
            subject="seed",
            hint="Use a smaller seed.",
        )
    random.seed(used)
    try:
        import numpy as np
    except ImportError:  # pragma: no cover - numpy is optional
        pass
    else:
        np.random.seed(used)
    torch.manual_seed(used)  # the CPU and every built-in accelerator's generators
    handles = state.handles if state is not None else None
    module = getattr(getattr(handles, "device_handle", None), "module", None)
    if module is not None and hasattr(module, "manual_seed_all"):
        module.manual_seed_all(used)  # e.g. Gaudi's, which torch.manual_seed does not reach
    return used


def end_training(state: PrepState) -> bool:
    """Destroy the default process group if this state's ``prepare`` created it (under torchrun
    with no group yet); a no-op otherwise. Returns whether it destroyed it.

    A group you created yourself stays yours to destroy; so does one a later ``prepare`` created
    after this one was ended (calling it twice is harmless). Afterwards the state's collectives
    (``reduce``, ``gather_for_metrics``, ...) raise a PrepareError; a new ``prepare`` in the same
    process creates a new group.

    An asynchronous checkpoint save in flight is waited for first (its thread needs the process
    groups); its failure, if nobody collected it, is raised here and nothing is destroyed (call
    ``end_training`` again).
    """
    background = sys.modules.get(
        "fprep.checkpoint.asynchronous.background"
    )  # only if a save ever ran
    if background is not None:
        background.settle()
    handles = handles_of(state)
    if not handles.owns_process_group or not _alive(handles.process_group):
        if _alive(handles.process_group):
            publish("ended")  # a rank still waiting for this one in a collective says so now
        return False
    world = dist.group.WORLD
    with guarded(state, [world], "fprep.end_training", arrive=True):
        barrier([world], handles.device, call="fprep.end_training")  # every rank is done
        if dist.get_rank() == 0:
            _forget_rendezvous()
        barrier([world], handles.device, call="fprep.end_training")  # ... before re-joining
    publish("ended")
    dist.destroy_process_group()
    return True


def _forget_rendezvous() -> None:
    """Delete the default group's keys from the rendezvous store.

    The store outlives the group: torchrun's agent hosts it, and rank 0's server lives on while
    anything (the old state, the old model) holds the old group. A new group after this one
    reuses the same key names, so a rank joining it could read the old group's addresses before
    rank 0 rewrote them and connect to sockets that are gone. Best effort: a store that cannot
    list its keys is left as it is.
    """
    try:
        store: Any = dist.distributed_c10d._get_default_store()  # PrefixStore("<n>/", ...)
        outer = getattr(store, "underlying_store", store)  # PrefixStore("default_pg", ...)
        for key in outer.list_keys():
            outer.delete_key(key)
    except (AttributeError, RuntimeError, NotImplementedError):  # pragma: no cover
        pass


__all__ = [
    "REDUCE_OPS",
    "ReduceOp",
    "end_training",
    "is_main_process",
    "print_once",
    "reduce",
    "set_seed",
    "wait_for_everyone",
]
