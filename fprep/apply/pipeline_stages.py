"""Pipeline parallelism, applied: this rank's stages carved out of the model, under their names.

``carve(model, gaps)`` makes a structural copy of ``model``: every module on the path to a gap is
copied one level (its own dicts of children, parameters, buffers and hooks), a ``StageGap``
pass-through stands in for each gap, and every other module is the model's own object, shared.
Nothing is copied that holds a tensor, and the model itself is left as it was.

``split_stages`` (right after ``connect``) carves two kinds of copies:

- the *rank model*, this rank's part: every module of this rank's stages under its own name
  (``layers.17`` stays ``layers.17``), a pass-through in place of every other stage's module.
  The later steps (tensor parallelism, checkpointing, compile, FSDP units, materialize,
  ``weights=``) work on it by name, exactly as on a whole model, and ``prepare`` returns it:
  its parameters, state dict and checkpoints carry the model's own names, so a checkpoint does
  not depend on the layout. It never runs: calling it is an error that says what to call.
- one *stage module* per stage this rank runs, sharing every module with the rank model: what
  ``torch.distributed.pipelining.PipelineStage`` runs. ``shard`` makes each one an FSDP2 root.

``stages`` (after ``precision``) gives each stage module the rank model's autocast, a forward that
returns one tensor (a transformers model returns a ``ModelOutput``), and its ``PipelineStage``.
"""

from __future__ import annotations

import copy
import inspect
from typing import Any

import torch
from torch import nn

from fprep.apply.precision import autocast_of, install_autocast
from fprep.apply.steps import handles_of, skipped, step, with_handles
from fprep.compat import pipeline_schedule_class, pipeline_stage_meshes
from fprep.errors import ConfigError, PlanOrderError, PrepareError
from fprep.snapshot import is_within, join_fqn
from fprep.state import PipelineState, PrepState


class StageGap(nn.Module):
    """Stands in for a module another pipeline stage holds: returns its first input as it is.

    The model's forward still calls it (it was declared a pass-through by the model's pipeline
    plan); keyword inputs are accepted and ignored, as a decoder layer is called with the mask
    and position embeddings beside the hidden states.
    """

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        if args:
            return args[0]
        return next(iter(kwargs.values()))


def _copy_one_level(module: nn.Module) -> nn.Module:
    """A new module object of the same class whose dicts and sets (children, parameters,
    buffers, hooks) are copies of the original's, so changing one leaves the other alone."""
    new = copy.copy(module)
    for key, value in module.__dict__.items():
        if isinstance(value, dict | set):
            new.__dict__[key] = value.copy()
    return new


def carve(model: nn.Module, gaps: tuple[str, ...] | frozenset[str]) -> nn.Module:
    """``model`` with a ``StageGap`` in place of each module named in ``gaps`` (see the module
    docstring). Modules off the paths to the gaps are shared with ``model``."""
    gap_set = frozenset(gaps)

    def walk(module: nn.Module, prefix: str) -> nn.Module:
        if not any(is_within(g, prefix) for g in gap_set):
            return module
        new = _copy_one_level(module)
        for name, child in module._modules.items():
            fqn = join_fqn(prefix, name)
            if fqn in gap_set:
                new._modules[name] = StageGap()
            elif child is not None:
                new._modules[name] = walk(child, fqn)
        return new

    return walk(model, "")


class NotCallable:
    """The rank model's forward under pipeline parallelism: the stages run, not the rank model."""

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        raise PrepareError(
            "under pipeline parallelism this model is one rank's part of the model and does "
            "not run on its own: the pipeline schedule runs its stages.",
            subject="model",
            hint="Run a training step with fprep.pipeline_step(state, model, inputs, targets, "
            "loss_fn) on every rank (docs/parallelism.md).",
        )


def check_pipeline_available(state: PrepState) -> None:
    """Before any effect: a ``ConfigError`` when this torch lacks the planned schedule, or
    cannot pass sequence-sharded DTensors between stages."""
    if state.pipeline is None:
        return
    pipeline_schedule_class(state.pipeline.schedule)
    if state.config.sequence_parallel and not pipeline_stage_meshes():
        raise ConfigError(
            f"sequence_parallel=True with pp={state.config.pp}: the stages pass the "
            "sequence-sharded stream as DTensors, which this torch's PipelineStage cannot "
            "(it has no get_mesh=).",
            subject="sequence_parallel",
            hint="Use a newer torch (2.13 has it), or sequence_parallel=False.",
        )


