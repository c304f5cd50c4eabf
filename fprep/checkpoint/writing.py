"""``fprep.save``: one checkpoint, written atomically, readable at any world size.

Order of work (every rank, collectives in the same order):

1. check that every rank's path leads to one place (``same_path``: one small all-gather), check
   the arguments and turn every non-tensor value into JSON data (before any effect);
2. rank 0 takes the root's lock (``lock.py``; held until the end), removes stale ``.tmp-*``
   leftovers and creates a fresh ``.tmp-*`` directory; all ranks agree that nothing failed;
3. ``torch.distributed.checkpoint.save`` of the tensors through ``SafeWriter`` (raw bytes,
   a BLAKE3 digest per file, ``metadata.json`` on the coordinator; a progress line on rank 0
   when it is slow);
4. rank 0 gathers each rank's file records, RNG states and loader position, writes
   ``manifest.json``, publishes (rename + ``latest``), rotates, and releases the lock;
5. every rank returns the published directory (or raises the same error).

Steps 1-2 are ``collect`` (the foreground of an asynchronous save: ``background.py`` stages the
tensors in host memory there), steps 3-5 ``write_and_publish`` (its background thread, on a
process group of its own, with one more check between 3 and 4: each rank reads back the files it
wrote and checks their digests, ``asynchronous.verify``); a synchronous ``save`` runs both in
turn. The root's lock is taken in ``collect`` and released when ``write_and_publish`` ends, so
it spans the whole save.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
from torch.distributed.checkpoint.state_dict_saver import save as dcp_save

from fprep.checkpoint import pipeline, rng
from fprep.checkpoint.asynchronous.verify import verify_written
from fprep.checkpoint.collective import Group, unwrap_dcp_error
from fprep.checkpoint.format.encoding import encode
from fprep.checkpoint.format.files import FileRecord
from fprep.checkpoint.format.manifest import Manifest, RankRecord
from fprep.checkpoint.same_path import agree_on_path
from fprep.checkpoint.states import model_tensors, split_optimizers
from fprep.checkpoint.stores.backend import Releasable, Store, open_store
from fprep.errors import CheckpointError, PrepError
from fprep.state import PrepState, need

#: ``collect``'s staging step: this rank's tensors -> what the writer reads (private copies)
Stage = Callable[[dict[str, torch.Tensor]], dict[str, torch.Tensor]]


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


@dataclass(frozen=True, kw_only=True)
class SaveArgs:
    """``fprep.save``'s keyword arguments (but ``wait``), as given: ``collect`` checks them."""

    optimizers: Sequence[torch.optim.Optimizer] | torch.optim.Optimizer = ()
    scheduler: Any = None
    loader: Any = None
    step: int = 0
    extras: Any = None
    keep_last: int | None = None


def save(
    path: str | os.PathLike[str], state: PrepState, model: nn.Module, args: SaveArgs
) -> Path | str:
    """Save model, optimizers, scheduler, loader position, RNG states, step and extras.

    Call it on every rank. Returns the published step directory (``path/step-<step>``; its
    URL, a ``str``, when ``path`` is an fsspec URL).
    Raises ``CheckpointError`` (on every rank) when anything cannot be saved; the previous
    checkpoints are untouched. See docs/checkpoints.md.
    """
    return write_and_publish(collect(path, state, model, args), Group.of(state))


