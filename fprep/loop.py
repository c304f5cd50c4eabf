"""Training-loop helpers: plain functions over (state, model, optimizer, ...), no wrappers.

They work with the user's own PyTorch objects and keep no global state, so they drop into any
research loop:

    for i, (x, y) in enumerate(loader):
        last = (i + 1) % accum == 0
        with fprep.accumulate(state, model, sync=last):
            loss = loss_fn(model(x), y) / accum
            fprep.backward(state, model, loss)
        if last:
            fprep.clip_grad_norm(state, model, 1.0, optimizer=opt)
            fprep.optimizer_step(state, opt, scheduler)
            opt.zero_grad()
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from fprep.apply.fast_ddp import DEFER_SYNC_ATTR
from fprep.apply.steps import handles_of
from fprep.collectives import collective
from fprep.data import PreparedDataLoader
from fprep.errors import PrepareError
from fprep.grad_norm import check_norm_type, is_dtensor
from fprep.grad_norm import total_norm as total_norm_of
from fprep.processes import gather_parts
from fprep.state import PrepState, need


def optimizer_step(
    state: PrepState,
    optimizer: torch.optim.Optimizer | Sequence[torch.optim.Optimizer],
    scheduler: Any = None,
) -> bool:
    """Step the optimizer (through the fp16 grad scaler when there is one), then the scheduler
    — but only if the optimizer really stepped. Returns whether it did. On Gaudi in lazy mode
    the accumulated work is flushed (``mark_step``) after the optimizer step.

    An fp16 step whose gradients overflowed is skipped by the scaler (and the scale lowered);
    the scheduler then stays where it is, so the learning-rate curve follows real steps.
    An optimizer that still holds parameters ``prepare`` replaced (built before it and given to
    neither ``prepare`` nor ``prepare_optimizer``) is refused with a PrepareError: it would
    step tensors the model no longer uses.
    Several optimizers over one backward (say, one per parameter group kind) go in one call —
    ``optimizer_step(state, [opt_a, opt_b], [sched_a, sched_b])`` — so that fp16's scaler
    unscales all of them with the scale the loss was scaled by, then updates once.
    With fp8 and float8 all-gather (``Fp8Options.fsdp_float8_all_gather``), a step that
    stepped then precomputes the float8 weights' scales (torchao's
    ``precompute_float8_dynamic_scale_for_fsdp``: one all-reduce instead of one per weight at
    the next all-gathers), as torchtitan does after its optimizer step.
    """
    handles = handles_of(state)
    optimizers = (optimizer,) if isinstance(optimizer, torch.optim.Optimizer) else optimizer
    replaced = handles.replaced_params
    if replaced is not None:  # only while a replaced parameter is still held somewhere
        for i, opt in enumerate(optimizers):
            replaced.check(opt, i, "optimizer_step")
    scaler = handles.grad_scaler
    if scaler is None:
        for opt in optimizers:
            opt.step()
        stepped = True
    else:
        use = handles.scaler_use
        if use is not None and use.updated_since_backward:
            raise PrepareError(
                "optimizer_step ran again since the last fprep.backward: with fp16 the loss "
                "scale has changed since the gradients were scaled, so they would be unscaled "
                "by the wrong factor.",
                subject="optimizer_step",
                hint="Step every optimizer of a backward in one call: "
                "fprep.optimizer_step(state, [opt_a, opt_b], [sched_a, sched_b]).",
            )
        before = scaler.get_scale()
        for opt in optimizers:
            scaler.step(opt)
        scaler.update()
        if use is not None:
            use.updated_since_backward = True
        stepped = bool(scaler.get_scale() >= before)  # an overflow always lowers the scale
    if stepped and handles.fp8_scales is not None:
        handles.fp8_scales()  # float8 all-gather: the new weights' scales, one all-reduce
    if handles.device_handle is not None:
        handles.device_handle.step_mark()  # a no-op except on Gaudi in lazy mode
    if stepped and scheduler is not None:
        schedulers = scheduler if isinstance(scheduler, list | tuple) else (scheduler,)
        for sched in schedulers:
            sched.step()
    return stepped


class _GradientSyncOff:
    """FSDP2: reduce-scatter (and hsdp's all-reduce) skipped inside, restored on exit."""

    def __init__(self, model: Any) -> None:
        self.model = model

    def __enter__(self) -> None:
        self.model.set_requires_gradient_sync(False)

    def __exit__(self, *exc: object) -> None:
        self.model.set_requires_gradient_sync(True)


class _DeferredSync:
    """fast_ddp: ``fprep.backward`` skips its fused all-reduce inside."""

    def __init__(self, model: nn.Module) -> None:
        self.model = model

    def __enter__(self) -> None:
        setattr(self.model, DEFER_SYNC_ATTR, True)

    def __exit__(self, *exc: object) -> None:
        setattr(self.model, DEFER_SYNC_ATTR, False)


_SYNC = contextlib.nullcontext()  # stateless, so one instance serves every call


def accumulate(
    state: PrepState, model: nn.Module, *, sync: bool
) -> contextlib.AbstractContextManager[None]:
    """Run forward and backward of one micro-step; with ``sync=False`` gradients stay local.

    DDP uses ``no_sync()``, FSDP2 ``set_requires_gradient_sync(False)``, fast_ddp skips its
    fused all-reduce in ``fprep.backward``; gradients then accumulate until a micro-step with
    ``sync=True`` reduces the sum. Scale each micro-step's loss by ``1 / micro_steps``.

    A plain function returning a context manager (not a generator-based one): the common case,
    ``sync=True``, costs a shared ``nullcontext`` and no frame.
    """
    if sync:
        return _SYNC
    strategy = need(state.core, "init_core", "accumulate").strategy
    wrapped: Any = model  # DDP / FSDPModule methods are looked up dynamically
    if strategy == "ddp" and hasattr(model, "no_sync"):
        no_sync: contextlib.AbstractContextManager[None] = wrapped.no_sync()
        return no_sync
    if strategy in ("fsdp", "hsdp") and hasattr(model, "set_requires_gradient_sync"):
        return _GradientSyncOff(wrapped)
    if strategy == "fast_ddp":
        return _DeferredSync(model)
    return _SYNC


def clip_grad_norm(
    state: PrepState,
    model: nn.Module,
    max_norm: float,
    *,
    norm_type: float = 2.0,
    optimizer: torch.optim.Optimizer | None = None,
) -> torch.Tensor:
    """Clip gradients to a total norm of ``max_norm``; returns the norm before clipping.

    The norm is the single-process norm of the full gradient: sharded (DTensor) gradients are
    reduced across their mesh, one all-reduce per distinct mesh, replicated ones counted once
    (``fprep.grad_norm``); under pipeline parallelism one more all-reduce combines the stages.
    With fp16, pass the optimizer so the gradients are unscaled first.
    ``norm_type`` is a positive p or ``math.inf``.
    """
    handles = handles_of(state)
    if optimizer is not None and handles.replaced_params is not None:
        handles.replaced_params.check(optimizer, 0, "clip_grad_norm")
    scaler = handles.grad_scaler
    if scaler is not None:
        if optimizer is None:
            raise PrepareError(
                "clip_grad_norm needs the optimizer under fp16, to unscale gradients first.",
                subject="optimizer",
                hint="Call fprep.clip_grad_norm(state, model, max_norm, optimizer=opt).",
            )
        scaler.unscale_(optimizer)
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    # Under pipeline parallelism each rank holds its stages' gradients: the stages' norms are
    # combined over the pipeline ranks (every rank takes part, with or without gradients).
    across = handles.pp_mesh.get_group() if handles.pp_mesh is not None else None
    if not grads and across is None:
        check_norm_type(norm_type)
        return torch.tensor(0.0)
    # one all-reduce per distinct mesh (and one over the pipeline); a lost rank is a
    # CollectiveError
    with collective("fprep.clip_grad_norm", state.config.timeout_s, arrive=False):
        if state.expert_parallel is not None:
            total_norm = _norm_with_experts(state, model, norm_type)
        else:
            total_norm = total_norm_of(grads, norm_type, across)
    coef = torch.clamp(max_norm / (total_norm + 1e-6), max=1.0)
    with torch.no_grad():
        for g in grads:  # a DTensor: scale this rank's shard, no collective, no dispatch
            local: torch.Tensor = g.to_local() if is_dtensor(g) else g  # type: ignore[attr-defined]
            local.mul_(coef.to(local.device))
    return total_norm


def _norm_with_experts(state: PrepState, model: nn.Module, norm_type: float) -> torch.Tensor:
    """Under expert parallelism the ranks of an ep group hold different experts: the experts'
    gradients are reduced over their efsdp mesh, then over the ep group; the others as usual."""
    plan = need(state.expert_parallel, "init_expert_parallel", "clip_grad_norm")
    names = set(plan.param_fqns)
    experts: list[torch.Tensor] = []
    dense: list[torch.Tensor] = []
    for name, param in model.named_parameters():
        if param.grad is not None:
            (experts if name in names else dense).append(param.grad)
    p = check_norm_type(norm_type)
    group = handles_of(state).expert_mesh.get_group("ep")
    own, rest = total_norm_of(experts, p, group), total_norm_of(dense, p)
    parts = torch.stack([own, rest.to(own.device)])
    return parts.max() if math.isinf(p) else parts.pow(p).sum().pow(1.0 / p)


def autocast(state: PrepState) -> contextlib.AbstractContextManager[Any]:
    """``torch.autocast`` as the prepared model's forward runs it (the plan's device type and
    dtype), for computations outside that forward: a loss computed after it, a second model.
    A context that does nothing when the plan has no autocast (``precision="no"``).
    Accelerate's ``accelerator.autocast()``; the prepared forward needs none.
    """
    policy = need(state.core, "init_core", "fprep.autocast").precision
    if policy.autocast_dtype is None:
        return contextlib.nullcontext()
    device = need(state.device, "init_device", "fprep.autocast")
    return torch.autocast(device.device_type, dtype=getattr(torch, policy.autocast_dtype))


def gather_for_metrics(
    state: PrepState, data: Any, loader: PreparedDataLoader | None = None
) -> Any:
    """All data-parallel ranks' ``data`` (batch dimension first) concatenated, every sample
    once, in data-parallel rank order (the order a prepared loader shards in). ``data`` is a
    tensor or lists, tuples and dicts of them, e.g. ``(predictions, labels)``; the same
    structure comes back (``fprep.gather``'s rules: the same structure, dtypes and dimensions
    beyond the first on every rank, or a ``ConfigError`` on every rank).

    The ranks are those the model was prepared over — the process group or DeviceMesh given to
    ``prepare`` (every dimension of an hsdp mesh), else the whole world — not necessarily every
    process in the job. With a prepared loader using even batches, the samples that were
    repeated to even out the last batches are dropped, so metrics over an epoch count each
    dataset sample exactly once.

    A 0-d tensor (a rank's loss, say) is one value per rank, not a batch: it comes back as a
    1-d tensor of one entry per data-parallel rank, in rank order, never trimmed (``loader`` is
    not used) — shape ``(1,)`` in one process, so the same code runs at any world size.
    """
    rebuild, parts, scalar = gather_parts(state, data, "fprep.gather_for_metrics")
    out = []
    for ranks, is_scalar in zip(parts, scalar, strict=True):
        counts = [p.shape[0] for p in ranks]
        keep = counts if is_scalar else _kept_counts(counts, loader, len(ranks))
        out.append(torch.cat([p[:k] for p, k in zip(ranks, keep, strict=True)]))
    return rebuild(out)


def _kept_counts(counts: list[int], loader: PreparedDataLoader | None, world: int) -> list[int]:
    """Per rank, how many of this batch's samples are real (not repeated by even batches)."""
    if loader is None or loader.remainder == 0 or loader.dataset_len is None:
        return counts
    n, bs = loader.dataset_len, loader.spec.batch_size
    start = (loader.batches - 1) * bs if loader.batches else 0  # position of this batch
    kept = []
    for rank, count in enumerate(counts):
        # rank r's j-th sample of the epoch is global position j * world + r
        kept.append(sum(1 for j in range(start, start + count) if j * world + rank < n))
    return kept
