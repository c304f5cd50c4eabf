"""init_extension: the dimensions beyond data parallelism fprep plans (tensor parallelism); a
mesh the user sliced from a larger one adds nothing here (its ranks are the mesh record's)."""

from __future__ import annotations

from typing import ClassVar

from _checks import check_plan_order, run_pure, run_until, success, with_rank
from hypothesis import given
from hypothesis import strategies as st

from fprep import ModuleTree, PrepConfig, PrepState, Topology
from fprep.state import ExtensionState
from fprep.testing import strategies as fst
from fprep.transitions import init_extension

SMALL = fst.module_trees(max_depth=1)


@given(fst.prep_states(before="init_extension"))
def test_pure_without_a_mesh(state: PrepState) -> None:
    extension = success(run_pure(init_extension, state)).extension
    assert extension is not None
    assert (extension.tensor_parallel is None) == (state.config.tp == 1)


@given(
    SMALL,
    fst.topologies(nodes=st.integers(1, 3), local_world_size=st.integers(1, 4)),
    st.booleans(),
    st.data(),
)
def test_a_mesh_slice_plans_nothing_beyond_data_parallelism(
    tree: ModuleTree, topology: Topology, hybrid: bool, data: st.DataObject
) -> None:
    """A slice of a larger mesh (dp of dp x tp) runs tensor parallelism the user applied:
    fprep plans none, and the slice's ranks are the process group record's."""
    layout = data.draw(fst.mesh_layouts(topology.world_size, hybrid=hybrid), label="layout")
    cfg = PrepConfig(strategy="hsdp" if hybrid else "fsdp")
    for rank in range(topology.world_size):  # every rank agrees
        mesh = layout.spec(rank)
        state = PrepState.initial(tree, cfg, with_rank(topology, rank), mesh=mesh)
        state = success(run_until("init_extension", state))
        assert success(run_pure(init_extension, state)).extension == ExtensionState()
        assert state.process_group is not None
        assert state.process_group.mesh.dp_group == mesh.ranks


@given(fst.prep_states(inputs=fst.plan_inputs(trees=SMALL)))
def test_plan_order(complete: PrepState) -> None:
    check_plan_order("init_extension", complete)


def test_qwen3s_own_plan_sums_the_q_k_norm_gradients_over_tp() -> None:
    """Qwen3's plan replicates its q / k norms with a gradient all-reduce (transformers'
    'replicated_with_grad_allreduce'): planned as Replicate DTensors over tp (fprep raised a
    bare KeyError once)."""
    import torch
    import transformers as tf

    import fprep
    from fprep.layout import Replicate

    with torch.device("meta"):
        model = tf.Qwen3ForCausalLM(
            tf.Qwen3Config(
                hidden_size=64,
                intermediate_size=128,
                num_hidden_layers=2,
                num_attention_heads=4,
                num_key_value_heads=2,
                vocab_size=128,
            )
        )
    cfg = fprep.PrepConfig(tp=2, strategy="fsdp")
    state = fprep.plan(model, cfg, fprep.Topology(world_size=4, rank=0)).unwrap()
    tps = state.tensor_parallel
    assert tps is not None
    assert dict(tps.modules)["model.layers.1.self_attn.q_norm"] == "replicated_with_grad_allreduce"
    assert dict(tps.placements)["model.layers.1.self_attn.k_norm.weight"] == Replicate()


def test_a_style_the_models_own_plan_names_that_fprep_does_not_know_is_a_config_error() -> None:
    from returns.result import Failure

    import fprep
    from fprep.testing.models import Llama, llama_tiny

    class Odd(Llama):
        _tp_plan: ClassVar[dict[str, str]] = {"layers.*.attention.wq": "frobnicate"}

    model = llama_tiny("meta")
    model.__class__ = Odd
    result = fprep.plan(model, fprep.PrepConfig(tp=2), fprep.Topology(world_size=2, rank=0))
    assert isinstance(result, Failure)
    error = result.failure()
    assert isinstance(error, fprep.ConfigError) and error.subject == "tp_plan"
    assert "'frobnicate'" in error.message and "layers.0.attention.wq" in error.message
