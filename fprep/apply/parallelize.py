"""parallelize: tensor parallelism, applied with torch's ``parallelize_module``.

Runs before checkpointing, compilation and sharding (torchtitan's order: TP, then activation
checkpointing, compile, FSDP2), on the tp sub-mesh connect built. Each planned Linear /
Embedding gets the torch style its name maps to (``fprep.layout.styles``); every other module the
plan gives a behaviour or whose parameters rules of their own place (transformers' packed,
mixture-of-experts, latent-attention, local-parameter styles) gets one ``ModuleStyle``
(``fprep.apply.tp_module_styles``) with its parameters' planned placements
(``TensorParallelState.placements``). The parameters become DTensors over the tp dimension, and
``shard`` then shards their local blocks over the data-parallel dims. The
float8 Linear layers the plan lists (``TensorParallelState.float8``, converted by the ``fp8``
step just before) get torchao's ``Float8ColwiseParallel`` / ``Float8RowwiseParallel`` where
the plan names them: the same layouts, with inputs and output gradients cast to float8.
The first forward checks that every rank of a tp group was given the same inputs
(``fprep.tp_inputs``).
"""

from __future__ import annotations

from typing import Any

from torch import nn

from fprep.apply.shard import carry_param_attributes, param_attributes
from fprep.apply.steps import handles_of, skipped, step
from fprep.apply.tp_ties import retie
from fprep.compat import float8_api, float8_tp_styles
from fprep.layout.styles import STYLES, Style
from fprep.parallel_loop import LabelsNeedLossParallel
from fprep.state import PrepState, TensorParallelState, need
from fprep.tp_inputs import FirstInputsCheck


def torch_style(style: Style, float8: tuple[Any, Any] | None = None) -> Any:
    """torch's ``ParallelStyle`` for one of fprep's (transformers') style names; with
    ``float8`` (torchao's ``(Float8ColwiseParallel, Float8RowwiseParallel)``) the colwise /
    rowwise classes are those, with the same layouts."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        SequenceParallel,
    )

    colwise, rowwise = float8 if float8 is not None else (ColwiseParallel, RowwiseParallel)

    if style.kind == "sequence":
        return SequenceParallel(sequence_dim=1, use_local_output=False)
    if style.kind in ("gather", "scatter"):
        from fprep.apply.sequence import GatherSequence, ScatterSequence

        return GatherSequence() if style.kind == "gather" else ScatterSequence()
    if style.kind == "colwise":
        return colwise(
            input_layouts=Shard(1) if style.sequence else Replicate(),
            output_layouts=Replicate() if style.output_replicated else Shard(-1),
            use_local_output=not style.dtensor_output,
        )
    return rowwise(  # sequence: reduce-scatter onto the stream, kept a DTensor
        input_layouts=Replicate() if style.input_replicated else Shard(-1),
        output_layouts=Shard(1) if style.sequence else Replicate(),
        use_local_output=not style.sequence,
    )


def module_styles(tps: TensorParallelState) -> dict[str, Any]:
    """One ``ModuleStyle`` (``fprep.apply.tp_module_styles``) per module the plan gives a
    behaviour, or whose own parameters rules of their own place (3-D experts, attention
    sinks): the behaviour (``none`` for a module without one) and each such parameter's torch
    placement. The parameters of the modules torch's own styles shard are left to them."""
    from fprep.apply.placements import to_torch
    from fprep.apply.tp_module_styles import ModuleStyle

    by_torch = {fqn for fqn, name in tps.modules if not STYLES[name].is_behaviour}
    behaviours = {fqn: name for fqn, name in tps.modules if STYLES[name].is_behaviour}
    params: dict[str, dict[str, Any]] = {}
    for fqn, placement in tps.placements:
        owner, _, leaf = fqn.rpartition(".")
        if owner not in by_torch:
            params.setdefault(owner, {})[leaf] = to_torch(placement)
    # the plan's order, the same on every rank: distributing a parameter is a collective
    owners = [*behaviours, *(o for o in params if o not in behaviours)]
    return {
        owner: ModuleStyle(
            behaviours.get(owner, "none"),  # type: ignore[arg-type]
            params.get(owner, {}),
            rope_dim=tps.rope_dim if behaviours.get(owner) == "mla_kv_a_proj" else None,
        )
        for owner in owners
    }


@step("parallelize")
def parallelize(state: PrepState, model: nn.Module) -> tuple[PrepState, nn.Module]:
    ext = need(state.extension, "init_extension", "parallelize")
    tps = ext.tensor_parallel
    if tps is None:
        return skipped(state, model)
    from torch.distributed.tensor.parallel import parallelize_module

    float8 = {fqn for fqn, cls in tps.float8 if cls.startswith("Float8")}
    styles = float8_tp_styles(float8_api("precision='fp8' with tp > 1")) if float8 else None
    plan: dict[str, Any] = {
        fqn: torch_style(STYLES[name], styles if fqn in float8 else None)
        for fqn, name in tps.modules
        if STYLES[name].kind != "replicate" and not STYLES[name].is_behaviour
    }
    plan.update(module_styles(tps))
    attrs = param_attributes(model)
    handles = handles_of(state)
    parallelize_module(model, handles.tp_mesh, plan)
    retie(model, state.tree, tuple(fqn for fqn, _ in tps.params))
    carry_param_attributes(model, attrs)
    # the ranks of a tp group must be given equal inputs: checked at the first forward
    check = FirstInputsCheck(handles.tp_mesh.get_group(), handles.device, state.config.timeout_s)
    check.install(model)
    if tps.loss_parallel:  # labels= outside loss_parallel: refused, naming the fix
        model.register_forward_pre_hook(LabelsNeedLossParallel(), with_kwargs=True)
    return state, model
