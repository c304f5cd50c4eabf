"""fprep.layout.mesh: the N-D mesh record against torch's DeviceMesh, and init_process_group's
fields read from it against the arithmetic they replaced."""

from __future__ import annotations

import dataclasses
import itertools
import math

import pytest
import torch
from _checks import run_pure, success, with_rank
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.distributed.device_mesh import DeviceMesh

import fprep
from fprep import ConfigError, MeshSpec, PrepConfig, PrepState, Topology, TopologyError
from fprep.layout.mesh import DIM_ORDER, MeshPlan
from fprep.state import ProcessGroupState
from fprep.testing import strategies as fst
from fprep.testing.distributed import fake_world
from fprep.transitions import init_process_group

TREE = fprep.ModuleTree(modules=(fprep.ModuleInfo(fqn="", cls="m.Model"),))
SUBSETS = tuple(
    names for n in range(len(DIM_ORDER) + 1) for names in itertools.combinations(DIM_ORDER, n)
)


@st.composite
def layouts(draw: st.DrawFn, max_world: int = 24) -> MeshPlan:
    """A record with random sizes (product at most ``max_world``), rank and rank order."""
    sizes: dict[str, int] = {}
    for name in DIM_ORDER:
        room = max_world // math.prod(sizes.values() or [1])
        sizes[name] = draw(st.integers(1, max(1, min(4, room))))
    world = math.prod(sizes.values())
    ranks = draw(st.none() | st.permutations(range(world)).map(tuple))
    return MeshPlan(world_size=world, rank=draw(st.integers(0, world - 1)), ranks=ranks, **sizes)


def torch_mesh(layout: MeshPlan) -> DeviceMesh:
    order = torch.tensor(layout.ranks if layout.ranks is not None else range(layout.size))
    return DeviceMesh("cpu", order.reshape(layout.shape), mesh_dim_names=DIM_ORDER)


def torch_all_groups(mesh: torch.Tensor, names: tuple[str, ...]) -> tuple[tuple[int, ...], ...]:
    """Every group along ``names`` of the mesh tensor: the other dims first, row-major."""
    inner = [DIM_ORDER.index(n) for n in names]
    outer = [i for i in range(len(DIM_ORDER)) if i not in inner]
    size = math.prod(mesh.shape[i] for i in inner)
    rows = mesh.permute(*outer, *inner).reshape(-1, size).tolist()
    return tuple(tuple(row) for row in rows)


@settings(max_examples=25, deadline=None)
@given(layouts())
def test_every_group_equals_torch_device_mesh(layout: MeshPlan) -> None:
    with fake_world(layout.world_size, layout.rank):
        mesh = torch_mesh(layout)
        assert tuple(mesh.get_coordinate() or ()) == tuple(layout.coordinate(n) for n in DIM_ORDER)
        for names in SUBSETS[1:]:
            expected = tuple(mesh[names].mesh.flatten().tolist())
            assert layout.group(*names) == expected, names
            assert layout.group(*reversed(names)) == expected  # any order, one answer
            assert layout.all_groups(*names) == torch_all_groups(mesh.mesh, names)
    assert layout.group() == (layout.rank,)
    assert layout.dp_group == layout.group("dp_replicate", "dp_shard")
    assert layout.tp_group == layout.group("tp")


@given(layouts(max_world=64), st.sampled_from(SUBSETS))
def test_a_group_reads_only_its_own_members(layout: MeshPlan, names: tuple[str, ...]) -> None:
    """The cost of a group is its size: it looks up exactly one global rank per member."""
    looked_up: list[int] = []
    original = MeshPlan.global_rank

    def counting(self: MeshPlan, flat: int) -> int:
        looked_up.append(flat)
        return original(self, flat)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(MeshPlan, "global_rank", counting)
        group = layout.group(*names)
    assert len(looked_up) == len(group) == math.prod(getattr(layout, n) for n in names)


