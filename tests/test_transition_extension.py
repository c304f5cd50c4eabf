"""init_extension: whether the data-parallel mesh is a slice of a larger one (DP x TP)."""

from __future__ import annotations

from _checks import check_plan_order, run_pure, run_until, success, with_rank
from hypothesis import given
from hypothesis import strategies as st

from fprep import ModuleTree, PrepConfig, PrepState, Topology
from fprep.testing import strategies as fst
from fprep.transitions import init_extension

SMALL = fst.module_trees(max_depth=1)


@given(fst.prep_states(before="init_extension"))
def test_pure_without_a_mesh(state: PrepState) -> None:
    extension = success(run_pure(init_extension, state)).extension
    assert extension is not None
    assert not extension.is_slice and extension.root_shape is None and extension.other_dims == ()


@given(
    SMALL,
    fst.topologies(nodes=st.integers(1, 3), local_world_size=st.integers(1, 4)),
    st.booleans(),
    st.data(),
)
def test_mesh_slices(
    tree: ModuleTree, topology: Topology, hybrid: bool, data: st.DataObject
) -> None:
    layout = data.draw(fst.mesh_layouts(topology.world_size, hybrid=hybrid), label="layout")
    cfg = PrepConfig(strategy="hsdp" if hybrid else "fsdp")
    for rank in range(topology.world_size):  # every rank agrees
        mesh = layout.spec(rank)
        state = PrepState.initial(tree, cfg, with_rank(topology, rank), mesh=mesh)
        state = success(run_until("init_extension", state))
        extension = success(run_pure(init_extension, state)).extension
        assert extension is not None
        assert extension.is_slice == layout.sliced == mesh.is_slice
        if layout.sliced:
            assert extension.root_shape == layout.root_shape
            assert extension.root_dim_names == mesh.root_dim_names
            # The dimensions that are not data parallelism: exactly tp (when named).
            assert extension.other_dims == (("tp",) if layout.named else ())
        else:
            assert extension.root_shape is None and extension.other_dims == ()


@given(fst.prep_states(inputs=fst.plan_inputs(trees=SMALL)))
def test_plan_order(complete: PrepState) -> None:
    check_plan_order("init_extension", complete)
