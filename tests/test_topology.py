"""Topology: explicit or from a launcher's environment; bad values are TopologyErrors."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from fprep import Topology, TopologyError


def test_defaults_are_a_single_process() -> None:
    t = Topology()
    assert (t.world_size, t.rank, t.local_rank, t.local_world_size, t.num_nodes) == (1, 0, 0, 1, 1)


def test_explicit_large_world() -> None:
    t = Topology(world_size=1024, rank=3)
    assert t.local_world_size == 1024 and t.local_rank == 3 and t.num_nodes == 1
    t = Topology(world_size=1024, rank=515, local_world_size=8)
    assert t.local_rank == 3 and t.node_rank == 64 and t.num_nodes == 128


@given(st.integers(1, 64), st.integers(1, 16), st.data())
def test_node_layout(nodes: int, per_node: int, data: st.DataObject) -> None:
    world = nodes * per_node
    rank = data.draw(st.integers(0, world - 1))
    t = Topology(world_size=world, rank=rank, local_world_size=per_node)
    assert t.num_nodes == nodes
    assert t.node_rank * per_node + t.local_rank == rank


@pytest.mark.parametrize(
    ("kwargs", "subject"),
    [
        ({"world_size": 0}, "world_size"),
        ({"world_size": 4, "rank": 4}, "rank"),
        ({"world_size": 4, "rank": -1}, "rank"),
        ({"world_size": 4, "local_world_size": 5}, "local_world_size"),
        ({"world_size": 4, "local_world_size": 2, "local_rank": 2}, "local_rank"),
        ({"world_size": 2.0}, "world_size"),
        ({"world_size": True}, "world_size"),
        ({"device_type": "tpu"}, "device_type"),
    ],
)
def test_bad_topologies(kwargs: dict[str, object], subject: str) -> None:
    with pytest.raises(TopologyError) as info:
        Topology(**kwargs)  # type: ignore[arg-type]
    assert info.value.subject == subject


def test_from_env_torchrun() -> None:
    env = {"WORLD_SIZE": "8", "RANK": "5", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "4"}
    t = Topology.from_env(env, device_type="cpu")
    assert (t.world_size, t.rank, t.local_rank, t.local_world_size) == (8, 5, 1, 4)
    assert t.launcher == "torchrun" and t.num_nodes == 2


def test_from_env_mpi() -> None:
    env = {
        "OMPI_COMM_WORLD_SIZE": "4",
        "OMPI_COMM_WORLD_RANK": "2",
        "OMPI_COMM_WORLD_LOCAL_RANK": "0",
        "OMPI_COMM_WORLD_LOCAL_SIZE": "2",
    }
    t = Topology.from_env(env, device_type="cpu")
    assert (t.world_size, t.rank, t.local_rank, t.launcher) == (4, 2, 0, "mpi")


def test_from_env_without_launcher_is_single_process() -> None:
    t = Topology.from_env({}, device_type="cpu")
    assert t.world_size == 1 and t.launcher == "none"


def test_from_env_world_without_rank_is_refused() -> None:
    with pytest.raises(TopologyError) as info:
        Topology.from_env({"WORLD_SIZE": "4"}, device_type="cpu")
    assert info.value.subject == "RANK"


def test_from_env_bad_value_names_the_variable() -> None:
    with pytest.raises(TopologyError) as info:
        Topology.from_env({"WORLD_SIZE": "two"}, device_type="cpu")
    assert info.value.subject == "WORLD_SIZE"
