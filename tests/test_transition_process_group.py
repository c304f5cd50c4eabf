"""init_process_group: world, rank, mesh and the shard / replicate groups of every rank."""

from __future__ import annotations

import math

from _checks import failure, run_pure, success, with_rank
from hypothesis import assume, given
from hypothesis import strategies as st

import fprep
from fprep import GroupSpec, MeshSpec, PrepConfig, PrepState, Topology, TopologyError
from fprep.state import ProcessGroupState
from fprep.testing import strategies as fst
from fprep.transitions import init_process_group
from fprep.transitions.process_group import gradient_divide_factors, hybrid_groups

TREE = fprep.ModuleTree(modules=(fprep.ModuleInfo(fqn="", cls="m.Model"),))
STRATEGIES = ("auto", "none", "ddp", "fast_ddp", "fsdp")


def divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def groups_for_all_ranks(
    topology: Topology, cfg: PrepConfig, **handles: object
) -> dict[int, ProcessGroupState]:
    out = {}
    for rank in range(topology.world_size):
        extra = {k: v(rank) for k, v in handles.items()}  # type: ignore[operator]
        state = PrepState.initial(TREE, cfg, with_rank(topology, rank), **extra)
        pg = success(run_pure(init_process_group, state)).process_group
        assert pg is not None
        out[rank] = pg
    return out


def assert_partition(groups: dict[int, tuple[int, ...]], world: int) -> None:
    """Every rank is in its own group, and every member of a group sees the same group."""
    assert set(groups) == set(range(world))
    for rank, group in groups.items():
        assert rank in group
        assert len(set(group)) == len(group)
        for member in group:
            assert groups[member] == group
    distinct = set(groups.values())
    assert sum(len(g) for g in distinct) == world  # disjoint and covering


def assert_groups(pgs: dict[int, ProcessGroupState], world: int) -> None:
    assert_partition({r: pg.shard_group for r, pg in pgs.items()}, world)
    assert_partition({r: pg.replicate_group for r, pg in pgs.items()}, world)
    for rank, pg in pgs.items():
        assert pg.rank == rank and pg.world_size == world
        # The two groups meet exactly at this rank, and together span the (sub)world.
        assert set(pg.shard_group) & set(pg.replicate_group) == {rank}
        assert pg.shard_group[pg.shard_rank] == rank
        assert pg.shard_size == len(pg.shard_group)
        assert len(pg.mesh_shape) == len(pg.mesh_dim_names) == len(pg.coordinate)
        assert all(0 <= c < d for c, d in zip(pg.coordinate, pg.mesh_shape, strict=True))
        size = math.prod(pg.mesh_shape)
        assert pg.gradient_predivide_factor * pg.gradient_postdivide_factor == size
        assert pg.gradient_predivide_factor >= 1


# -- purity and the default (no handle) path ------------------------------------------------------
@given(fst.prep_states(before="init_process_group"))
def test_pure_on_any_input(state: PrepState) -> None:
    success(run_pure(init_process_group, state))


@given(
    fst.topologies(nodes=st.integers(1, 3), local_world_size=st.integers(1, 4)),
    st.sampled_from(STRATEGIES),
)
def test_one_dimensional_world(topology: Topology, strategy: str) -> None:
    pgs = groups_for_all_ranks(topology, PrepConfig(strategy=strategy))  # type: ignore[arg-type]
    assert_groups(pgs, topology.world_size)
    for rank, pg in pgs.items():
        assert pg.shard_group == tuple(range(topology.world_size))
        assert pg.replicate_group == (rank,)
        assert pg.mesh_shape == (topology.world_size,)
        assert pg.mesh_dim_names == ("dp",)
        assert pg.coordinate == (rank,)


