"""The readers of the mesh record: "does this run have several processes" and "who are my
data-parallel peers" are answered from ``ProcessGroupState.mesh`` alone, also for meshes whose
strategy resolves to "none" with several processes (pipeline or tensor parallelism alone)."""

from __future__ import annotations

import dataclasses
import math

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import fprep
from fprep.checkpoint.collective import Group
from fprep.data import data_parallel_position
from fprep.layout.mesh import DIM_ORDER, MeshPlan
from fprep.state import PrepState, ProcessGroupState
from fprep.testing.distributed import fake_world
from fprep.transitions import init_state_dict


def planned(strategy: str, mesh: MeshPlan) -> PrepState:
    """A one-process plan whose process-group state is ``mesh`` and whose strategy is
    ``strategy`` (what init_core resolves for such a mesh)."""
    model = torch.nn.Sequential(torch.nn.Linear(4, 4))
    state = fprep.plan(model, fprep.PrepConfig(state_dict_type="full")).unwrap()
    assert state.core is not None
    return state.replace(
        process_group=ProcessGroupState(
            mesh=mesh, gradient_predivide_factor=1.0, gradient_postdivide_factor=1.0
        ),
        core=dataclasses.replace(state.core, strategy=strategy),
    )


@st.composite
def meshes(draw: st.DrawFn, max_world: int = 24) -> MeshPlan:
    sizes: dict[str, int] = {}
    for name in DIM_ORDER:
        room = max_world // math.prod(sizes.values() or [1])
        sizes[name] = draw(st.integers(1, max(1, min(3, room))))
    world = math.prod(sizes.values())
    return MeshPlan(world_size=world, rank=draw(st.integers(0, world - 1)), **sizes)


def test_pipeline_parallelism_alone_saves_collectively() -> None:
    """pp=2 without data parallelism resolves the strategy to "none", yet both ranks hold part
    of the model: a checkpoint is one collective call, not each rank writing alone."""
    state = planned("none", MeshPlan(world_size=2, rank=1, pp=2))
    with fake_world(2, 1):
        group = Group.of(state)
    assert (group.distributed, group.rank, group.world_size) == (True, 1, 2)


def test_one_process_saves_alone_even_with_a_process_group() -> None:
    state = planned("none", MeshPlan(world_size=1, rank=0))
    with fake_world(1, 0):
        group = Group.of(state)
    assert (group.distributed, group.rank, group.world_size) == (False, 0, 1)


def test_pipeline_parallelism_alone_gathers_full_state_dicts_on_rank_0() -> None:
    state = planned("none", MeshPlan(world_size=2, rank=0, pp=2))
    sd = init_state_dict(state).unwrap().state_dict
    assert sd is not None and sd.full_on_rank0_only and sd.broadcast_from_rank0


@settings(max_examples=40, deadline=None)
@given(meshes(), st.sampled_from(("fsdp", "ddp")))
def test_ranks_differing_only_beside_data_parallelism_read_the_same_batch(
    mesh: MeshPlan, strategy: str
) -> None:
    """process_index / num_processes are the record's dp views: every rank of this rank's
    pp x cp x tp group gets its index, and the data-parallel peers get 0 .. dp_size - 1."""
    index, count = data_parallel_position(planned(strategy, mesh))
    assert (index, count) == (mesh.dp_rank, mesh.dp_size)
    for other in mesh.group("pp", "cp", "tp"):
        beside = planned(strategy, dataclasses.replace(mesh, rank=other))
        assert data_parallel_position(beside) == (index, count)
    peers = [
        data_parallel_position(planned(strategy, dataclasses.replace(mesh, rank=peer)))[0]
        for peer in mesh.dp_group
    ]
    assert peers == list(range(count))


def test_without_data_parallelism_every_rank_reads_the_whole_data() -> None:
    state = planned("none", MeshPlan(world_size=4, rank=3, pp=2, tp=2))
    assert data_parallel_position(state) == (0, 1)
