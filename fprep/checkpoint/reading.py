"""``fprep.load``: read a checkpoint into a prepared model, at any world size and strategy.

Phases (every rank, collectives in the same order), each ending in agreement so that a failure
on one rank is raised on all:

1. every rank's path must lead to one place (``same_path``); rank 0 resolves the step
   directory (``latest`` with the manifest digest it pins, or the newest ``step-*``);
2. every rank checks ``manifest.json``'s seal (and the pinned digest) and parses it (strict
   JSON), checks ``metadata.json`` against the size and digest the manifest records, parses it,
   and compares keys, shapes and dtypes with the live model and optimizers; each optimizer
   record is checked against the live optimizer (``optim_fit``: groups, hyperparameter kinds,
   state entries), the RNG states in full (``rng.check``: ``rng.restore`` cannot fail on what
   passes), the scheduler / loader / extras data is decoded. Nothing has been changed yet (see
   ``_restore`` for the one exception); all ranks agree that every check passed on every rank;
3. DCP plans which chunks each rank reads; ``SafeReader`` opens and checks every file this rank
   needs (size, digest), all ranks agree that every check passed, and only then copies the
   chunks into the live tensors (this rank's shards, in place: no second copy of the state);
4. then the model, optimizers, scheduler, loader and RNG states are set from them, and the
   ranks agree once more: every rank returns, or every rank raises.

An ``OSError`` on the way (permissions, a file that cannot be opened, an I/O error) becomes a
``CheckpointError`` naming the file and what to do, on every rank.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.checkpoint.state_dict_loader import load as dcp_load

from fprep.checkpoint import optim_fit, pipeline, rng, validate
from fprep.checkpoint.collective import Group, unwrap_dcp_error
from fprep.checkpoint.format import metadata as md_json
from fprep.checkpoint.format.encoding import decode, encode, tensor_keys
from fprep.checkpoint.format.files import parse_json, read_failure
from fprep.checkpoint.format.manifest import Manifest, parse
from fprep.checkpoint.info import LoadedInfo
from fprep.checkpoint.same_path import agree_on_path
from fprep.checkpoint.states import (
    MODEL,
    class_name,
    fresh_skeleton,
    group_params,
    model_key,
    model_tensors,
    optimizer_prefix,
)
from fprep.checkpoint.stores import layout
from fprep.checkpoint.stores.backend import StepFiles, open_store
from fprep.checkpoint.writing import as_optimizers, check_stateful
from fprep.errors import CheckpointError
from fprep.state import PrepState, need


@dataclass
class _OptimizerPlan:
    optimizer: torch.optim.Optimizer
    index: int
    fresh: bool  # saved before its first step: restore hyperparameters, clear state
    saved: Any  # the checkpoint's encoded skeleton
    saved_groups: list[dict[str, Any]]  # tensors in them are placeholders
    load_groups: bool  # False: another optimizer class (strict=False), keep its hyperparameters
    live: Any = None  # the live encoded skeleton (not fresh)
    fill: list[dict[str, Any]] = field(default_factory=list)  # per group: live values kept
    live_tensors: dict[str, torch.Tensor] = field(default_factory=dict)


@dataclass
class _Plan:
    step_dir: Path | str
    manifest: Manifest
    metadata: Metadata
    targets: dict[str, torch.Tensor]
    model_keys: list[str]
    optimizers: list[_OptimizerPlan]
    scheduler_state: Any
    scaler_state: Any
    loader_state: Any
    rng_state: Any
    extras: Any
    missing: tuple[str, ...]
    unexpected: tuple[str, ...]
    notes: list[str]


def _dummy(key: str) -> torch.Tensor:
    return torch.empty(0)


def _read(step_dir: StepFiles, pinned: str | None) -> tuple[Manifest, Metadata]:
    manifest = parse(
        step_dir.read_small(layout.MANIFEST, layout.MANIFEST),
        pinned=pinned,
        pointer=step_dir.pointer(),
    )
    files = manifest.files
    raw = step_dir.read_verified(
        md_json.METADATA_FILE, files[md_json.METADATA_FILE], md_json.METADATA_FILE
    )
    metadata = md_json.from_json(
        parse_json(raw, md_json.METADATA_FILE), {n: r.size for n, r in files.items()}
    )
    for name, record in sorted(files.items()):
        if name != md_json.METADATA_FILE:
            step_dir.check_size(name, record, name)  # missing or truncated: fail early
    return manifest, metadata


def _saved_specs(metadata: Metadata) -> dict[str, validate.Spec]:
    return {
        key: (tuple(md.size), md.properties.dtype)
        for key, md in metadata.state_dict_metadata.items()
        if isinstance(md, TensorStorageMetadata)
    }


def _spec(t: torch.Tensor) -> validate.Spec:
    return tuple(t.shape), t.dtype


def _decode_plain(data: Any, what: str) -> Any:
    return decode(data, what, None)


def _nothing_saved(arg: str, saved: str, kept: str, strict: bool, source: str) -> str:
    """An object was passed whose state the checkpoint does not have: refused when strict,
    else the note saying it was left as is."""
    if strict:
        raise CheckpointError(
            f"{source} has no {saved}, but a {arg} was passed.",
            subject=arg,
            hint=f"Pass {arg}=None, or load with strict=False to keep its {kept}.",
        )
    return f"the checkpoint has no {saved}; the {arg} was left as is."


def _plan(
    target: StepFiles,
    pinned: str | None,
    state: PrepState,
    model: nn.Module,
    opts: tuple[torch.optim.Optimizer, ...],
    scheduler: Any,
    loader: Any,
    strict: bool,
    group: Group,
) -> _Plan:
    device = need(state.device, "init_device", "fprep.load")
    step_dir = target.location
    manifest, metadata = _read(target, pinned)
    saved = _saved_specs(metadata)
    notes: list[str] = []
    source = f"the checkpoint {step_dir}"

    live_model = model_tensors(state, model, for_save=False)
    live: dict[str, torch.Tensor] = dict(live_model)
    saved_for_compare = {k: v for k, v in saved.items() if k.startswith(MODEL + "/")}
    # under pipeline parallelism: what other stages hold is compared (its shape), not loaded
    others = pipeline.elsewhere(state)
    expected: dict[str, validate.Spec] = {}
    for fqn, shape in others.items():
        key = model_key(fqn)
        found = saved.get(key)
        expected[key] = (shape, found[1] if found is not None else torch.float32)

    # optimizers: structure first, so that a mismatch fails before any optimizer state exists
    if len(opts) > len(manifest.optimizers):
        message = (
            f"{len(opts)} optimizer(s) were passed but the checkpoint has "
            f"{len(manifest.optimizers)}."
        )
        if strict:
            raise CheckpointError(
                f"{source} does not match: {message}",
                subject="optimizers",
                hint="Pass the optimizers that were saved (in the same order), or strict=False.",
            )
        notes.append(message + " The others were left as they are.")
    elif len(opts) < len(manifest.optimizers):
        notes.append(
            f"the checkpoint has {len(manifest.optimizers)} optimizer(s); {len(opts)} were loaded."
        )
    plans: list[_OptimizerPlan] = []
    for i, (opt, saved_opt) in enumerate(zip(opts, manifest.optimizers, strict=False)):
        prefix = optimizer_prefix(i)
        what = f"the checkpoint's optimizer {i}"
        saved_skel = pipeline.restrict(saved_opt.state, others)  # this rank's parameters
        same_class = saved_opt.cls == class_name(opt)
        if not same_class:
            message = f"optimizer {i} is a {class_name(opt)}; the checkpoint's is a {saved_opt.cls}"
            if strict:
                raise CheckpointError(
                    f"{source} does not match: {message}.",
                    subject=f"optimizers[{i}]",
                    hint="Pass the optimizers that were saved, in the same order (or "
                    "strict=False to load what both have in common).",
                )
            notes.append(message + "; its hyperparameters were not loaded.")
        for key in tensor_keys(saved_skel):
            if not key.startswith(prefix + "/") or key not in saved:
                raise CheckpointError(
                    f"{what} refers to a tensor {key!r} that metadata.json does not have.",
                    subject="manifest.json",
                    hint="The manifest was modified or does not belong to this checkpoint.",
                )
        structure = decode(saved_skel, what, _dummy)
        groups = structure.get("param_groups") if isinstance(structure, dict) else None
        if (
            not isinstance(groups, list)
            or not all(isinstance(g, dict) and isinstance(g.get("params"), list) for g in groups)
            or not isinstance(structure.get("state"), dict)
        ):
            raise CheckpointError(
                f"{what} is not an optimizer state dict (no 'state' / 'param_groups').",
                subject="manifest.json",
                hint="The manifest was modified or was not written by fprep.save.",
            )
        fresh = not tensor_keys(saved_skel) and not structure["state"]
        plan = _OptimizerPlan(
            optimizer=opt,
            index=i,
            fresh=fresh,
            saved=saved_skel,
            saved_groups=groups,
            load_groups=same_class,
        )
        if fresh:
            osd = fresh_skeleton(model, opt)
        else:
            osd = get_optimizer_state_dict(model, opt)  # creates state if it has none (undone
            # by _restore on failure)
            plan.live = encode(osd, prefix, plan.live_tensors)
            live.update(plan.live_tensors)
            saved_for_compare.update(
                {
                    k: v
                    for k, v in saved.items()
                    if k.startswith(prefix + "/")
                    and not pipeline.optimizer_key_elsewhere(k, others)
                }
            )
        live_groups = group_params(osd)
        saved_groups = [list(g["params"]) for g in groups]
        if saved_groups != live_groups:
            message = (
                f"optimizer {i}'s param groups hold different parameters: the checkpoint has "
                f"{_groups_text(saved_groups)}, the live optimizer {_groups_text(live_groups)}"
            )
            if strict or len(saved_groups) != len(live_groups):
                raise CheckpointError(
                    f"{source} does not match: {message}.",
                    subject=f"optimizers[{i}]",
                    hint="Build the optimizer over the same parameters, in the same groups.",
                )
            notes.append(message + "; hyperparameters were loaded by group position.")
        _check_fit(plan, structure, osd, source, notes)
        plans.append(plan)

    diff = validate.compare({k: _spec(v) for k, v in live.items()} | expected, saved_for_compare)
    validate.check(diff, strict=strict, source=source)

    scheduler_state = None
    if scheduler is not None:
        if manifest.scheduler is None:
            notes.append(_nothing_saved("scheduler", "scheduler state", "state", strict, source))
        else:
            scheduler_state = _decode_plain(manifest.scheduler, "the scheduler state")
            if not isinstance(scheduler_state, dict):
                raise CheckpointError(
                    "the checkpoint's scheduler state is not a dict.", subject="scheduler"
                )

    scaler_state = None
    has_scaler = getattr(state.handles, "grad_scaler", None) is not None
    if has_scaler and manifest.grad_scaler is None:
        notes.append("the checkpoint has no fp16 grad-scaler state; the loss scale starts anew.")
    elif manifest.grad_scaler is not None and not has_scaler:
        notes.append("the checkpoint's fp16 grad-scaler state was not used (this run is not fp16).")
    elif manifest.grad_scaler is not None:
        scaler_state = _decode_plain(manifest.grad_scaler, "the grad-scaler state")
        if not isinstance(scaler_state, dict) or not isinstance(scaler_state.get("scale"), float):
            raise CheckpointError(
                "the checkpoint's grad-scaler state is not a GradScaler state dict.",
                subject="grad_scaler",
                hint="The manifest was modified or not written by fprep.save; nothing was loaded.",
            )

    same_world = manifest.world_size == group.world_size
    record = manifest.ranks[group.rank] if same_world else manifest.ranks[0]
    loader_state = None
    if loader is not None:
        if record.loader is None:
            notes.append(
                _nothing_saved("loader", "data-loader position", "position", strict, source)
            )
        else:
            loader_state = _decode_plain(record.loader, "the data-loader position")
            if not same_world:
                notes.append(
                    f"saved at world size {manifest.world_size}: rank 0's data-loader position "
                    "was applied (its batch count is per rank)."
                )

    rng_state = None
    if same_world:
        notes.extend(rng.check(record.rng, device.device_type))
        rng_state = record.rng
    else:
        notes.append(
            f"RNG states were not restored: saved by {manifest.world_size} rank(s), loaded by "
            f"{group.world_size}."
        )

    extras = _decode_plain(manifest.extras, "the extras")
    # DCP reads into the live tensors themselves (after every check has passed, see
    # SafeReader); cast copies for buffers whose dtype changed since they were recorded.
    targets = {key: live[key] for key in live if key in saved_for_compare}
    return _Plan(
        step_dir=step_dir,
        manifest=manifest,
        metadata=metadata,
        targets=targets,
        model_keys=[k for k in live_model if k in targets],
        optimizers=plans,
        scheduler_state=scheduler_state,
        scaler_state=scaler_state,
        loader_state=loader_state,
        rng_state=rng_state,
        extras=extras,
        missing=diff.missing,
        unexpected=diff.unexpected,
        notes=notes,
    )


def _check_fit(
    plan: _OptimizerPlan, structure: Any, live: dict[str, Any], source: str, notes: list[str]
) -> None:
    """The saved record against the live optimizer (``optim_fit``), for what will be applied:
    its hyperparameters (when they are loaded) and its state (when the saved one is used)."""
    if plan.load_groups:
        optim_fit.check_groups(plan.saved_groups, live["param_groups"], plan.index, source)
        plan.fill = optim_fit.missing_hyperparameters(plan.saved_groups, live["param_groups"])
        for g, fill in enumerate(plan.fill):
            if fill:
                notes.append(
                    f"optimizer {plan.index} param group {g}: the checkpoint has no "
                    f"{', '.join(map(repr, sorted(fill)))}; the live value was kept."
                )
    if not plan.fresh and set(tensor_keys(plan.saved)) == set(plan.live_tensors):
        optim_fit.check_state(structure["state"], live["state"], plan.index, source)


def _groups_text(groups: list[list[str]]) -> str:
    return "[" + "; ".join(", ".join(g[:4]) + (", …" if len(g) > 4 else "") for g in groups) + "]"


def _restore(opts: Sequence[torch.optim.Optimizer], snapshots: list[dict[Any, Any]]) -> None:
    """Undo ``get_optimizer_state_dict``'s state creation on optimizers that had none."""
    for opt, snapshot in zip(opts, snapshots, strict=True):
        opt.state.clear()
        opt.state.update(snapshot)


