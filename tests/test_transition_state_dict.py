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
    pg, cfg = state.process_group, state.config
    assert sd is not None and pg is not None
    assert sd.type == cfg.state_dict_type
    full = cfg.state_dict_type == "full"
    several = pg.world_size > 1
    # Full state dicts are gathered to CPU, on rank 0 only when there are other ranks.
    assert sd.cpu_offload == full
    assert sd.full_on_rank0_only == (full and several)
    # Loading reads on rank 0 and broadcasts: for full checkpoints and sync_module_states.
    assert sd.broadcast_from_rank0 == (several and (full or cfg.sync_module_states))
    if not several:
        assert not sd.full_on_rank0_only and not sd.broadcast_from_rank0


def test_tensor_parallelism_alone_gathers_full_state_dicts_on_rank_0() -> None:
    """tp over the whole world resolves the strategy to "none", yet the run has two processes:
    a full state dict is rank 0's alone, as for any other multi-process plan."""
    import torch

    import fprep

    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 8))
    cfg = fprep.PrepConfig(tp=2, tp_plan={"0": "colwise", "1": "rowwise"}, state_dict_type="full")
    topology = fprep.Topology(world_size=2, rank=1, local_world_size=2)
    state = fprep.plan(model, cfg, topology).unwrap()
    assert state.core is not None and state.core.strategy == "none"
    assert state.state_dict is not None
    assert state.state_dict.full_on_rank0_only and state.state_dict.broadcast_from_rank0


@given(fst.prep_states(inputs=fst.plan_inputs(trees=SMALL)))
def test_plan_order(complete: PrepState) -> None:
    check_plan_order("init_state_dict", complete)
