"""The composed plan: the transitions in order, and properties no single transition has."""

from __future__ import annotations

import copy
import dataclasses

import torch
from _checks import FIELD, PREREQUISITES, TRANSITIONS, success, with_rank
from hypothesis import given, settings
from hypothesis import strategies as st
from returns.result import Failure, Success
from torch import nn

import fprep
from fprep import ModuleTree, PrepState
from fprep.snapshot import join_fqn, parent_fqn
from fprep.state import SUBSTATES
from fprep.testing import strategies as fst

SMALL = fst.module_trees(max_depth=2)
SMALL_WORLDS = fst.topologies(nodes=st.integers(1, 2), local_world_size=st.integers(1, 4))


@given(fst.plan_inputs())
def test_readme_example(inputs: fst.PlanCase) -> None:
    # The README's property test, with valid inputs: fprep accepts every one of them.
    tree, cfg, topo = inputs
    result = fprep.plan(tree, cfg, topo)
    assert isinstance(result, Success), result
    state = result.unwrap()
    assert state.is_complete and state.applied == ()
    assert (state.tree, state.config, state.topology) == (tree, cfg, topo)
    assert inputs.tree is tree and inputs.cfg is cfg and inputs.topology is topo


@given(fst.plan_inputs())
def test_plan_is_pure_and_is_the_chain_of_transitions(inputs: fst.PlanCase) -> None:
    tree, cfg, topo = inputs
    copies = copy.deepcopy((tree, cfg, topo))
    first = fprep.plan(tree, cfg, topo)
    second = fprep.plan(*copies)
    assert (tree, cfg, topo) == copies  # inputs unchanged
    assert first == second and hash(first) == hash(second)  # equal inputs, equal plans
    initial = PrepState.initial(tree, cfg, topo)
    assert fprep.chain(*fprep.DEFAULT_TRANSITIONS)(initial) == first


@given(fst.prep_states())
def test_transitions_are_idempotent_on_a_complete_plan(state: PrepState) -> None:
    # Each transition recomputes its sub-state from what it reads: running it again is a no-op.
    assert state.is_complete
    assert state.extension is not None and state.tensor_parallel is state.extension.tensor_parallel
    for name, transition in TRANSITIONS.items():
        assert transition(state) == Success(state), name
    # init_pipeline and init_expert_parallel write their sub-states only under pp > 1 / ep > 1
    # (tests/test_pipeline_plan.py, tests/test_expert_parallel_plan.py)
    optional = ("init_pipeline", "init_expert_parallel")
    assert [FIELD[name] for name in TRANSITIONS if name not in optional] == list(SUBSTATES)


def _simulate(order: list[str]) -> str | None:
    """The first transition in ``order`` that runs before one of its prerequisites."""
    done: set[str] = set()
    for name in order:
        if not PREREQUISITES[name] <= done:
            return name
        done.add(name)
    return None


@given(fst.plan_inputs(trees=SMALL), st.permutations(list(TRANSITIONS)))
def test_any_order_of_prerequisites_gives_the_same_plan(
    inputs: fst.PlanCase, order: list[str]
) -> None:
    reference = success(fprep.plan(*inputs))
    result = fprep.plan(*inputs, transitions=tuple(TRANSITIONS[n] for n in order))
    early = _simulate(order)
    if early is None:
        assert result == Success(reference)
    else:
        assert isinstance(result, Failure)
        error = result.failure()
        assert isinstance(error, fprep.PlanOrderError)
        done = set(order[: order.index(early)])
        assert error.subject in PREREQUISITES[early] - done
        assert early in error.message


def _subjects(tree: ModuleTree) -> set[str]:
    """What an error may name: a config field, a part of the model, or one of the handles."""
    fields = {f.name for f in dataclasses.fields(fprep.PrepConfig)}
    topology = {"world_size", "rank", "local_rank", "local_world_size", "device_type"}
    handles = {"model", "mesh", "process_group", "hf_device_map", "ddp.comm_hook"}
    model = {m.fqn for m in tree.modules} | {n for p in tree.params for n in p.names}
    return fields | topology | handles | model | {b.fqn for b in tree.buffers}


@given(fst.plan_inputs(valid=False))
def test_plan_never_raises_and_failures_name_their_subject(inputs: fst.PlanCase) -> None:
    result = fprep.plan(*inputs)
    assert isinstance(result, Success | Failure)
    if isinstance(result, Failure):
        error = result.failure()
        assert isinstance(error, fprep.PrepError) and not isinstance(error, fprep.PlanOrderError)
        assert error.message and error.subject in _subjects(inputs.tree)
        assert fprep.plan(*copy.deepcopy(tuple(inputs))) == result  # failures are values too
    else:
        assert result.unwrap().is_complete


