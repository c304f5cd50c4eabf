"""init_state_dict: how checkpoints are written and read."""

from __future__ import annotations

from _checks import check_plan_order, run_pure, success
from hypothesis import given

from fprep import PrepState
from fprep.testing import strategies as fst
from fprep.transitions import init_state_dict

SMALL = fst.module_trees(max_depth=2)


@given(fst.prep_states(before="init_state_dict"))
def test_pure_and_invariants(state: PrepState) -> None:
    sd = success(run_pure(init_state_dict, state)).state_dict
    core, cfg = state.core, state.config
    assert sd is not None and core is not None
    assert sd.type == cfg.state_dict_type
    full = cfg.state_dict_type == "full"
    # Full state dicts are gathered to CPU, on rank 0 only when there are other ranks.
    assert sd.cpu_offload == full
    assert sd.full_on_rank0_only == (full and core.is_distributed)
    # Loading reads on rank 0 and broadcasts: for full checkpoints and sync_module_states.
    assert sd.broadcast_from_rank0 == (core.is_distributed and (full or cfg.sync_module_states))
    if not core.is_distributed:
        assert not sd.full_on_rank0_only and not sd.broadcast_from_rank0


@given(fst.prep_states(inputs=fst.plan_inputs(trees=SMALL)))
def test_plan_order(complete: PrepState) -> None:
    check_plan_order("init_state_dict", complete)
