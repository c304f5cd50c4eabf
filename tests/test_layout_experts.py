"""fprep.layout.experts and the mesh record's ep view: which rank holds which experts, the
groups that exchange tokens and shard experts, and the shapes each rank keeps, against what
torch's DeviceMesh, DTensor and FSDP2 build on fake groups."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import Shard
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

from fprep import ConfigError
from fprep.layout.experts import ExpertLayout, chunk_size
from fprep.layout.mesh import MeshPlan
from fprep.testing.distributed import fake_world


@st.composite
def ep_meshes(draw: st.DrawFn, max_world: int = 32) -> MeshPlan:
    """A record with random pp, dp_replicate, dp_shard, tp and an ep dividing dp_shard x tp."""
    pp, rep, shard, tp = (draw(st.integers(1, 4)) for _ in range(4))
    while pp * rep * shard * tp > max_world:
        pp, rep = max(1, pp // 2), max(1, rep // 2)
        shard = max(1, shard // 2) if pp * rep * shard * tp > max_world else shard
    borrowed = shard * tp
    ep = draw(st.sampled_from([d for d in range(1, borrowed + 1) if borrowed % d == 0]))
    world = pp * rep * shard * tp
    ranks = draw(st.none() | st.permutations(range(world)).map(tuple))
    return MeshPlan(
        world_size=world,
        rank=draw(st.integers(0, world - 1)),
        pp=pp,
        dp_replicate=rep,
        dp_shard=shard,
        tp=tp,
        ep=ep,
        ranks=ranks,
    )


def at(mesh: MeshPlan, rank: int) -> MeshPlan:
    return dataclasses.replace(mesh, rank=rank)


@settings(max_examples=40, deadline=None)
@given(ep_meshes(), st.integers(1, 6))
def test_every_expert_is_held_by_exactly_one_rank_of_each_ep_group(
    mesh: MeshPlan, per_rank: int
) -> None:
    layout = ExpertLayout(num_experts=per_rank * mesh.ep, ep=mesh.ep, efsdp=mesh.efsdp)
    group = mesh.ep_group
    assert len(group) == mesh.ep and mesh.rank in group
    held: list[int] = []
    for position, member in enumerate(group):
        other = at(mesh, member)
        assert other.ep_group == group  # one group, whoever reads it
        assert other.ep_rank == position
        held.extend(layout.experts_of(other.ep_rank))
    assert sorted(held) == list(range(layout.num_experts))
    assert all(
        layout.owner(e) == group.index(r) for r in group for e in layout.experts_of(group.index(r))
    )
    # the efsdp group holds copies of the same experts, one per ep group of the replica
    copies = mesh.efsdp_group
    assert len(copies) == mesh.efsdp and mesh.rank in copies
    assert {at(mesh, r).ep_rank for r in copies} == {mesh.ep_rank}
    assert sorted(at(mesh, r).efsdp_rank for r in copies) == list(range(mesh.efsdp))
    # ep x efsdp covers exactly the dp_shard x tp ranks beside this one
    block = {r for c in copies for r in at(mesh, c).ep_group}
    assert block == set(mesh.group("dp_shard", "tp"))


@settings(max_examples=20, deadline=None)
@given(ep_meshes(max_world=24))
def test_ep_and_efsdp_groups_equal_torch_device_mesh(mesh: MeshPlan) -> None:
    """The ep view is the (dp_shard, tp) ranks reshaped to (efsdp, ep): ep innermost."""
    order = torch.tensor(mesh.ranks if mesh.ranks is not None else range(mesh.size))
    shape = (mesh.pp, mesh.dp_replicate, mesh.efsdp, mesh.ep)
    with fake_world(mesh.world_size, mesh.rank):
        torch_mesh = DeviceMesh(
            "cpu", order.reshape(shape), mesh_dim_names=("pp", "dp_replicate", "efsdp", "ep")
        )
        assert tuple(torch_mesh["ep"].mesh.tolist()) == mesh.ep_group
        assert tuple(torch_mesh["efsdp"].mesh.tolist()) == mesh.efsdp_group
        coordinate = torch_mesh.get_coordinate()
        assert coordinate is not None and tuple(coordinate[2:]) == (mesh.efsdp_rank, mesh.ep_rank)


def test_ep_neighbours_are_consecutive_ranks() -> None:
    mesh = MeshPlan(world_size=8, rank=5, dp_shard=8, ep=4)
    assert mesh.ep_group == (4, 5, 6, 7) and mesh.efsdp_group == (1, 5)
    assert (mesh.ep_rank, mesh.efsdp_rank, mesh.efsdp) == (1, 1, 2)
    assert "ep=4 x efsdp=2" in mesh.describe()


@pytest.mark.parametrize(("shard", "tp", "ep"), [(4, 1, 3), (2, 2, 8), (3, 1, 2)])
def test_an_ep_not_dividing_dp_shard_x_tp_is_refused_by_the_record(
    shard: int, tp: int, ep: int
) -> None:
    with pytest.raises(ConfigError) as caught:
        MeshPlan(world_size=shard * tp, rank=0, dp_shard=shard, tp=tp, ep=ep)
    assert caught.value.subject == "ep" and "divide" in caught.value.message


@settings(max_examples=40, deadline=None)
@given(
    st.integers(1, 4),  # experts per ep rank
    st.integers(1, 4),  # ep
    st.integers(1, 4),  # efsdp
    st.lists(st.integers(1, 9), min_size=1, max_size=2),  # the other dims
    st.data(),
)
def test_local_shapes_equal_what_torch_builds(
    per_rank: int, ep: int, efsdp: int, rest: list[int], data: st.DataObject
) -> None:
    """An ep rank's experts are DTensor's Shard(0) over ep; FSDP2 then shards them over efsdp
    on the layout's dimension."""
    layout = ExpertLayout(num_experts=per_rank * ep, ep=ep, efsdp=efsdp)
    shape = (layout.num_experts, *rest)
    ep_rank = data.draw(st.integers(0, ep - 1))
    efsdp_rank = data.draw(st.integers(0, efsdp - 1))
    with fake_world(ep, ep_rank):
        ep_mesh = init_device_mesh("cpu", (ep,))
        ep_local, offset = compute_local_shape_and_global_offset(shape, ep_mesh, [Shard(0)])
    assert tuple(ep_local) == layout.ep_shape(shape)
    assert offset[0] == layout.experts_of(ep_rank).start
    with fake_world(efsdp, efsdp_rank):
        efsdp_mesh = init_device_mesh("cpu", (efsdp,))
        with torch.device("meta"):
            module = nn.Module()
            module.w = nn.Parameter(torch.empty(layout.ep_shape(shape)))
        dim = layout.fsdp_dim(shape)
        fully_shard(module, mesh=efsdp_mesh, shard_placement_fn=lambda _: Shard(dim))
        local = module.w.to_local()  # type: ignore[operator]
    assert tuple(local.shape) == layout.local_shape(shape, efsdp_rank)
    assert layout.local_bytes(shape, 4, efsdp_rank) == local.numel() * 4