def pipeline_plan(state: PrepState, caller: str) -> PipelineState:
    """The plan's pipeline; a PlanOrderError when pp > 1 was asked but never planned."""
    plan = state.pipeline
    if plan is None:
        raise PlanOrderError(
            f"{caller} needs a pipeline plan: PrepConfig.pp={state.config.pp} but init_pipeline "
            "did not run.",
            subject="init_pipeline",
            hint="Plan with fprep.plan (its default transitions include init_pipeline).",
        )
    return plan


@step("split_stages")
def split_stages(state: PrepState, model: nn.Module) -> tuple[PrepState, nn.Module]:
    if state.config.pp == 1:
        return skipped(state, model)
    plan = pipeline_plan(state, "split_stages")
    rank_model = carve(model, plan.gaps())
    parts = tuple(carve(model, plan.gaps(stage)) for stage in plan.stages)
    return with_handles(state, stage_modules=parts), rank_model


def _mesh_lookup(world_mesh: Any) -> Any:
    def get_mesh(names: tuple[str, ...], layout: Any) -> Any:
        del layout  # one mesh per set of names in fprep's N-D mesh
        return world_mesh[names[0] if len(names) == 1 else tuple(names)]

    return get_mesh


class StageForward:
    """A stage module's forward: the model's own, returning one tensor.

    A transformers model returns a ``ModelOutput`` (its first field: the logits, or the hidden
    states on a stage before the last); ``PipelineStage`` sends tensors only. A forward with a
    ``use_cache`` argument is told not to build a KV cache (training never reads it).
    """

    def __init__(self, module: nn.Module) -> None:
        self.module = module
        forward = type(module).forward
        self.no_cache = "use_cache" in inspect.signature(forward).parameters

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if self.no_cache:
            kwargs.setdefault("use_cache", False)
        out = type(self.module).forward(self.module, *args, **kwargs)
        if isinstance(out, torch.Tensor):
            return out
        first = out.to_tuple()[0] if hasattr(out, "to_tuple") else out[0]
        if not isinstance(first, torch.Tensor):
            raise PrepareError(
                f"a pipeline stage of {type(self.module).__qualname__} returned "
                f"{type(out).__qualname__} whose first entry is not a tensor.",
                subject="model",
                hint="Pipeline stages pass tensors: return the activations (or logits) first.",
            )
        return first


@step("stages")
def stages(state: PrepState, model: nn.Module) -> tuple[PrepState, nn.Module]:
    if state.config.pp == 1:
        return skipped(state, model)
    from torch.distributed.pipelining import PipelineStage

    plan = pipeline_plan(state, "stages")
    handles = handles_of(state)
    parts = handles.stage_modules
    if not parts or handles.pp_mesh is None:
        raise PlanOrderError(
            "the stages step needs split_stages and connect to have run first.",
            subject="stages",
            hint="Use fprep.default_steps() (or keep their order in a custom pipeline).",
        )
    autocast = autocast_of(model)
    group = handles.pp_mesh.get_group()
    # DTensor activations (the sequence-sharded stream) cross stages on the meshes of the one
    # N-D mesh: torch looks them up by their dimension names
    extra: dict[str, Any] = {}
    if pipeline_stage_meshes() and handles.world_mesh is not None:
        extra["get_mesh"] = _mesh_lookup(handles.world_mesh)
    built = []
    for index, part in zip(plan.stages, parts, strict=True):
        part.__dict__["forward"] = StageForward(part)
        if autocast is not None:
            install_autocast(part, autocast.device_type, autocast.dtype)
        built.append(
            PipelineStage(part, index, plan.num_stages, handles.device, group=group, **extra)
        )
    model.__dict__["forward"] = NotCallable()
    return with_handles(state, pipeline_stages=tuple(built), schedules={}), model