@given(fst.topologies(nodes=st.integers(1, 3), local_world_size=st.integers(1, 4)), st.data())
def test_hsdp_groups_partition_the_world(topology: Topology, data: st.DataObject) -> None:
    world = topology.world_size
    shard = data.draw(st.none() | st.sampled_from(divisors(world)), label="hsdp_shard_size")
    pgs = groups_for_all_ranks(topology, PrepConfig(strategy="hsdp", hsdp_shard_size=shard))
    assert_groups(pgs, world)
    size = shard or topology.local_world_size  # one node by default
    shard_groups, replicate_groups = hybrid_groups(world, size)
    assert {pg.shard_group for pg in pgs.values()} == set(shard_groups)
    assert {pg.replicate_group for pg in pgs.values()} == set(replicate_groups)
    for rank, pg in pgs.items():
        assert pg.mesh_shape == (world // size, size)
        assert pg.mesh_dim_names == ("replicate", "shard")
        assert pg.coordinate == (rank // size, rank % size)
        assert pg.shard_rank == rank % size
        if shard is None:  # the default shard group is this rank's node
            node = rank // topology.local_world_size
            assert set(pg.shard_group) == {
                r for r in range(world) if r // topology.local_world_size == node
            }


@given(st.integers(1, 64).flatmap(lambda w: st.tuples(st.just(w), st.sampled_from(divisors(w)))))
def test_hybrid_groups_partition(world_and_shard: tuple[int, int]) -> None:
    world, shard = world_and_shard
    shard_groups, replicate_groups = hybrid_groups(world, shard)
    assert sorted(r for g in shard_groups for r in g) == list(range(world))
    assert sorted(r for g in replicate_groups for r in g) == list(range(world))
    for s in shard_groups:
        for r in replicate_groups:
            assert len(set(s) & set(r)) == 1  # rows and columns meet exactly once


@given(st.integers(1, 4096))
def test_gradient_divide_factors_split_the_world(world: int) -> None:
    pre, post = gradient_divide_factors(world)
    assert pre * post == world
    assert pre >= 1 and int(pre) == pre and (int(pre) & (int(pre) - 1)) == 0  # a power of two


# -- meshes and process groups passed in -------------------------------------------------------
@given(fst.topologies(nodes=st.integers(1, 3), local_world_size=st.integers(1, 4)), st.data())
def test_mesh_groups_partition_the_world(topology: Topology, data: st.DataObject) -> None:
    hybrid = data.draw(st.booleans(), label="hybrid")
    layout = data.draw(fst.mesh_layouts(topology.world_size, hybrid=hybrid), label="layout")
    cfg = PrepConfig(strategy="hsdp" if hybrid else "fsdp")
    pgs = groups_for_all_ranks(topology, cfg, mesh=layout.spec)
    assert_groups(pgs, topology.world_size)
    for rank, pg in pgs.items():
        mesh = layout.spec(rank)
        assert pg.mesh_shape == mesh.shape
        assert pg.coordinate == mesh.coordinate
        assert set(pg.shard_group) | set(pg.replicate_group) <= set(mesh.ranks or ())
        assert len(pg.shard_group) * len(pg.replicate_group) == mesh.size
        if hybrid:
            assert pg.shard_size == mesh.shape[1]
        else:
            assert pg.shard_group == mesh.ranks and pg.replicate_group == (rank,)


@given(fst.topologies(nodes=st.integers(1, 3), local_world_size=st.integers(1, 4)), st.data())
def test_process_group_is_the_shard_group(topology: Topology, data: st.DataObject) -> None:
    layout = data.draw(fst.group_layouts(topology.world_size), label="groups")
    pgs = groups_for_all_ranks(topology, PrepConfig(strategy="fsdp"), process_group=layout.spec)
    assert_groups(pgs, topology.world_size)
    for rank, pg in pgs.items():
        assert pg.shard_group == layout.spec(rank).ranks
        assert pg.coordinate == (layout.spec(rank).rank,)


# -- failures as values -------------------------------------------------------------------------
@given(fst.topologies(), st.sampled_from((*STRATEGIES, "hsdp")))
def test_group_and_mesh_both_given(topology: Topology, strategy: str) -> None:
    world = topology.world_size
    state = PrepState.initial(
        TREE,
        PrepConfig(strategy=strategy),  # type: ignore[arg-type]
        topology,
        process_group=GroupSpec(size=world, rank=topology.rank),
        mesh=MeshSpec(shape=(world,)),
    )
    failure(run_pure(init_process_group, state), TopologyError, "process_group")


@given(fst.topologies())
def test_hsdp_with_a_one_dimensional_group(topology: Topology) -> None:
    group = GroupSpec(size=topology.world_size, rank=topology.rank)
    state = PrepState.initial(TREE, PrepConfig(strategy="hsdp"), topology, process_group=group)
    failure(run_pure(init_process_group, state), TopologyError, "process_group")


@given(fst.topologies(), st.data())
def test_mesh_of_the_wrong_rank(topology: Topology, data: st.DataObject) -> None:
    world = topology.world_size
    hybrid = data.draw(st.booleans(), label="hybrid")
    if hybrid:  # hsdp needs 2-D: give 1-D or 3-D
        shape = data.draw(st.sampled_from([(world,), (world, 1, 1), (1, world, 1)]))
    else:  # 1-D wanted: give 2-D
        shard = data.draw(st.sampled_from(divisors(world)))
        shape = (world // shard, shard)
    cfg = PrepConfig(strategy="hsdp" if hybrid else "fsdp")
    state = PrepState.initial(TREE, cfg, topology, mesh=MeshSpec(shape=shape))
    failure(run_pure(init_process_group, state), TopologyError, "mesh")


@given(fst.topologies(), st.integers(1, 16))
def test_mesh_over_another_world(topology: Topology, size: int) -> None:
    assume(size != topology.world_size)
    state = PrepState.initial(
        TREE, PrepConfig(strategy="fsdp"), topology, mesh=MeshSpec(shape=(size,))
    )
    failure(run_pure(init_process_group, state), TopologyError, "mesh")


@given(fst.topologies(nodes=st.integers(1, 3), local_world_size=st.integers(2, 4)), st.data())
def test_mesh_without_this_rank(topology: Topology, data: st.DataObject) -> None:
    world = topology.world_size
    rank = topology.rank
    others = [r for r in range(world) if r != rank]
    bad = data.draw(
        st.sampled_from(
            [
                (*others, others[0]),  # this rank missing, another twice
                (*others, world),  # a rank outside the world
                (*others, -1),
                (rank, *others[1:], rank),  # this rank twice (another missing)
            ]
        )
    )
    mesh = MeshSpec(shape=(world,), ranks=bad)
    state = PrepState.initial(TREE, PrepConfig(strategy="fsdp"), topology, mesh=mesh)
    failure(run_pure(init_process_group, state), TopologyError, "mesh")


@given(fst.topologies(nodes=st.integers(1, 3), local_world_size=st.integers(2, 4)), st.data())
def test_process_group_without_this_rank(topology: Topology, data: st.DataObject) -> None:
    world, rank = topology.world_size, topology.rank
    other = (rank + 1) % world
    group = data.draw(
        st.sampled_from(
            [
                GroupSpec(size=world, rank=other),  # the snapshot's rank is another rank's
                GroupSpec(size=1, rank=0, ranks=(other,)),  # a group this rank is not in
                GroupSpec(size=2, rank=0, ranks=(rank,)),  # size and members disagree
                GroupSpec(size=2, rank=0, ranks=(rank, rank)),  # a member twice
                GroupSpec(size=2, rank=0, ranks=(rank, world)),  # outside the world
                GroupSpec(size=world, rank=world),  # rank out of range
            ]
        )
    )
    state = PrepState.initial(TREE, PrepConfig(strategy="fsdp"), topology, process_group=group)
    failure(run_pure(init_process_group, state), TopologyError, "process_group")


@given(st.integers(2, 12), st.integers(2, 12), st.data())
def test_world_not_divisible_into_nodes(world: int, local: int, data: st.DataObject) -> None:
    assume(local <= world and world % local != 0)
    rank = data.draw(st.integers(0, world - 1))
    topology = Topology(world_size=world, rank=rank, local_world_size=local)
    strategy = data.draw(st.sampled_from((*STRATEGIES, "hsdp")))
    state = PrepState.initial(TREE, PrepConfig(strategy=strategy), topology)
    failure(run_pure(init_process_group, state), TopologyError, "local_world_size")


@given(fst.topologies(), st.integers(1, 16))
def test_hsdp_shard_size_not_dividing_the_world(topology: Topology, shard: int) -> None:
    assume(topology.world_size % shard != 0)
    cfg = PrepConfig(strategy="hsdp", hsdp_shard_size=shard)
    state = PrepState.initial(TREE, cfg, topology)
    failure(run_pure(init_process_group, state), TopologyError, "hsdp_shard_size")


def test_no_prerequisites() -> None:
    # The first transition: it runs on the initial state.
    state = PrepState.initial(TREE, PrepConfig(), Topology(world_size=4, rank=1))
    pg = success(init_process_group(state)).process_group
    assert pg is not None and pg.shard_group == (0, 1, 2, 3)


def test_mesh_checks_name_the_real_problem() -> None:
    import torch

    import fprep
    from fprep import MeshSpec, PrepConfig

    tree = fprep.ModuleTree.of(torch.nn.Linear(4, 4))
    topo = Topology(world_size=4, rank=1)
    dup = MeshSpec(shape=(4,), ranks=(0, 0, 1, 2))
    error = fprep.plan(tree, PrepConfig(strategy="fsdp"), topo, mesh=dup).failure()
    assert error.subject == "mesh" and "distinct" in error.message
    two_d = MeshSpec(shape=(2, 2))
    error = fprep.plan(tree, PrepConfig(strategy="auto"), topo, mesh=two_d).failure()
    assert "strategy 'auto' needs a 1-D mesh" in error.message
    cfg = PrepConfig(strategy="hsdp", hsdp_shard_size=4)
    error = fprep.plan(tree, cfg, topo, mesh=two_d).failure()
    assert error.subject == "hsdp_shard_size"