def test_a_rank_of_a_large_world_gets_its_groups_without_listing_the_world() -> None:
    # 1024 ranks as fprep plans 405B: pp 8 x dp_shard 16 x tp 8, rank 777.
    layout = MeshPlan(world_size=1024, rank=777, pp=8, dp_shard=16, tp=8)
    assert (layout.coordinate("pp"), layout.coordinate("dp_shard"), layout.coordinate("tp")) == (
        6,
        1,
        1,
    )
    assert layout.tp_group == tuple(range(776, 784))
    assert layout.shard_group == tuple(range(6 * 128 + 1, 7 * 128, 8))
    assert layout.group("pp") == tuple(range(9, 1024, 128))
    assert layout.same_shard_ranks == (777,)


def test_the_data_parallel_views() -> None:
    hsdp = MeshPlan(
        world_size=16, rank=13, dp_replicate=2, dp_shard=4, tp=2, dp_mesh_names=("r", "s")
    )
    assert hsdp.dp_mesh_shape == (2, 4) and hsdp.dp_mesh_names == ("r", "s")
    assert hsdp.dp_coordinate == (1, 2) and hsdp.dp_size == 8
    assert hsdp.shard_group == (9, 11, 13, 15)
    assert hsdp.same_shard_ranks == (5, 13)
    assert hsdp.is_distributed
    plain = MeshPlan(world_size=1, rank=0)
    assert plain.dp_mesh_shape == (1,) and plain.dp_coordinate == (0,)
    assert not plain.is_distributed and plain.describe() == "1"


@settings(max_examples=40, deadline=None)
@given(layouts())
def test_dp_rank_is_the_index_among_the_data_parallel_peers(layout: MeshPlan) -> None:
    """``dp_rank`` is this rank's place in torch's flattened data-parallel sub-mesh; every
    rank that differs only in pp, cp or tp reads the same share, and the peers' indices are
    ``0 .. dp_size - 1`` in order."""
    with fake_world(layout.world_size, layout.rank):
        peers = torch_mesh(layout)[("dp_replicate", "dp_shard")].mesh.flatten().tolist()
    assert 0 <= layout.dp_rank < layout.dp_size == len(peers)
    assert peers[layout.dp_rank] == layout.rank
    for other in layout.group("pp", "cp", "tp"):
        assert dataclasses.replace(layout, rank=other).dp_rank == layout.dp_rank
    indices = [dataclasses.replace(layout, rank=peer).dp_rank for peer in layout.dp_group]
    assert indices == list(range(layout.dp_size))


def test_the_record_is_a_frozen_hashable_value() -> None:
    a = MeshPlan(world_size=4, rank=1, dp_shard=2, tp=2)
    b = MeshPlan(world_size=4, rank=1, dp_shard=2, tp=2)
    assert a == b and hash(a) == hash(b) and len({a, b}) == 1
    assert a != dataclasses.replace(a, rank=2)
    with pytest.raises(dataclasses.FrozenInstanceError):
        a.tp = 4  # type: ignore[misc]


@pytest.mark.parametrize(
    ("fields", "error", "subject"),
    [
        ({"world_size": 4, "rank": 0, "dp_shard": 4, "tp": 0}, ConfigError, "tp"),
        ({"world_size": 4, "rank": 0, "pp": -2, "dp_shard": 4}, ConfigError, "pp"),
        ({"world_size": 8, "rank": 0, "dp_shard": 2, "tp": 2}, TopologyError, "world_size"),
        ({"world_size": 4, "rank": 4, "dp_shard": 4}, TopologyError, "rank"),
        ({"world_size": 4, "rank": 1, "dp_shard": 2, "ranks": (0, 2)}, TopologyError, "rank"),
        ({"world_size": 4, "rank": 0, "dp_shard": 2, "ranks": (0, 0)}, TopologyError, "ranks"),
        ({"world_size": 4, "rank": 0, "dp_shard": 2, "ranks": (0, 4)}, TopologyError, "ranks"),
        ({"world_size": 4, "rank": 0, "dp_shard": 2, "ranks": (0,)}, TopologyError, "ranks"),
        ({"world_size": 0, "rank": 0}, TopologyError, "world_size"),
        (
            {
                "world_size": 4,
                "rank": 0,
                "dp_replicate": 2,
                "dp_shard": 2,
                "dp_mesh_names": ("dp",),
            },
            ConfigError,
            "dp_mesh_names",
        ),
    ],
)
def test_a_bad_record_is_refused_naming_the_field(
    fields: dict[str, object], error: type[Exception], subject: str
) -> None:
    with pytest.raises(error) as caught:
        MeshPlan(**fields)  # type: ignore[arg-type]
    assert getattr(caught.value, "subject", None) == subject


