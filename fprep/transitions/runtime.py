"""init_runtime: gradient sync, the DDP options and comm hook, and fast_ddp's settings.

A mixture-of-experts model whose experts are separate modules (a ``ModuleList`` named
``experts``, not transformers 5's fused 3-D weights) leaves an expert that a rank's router sent
no token without a gradient on that rank: DDP then waits for it forever on the other ranks and
fails at the next forward on this one. The plan turns on DDP's ``find_unused_parameters`` for
such a model (its gradient is then zero there, as one process computes it); with
``static_graph=True`` (which promises the same parameters every step) it is a ConfigError.

torch refuses ``bf16_compress_hook`` by name on gloo; the plan records ``"bf16_gloo"`` there, for
which the replicate step installs an equivalent hook of its own that gloo accepts.
"""

from __future__ import annotations

import dataclasses

from fprep.errors import ConfigError
from fprep.snapshot import ModuleTree
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
        experts = routed_expert_lists(state.tree)
        if experts and ddp.static_graph:
            raise ConfigError(
                f"ddp.static_graph=True promises DDP that every step uses the same parameters, "
                f"but {experts[0]} holds experts a router picks per token: an expert that "
                "receives no token on a rank has no gradient there.",
                subject="ddp.static_graph",
                hint="Leave static_graph=False (fprep then sets find_unused_parameters=True "
                "for this model), or use strategy='fsdp'.",
            )
        if experts:
            options["find_unused_parameters"] = True
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


def routed_expert_lists(tree: ModuleTree) -> list[str]:
    """The FQNs of module lists named ``experts`` (containers without a forward): experts held
    as separate modules, of which a router runs only some per token."""
    return [
        m.fqn
        for m in tree.modules
        if m.fqn.rpartition(".")[2] == "experts" and not m.can_run_forward
    ]
