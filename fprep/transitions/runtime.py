"""init_runtime: gradient sync, the DDP options and comm hook, and fast_ddp's settings.

torch refuses ``bf16_compress_hook`` by name on gloo; the plan records ``"bf16_gloo"`` there, for
which the replicate step installs an equivalent hook of its own that gloo accepts.
"""

from __future__ import annotations

import dataclasses

from fprep.errors import ConfigError
from fprep.state import PrepState, RuntimeState, need
from fprep.transitions._base import transition


@transition
def init_runtime(state: PrepState) -> PrepState:
    core = need(state.core, "init_core", "init_runtime")
    device = need(state.device, "init_device", "init_runtime")
    pg = need(state.process_group, "init_process_group", "init_runtime")
    ddp = state.config.ddp
    hook: str = ddp.comm_hook
    if hook != "none" and core.strategy == "none" and state.config.strategy in ("ddp", "auto"):
        hook = "none"  # world size 1: nothing to communicate (init_core notes it)
    if hook != "none" and core.strategy != "ddp":
        raise ConfigError(
            f"ddp.comm_hook={hook!r} applies to strategy 'ddp'; the strategy is {core.strategy!r}.",
            subject="ddp.comm_hook",
            hint="Use strategy='ddp', or leave ddp.comm_hook='none'.",
        )
    if hook == "bf16" and device.backend == "gloo":
        hook = "bf16_gloo"
    kwargs: tuple[tuple[str, object], ...] = ()
    if core.strategy == "ddp":
        options = dataclasses.asdict(ddp)
        for key in ("comm_hook", "powersgd_rank", "powersgd_start_iter"):
            options.pop(key)
        kwargs = tuple(sorted(options.items()))
    fast = core.strategy == "fast_ddp"
    return state.replace(
        runtime=RuntimeState(
            sync_gradients=True,
            comm_hook=hook,
            ddp_kwargs=kwargs,
            fast_ddp_dtype=state.config.fast_ddp_dtype if fast else None,
            # averaged over the data-parallel group (which may be a subgroup of the world)
            fast_ddp_scale=1.0 / pg.mesh.dp_size if fast else None,
        )
    )