def _fallback(
    loaded: dict[str, torch.Tensor], live: dict[str, torch.Tensor]
) -> Callable[[str], torch.Tensor]:
    def lookup(key: str) -> torch.Tensor:
        return loaded[key] if key in loaded else live[key]

    return lookup


def _apply(plan: _Plan, model: nn.Module, strict: bool) -> None:
    targets = plan.targets
    model_sd: dict[str, Any] = {key.partition("/")[2]: targets[key] for key in plan.model_keys}
    missing_model = any(k.startswith(MODEL + "/") for k in plan.missing)
    set_model_state_dict(
        model, model_sd, options=StateDictOptions(strict=strict and not missing_model)
    )
    for op in plan.optimizers:
        opt = op.optimizer
        if op.fresh:
            if op.load_groups:
                _update_groups(opt.param_groups, op.saved_groups)
                opt.state.clear()
            continue
        what = f"optimizer {op.index}"
        live = decode(op.live, what, _fallback(targets, op.live_tensors))
        if set(tensor_keys(op.saved)) == set(op.live_tensors):
            osd = decode(op.saved, what, targets.__getitem__)
            if not op.load_groups:
                osd["param_groups"] = live["param_groups"]
            for group, fill in zip(osd["param_groups"], op.fill, strict=False):
                group.update(fill)
        else:  # strict=False with differing keys: the live structure, saved values where present
            osd = live
            if op.load_groups:
                _update_groups(osd["param_groups"], op.saved_groups)
        set_optimizer_state_dict(model, opt, osd)