def collect(
    path: str | os.PathLike[str],
    state: PrepState,
    model: nn.Module,
    args: SaveArgs,
    *,
    stage: Stage | None = None,
) -> Collected:
    """Steps 1 and 2: check and collect everything, take the lock, make the staging place,
    agree. ``stage(tensors)`` (asynchronous saves) replaces the live tensors by private copies
    before the agreement, so that a rank failing to stage fails every rank. Collectives: the
    default group only. The lock a returned ``Collected`` holds is released by
    ``write_and_publish``; on failure it is released here.
    """
    step, keep_last, scheduler, loader = args.step, args.keep_last, args.scheduler, args.loader
    group = Group.of(state)
    root = agree_on_path(group, "fprep.save", path, open_store)  # one place on every rank
    core = need(state.core, "init_core", "fprep.save")
    sd_state = need(state.state_dict, "init_state_dict", "fprep.save")
    device = need(state.device, "init_device", "fprep.save")
    tmp: str | None = None
    lock: Releasable | None = None
    error: BaseException | None = None
    collected = Collected(root=root, step=step, keep_last=keep_last)
    try:
        try:
            _check_args(step, keep_last)
            opts = as_optimizers(args.optimizers)
            check_stateful(scheduler, "scheduler")
            check_stateful(loader, "loader")
            extras = encode(args.extras, "extras", None)
            encoded_scheduler = (
                None if scheduler is None else encode(scheduler.state_dict(), "scheduler", None)
            )
            encoded_loader = None if loader is None else encode(loader.state_dict(), "loader", None)
            scaler = _grad_scaler_state(state)
            tensors: dict[str, torch.Tensor] = model_tensors(state, model, for_save=True)
            records = split_optimizers(state, model, opts, tensors, for_save=True)
            if sd_state.type == "full":
                tensors = pipeline.keep_full(state, tensors)
            collected.tensors = tensors if stage is None else stage(tensors)
            collected.rank = RankRecord(rng=rng.capture(device.device_type), loader=encoded_loader)
        except Exception as e:
            error = e if isinstance(e, PrepError) else _failed("collecting state", root, e)
        try:  # every rank of a pipeline: the stages' optimizer records, merged (a collective)
            records = pipeline.whole_records(state, None if error is not None else records)
        except CheckpointError as e:
            error = error or e
        try:
            if error is None:
                collected.manifest = Manifest(
                    step=step,
                    world_size=group.world_size,
                    strategy=core.strategy,
                    state_dict_type=sd_state.type,
                    optimizers=tuple(records),
                    scheduler=encoded_scheduler,
                    grad_scaler=scaler,
                    extras=extras,
                    fprep_version=_fprep_version(),
                    torch_version=str(torch.__version__),
                )
                if group.rank == 0:
                    root.check_root()
                    lock = root.lock()  # held until this save has published and rotated
                    root.clean_stale()  # the lock proves that no one writes them any more
                    tmp = root.new_staging(step)
        except Exception as e:
            error = e if isinstance(e, PrepError) else _failed("collecting state", root, e)
        try:
            names = group.agree(error, tmp)
        except BaseException:
            if tmp is not None:
                root.discard(tmp)
            raise
    except BaseException:
        if lock is not None:
            lock.release()
        raise
    collected.tmp, collected.lock = names[0], lock
    return collected


def write_and_publish(
    collected: Collected,
    group: Group,
    *,
    process_group: Any = None,
    progress: bool = True,
    verify: bool = False,
) -> Path | str:
    """Steps 3 to 5: write the tensors and ``metadata.json``, then (rank 0) the manifest;
    publish; release the lock. Every collective runs on ``group`` (and DCP's on
    ``process_group``, None for the default group). ``progress``: rank 0 may draw a progress
    line. ``verify``: every rank reads back its files and checks their digests before
    anything is published (``asynchronous/verify.py``; asynchronous saves)."""
    try:
        _write_tensors(collected, group, process_group=process_group, progress=progress)
        if verify:
            _verify(collected, group)
        return _publish(collected, group)
    finally:
        if collected.lock is not None:
            collected.lock.release()
            collected.lock = None


@dataclass(kw_only=True)
class Collected:
    """A save's foreground part done: every value to write, the staging place made, the lock
    held (rank 0). ``tensors`` are this rank's (the live ones for a synchronous save, staged
    host copies for an asynchronous one; emptied once written); everything else is already
    JSON data, independent of the live objects."""

    root: Store
    step: int
    keep_last: int | None
    tmp: str = ""
    lock: Releasable | None = None
    manifest: Manifest | None = None  # without files and ranks, which writing adds
    tensors: dict[str, torch.Tensor] = field(default_factory=dict)
    rank: RankRecord = field(default_factory=RankRecord)
    files: dict[str, FileRecord] = field(default_factory=dict)  # written by this rank


