"""shard: FSDP2 ``fully_shard`` on every wrap unit (inner units first), then the root.

Everything comes from the plan: the mesh (1-D, or 2-D ``(replicate, shard)`` for hsdp),
``reshard_after_forward`` per unit, the ``MixedPrecisionPolicy`` dtypes (float32 outputs on the
root only, so blocks pass low-precision activations to each other), CPU offload (memory pinned
only where an accelerator exists), ignored parameters, and the explicit prefetch lists.
"""

from __future__ import annotations

from typing import Any
from weakref import ref

import torch
from torch import nn

from fprep.apply.steps import handles_of, skipped, step, with_handles
from fprep.errors import ConfigError
from fprep.state import PrepState, need
from fprep.transitions.runtime import routed_expert_lists


def _dtype(name: str | None) -> torch.dtype | None:
    return None if name is None else getattr(torch, name)


def _is_dtensor(p: torch.Tensor) -> bool:
    return hasattr(p, "to_local") and hasattr(p, "placements")


def param_attributes(module: nn.Module, *, recurse: bool = True) -> dict[str, dict[str, Any]]:
    """Attributes users set on ``module``'s parameters (``p.no_decay = True``), by name."""
    return {
        name: {k: v for k, v in vars(p).items() if not k.startswith("_fsdp")}
        for name, p in module.named_parameters(recurse=recurse, remove_duplicate=False)
        if vars(p)
    }


def carry_param_attributes(
    module: nn.Module, attrs: dict[str, dict[str, Any]], *, recurse: bool = True
) -> None:
    """Put ``param_attributes`` back on the parameters that now hold those names: FSDP2 and
    ``to_empty`` replace parameters by new ``nn.Parameter`` objects, which have none."""
    if not attrs:
        return
    for name, p in module.named_parameters(recurse=recurse, remove_duplicate=False):
        for key, value in attrs.get(name, {}).items():
            if not hasattr(p, key):
                setattr(p, key, value)


def _managed_elsewhere(
    module: nn.Module, fqn: str, unit_of: dict[int, tuple[ref[nn.Parameter], str]]
) -> dict[int, nn.Parameter]:
    """``module``'s plain parameters that another unit manages (tied ones), by id."""
    out = {}
    for p in module.parameters():
        held, owner = unit_of.get(id(p), (None, fqn))
        if not _is_dtensor(p) and held is not None and held() is p and owner != fqn:
            out[id(p)] = p
    return out


@step("shard")
def shard(state: PrepState, model: nn.Module) -> tuple[PrepState, nn.Module]:
    core = need(state.core, "init_core", "shard")
    if not core.is_sharded:
        return skipped(state, model)
    from torch.distributed.fsdp import (
        CPUOffloadPolicy,
        FSDPModule,
        MixedPrecisionPolicy,
        OffloadPolicy,
        fully_shard,
    )

    plan = need(state.param_handles, "init_param_handles", "shard")
    prefetch = need(state.prefetching, "init_prefetching", "shard")
    handles = handles_of(state)
    # experts held as separate modules: one a rank's router sent no token has no gradient
    # there, and FSDP2 would reduce-scatter fewer gradients on that rank than on the others
    experts = routed_expert_lists(state.tree)
    if experts and not hasattr(FSDPModule, "set_reduce_scatter_unused_params"):
        raise ConfigError(
            f"{experts[0]} holds experts a router picks per token; this torch's FSDP2 cannot "
            "reduce the zero gradients of an expert a rank sent no token (its ranks would "
            "reduce-scatter different sizes).",
            subject=experts[0],
            hint="Use a newer torch (2.13 has FSDPModule.set_reduce_scatter_unused_params), "
            "fused expert weights (transformers 5's layout), or strategy='ddp'.",
        )
    if state.config.sync_module_states and state.topology.rank == 0:
        full = {k: v.detach().to("cpu", copy=True) for k, v in model.state_dict().items()}
        state = with_handles(state, rank0_full_state=full)

    named = dict(model.named_parameters(remove_duplicate=False))
    attrs = param_attributes(model)
    ignored = {id(named[n]): named[n] for spec in plan.ignored for n in spec.names}
    # Which unit manages each parameter, holding the parameters weakly: each fully_shard
    # replaces its unit's parameters, and a strong reference here would keep every replaced
    # one (under TP, every TP block: half the model at tp 2) alive until the last unit.
    unit_of = {
        id(named[spec.fqn]): (ref(named[spec.fqn]), u.fqn) for u in plan.units for spec in u.params
    }
    del named
    policy = core.precision
    offload: Any = (
        CPUOffloadPolicy(pin_memory=core.pin_memory) if core.offload == "cpu" else OffloadPolicy()
    )
    for unit in plan.units:
        mp = MixedPrecisionPolicy(
            param_dtype=_dtype(policy.param_dtype),
            reduce_dtype=_dtype(policy.reduce_dtype),
            output_dtype=_dtype(policy.output_dtype)
            if unit.fqn == "" and policy.param_dtype
            else None,
        )
        # Under pipeline parallelism the root unit is each stage module (the model prepare
        # returns never runs; fprep.apply.pipeline_stages): each is an FSDP2 root, as torchtitan's.
        targets = (
            handles.stage_modules
            if unit.fqn == "" and handles.stage_modules
            else (model.get_submodule(unit.fqn),)
        )
        for module in targets:
            skip = {**ignored, **_managed_elsewhere(module, unit.fqn, unit_of)}
            fully_shard(
                module,
                mesh=handles.mesh,
                reshard_after_forward=unit.reshard_after_forward,
                mp_policy=mp,
                offload_policy=offload,
                ignored_params=set(skip.values()) or None,
            )

    carry_param_attributes(model, attrs)
    if experts:
        for root in (model, *handles.stage_modules):
            for module in root.modules():
                if isinstance(module, FSDPModule):
                    module.set_reduce_scatter_unused_params(True, recurse=False)

    def fsdp(fqn: str) -> FSDPModule:
        m = model.get_submodule(fqn)
        assert isinstance(m, FSDPModule)
        return m

    for fqn, targets in prefetch.forward:
        fsdp(fqn).set_modules_to_forward_prefetch([fsdp(t) for t in targets])
    for fqn, targets in prefetch.backward:
        fsdp(fqn).set_modules_to_backward_prefetch([fsdp(t) for t in targets])
    return state, model