@given(fst.plan_inputs(trees=SMALL, topos=SMALL_WORLDS))
def test_every_rank_plans_the_same_job(inputs: fst.PlanCase) -> None:
    tree, cfg, topology = inputs
    plans = [
        success(fprep.plan(tree, cfg, with_rank(topology, r))) for r in range(topology.world_size)
    ]
    first = plans[0]
    assert first.core is not None and first.param_handles is not None
    managed = sum(s.numel for s in first.param_handles.specs)
    for plan in plans:
        # Decisions about the job are the same everywhere ...
        assert plan.ignored == first.ignored and plan.buffers == first.buffers
        assert plan.core == first.core and plan.runtime == first.runtime
        assert plan.state_dict == first.state_dict and plan.prefetching == first.prefetching
        assert plan.param_handles is not None
        units = [(u.fqn, [(s.fqn, s.shape) for s in u.params]) for u in plan.param_handles.units]
        assert units == [
            (u.fqn, [(s.fqn, s.shape) for s in u.params]) for u in first.param_handles.units
        ]
    # ... and each shard group holds every managed element exactly once.
    pgs = {r: p.process_group for r, p in enumerate(plans)}
    for group in {pg.shard_group for pg in pgs.values() if pg is not None}:
        held = sum(
            s.local_numel
            for r in group
            for s in plans[r].param_handles.specs  # type: ignore[union-attr]
        )
        assert held == (managed if first.core.is_sharded else managed * len(group))


@given(fst.prep_states())
def test_summary_and_memory_of_a_complete_plan(state: PrepState) -> None:
    text = state.summary()
    topo = state.topology
    assert f"rank {topo.rank} of {topo.world_size}" in text
    assert state.core is not None and state.core.strategy in text
    memory = fprep.estimate_memory(state)
    handles = state.param_handles
    assert handles is not None
    # Parameters cost at least what this rank really holds, at most what it allocates.
    held = sum(s.local_numel for s in handles.specs) + sum(s.numel for s in handles.ignored)
    allocated = sum(s.padded_numel for s in handles.specs) + sum(s.numel for s in handles.ignored)
    assert memory.params >= 0
    if held:
        assert memory.params >= held  # every dtype has at least one byte
    assert memory.params <= 8 * allocated


# -- the generator itself ----------------------------------------------------------------------
def _materialize(tree: ModuleTree) -> nn.Module:
    """A real module with the tree's structure (parameters and buffers on the meta device)."""
    modules = {m.fqn: nn.Module() for m in tree.modules}
    for m in tree.modules[1:]:
        modules[parent_fqn(m.fqn)].add_module(m.fqn.rpartition(".")[2], modules[m.fqn])
    tensors = {
        p.fqn: nn.Parameter(
            torch.empty(p.shape, dtype=getattr(torch, p.dtype), device="meta"),
            requires_grad=p.requires_grad,
        )
        for p in tree.params
    }
    for m in tree.modules:  # in each module's registration order; tied: the same object
        for local in m.param_names:
            p = tree.param(join_fqn(m.fqn, local))
            assert p is not None
            modules[m.fqn].register_parameter(local, tensors[p.fqn])
    for b in tree.buffers:
        modules[parent_fqn(b.fqn)].register_buffer(
            b.fqn.rpartition(".")[2],
            torch.empty(b.shape, dtype=getattr(torch, b.dtype), device="meta"),
            persistent=b.persistent,
        )
    return modules[""]


@settings(max_examples=15)
@given(
    fst.module_trees(
        allow_scalar=True, allow_meta=True, allow_missing_reset=True, max_depth=st.integers(0, 3)
    )
)
def test_generated_trees_are_what_a_snapshot_would_record(tree: ModuleTree) -> None:
    # Internally consistent: root first, pre-order, every name's module exists and lists it.
    assert tree.modules[0].fqn == ""
    fqns = [m.fqn for m in tree.modules]
    assert len(set(fqns)) == len(fqns)
    for m in tree.modules:
        assert all(parent_fqn(c) == m.fqn and tree.has_module(c) for c in m.children)
        assert m.mro[0] == m.cls and "torch.nn.modules.module.Module" in m.mro
    for p in tree.params:
        for name in p.names:
            owner = tree.module(parent_fqn(name))
            assert owner is not None and name.rpartition(".")[2] in owner.param_names
    # And exactly what ModuleTree.of records for a real module of that structure.
    real = ModuleTree.of(_materialize(tree))

    def structure(t: ModuleTree) -> object:
        return (
            [(m.fqn, m.children, m.param_names, m.buffer_names) for m in t.modules],
            [(p.names, p.shape, p.dtype, p.requires_grad) for p in t.params],
            [(b.fqn, b.shape, b.dtype, b.persistent) for b in t.buffers],
        )

    assert structure(real) == structure(tree)
