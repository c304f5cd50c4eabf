"""place: move a replicated (or single-device) model to the compute device.

Sharded strategies skip this: ``fully_shard`` moves each unit's shards itself, so no rank ever
holds the whole model on its device.
"""

from __future__ import annotations

from torch import nn

from fprep.apply.steps import handles_of, skipped, step
from fprep.state import PrepState, need


@step("place")
def place(state: PrepState, model: nn.Module) -> tuple[PrepState, nn.Module]:
    core = need(state.core, "init_core", "place")
    if core.is_sharded or not state.config.device_placement:
        return skipped(state, model)
    device = handles_of(state).device
    if any(p.device != device for p in model.parameters()) or any(
        b.device != device for b in model.buffers()
    ):
        model.to(device)
    return state, model