def _apply_failed(step_dir: Path | str, error: Exception) -> CheckpointError:
    """A failure after every check passed (a scheduler's or loader's own ``load_state_dict``,
    an I/O error, a bug): the live objects may be partly loaded, and every rank says so."""
    if isinstance(error, CheckpointError):
        return error
    wrapped = CheckpointError(
        f"loading {step_dir} failed after every check had passed, while applying it: "
        f"{type(error).__name__}: {error}",
        subject=str(step_dir),
        hint="The model, optimizers, scheduler or loader may be partly loaded: load again or "
        "rebuild them. A scheduler's or loader's load_state_dict gets the saved data as it is; "
        "anything else is a bug in fprep's checks, please report it.",
    )
    wrapped.__cause__ = error
    return wrapped


def _update_groups(groups: list[dict[str, Any]], saved_groups: list[dict[str, Any]]) -> None:
    """Saved hyperparameters into param groups (by position; tensor-valued ones excepted)."""
    for group, saved in zip(groups, saved_groups, strict=False):
        group.update(
            {k: v for k, v in saved.items() if k != "params" and not isinstance(v, torch.Tensor)}
        )


def load(
    path: str | os.PathLike[str],
    state: PrepState,
    model: nn.Module,
    *,
    optimizers: Sequence[torch.optim.Optimizer] | torch.optim.Optimizer = (),
    scheduler: Any = None,
    loader: Any = None,
    strict: bool = True,
    verify_hashes: bool = True,
) -> LoadedInfo:
    """Load a checkpoint saved by ``fprep.save`` (any world size, strategy or state-dict type).

    ``path`` is the root given to ``save`` (its ``latest`` checkpoint is read) or one step
    directory. Call it on every rank. Raises ``CheckpointError`` (on every rank) for anything
    that cannot be loaded safely and exactly; the model and optimizers are then unchanged.
    ``verify_hashes=False`` skips the digests of the tensor files (for storage you trust, when
    hashing is the bottleneck); sizes, structure and metadata are still checked, and nothing is
    ever unpickled either way.
    """
    group = Group.of(state)
    device = need(state.device, "init_device", "fprep.load")
    error: BaseException | None = None
    opts: tuple[torch.optim.Optimizer, ...] = ()
    found: tuple[str, str | None] | None = None
    store = agree_on_path(group, "fprep.load", path, open_store)  # one place on every rank
    try:
        for flag, value in (("strict", strict), ("verify_hashes", verify_hashes)):
            if not isinstance(value, bool):
                raise CheckpointError(f"{flag} must be True or False; got {value!r}.", subject=flag)
        opts = as_optimizers(optimizers)
        check_stateful(scheduler, "scheduler")
        check_stateful(loader, "loader")
        if group.rank == 0:
            found = store.resolve()
    except Exception as e:
        error = read_failure(e, path)
    name, pinned = group.agree(error, found)[0]
    target = store.step(name)
    step_dir = target.location

    snapshots = [dict(opt.state) for opt in opts]
    plan: _Plan | None = None
    error = None
    try:
        plan = _plan(target, pinned, state, model, opts, scheduler, loader, strict, group)
    except Exception as e:
        error = read_failure(e, step_dir)
    try:
        group.agree(error)
    except BaseException:
        _restore(opts, snapshots)
        raise
    assert plan is not None
    if plan.targets:
        reader = target.reader(
            plan.metadata,
            plan.manifest.files,
            verify=verify_hashes,
            agree=group.agree if group.distributed else None,
            progress=group.rank == 0,
        )
        try:
            with group.dcp_call():
                dcp_load(
                    plan.targets,
                    storage_reader=reader,
                    planner=DefaultLoadPlanner(flatten_state_dict=False),
                    no_dist=not group.distributed,
                )
        except BaseException as e:  # DCP raises CheckpointException, a BaseException
            _restore(opts, snapshots)
            if isinstance(e, KeyboardInterrupt | SystemExit):
                raise
            raise unwrap_dcp_error(e) from None
        finally:
            reader.close()  # files still open if DCP failed before reading
    error = None
    try:
        _apply(plan, model, strict)
        if scheduler is not None and plan.scheduler_state is not None:
            scheduler.load_state_dict(plan.scheduler_state)
        scaler = getattr(state.handles, "grad_scaler", None)
        if scaler is not None and plan.scaler_state is not None:
            scaler.load_state_dict(plan.scaler_state)
        if loader is not None and plan.loader_state is not None:
            loader.load_state_dict(plan.loader_state)
        if plan.rng_state is not None:
            rng.restore(plan.rng_state, device.device_type)
    except Exception as e:
        error = _apply_failed(step_dir, e)
    group.agree(error)  # every rank returns, or every rank raises
    refresh = getattr(state.handles, "fp8_scales", None)
    if refresh is not None:  # float8 all-gather: scales precomputed for the old weights
        refresh()
    return LoadedInfo(
        step=plan.manifest.step,
        extras=plan.extras,
        path=step_dir,
        world_size=plan.manifest.world_size,
        strategy=plan.manifest.strategy,
        state_dict_type=plan.manifest.state_dict_type,
        missing_keys=plan.missing,
        unexpected_keys=plan.unexpected,
        rng_restored=plan.rng_state is not None,
        notes=tuple(plan.notes),
    )
