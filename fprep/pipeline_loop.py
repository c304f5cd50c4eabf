"""``pipeline_step``: one training step's forward and backward under pipeline parallelism.

The schedule (``PrepConfig.pp_schedule``) cuts the batch into ``pp_microbatches`` micro-batches,
runs each stage's forward and backward on them in its order, and leaves every stage's gradients
those of the whole batch's mean loss: each micro-batch's loss (a mean over its rows) is divided
by the number of micro-batches before its backward, so their gradients add up to the gradient of
the mean over the batch (micro-batches of equal size: the batch must divide). Gradients add to
what earlier steps left, as a plain ``backward`` does (``fprep.accumulate``). The optimizer step,
clipping (``fprep.clip_grad_norm``: one norm over every stage) and checkpoints are the usual
calls.

Every rank calls it with the same batch: the first stage reads ``inputs``, the last stage
``targets``, the others use them only to check that the batch keeps its shape (the activation
shapes each stage receives are fixed at the first step).

Without pipeline parallelism it is the plain step (``loss_fn(model(inputs), targets)``, then
``fprep.backward``), so one loop serves every layout, as ``fprep.loss_parallel`` does for tp.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from fprep.apply.pipeline_stages import pipeline_plan
from fprep.apply.steps import handles_of
from fprep.collectives import collective
from fprep.compat import pipeline_schedule_class
from fprep.errors import ConfigError, PrepareError
from fprep.moe import RouterWatch, check_no_model_aux, existing_watch, watch_routers
from fprep.state import PrepState

LossFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]

_SHAPE_KEY = "batch_shape"


def _schedule(state: PrepState, loss_fn: LossFn) -> Any:
    """The schedule for ``loss_fn``, built on first use and kept with the handles."""
    handles = handles_of(state)
    cache = handles.schedules
    if cache is None:
        raise PrepareError(
            "pipeline_step needs the model prepare returned under pp > 1.",
            subject="state",
            hint="Pass the state and model fprep.prepare returned.",
        )
    found = cache.get(id(loss_fn))
    if found is not None and found[0] is loss_fn:
        return found[1]
    plan = pipeline_plan(state, "fprep.pipeline_step")
    cls = pipeline_schedule_class(plan.schedule)
    stages = handles.pipeline_stages
    chosen = stages[0] if len(stages) == 1 and plan.schedule in ("GPipe", "1F1B") else list(stages)
    # The micro-batch losses are divided here, not the gradients after the step (torch's
    # scale_grads=True): that division would also shrink gradients accumulated by earlier
    # steps (fprep.accumulate), silently.
    scaled = _PerMicrobatch(loss_fn, plan.microbatches)
    schedule = cls(chosen, n_microbatches=plan.microbatches, loss_fn=scaled, scale_grads=False)
    cache[id(loss_fn)] = (loss_fn, schedule)
    return schedule


class _PerMicrobatch:
    """``loss_fn`` divided by the micro-batch count: the micro-batches' gradients then add up
    to the gradient of the batch's mean loss."""

    def __init__(self, loss_fn: LossFn, microbatches: int) -> None:
        self.loss_fn = loss_fn
        self.microbatches = microbatches

    def __call__(self, output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return self.loss_fn(output, target) / self.microbatches


def _batch_rows(value: Any, name: str) -> tuple[int, ...]:
    if not isinstance(value, torch.Tensor):
        raise ConfigError(
            f"pipeline_step's {name} must be a tensor (batch first); got "
            f"{type(value).__qualname__}.",
            subject=name,
            hint="Pass the batch's input tensor and target tensor.",
        )
    if value.ndim == 0:
        raise ConfigError(
            f"pipeline_step's {name} is a 0-d tensor; it needs a batch dimension first.",
            subject=name,
        )
    return tuple(value.shape)


def pipeline_step(
    state: PrepState,
    model: nn.Module,
    inputs: torch.Tensor,
    targets: torch.Tensor,
    loss_fn: LossFn,
    *,
    aux_loss_coef: float | None = None,
) -> torch.Tensor | None:
    """Run one pipelined forward and backward over the batch; call it on every rank.

    Returns the batch's mean loss (the mean of the micro-batches' losses, detached) on the
    ranks that run the last stage, and ``None`` on the others (the loss is known only there;
    ``fprep.gather`` or a broadcast from the last stage shares it). ``loss_fn(output, target)``
    runs on the last stage for each micro-batch and should return that micro-batch's mean loss.
    Without pipeline parallelism: the forward, ``loss_fn`` and ``fprep.backward`` on the whole
    batch, returning its loss on every rank.

    ``aux_loss_coef=c`` trains a mixture-of-experts model's load balance too: ``c`` times its
    routers' load-balancing loss (``fprep.watch_routers``) joins the backward, added to the loss
    without pipeline parallelism, and with it to each stage's own backward, per micro-batch
    (divided by their number as the loss is). The returned loss is ``loss_fn``'s alone.
    """
    watch = _router_watch(state, model, aux_loss_coef)
    if state.config.pp == 1:
        return _plain_step(state, model, inputs, targets, loss_fn, watch, aux_loss_coef)
    plan = pipeline_plan(state, "fprep.pipeline_step")
    handles = handles_of(state)
    if not handles.stage_modules:
        raise PrepareError(
            "pipeline_step needs the model prepare returned under pp > 1.",
            subject="model",
            hint="Pass the state and model fprep.prepare returned.",
        )
    shape = _batch_rows(inputs, "inputs")
    target_shape = _batch_rows(targets, "targets")
    if shape[0] != target_shape[0]:
        raise ConfigError(
            f"inputs have {shape[0]} rows but targets {target_shape[0]}.",
            subject="targets",
            hint="Pass the targets of the same batch.",
        )
    if shape[0] % plan.microbatches:
        raise ConfigError(
            f"a batch of {shape[0]} rows does not divide into pp_microbatches="
            f"{plan.microbatches} equal micro-batches (unequal ones would weigh rows unequally "
            "in the mean loss).",
            subject="pp_microbatches",
            hint=f"Use a batch size that is a multiple of {plan.microbatches} (or change "
            "pp_microbatches).",
        )
    known = handles.schedules.get(_SHAPE_KEY) if handles.schedules is not None else None
    if known is not None and known != (shape, target_shape):
        raise ConfigError(
            f"the batch changed shape from {known[0]} to {shape}: each pipeline stage sized "
            "the activations it receives at the first step.",
            subject="inputs",
            hint="Keep every batch the same shape (drop_last=True, or pad the last batch).",
        )
    schedule = _schedule(state, loss_fn)
    handles.schedules[_SHAPE_KEY] = (shape, target_shape)
    if watch is not None:
        watch.stage_scale = aux_loss_coef / plan.microbatches if aux_loss_coef else None
    args = (inputs.to(handles.device),) if plan.holds_first else ()
    kwargs: dict[str, Any] = {}
    losses: list[torch.Tensor] = []
    if plan.holds_last:
        kwargs = {"target": targets.to(handles.device), "losses": losses}
    with collective("fprep.pipeline_step", state.config.timeout_s, arrive=False):
        schedule.step(*args, **kwargs)
    if not plan.holds_last:
        return None
    # each entry is a micro-batch's loss divided by their number: their sum is the mean
    return torch.stack([loss.detach() for loss in losses]).sum()


def _router_watch(
    state: PrepState, model: nn.Module, aux_loss_coef: float | None
) -> RouterWatch | None:
    """The model's router watch when the step trains the auxiliary loss (or a watch exists);
    under pp a refusal, on every rank, of a model that computes its own auxiliary loss."""
    if aux_loss_coef is not None and (
        isinstance(aux_loss_coef, bool)
        or not isinstance(aux_loss_coef, int | float)
        or not math.isfinite(aux_loss_coef)
        or aux_loss_coef < 0
    ):
        raise ConfigError(
            f"aux_loss_coef must be a finite number >= 0; got {aux_loss_coef!r}.",
            subject="aux_loss_coef",
            hint="Pass the load-balancing loss's weight, e.g. config.router_aux_loss_coef "
            "(0.001 for Qwen3-MoE, 0.02 for Mixtral), or leave it out.",
        )
    if state.config.pp > 1:
        check_no_model_aux(model)
    if aux_loss_coef is None:
        return existing_watch(model)
    return watch_routers(state, model)


def _plain_step(
    state: PrepState,
    model: nn.Module,
    inputs: torch.Tensor,
    targets: torch.Tensor,
    loss_fn: LossFn,
    watch: RouterWatch | None,
    aux_loss_coef: float | None,
) -> torch.Tensor:
    from fprep.prepare import backward

    out = model(inputs)
    if not isinstance(out, torch.Tensor):  # a transformers ModelOutput: its logits
        out = out.logits if hasattr(out, "logits") else out[0]
    loss = loss_fn(out, targets)
    total = loss
    if watch is not None and aux_loss_coef:
        total = loss + aux_loss_coef * watch.aux_loss()
    backward(state, model, total)
    return loss.detach()
