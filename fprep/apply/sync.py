"""sync_module_states: weights held by rank 0 reach every rank.

For sharded strategies rank 0's full state dict (captured before sharding) is loaded with
``broadcast_from_rank0=True``: other ranks may hold meta tensors and only ever receive their own
shards. DDP broadcasts rank 0's weights when it is constructed and fast_ddp in its own step, so
this step only acts for fsdp / hsdp.
"""

from __future__ import annotations

from torch import nn

from fprep.apply.steps import handles_of, skipped, step, with_handles
from fprep.state import PrepState, need


@step("sync_module_states")
def sync_module_states(state: PrepState, model: nn.Module) -> tuple[PrepState, nn.Module]:
    core = need(state.core, "init_core", "sync_module_states")
    if not (state.config.sync_module_states and core.is_sharded):
        return skipped(state, model)
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

    full = handles_of(state).rank0_full_state if state.topology.rank == 0 else {}
    set_model_state_dict(
        model,
        full or {},
        options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=True),
    )
    return with_handles(state, rank0_full_state=None), model
