"""``prepare``: plan, then apply the plan with the default pipeline of steps.

The default pipeline, in order (each step is a no-op when the plan does not ask for it):

1. ``connect``            process group, N-D DeviceMesh (nothing for a single process)
   ``split_stages``       pipeline parallelism: this rank's part and its stage modules (pp > 1)
2. ``fp8``                the planned Linear layers become float8 ones (precision="fp8")
3. ``parallelize``        tensor parallelism: ``parallelize_module`` on the tp sub-mesh (tp > 1)
   ``experts``            expert parallelism: each rank keeps its experts (ep > 1)
4. ``checkpoint``         activation checkpointing per region (non-reentrant torch.utils.checkpoint)
5. ``compile_regions``    regional ``torch.compile`` of the repeated blocks
6. ``shard``              FSDP2 ``fully_shard`` per unit, then the root (fsdp, hsdp)
7. ``materialize``        meta -> real, only this rank's shards (reproducible by default)
8. ``load_weights``       ``PrepConfig.weights``: each rank reads its own rows from the files
9. ``place``              move a replicated model to the compute device
10. ``sync_module_states`` rank 0's weights to every rank (fsdp, hsdp; DDP does it itself)
11. ``precision``         autocast with float32 outputs; fp16 grad scaler
    ``stages``            pipeline parallelism: a ``PipelineStage`` per stage module (pp > 1)
12. ``replicate``         DistributedDataParallel and its comm hook (ddp)
13. ``fast_ddp``          broadcast from rank 0 once (fast_ddp)
14. ``compile_whole``     whole-model ``torch.compile``
15. ``mark_prepared``     so that a second ``prepare`` is refused instead of double wrapping

Everything the plan can reject is rejected before step 1, so a failed ``prepare`` leaves the
model exactly as it was. Ranks agree on the plan first (``fprep.agreement``): a plan that fails
on one rank raises the same error on every rank, before any effect. A failure the plan cannot
foresee (a user's ``reset_parameters`` raising, a custom step failing, out of memory) rolls the
model's structure back to what it was before step 1 (see ``fprep.apply.rollback``) and
re-raises; a rank lost during the steps is a ``CollectiveError`` naming it.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, TypeVar, overload

import torch
from returns.result import Failure, Success
from torch import nn
from torch.utils.data import DataLoader

from fprep.agreement import agree_on_plan
from fprep.apply import (
    checkpoint,
    compile_regions,
    compile_whole,
    fast_ddp,
    fp8,
    make_connect,
    materialize,
    pipeline,
    place,
    precision,
    replicate,
    shard,
    step,
    sync_module_states,
)
from fprep.apply.experts import experts
from fprep.apply.fast_ddp import DEFER_SYNC_ATTR
from fprep.apply.fp8 import check_fp8_available
from fprep.apply.load_weights import load_weights
from fprep.apply.lora_init import lora_inits
from fprep.apply.parallelize import parallelize
from fprep.apply.pipeline_stages import check_pipeline_available, split_stages, stages
from fprep.apply.rollback import Rollback
from fprep.apply.steps import Step, handles_of, with_handles
from fprep.collectives import collective
from fprep.config import PrepConfig
from fprep.data import prepare_data_loader
from fprep.errors import ConfigError, PrepError
from fprep.optim import (
    ReplacedParams,
    canonical_names_weak,
    optimizer_fqns,
    rebind_optimizer,
    refuse_stale_steps,
    refuse_training_nothing,
)
from fprep.planning import plan
from fprep.snapshot import PREPARED_ATTR
from fprep.state import PrepState
from fprep.topology import Topology

A = TypeVar("A")
B = TypeVar("B")
C = TypeVar("C")


@step("mark_prepared")
def mark_prepared(state: PrepState, model: nn.Module) -> tuple[PrepState, nn.Module]:
    setattr(model, PREPARED_ATTR, True)
    inner = getattr(model, "module", None)
    if isinstance(inner, nn.Module):
        setattr(inner, PREPARED_ATTR, True)
    return state, model


def default_steps(*, mesh: Any = None, process_group: Any = None) -> tuple[Step, ...]:
    """The default steps, in order; ``connect`` uses the given mesh or process group."""
    return (
        make_connect(mesh=mesh, process_group=process_group),
        split_stages,
        fp8,
        parallelize,
        experts,
        checkpoint,
        compile_regions,
        shard,
        materialize,
        load_weights,
        place,
        sync_module_states,
        precision,
        stages,
        replicate,
        fast_ddp,
        compile_whole,
        mark_prepared,
    )


@overload
def prepare(
    model: nn.Module,
    cfg: PrepConfig | None = ...,
    *,
    topology: Topology | None = ...,
    process_group: Any = ...,
    mesh: Any = ...,
    device_placement: Sequence[bool] | None = ...,
    steps: Sequence[Step] | None = ...,
) -> tuple[PrepState, nn.Module]: ...
@overload
def prepare(
    model: nn.Module,
    cfg: PrepConfig | None,
    a: A,
    /,
    *,
    topology: Topology | None = ...,
    process_group: Any = ...,
    mesh: Any = ...,
    device_placement: Sequence[bool] | None = ...,
    steps: Sequence[Step] | None = ...,
) -> tuple[PrepState, nn.Module, A]: ...
@overload
def prepare(
    model: nn.Module,
    cfg: PrepConfig | None,
    a: A,
    b: B,
    /,
    *,
    topology: Topology | None = ...,
    process_group: Any = ...,
    mesh: Any = ...,
    device_placement: Sequence[bool] | None = ...,
    steps: Sequence[Step] | None = ...,
) -> tuple[PrepState, nn.Module, A, B]: ...
@overload
def prepare(
    model: nn.Module,
    cfg: PrepConfig | None,
    a: A,
    b: B,
    c: C,
    /,
    *objects: Any,
    topology: Topology | None = ...,
    process_group: Any = ...,
    mesh: Any = ...,
    device_placement: Sequence[bool] | None = ...,
    steps: Sequence[Step] | None = ...,
) -> tuple[Any, ...]: ...
def prepare(
    model: nn.Module,
    cfg: PrepConfig | None = None,
    *objects: Any,
    topology: Topology | None = None,
    process_group: Any = None,
    mesh: Any = None,
    device_placement: Sequence[bool] | None = None,
    steps: Sequence[Step] | None = None,
) -> tuple[Any, ...]:
    """Plan and apply; return ``(state, model, *objects)`` in input order.

    Raises the ``PrepError`` itself when the plan fails (before any effect). Optimizers among
    ``objects`` are rebound to the prepared model's parameters (by name), so they may be built
    before ``prepare``; one holding a parameter that is not the model's is refused, before any
    effect. ``steps`` replaces the default pipeline (see ``default_steps``);
    ``device_placement`` is one bool per prepared object (the model first) and overrides
    ``PrepConfig.device_placement``.
    """
    cfg = PrepConfig() if cfg is None else cfg
    if device_placement is not None:
        if len(device_placement) != 1 + len(objects):
            raise ConfigError(
                f"device_placement has {len(device_placement)} entries for "
                f"{1 + len(objects)} objects (the model and {len(objects)} more).",
                subject="device_placement",
                hint="Give one bool per object passed to prepare, the model first.",
            )
        if isinstance(cfg, PrepConfig) and cfg.device_placement != bool(device_placement[0]):
            cfg = cfg.replace(device_placement=bool(device_placement[0]))
    for i, obj in enumerate(objects):
        if isinstance(obj, nn.Module):
            raise ConfigError(
                f"argument {i + 3} is a second model ({type(obj).__name__}); prepare takes one "
                "model per call.",
                subject="objects",
                hint="Call fprep.prepare once per model: each call returns its own state.",
            )
    topology = topology if topology is not None else Topology.from_env()
    result = plan(model, cfg, topology, process_group=process_group, mesh=mesh)
    optimizers = [obj for obj in objects if isinstance(obj, torch.optim.Optimizer)]
    recorded: list[tuple[torch.optim.Optimizer, tuple[tuple[str, ...], ...]]] = []
    out = list(objects)
    if isinstance(result, Success):
        try:
            planned = result.unwrap()
            if planned.param_handles is not None:  # nothing can initialize a module: a note in
                planned.param_handles.materialize.check()  # the plan, refused by prepare
            check_fp8_available(planned)  # fp8 on CUDA needs a recent enough torchao
            check_pipeline_available(planned)  # the schedule exists in this torch
            lora_inits(planned, model)  # LoRA factors on meta: an init fprep can compute
            refuse_training_nothing(model, optimizers)  # an optimizer of frozen parameters
            # Sharding and meta-device materialization replace Parameter objects: record what
            # each optimizer holds by name now (refusing foreign parameters before any effect)
            # and point it at the new parameters afterwards, so that an optimizer built before
            # prepare still trains.
            recorded = [(opt, optimizer_fqns(model, opt, i)) for i, opt in enumerate(optimizers)]
            # Data loaders need only the plan: prepare them now, so that a refused loader fails
            # before any effect on the model.
            out = _prepare_loaders(planned, objects, device_placement)
        except PrepError as e:  # agreed on below, like the plan's own errors
            result = Failure(e)
    # Ranks may plan differently (real weights on rank 0, meta elsewhere): all learn every
    # rank's outcome before any effect, and raise the same error (one store exchange).
    timeout_s = cfg.timeout_s if isinstance(cfg, PrepConfig) else PrepConfig().timeout_s
    state = agree_on_plan(result, topology, timeout_s, process_group=process_group, mesh=mesh)
    run = pipeline(
        *(steps if steps is not None else default_steps(mesh=mesh, process_group=process_group))
    )
    before = canonical_names_weak(model)
    undo = Rollback.of(model)
    # A lost rank (or a backend timeout) in a step's collectives: a CollectiveError naming it.
    with collective("fprep.prepare", state.config.timeout_s, process_group, arrive=False):
        try:
            state, prepared = run(state, model)
        except BaseException:
            undo.restore()  # a step failed after others changed the model: put it back
            raise
    del undo
    elsewhere = _other_stages(state)
    for i, (opt, fqns) in enumerate(recorded):
        rebind_optimizer(prepared, opt, fqns, i, elsewhere)
    # Replaced parameters something still holds (an optimizer not passed here): refused by
    # optimizer_step and by a plain optimizer.step(). Usually none are left, and then the
    # check costs nothing.
    replaced = ReplacedParams.of(before, prepared)
    if replaced is not None:
        refuse_stale_steps(replaced)
    state = with_handles(state, param_fqns_before=before, replaced_params=replaced)
    return (state, prepared, *out)


def _other_stages(state: PrepState) -> frozenset[str]:
    """Under pp, the parameter names other pipeline ranks hold."""
    plan = state.pipeline
    return frozenset() if plan is None else frozenset(plan.elsewhere(state.tree))


def _prepare_loaders(
    state: PrepState, objects: Sequence[Any], device_placement: Sequence[bool] | None
) -> list[Any]:
    flags = list(device_placement[1:]) if device_placement is not None else [None] * len(objects)
    return [
        prepare_data_loader(state, obj, device_placement=flag)
        if isinstance(obj, DataLoader)
        else obj
        for obj, flag in zip(objects, flags, strict=True)
    ]


def prepare_optimizer(
    state: PrepState, model: nn.Module, optimizer: torch.optim.Optimizer
) -> torch.optim.Optimizer:
    """Point an optimizer that was not passed to ``prepare`` at the prepared parameters.

    Parameters it holds are matched by name: current ones as they are, ones the model had
    before ``prepare`` (replaced by sharding or materialization) by the names recorded then.
    Hyperparameters and state are kept; a parameter that matches neither is a PrepareError.
    """
    before = handles_of(state).param_fqns_before  # parameter (held weakly) -> canonical FQN
    fqns = optimizer_fqns(model, optimizer, before=before if before is not None else {})
    rebind_optimizer(model, optimizer, fqns)
    return optimizer


def backward(state: PrepState, model: nn.Module, loss: Any) -> None:
    """``loss.backward()`` with the plan's extras: fp16 loss scaling, fast_ddp's all-reduce,
    and Gaudi's step mark in lazy mode."""
    handles = handles_of(state)
    # DDP's and FSDP's gradient collectives run inside: a lost rank is a CollectiveError
    with collective("fprep.backward", state.config.timeout_s, handles.process_group, arrive=False):
        if handles.grad_scaler is not None:
            handles.grad_scaler.scale(loss).backward()
            if handles.scaler_use is not None:
                handles.scaler_use.updated_since_backward = False
        else:
            loss.backward()
    runtime = state.runtime
    # (the plan is checked first: a missing attribute costs a microsecond on an nn.Module)
    if (
        runtime is not None
        and runtime.fast_ddp_dtype is not None
        and not getattr(model, DEFER_SYNC_ATTR, False)  # inside fprep.accumulate(sync=False)
    ):
        from fprep.apply.fast_ddp import all_reduce_gradients

        all_reduce_gradients(state, model)
    if handles.device_handle is not None:
        handles.device_handle.step_mark()  # a no-op except on Gaudi in lazy mode
