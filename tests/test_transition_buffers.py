"""init_buffers: every buffer's original dtype, so checkpoints can restore it after casting."""

from __future__ import annotations

from _checks import run_pure, success
from hypothesis import given
from hypothesis import strategies as st

from fprep import BufferInfo, ModuleInfo, ModuleTree, PrepConfig, PrepState
from fprep.testing import strategies as fst
from fprep.transitions import init_buffers


@given(fst.prep_states(before="init_buffers"))
def test_pure_and_covers_exactly_the_buffers(state: PrepState) -> None:
    buffers = success(run_pure(init_buffers, state)).buffers
    assert buffers is not None
    tree = state.tree
    dtypes = buffers.as_dict()
    # Exactly the buffers (ignored and non-persistent ones too), each with its own dtype.
    assert set(dtypes) == {b.fqn for b in tree.buffers}
    assert len(buffers.dtypes) == len(tree.buffers)
    for b in tree.buffers:
        assert dtypes[b.fqn] == b.dtype
    assert [name for name, _ in buffers.dtypes] == sorted(dtypes)


@given(fst.prep_states(before="init_buffers"), fst.configs())
def test_depends_on_the_model_only(state: PrepState, cfg: PrepConfig) -> None:
    # Precision, strategy and what is ignored do not change what a buffer's dtype was.
    other = PrepState.initial(state.tree, cfg, state.topology)
    assert success(init_buffers(other)).buffers == success(init_buffers(state)).buffers


@given(st.sampled_from(("_orig_mod", "_checkpoint_wrapped_module", "_fsdp_wrapped_module")))
def test_wrapper_prefixes_are_dropped(wrapper: str) -> None:
    tree = ModuleTree(
        modules=(
            ModuleInfo(fqn="", cls="m.Wrapper", children=(wrapper,)),
            ModuleInfo(fqn=wrapper, cls="m.Model", buffer_names=("running_mean", "steps")),
        ),
        buffers=(
            BufferInfo(fqn=f"{wrapper}.running_mean", shape=(4,), dtype="float32"),
            BufferInfo(fqn=f"{wrapper}.steps", shape=(), dtype="int64", persistent=False),
        ),
    )
    buffers = success(run_pure(init_buffers, PrepState.initial(tree, PrepConfig()))).buffers
    assert buffers is not None
    assert buffers.as_dict() == {"running_mean": "float32", "steps": "int64"}


def test_no_prerequisites() -> None:
    # init_buffers reads only the model: it runs on the initial state (no PlanOrderError).
    tree = ModuleTree(modules=(ModuleInfo(fqn="", cls="m.Model"),))
    buffers = success(init_buffers(PrepState.initial(tree, PrepConfig()))).buffers
    assert buffers is not None and buffers.dtypes == ()
