"""init_prefetching: which units all-gather which others ahead of time."""

from __future__ import annotations

from _checks import check_plan_order, run_pure, success
from hypothesis import given
from hypothesis import strategies as st

from fprep import PrepState
from fprep.testing import strategies as fst
from fprep.transitions import init_prefetching

SMALL = fst.module_trees(max_depth=2)
SHARDED = fst.plan_inputs(
    topos=fst.topologies(nodes=st.integers(1, 2), local_world_size=st.integers(2, 4)),
    strategy=st.sampled_from(("fsdp", "hsdp")),
    wrap=st.one_of(st.integers(1, 30), st.sampled_from(fst.WRAP_PREDICATES)),
)


def check_prefetching(state: PrepState) -> None:
    prefetch = success(run_pure(init_prefetching, state)).prefetching
    core, handles, cfg = state.core, state.param_handles, state.config
    assert prefetch is not None and core is not None and handles is not None
    if not core.is_sharded:
        assert prefetch.forward == () and prefetch.backward == ()
        return
    # Forward runs the non-root units in module order; backward in reverse. The root is left out.
    model_order = [m.fqn for m in state.tree.modules]
    forward = sorted((u.fqn for u in handles.units if u.fqn), key=model_order.index)
    for plan, order, depth in (
        (prefetch.forward, forward, cfg.forward_prefetch),
        (prefetch.backward, forward[::-1], cfg.backward_prefetch),
    ):
        keys = [fqn for fqn, _ in plan]
        assert len(keys) == len(set(keys))
        if depth == 0:
            assert plan == ()
            continue
        assert keys == order[:-1]  # every unit but the last prefetches something
        for fqn, targets in plan:
            i = order.index(fqn)
            assert targets == tuple(order[i + 1 : i + 1 + depth])  # the next `depth` units
            assert 1 <= len(targets) <= depth and fqn not in targets and "" not in targets


@given(fst.prep_states(before="init_prefetching"))
def test_pure_and_invariants(state: PrepState) -> None:
    check_prefetching(state)


@given(fst.prep_states(before="init_prefetching", inputs=SHARDED))
def test_pure_and_invariants_sharded(state: PrepState) -> None:
    check_prefetching(state)


@given(fst.prep_states(inputs=fst.plan_inputs(trees=SMALL)))
def test_plan_order(complete: PrepState) -> None:
    check_plan_order("init_prefetching", complete)
