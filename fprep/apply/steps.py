"""Steps: the effectful combinators that apply a plan to a model.

A step is ``(PrepState, nn.Module) -> (PrepState, nn.Module)``. It reads its instructions from
the (complete, validated) state, does one job with PyTorch's own engines, and returns the state
with its name appended to ``state.applied`` (and to ``state.skipped`` when it returned
``skipped(state, model)``: nothing to do for this plan). ``pipeline(*steps)`` composes steps into
one; users build their own by inserting, removing or replacing steps (see docs/pipeline.md).
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, NamedTuple

from torch import nn

from fprep.errors import PlanOrderError
from fprep.state import PrepState

if TYPE_CHECKING:
    import torch

#: An effectful step of ``prepare``: ``(state, model) -> (state, model)``.
Step = Callable[[PrepState, nn.Module], tuple[PrepState, nn.Module]]


class Skipped(NamedTuple):
    """A step's result when the plan gives it nothing to do; see ``skipped``."""

    state: PrepState
    model: nn.Module


def skipped(state: PrepState, model: nn.Module) -> tuple[PrepState, nn.Module]:
    """Return this from a step that has nothing to do for this plan (``shard`` for a model that
    is not sharded): the step is recorded in ``state.skipped`` as well as ``state.applied``, so
    the summary can tell what acted from what was a no-op. Still a ``(state, model)`` pair."""
    return Skipped(state, model)


@dataclass
class ScalerUse:
    """fp16 bookkeeping shared by ``backward`` and ``optimizer_step`` (one per preparation): the
    scale changed since the gradients were scaled, so stepping another optimizer now would
    unscale them by the wrong factor."""

    updated_since_backward: bool = False


@dataclass(frozen=True, kw_only=True)
class Handles:
    """Live objects a prepared model needs; kept out of the plan's equality, hash and repr.

    ``owns_process_group`` is True when fprep created the default process group (the caller
    then decides when to destroy it; fprep never does behind their back).
    """

    device: torch.device
    device_handle: Any = None  # fprep.devices.DeviceHandle for device.type
    mesh: Any = None  # torch.distributed.DeviceMesh, None for a single process
    process_group: Any = None  # the data-parallel process group
    tp_mesh: Any = None  # the tensor-parallel sub-mesh (PrepConfig.tp > 1)
    world_mesh: Any = None  # the whole N-D mesh (pp, dp dims..., tp) under tp or pp
    pp_mesh: Any = None  # the pipeline sub-mesh (PrepConfig.pp > 1)
    expert_mesh: Any = None  # the (efsdp, ep) mesh of expert parallelism (PrepConfig.ep > 1)
    #: under pp: the modules the pipeline stages run, one per stage of this rank (they share
    #: every module with the model prepare returns; fprep.apply.pipeline_stages)
    stage_modules: tuple[Any, ...] = ()
    pipeline_stages: tuple[Any, ...] = ()  # torch's PipelineStage of each
    #: the schedule built for each loss function (fprep.pipeline_step builds them on first use)
    schedules: Any = None
    owns_process_group: bool = False
    grad_scaler: Any = None  # torch.amp.GradScaler for fp16
    scaler_use: ScalerUse | None = None  # with grad_scaler
    rank0_full_state: Any = None  # rank 0's full state dict, held from shard to sync
    param_fqns_before: Any = None  # parameter before prepare (held weakly) -> canonical FQN
    replaced_params: Any = None  # fprep.optim.ReplacedParams: what optimizers must not hold
    #: fp8 with float8 all-gather: () -> None, torchao's precompute of every float8 weight's
    #: scale (one all-reduce); run after each optimizer step and checkpoint load
    fp8_scales: Any = None


def handles_of(state: PrepState) -> Handles:
    handles = state.handles
    if not isinstance(handles, Handles):
        raise PlanOrderError(
            "this step needs the connect step to have run first.",
            subject="connect",
            hint="Run the connect step first: start custom pipelines with "
            "fprep.default_steps()[0], and use helpers only on what prepare returned.",
        )
    return handles


def with_handles(state: PrepState, **changes: Any) -> PrepState:
    return state.replace(handles=dataclasses.replace(handles_of(state), **changes))


def step(name: str) -> Callable[[Step], Step]:
    """Name a step; the name is appended to ``state.applied`` when it has run."""

    def decorate(fn: Step) -> Step:
        @functools.wraps(fn)
        def run(state: PrepState, model: nn.Module) -> tuple[PrepState, nn.Module]:
            if not state.is_complete:
                raise PlanOrderError(
                    f"step {name!r} needs a complete plan.",
                    subject=name,
                    hint="Run fprep.plan(...) (all ten transitions) before applying steps.",
                )
            result = fn(state, model)
            new_state, new_model = result
            noop = (name,) if isinstance(result, Skipped) else ()
            return (
                new_state.replace(
                    applied=(*new_state.applied, name), skipped=(*new_state.skipped, *noop)
                ),
                new_model,
            )

        run.step_name = name  # type: ignore[attr-defined]
        return run

    return decorate


def pipeline(*steps: Step) -> Step:
    """Compose steps left to right into one step."""

    def run(state: PrepState, model: nn.Module) -> tuple[PrepState, nn.Module]:
        for s in steps:
            state, model = s(state, model)
        return state, model

    run.steps = steps  # type: ignore[attr-defined]
    return run