def _write_tensors(
    collected: Collected, group: Group, *, process_group: Any, progress: bool
) -> None:
    """Every rank's tensors into the staging place through DCP; the files written go to
    ``collected``."""
    root, tmp = collected.root, collected.tmp
    writer = root.writer(tmp, progress=progress and group.rank == 0)
    try:
        with group.dcp_call():
            dcp_save(
                collected.tensors,
                storage_writer=writer,
                planner=DefaultSavePlanner(flatten_state_dict=False),
                process_group=process_group,
                no_dist=not group.distributed,
            )
    except BaseException as e:  # DCP raises CheckpointException, a BaseException
        if isinstance(e, KeyboardInterrupt | SystemExit):
            raise
        _discard(root, tmp, group)
        raise unwrap_dcp_error(e) from None
    collected.tensors = {}  # written: free them (a full state dict on rank 0 is a whole model)
    collected.files = dict(writer.files)


def _verify(collected: Collected, group: Group) -> None:
    """Every rank reads back the files it wrote; all agree (nothing published on a failure)."""
    error: BaseException | None = None
    try:
        verify_written(collected.root, collected.tmp, collected.files, collected.step)
    except Exception as e:
        error = e if isinstance(e, PrepError) else _failed("verifying", collected.root, e)
    try:
        group.agree(error)
    except BaseException:
        _discard(collected.root, collected.tmp, group)
        raise


def _publish(collected: Collected, group: Group) -> Path | str:
    """Rank 0 completes the manifest with every rank's files and records, writes it, publishes
    and rotates; every rank returns the published directory (or raises the same error)."""
    root, tmp, keep_last = collected.root, collected.tmp, collected.keep_last
    manifest = collected.manifest
    assert manifest is not None  # set by collect before the agreement
    try:
        gathered = group.all_gather((collected.files, collected.rank))
    except BaseException:  # a rank lost after writing: leave no staged files behind
        _discard(root, tmp, group)
        raise
    published: str | None = None
    error = None
    if group.rank == 0:
        try:
            manifest = dataclasses.replace(
                manifest,
                files={name: rec for f, _ in gathered for name, rec in f.items()},
                ranks=tuple(r for _, r in gathered),
            )
            sealed = root.write_manifest(tmp, manifest.to_json_bytes())
            published = root.publish(tmp, manifest.step, sealed.digest)
            if keep_last is not None:
                root.rotate(keep_last)  # after the pointer: never the step it names
        except Exception as e:
            error = e if isinstance(e, PrepError) else _failed("publishing", root, e)
            if published is None:
                root.discard(tmp)
    group.agree(error)
    name = group.broadcast(published)
    return root.location(str(name))


def _grad_scaler_state(state: PrepState) -> Any:
    """fp16's loss scale and growth tracker: without them a resumed run starts from the initial
    scale (and skips steps finding it again), so it would not equal the uninterrupted run."""
    scaler = getattr(state.handles, "grad_scaler", None)
    if scaler is None or not scaler.is_enabled():
        return None
    return encode(scaler.state_dict(), "grad_scaler", None)


def _failed(phase: str, root: object, error: Exception) -> CheckpointError:
    wrapped = CheckpointError(
        f"saving to {root} failed while {phase}: {type(error).__name__}: {error}",
        subject=str(root),
        hint="The previous checkpoints are untouched; the next save removes what this one left.",
    )
    wrapped.__cause__ = error
    return wrapped


def _discard(root: Store, tmp: str, group: Group) -> None:
    if group.rank == 0:
        root.discard(tmp)


def _fprep_version() -> str:
    import fprep

    return str(getattr(fprep, "__version__", ""))
