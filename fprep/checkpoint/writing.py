"""``fprep.save``: one checkpoint, written atomically, readable at any world size.

Order of work (every rank, collectives in the same order):

1. check the arguments and turn every non-tensor value into JSON data (before any effect);
2. rank 0 creates a fresh ``.tmp-*`` directory; all ranks agree that nothing failed;
3. ``torch.distributed.checkpoint.save`` of the tensors through ``SafeWriter`` (raw bytes,
   a BLAKE3 digest per file, ``metadata.json`` on the coordinator; a progress line on rank 0
   when it is slow);
4. rank 0 gathers each rank's file records, RNG states and loader position, writes
   ``manifest.json``, publishes (rename + ``latest``), rotates, removes stale temp dirs;
5. every rank returns the published directory (or raises the same error).

Steps 1-2 are ``collect`` (the foreground of an asynchronous save, which also stages the tensors
in host memory there), steps 3-5 ``write_and_publish`` (what its background thread runs, on a
process group of its own; see ``background.py``). ``save`` runs both, one after the other.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
from torch.distributed.checkpoint.state_dict_saver import save as dcp_save

from fprep.checkpoint import layout, rng
from fprep.checkpoint.collective import Group, unwrap_dcp_error
from fprep.checkpoint.encoding import encode
from fprep.checkpoint.files import write_durable
from fprep.checkpoint.manifest import Manifest, OptimizerRecord, RankRecord
from fprep.checkpoint.states import model_tensors, split_optimizers
from fprep.checkpoint.storage import SafeWriter
from fprep.errors import CheckpointError, PrepError
from fprep.state import PrepState, need


def as_optimizers(optimizers: Any) -> tuple[torch.optim.Optimizer, ...]:
    if isinstance(optimizers, torch.optim.Optimizer):
        return (optimizers,)
    out = tuple(optimizers)
    for i, opt in enumerate(out):
        if not isinstance(opt, torch.optim.Optimizer):
            raise CheckpointError(
                f"optimizers[{i}] is a {type(opt).__qualname__}, not a torch.optim.Optimizer.",
                subject=f"optimizers[{i}]",
                hint="Pass optimizers=(opt,) or optimizers=opt.",
            )
    return out


def check_stateful(obj: Any, name: str) -> None:
    if obj is not None and not (
        callable(getattr(obj, "state_dict", None))
        and callable(getattr(obj, "load_state_dict", None))
    ):
        raise CheckpointError(
            f"{name} is a {type(obj).__qualname__} without state_dict() / load_state_dict().",
            subject=name,
            hint=f"Pass the object whose position should be saved, or {name}=None.",
        )


def _check_args(step: object, keep_last: object) -> None:
    if not isinstance(step, int) or isinstance(step, bool) or step < 0:
        raise CheckpointError(f"step must be an int >= 0; got {step!r}.", subject="step")
    if keep_last is not None and (
        not isinstance(keep_last, int) or isinstance(keep_last, bool) or keep_last < 1
    ):
        raise CheckpointError(
            f"keep_last must be None or an int >= 1; got {keep_last!r}.",
            subject="keep_last",
            hint="keep_last=None keeps every checkpoint.",
        )


@dataclass(kw_only=True)
class Collected:
    """A save's foreground part done: every value to write, the ``.tmp-*`` directory made.

    ``tensors`` are this rank's (the live ones for a synchronous save, staged host copies for an
    asynchronous one; emptied once written); everything else is already JSON data, independent
    of the live objects.
    """

    root: Path
    tmp: Path
    step: int
    keep_last: int | None
    strategy: str
    state_dict_type: str
    tensors: dict[str, torch.Tensor]
    optimizers: tuple[OptimizerRecord, ...]
    scheduler: Any
    grad_scaler: Any
    extras: Any
    record: RankRecord


def save(
    path: str | os.PathLike[str],
    state: PrepState,
    model: nn.Module,
    *,
    optimizers: Sequence[torch.optim.Optimizer] | torch.optim.Optimizer = (),
    scheduler: Any = None,
    loader: Any = None,
    step: int = 0,
    extras: Any = None,
    keep_last: int | None = None,
) -> Path:
    """Save model, optimizers, scheduler, loader position, RNG states, step and extras.

    Call it on every rank. Returns the published step directory (``path/step-<step>``).
    Raises ``CheckpointError`` (on every rank) when anything cannot be saved; the previous
    checkpoints are untouched. See docs/checkpoints.md.
    """
    return write_and_publish(
        collect(
            path,
            state,
            model,
            optimizers=optimizers,
            scheduler=scheduler,
            loader=loader,
            step=step,
            extras=extras,
            keep_last=keep_last,
        ),
        Group.of(state),
    )


def collect(
    path: str | os.PathLike[str],
    state: PrepState,
    model: nn.Module,
    *,
    optimizers: Sequence[torch.optim.Optimizer] | torch.optim.Optimizer = (),
    scheduler: Any = None,
    loader: Any = None,
    step: int = 0,
    extras: Any = None,
    keep_last: int | None = None,
    stage: Callable[[dict[str, torch.Tensor]], dict[str, torch.Tensor]] | None = None,
) -> Collected:
    """Steps 1 and 2: check and collect everything, make the ``.tmp-*`` directory, agree.

    ``stage`` (asynchronous saves) replaces the live tensors by copies before the agreement, so
    that a rank failing to stage fails every rank. Collectives: the default group only.
    """
    root = Path(path)
    group = Group.of(state)
    core = need(state.core, "init_core", "fprep.save")
    sd_state = need(state.state_dict, "init_state_dict", "fprep.save")
    device = need(state.device, "init_device", "fprep.save")
    tmp: Path | None = None
    error: BaseException | None = None
    tensors: dict[str, torch.Tensor] = {}
    skeletons: list[OptimizerRecord] = []
    encoded_extras: Any = None
    encoded_scheduler: Any = None
    encoded_scaler: Any = None
    record = RankRecord()
    try:
        _check_args(step, keep_last)
        opts = as_optimizers(optimizers)
        check_stateful(scheduler, "scheduler")
        check_stateful(loader, "loader")
        encoded_extras = encode(extras, "extras", None)
        encoded_scheduler = (
            None if scheduler is None else encode(scheduler.state_dict(), "scheduler", None)
        )
        encoded_loader = None if loader is None else encode(loader.state_dict(), "loader", None)
        encoded_scaler = _grad_scaler_state(state)
        tensors.update(model_tensors(state, model, for_save=True))
        skeletons = split_optimizers(state, model, opts, tensors, for_save=True)
        if stage is not None:
            tensors = stage(tensors)
        record = RankRecord(rng=rng.capture(device.device_type), loader=encoded_loader)
        if group.rank == 0:
            tmp = layout.new_tmp_dir(root, step)
    except Exception as e:
        error = e if isinstance(e, PrepError) else _failed("collecting state", root, e)
    try:
        names = group.agree(error, None if tmp is None else tmp.name)
    except BaseException:
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)
        raise
    return Collected(
        root=root,
        tmp=root / names[0],
        step=step,
        keep_last=keep_last,
        strategy=core.strategy,
        state_dict_type=sd_state.type,
        tensors=tensors,
        optimizers=tuple(skeletons),
        scheduler=encoded_scheduler,
        grad_scaler=encoded_scaler,
        extras=encoded_extras,
        record=record,
    )


def write_and_publish(
    collected: Collected, group: Group, *, process_group: Any = None, progress: bool = True
) -> Path:
    """Steps 3 to 5: write the tensors and ``metadata.json``, then (rank 0) the manifest;
    publish. Every collective runs on ``group`` (and DCP's on ``process_group``, None for the
    default group). ``progress``: rank 0 may draw a progress line."""
    c = collected
    tmp = c.tmp
    writer = SafeWriter(tmp, progress=progress and group.rank == 0)
    try:
        with group.dcp_call():
            dcp_save(
                c.tensors,
                storage_writer=writer,
                planner=DefaultSavePlanner(flatten_state_dict=False),
                process_group=process_group,
                no_dist=not group.distributed,
            )
    except BaseException as e:  # DCP raises CheckpointException, a BaseException
        if isinstance(e, KeyboardInterrupt | SystemExit):
            raise
        _discard(tmp, group)
        raise unwrap_dcp_error(e) from None
    c.tensors = {}  # written: free them (a full state dict on rank 0 is a whole model)
    gathered = group.all_gather((dict(writer.files), c.record))
    published: Path | None = None
    error: BaseException | None = None
    if group.rank == 0:
        try:
            files = {name: rec for f, _ in gathered for name, rec in f.items()}
            manifest = Manifest(
                step=c.step,
                world_size=group.world_size,
                strategy=c.strategy,
                state_dict_type=c.state_dict_type,
                files=files,
                optimizers=c.optimizers,
                scheduler=c.scheduler,
                grad_scaler=c.grad_scaler,
                ranks=tuple(r for _, r in gathered),
                extras=c.extras,
                fprep_version=_fprep_version(),
                torch_version=str(torch.__version__),
            )
            write_durable(tmp / layout.MANIFEST, manifest.to_json_bytes())
            published = layout.publish(c.root, tmp, c.step)
            if c.keep_last is not None:
                layout.rotate(c.root, c.keep_last)
            layout.clean_stale(c.root)
        except Exception as e:
            error = e if isinstance(e, PrepError) else _failed("publishing", c.root, e)
            if published is None:
                shutil.rmtree(tmp, ignore_errors=True)
    group.agree(error)
    name = group.broadcast(None if published is None else published.name)
    return c.root / str(name)


def _grad_scaler_state(state: PrepState) -> Any:
    """fp16's loss scale and growth tracker: without them a resumed run starts from the initial
    scale (and skips steps finding it again), so it would not equal the uninterrupted run."""
    scaler = getattr(state.handles, "grad_scaler", None)
    if scaler is None or not scaler.is_enabled():
        return None
    return encode(scaler.state_dict(), "grad_scaler", None)


def _failed(phase: str, root: Path, error: Exception) -> CheckpointError:
    wrapped = CheckpointError(
        f"saving to {root} failed while {phase}: {type(error).__name__}: {error}",
        subject=str(root),
        hint="The previous checkpoints are untouched; the next save removes what this one left.",
    )
    wrapped.__cause__ = error
    return wrapped


def _discard(tmp: Path, group: Group) -> None:
    if group.rank == 0:
        shutil.rmtree(tmp, ignore_errors=True)


def _fprep_version() -> str:
    import fprep

    return str(getattr(fprep, "__version__", ""))
