"""init_state_dict: how checkpoints are written and read.

Sharded (the default) writes each rank's shards through torch.distributed.checkpoint and can be
read back at another world size. Full gathers on rank 0 only (to CPU) and, when loading, reads on
rank 0 and broadcasts: the one way to get the same weights for every world size.
"""

from __future__ import annotations

from fprep.state import PrepState, StateDictState, need
from fprep.transitions._base import transition


@transition
def init_state_dict(state: PrepState) -> PrepState:
    core = need(state.core, "init_core", "init_state_dict")
    cfg = state.config
    full = cfg.state_dict_type == "full"
    distributed = core.strategy != "none"
    return state.replace(
        state_dict=StateDictState(
            type=cfg.state_dict_type,
            cpu_offload=full,
            full_on_rank0_only=full and distributed,
            broadcast_from_rank0=distributed and (full or cfg.sync_module_states),
        )
    )
