"""``prepare``: plan, then apply the plan with the default pipeline of steps.

The default pipeline, in order (each step is a no-op when the plan does not ask for it):

1. ``connect``            process group and DeviceMesh (nothing for a single process)
2. ``checkpoint``         activation checkpointing per region (composable, non-reentrant)
3. ``compile_regions``    regional ``torch.compile`` of the repeated blocks
4. ``shard``              FSDP2 ``fully_shard`` per unit, then the root (fsdp, hsdp)
5. ``materialize``        meta -> real, only this rank's shards (reproducible by default)
6. ``place``              move a replicated model to the compute device
7. ``sync_module_states`` rank 0's weights to every rank (fsdp, hsdp; DDP does it itself)
8. ``precision``          autocast with float32 outputs; fp16 grad scaler; fp8 conversion
9. ``replicate``          DistributedDataParallel and its comm hook (ddp)
10. ``fast_ddp``          broadcast from rank 0 once (fast_ddp)
11. ``compile_whole``     whole-model ``torch.compile``
12. ``mark_prepared``     so that a second ``prepare`` is refused instead of double wrapping

Everything the plan can reject is rejected before step 1, so a failed ``prepare`` leaves the
model exactly as it was.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, TypeVar, overload

from returns.result import Failure
from torch import nn

from fprep.apply import (
    checkpoint,
    compile_regions,
    compile_whole,
    fast_ddp,
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
from fprep.apply.steps import Step, handles_of
from fprep.config import PrepConfig
from fprep.errors import ConfigError
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
        checkpoint,
        compile_regions,
        shard,
        materialize,
        place,
        sync_module_states,
        precision,
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

    Raises the ``PrepError`` itself when the plan fails (before any effect). ``steps`` replaces
    the default pipeline (see ``default_steps``); ``device_placement`` is one bool per prepared
    object (the model first) and overrides ``PrepConfig.device_placement``.
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
                f"argument {i + 2} is a second model ({type(obj).__name__}); prepare takes one "
                "model per call.",
                subject="objects",
                hint="Call fprep.prepare once per model: each call returns its own state.",
            )
    result = plan(model, cfg, topology, process_group=process_group, mesh=mesh)
    if isinstance(result, Failure):
        raise result.failure()
    state = result.unwrap()
    run = pipeline(
        *(steps if steps is not None else default_steps(mesh=mesh, process_group=process_group))
    )
    state, prepared = run(state, model)
    return (state, prepared, *objects)


def backward(state: PrepState, model: nn.Module, loss: Any) -> None:
    """``loss.backward()`` with the plan's extras: fp16 loss scaling, fast_ddp's all-reduce."""
    handles = handles_of(state)
    if handles.grad_scaler is not None:
        handles.grad_scaler.scale(loss).backward()
    else:
        loss.backward()
    runtime = state.runtime
    if runtime is not None and runtime.fast_ddp_dtype is not None:
        from fprep.apply.fast_ddp import all_reduce_gradients

        all_reduce_gradients(state, model)