def test_fsdp_shards_inside_experts_when_efsdp_x_ep_exceeds_them() -> None:
    few = ExpertLayout(num_experts=4, ep=2, efsdp=4)  # 8 ranks, 4 experts
    assert few.shards_inside_experts and few.fsdp_dim((4, 32, 16)) == 1
    assert few.local_shape((4, 32, 16), 3) == (2, 8, 16)
    assert few.fsdp_dim((4, 30, 16)) == 0  # FSDP2 shards dim 1 evenly only
    many = ExpertLayout(num_experts=8, ep=2, efsdp=2)
    assert not many.shards_inside_experts and many.local_shape((8, 32, 16), 1) == (2, 32, 16)


@given(st.integers(0, 40), st.integers(1, 8))
def test_chunk_sizes_are_torch_chunk(length: int, parts: int) -> None:
    sizes = [c.shape[0] for c in torch.empty(length).chunk(parts)]
    sizes += [0] * (parts - len(sizes))
    assert [chunk_size(length, parts, i) for i in range(parts)] == sizes
    assert sum(sizes) == length


def test_an_ep_not_dividing_the_experts_is_refused() -> None:
    with pytest.raises(ConfigError) as caught:
        ExpertLayout(num_experts=6, ep=4)
    assert caught.value.subject == "ep" and "1, 2, 3, 6" in (caught.value.hint or "")
