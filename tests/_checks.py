"""Shared checks for the transition property tests (purity, failures as values, plan order)."""

from __future__ import annotations

import copy
import dataclasses
import importlib
from collections.abc import Callable, Iterable, Mapping
from typing import Any

from hypothesis import assume
from returns.result import Failure, Result, Success

import fprep
from fprep import PrepError, PrepState
from fprep.sharding import shard_shape
from fprep.snapshot import ModuleInfo, ModuleTree, ParamInfo
from fprep.state import ShardSpec
from fprep.topology import Topology
from fprep.transitions import Transition

TRANSITIONS: dict[str, Transition] = {t.__name__: t for t in fprep.DEFAULT_TRANSITIONS}
#: Each transition writes exactly one sub-state, named after it.
FIELD: dict[str, str] = {name: name.removeprefix("init_") for name in TRANSITIONS}

#: What each transition reads (the sub-states it must refuse to run without).
PREREQUISITES: dict[str, frozenset[str]] = {
    "init_process_group": frozenset(),
    # with pp=1 (what the generated configs ask) it plans nothing and reads nothing; with
    # pp > 1 it reads init_process_group and must run before the rest (tests/test_pipeline_plan.py)
    "init_pipeline": frozenset(),
    "init_ignored": frozenset(),
    "init_device": frozenset({"init_ignored"}),
    "init_buffers": frozenset(),
    "init_core": frozenset({"init_process_group", "init_device", "init_ignored"}),
    "init_runtime": frozenset({"init_core", "init_device", "init_process_group"}),
    "init_extension": frozenset({"init_process_group", "init_ignored"}),
    # with ep=1 (what the generated configs ask) it plans nothing and reads nothing; with ep > 1
    # it reads the mesh record, the core and the ignored set (tests/test_expert_parallel_plan.py)
    "init_expert_parallel": frozenset(),
    "init_state_dict": frozenset({"init_core", "init_process_group"}),
    "init_param_handles": frozenset(
        {"init_core", "init_process_group", "init_ignored", "init_extension"}
    ),
    "init_prefetching": frozenset({"init_param_handles", "init_core"}),
}


def run_pure(transition: Transition, state: PrepState) -> Result[PrepState, PrepError]:
    """Run ``transition`` and check it is pure and total on ``state``.

    Equal inputs give equal outputs (an equal deep copy, and a second run on the same object);
    the input is unchanged (equality, hash and the tree's lookup indexes); the result is a value
    (``Success`` or ``Failure(PrepError)``, never a raise), and a success changes exactly the
    transition's own sub-state.
    """
    twin = copy.deepcopy(state)
    assert twin == state and twin is not state
    before_hash = hash(state)
    module_index = dict(state.tree._module_index)
    param_index = dict(state.tree._param_index)

    first = transition(state)
    second = transition(twin)
    third = transition(state)

    assert state == twin
    assert hash(state) == before_hash
    assert state.tree._module_index == module_index
    assert state.tree._param_index == param_index
    assert isinstance(first, Success | Failure)
    assert first == second == third
    assert hash(first) == hash(second)
    if isinstance(first, Success):
        out = first.unwrap()
        assert isinstance(out, PrepState)
        field = FIELD[transition.__name__]
        assert getattr(out, field) is not None
        assert out.replace(**{field: getattr(state, field)}) == state, "changed another field"
    else:
        error = first.failure()
        assert isinstance(error, PrepError)
        assert error.message
    return first


def success(result: Result[PrepState, PrepError]) -> PrepState:
    """The planned state. Generated wrap policies (classes, predicates) can put a tied
    parameter's modules in separate sibling units; fprep refuses that plan (FSDP2 would break
    the tie; see test_tied_across_sibling_units_is_refused), and generated dtypes can put
    trainable parameters of two dtypes in one fsdp unit (refused too: tests/test_misuse_plan.py),
    so such inputs are discarded."""
    refused = ("is tied across units", "trainable parameters of two dtypes")
    if isinstance(result, Failure) and any(why in str(result.failure()) for why in refused):
        assume(False)
    assert isinstance(result, Success), f"expected success, got {result!r}"
    state = result.unwrap()
    assert isinstance(state, PrepState)
    return state


def failure(
    result: Result[PrepState, PrepError], kind: type[PrepError], subject: str | Iterable[str]
) -> PrepError:
    """The error of a ``Failure`` of type ``kind`` whose subject is ``subject`` (or one of them)."""
    assert isinstance(result, Failure), f"expected a {kind.__name__}, got {result!r}"
    error = result.failure()
    assert isinstance(error, kind), f"expected a {kind.__name__}, got {error!r}"
    allowed = {subject} if isinstance(subject, str) else set(subject)
    assert error.subject in allowed, f"subject {error.subject!r} not in {sorted(allowed)}"
    assert error.message
    return error