def test_an_unknown_or_repeated_dimension_is_refused() -> None:
    layout = MeshPlan(world_size=2, rank=0, dp_shard=2)
    with pytest.raises(ConfigError, match="'ep' is not a mesh dimension"):
        layout.group("ep")
    with pytest.raises(ConfigError, match="named twice"):
        layout.group("tp", "tp")


# -- init_process_group reads the record ---------------------------------------------------------


def old_arithmetic(
    state: PrepState,
) -> tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...], tuple[int, ...]]:
    """(mesh_shape, coordinate, shard_group, replicate_group) as init_process_group computed
    them before the record, for a plan with no mesh or group given."""
    topo, cfg = state.topology, state.config
    world, rank, tp = topo.world_size, topo.rank, cfg.tp
    if cfg.strategy == "hsdp":
        local = max(1, topo.local_world_size // tp) if tp > 1 else topo.local_world_size
        shard = cfg.hsdp_shard_size or local
        shape: tuple[int, ...] = (world // tp // shard, shard)
    else:
        shape = (world // tp,)
    ranks = tuple(range(rank % tp, world, tp))
    flat = ranks.index(rank)
    if len(shape) == 2:
        rows, cols = shape
        r, c = divmod(flat, cols)
        column = tuple(ranks[i * cols + c] for i in range(rows))
        return shape, (r, c), ranks[r * cols : (r + 1) * cols], column
    return shape, (flat,), ranks, (rank,)


def planned(state: PrepState) -> ProcessGroupState:
    pg = success(run_pure(init_process_group, state)).process_group
    assert pg is not None
    return pg


@settings(max_examples=60, deadline=None)
@given(fst.plan_inputs(), st.data())
def test_the_fields_equal_the_old_arithmetic_for_every_drawn_plan(
    case: fst.PlanCase, data: st.DataObject
) -> None:
    tree, cfg, topology = case
    # tensor parallelism too, where it divides the world (the drawn configs leave tp at 1)
    tps = [t for t in range(1, topology.world_size + 1) if topology.world_size % t == 0]
    tp = data.draw(st.sampled_from(tps))
    if tp > 1 and cfg.strategy == "hsdp":
        dp = topology.world_size // tp
        shard = data.draw(st.sampled_from([d for d in range(1, dp + 1) if dp % d == 0]))
        cfg = dataclasses.replace(cfg, tp=tp, hsdp_shard_size=shard)
    elif tp > 1:
        cfg = dataclasses.replace(cfg, tp=tp)
    state = PrepState.initial(tree, cfg, topology)
    pg = planned(state)
    shape, coordinate, shard_group, replicate_group = old_arithmetic(state)
    assert (pg.mesh_shape, pg.coordinate) == (shape, coordinate)
    assert (pg.shard_group, pg.replicate_group) == (shard_group, replicate_group)
    names = ("replicate", "shard") if cfg.strategy == "hsdp" else ("dp",)
    assert pg.mesh_dim_names == names
    assert pg.mesh.tp == cfg.tp and pg.mesh.size == topology.world_size
    assert pg.mesh.tp_group == tuple(
        range(topology.rank // tp * tp, (topology.rank // tp + 1) * tp)
    )


@settings(max_examples=40, deadline=None)
@given(st.sampled_from((2, 4, 6, 8)), st.booleans(), st.data())
def test_a_user_mesh_is_described_with_its_own_ranks(
    world: int, hybrid: bool, data: st.DataObject
) -> None:
    layout = data.draw(fst.mesh_layouts(world, hybrid=hybrid))
    rank = data.draw(st.integers(0, world - 1))
    spec = layout.spec(rank)
    cfg = PrepConfig(strategy="hsdp" if hybrid else "fsdp")
    topology = with_rank(Topology(world_size=world, local_world_size=world), rank)
    pg = planned(PrepState.initial(TREE, cfg, topology, mesh=spec))
    members = spec.ranks or tuple(range(world))
    assert pg.mesh.ranks == members and pg.mesh.dp_group == members
    assert pg.mesh_shape == spec.shape and pg.coordinate == spec.coordinate
    cols = spec.shape[-1]
    row = spec.coordinate[0] if hybrid else 0
    assert pg.shard_group == members[row * cols : (row + 1) * cols]
    expected_replicas = members[spec.coordinate[-1] :: cols] if hybrid else (rank,)
    assert pg.replicate_group == expected_replicas


@settings(max_examples=30, deadline=None)
@given(st.sampled_from((2, 4, 6, 8)), st.data())
def test_a_user_group_is_described_with_its_own_ranks(world: int, data: st.DataObject) -> None:
    groups = data.draw(fst.group_layouts(world))
    rank = data.draw(st.integers(0, world - 1))
    spec = groups.spec(rank)
    topology = with_rank(Topology(world_size=world, local_world_size=world), rank)
    pg = planned(PrepState.initial(TREE, PrepConfig(strategy="fsdp"), topology, process_group=spec))
    members = spec.ranks or tuple(range(spec.size))
    assert pg.mesh.ranks == members and pg.shard_group == members
    assert pg.coordinate == (spec.rank,) and pg.replicate_group == (rank,)


def test_a_mesh_naming_the_wrong_number_of_dimensions_is_refused() -> None:
    topology = Topology(world_size=4, local_world_size=4)
    spec = MeshSpec(shape=(4,), dim_names=("replicate", "shard"))
    state = PrepState.initial(TREE, PrepConfig(strategy="fsdp"), topology, mesh=spec)
    error = run_pure(init_process_group, state).failure()
    assert isinstance(error, TopologyError) and error.subject == "mesh"


@settings(max_examples=30, deadline=None)
@given(st.sampled_from((2, 4, 6, 8, 12)), st.booleans(), st.data())
def test_the_tensor_parallel_state_reads_the_same_record(
    world: int, hybrid: bool, data: st.DataObject
) -> None:
    """TensorParallelState's group and mesh are the record's, equal to the arithmetic they
    replaced (tp innermost: this rank's tp group is its run of ``tp`` neighbours)."""
    tp = data.draw(st.sampled_from([t for t in range(2, world + 1) if world % t == 0]))
    dp = world // tp
    shard = data.draw(st.sampled_from([d for d in range(1, dp + 1) if dp % d == 0]))
    rank = data.draw(st.integers(0, world - 1))
    cfg = PrepConfig(
        strategy="hsdp" if hybrid else "fsdp",
        hsdp_shard_size=shard if hybrid else None,
        tp=tp,
        tp_plan={"0": "colwise", "1": "rowwise"},
    )
    model = torch.nn.Sequential(torch.nn.Linear(24, 24), torch.nn.Linear(24, 24))
    topology = Topology(world_size=world, rank=rank, local_world_size=world)
    state = fprep.plan(model, cfg, topology).unwrap()
    tps = state.extension.tensor_parallel  # type: ignore[union-attr]
    pg = state.process_group
    assert tps is not None and pg is not None
    start = rank - rank % tp
    assert (tps.size, tps.rank, tps.group) == (tp, rank % tp, tuple(range(start, start + tp)))
    dp_shape = (dp // shard, shard) if hybrid else (dp,)
    names = ("replicate", "shard") if hybrid else ("dp",)
    assert (tps.mesh_shape, tps.mesh_dim_names) == ((*dp_shape, tp), (*names, "tp"))
    assert tps.group == pg.mesh.tp_group and pg.mesh_shape == dp_shape
    # one record: the tp state holds the process group's mesh, and no field copied from it
    assert tps.mesh is pg.mesh
    stored = {f.name for f in dataclasses.fields(tps)}
    assert not stored & {"size", "rank", "group", "mesh_shape", "mesh_dim_names"}