def check_plan_order(name: str, complete: PrepState) -> None:
    """Each missing prerequisite of ``name`` is a ``PlanOrderError`` naming it; none other is."""
    transition = TRANSITIONS[name]
    for prerequisite in PREREQUISITES[name]:
        state = complete.replace(**{FIELD[prerequisite]: None})
        failure(run_pure(transition, state), fprep.PlanOrderError, prerequisite)
    # What the transition does not read cannot change what it computes.
    others = set(TRANSITIONS) - PREREQUISITES[name] - {name}
    state = complete.replace(**{FIELD[other]: None for other in others})
    field = FIELD[name]
    assert getattr(success(transition(state)), field) == getattr(complete, field)


def with_rank(topology: Topology, rank: int) -> Topology:
    """The same job seen from another rank."""
    return Topology(
        world_size=topology.world_size,
        rank=rank,
        local_world_size=topology.local_world_size,
        device_type=topology.device_type,
        backend=topology.backend,
    )


def run_until(name: str, state: PrepState) -> Result[PrepState, PrepError]:
    """The default transitions before ``name``, applied to ``state``."""
    names = list(TRANSITIONS)
    return fprep.chain(*fprep.DEFAULT_TRANSITIONS[: names.index(name)])(state)


def replace_modules(tree: ModuleTree, changes: Mapping[str, dict[str, object]]) -> ModuleTree:
    """``tree`` with some modules' fields replaced (by FQN)."""
    modules = tuple(
        dataclasses.replace(m, **changes[m.fqn]) if m.fqn in changes else m for m in tree.modules
    )
    return dataclasses.replace(tree, modules=modules)


def replace_params(tree: ModuleTree, changes: Mapping[str, dict[str, object]]) -> ModuleTree:
    """``tree`` with some parameters' fields replaced (by canonical FQN)."""
    params = tuple(
        dataclasses.replace(p, **changes[p.fqn]) if p.fqn in changes else p for p in tree.params
    )
    return dataclasses.replace(tree, params=params)


FSDP2_MARKER = "torch.distributed.fsdp._fully_shard._fully_shard.FSDPModule"
DDP_MARKER = "torch.nn.parallel.distributed.DistributedDataParallel"


def sharded(module: ModuleInfo) -> dict[str, object]:
    """Changes that make ``module`` look already sharded by FSDP2 (class ``FSDP<Cls>``)."""
    cls = f"torch.distributed.fsdp._fully_shard._fully_shard.FSDP{module.class_name}"
    return {"cls": cls, "mro": (cls, FSDP2_MARKER, *module.mro)}


def replicated(module: ModuleInfo) -> dict[str, object]:
    """Changes that make ``module`` look wrapped by DDP."""
    return {"cls": DDP_MARKER, "mro": (DDP_MARKER, *module.mro)}


def managed(tree: ModuleTree, ignored: frozenset[str]) -> list[ParamInfo]:
    return [p for p in tree.params if p.fqn not in ignored]


def timed(sections: dict[str, Callable[[], Any]]) -> dict[str, Any]:
    """Run a rank function's sections in order: their results, and each one's seconds."""
    import time

    out: dict[str, Any] = {"seconds": {}}
    for name, fn in sections.items():
        start = time.perf_counter()
        out[name] = fn()
        out["seconds"][name] = round(time.perf_counter() - start, 2)
    return out


# -- materialize's row-local init ---------------------------------------------------------------
#: materialize's pure planning and its per-module jobs
_schedule: Any = importlib.import_module("fprep.apply.init_schedule")
_jobs: Any = importlib.import_module("fprep.apply.init_jobs")


def shard_spec(fqn: str, shape: tuple[int, ...], world: int, rank: int) -> ShardSpec:
    """The spec of FSDP2's dim-0 shard of a float32 parameter of ``shape`` on ``rank``."""
    local, padded = shard_shape(shape, world, rank)
    return ShardSpec(
        fqn=fqn,
        names=(fqn,),
        shape=shape,
        dtype="float32",
        local_shape=local,
        padded_shape=padded,
        requires_grad=True,
    )


def rows_of(shape: tuple[int, ...], world: int, rank: int) -> tuple[int, int]:
    """The rows ``[start, stop)`` of a parameter of ``shape`` that FSDP2 gives ``rank``."""
    start, stop = _schedule.row_span(shard_spec("p", shape, world, rank), world, rank)
    return int(start), int(stop)


def bare_job(module: Any) -> Any:
    """A materialize job for ``module`` alone: no stand-ins (nothing sharded or tied), seed 5."""
    return _jobs.Job(
        fqn="m",
        module=module,
        stand_ins=(),
        seed=5,
        skip=False,
        shareable=False,
        broadcast_buffers=False,
    )
