"""materialize: turn meta-device parameters into real ones, as the plan says.

Runs after sharding, so a sharded rank only ever allocates its own shards.

Reproducible mode (``PrepConfig.reproducible_init=True``, the default) seeds each module from
``(seed, module FQN)`` and gives the same full parameters for any world size — 1, 2 or 3 ranks
give bitwise the same — which raw FSDP2 (each rank running ``reset_parameters`` on its shard)
does not give. Two ways, tried in this order for each module:

* row-local (``init_rows``): the module's init runs on windows onto this rank's rows, random
  fills drawn per fixed block of rows from generators seeded per block, so each rank draws only
  its own numbers (what raw FSDP2 costs) and the blocks make the result world-size independent.
  An init that does anything a window cannot do on its rows alone is put back as it was and goes
  the second way; which way a module goes never depends on the world size.
* full computation (``init_jobs``): the module's full parameters are computed on stand-ins in
  one scratch buffer reused for every module, and each rank keeps its rows. On gloo (CPU), the
  ranks of a shard group share this work: each module is computed in full on one rank (largest
  first, to the rank with the least work so far), which sends every other rank its rows, point
  to point, straight into their shards. Only leaf modules without buffers whose parameters are
  all sharded are shared; the others (a module whose init may write its children's parameters,
  as ``nn.MultiheadAttention`` does, or one with buffers) are computed on every rank, in plan
  order. On other backends (NCCL, HCCL, ...) every rank computes them in full: accelerators
  draw random numbers at memory bandwidth, faster than an interconnect moves them.

Non-reproducible mode (``reproducible_init=False``) initializes each rank's shards in place,
seeded from ``(seed, FQN, shard rank)`` for modules that hold shards (so shards differ across
ranks, unlike raw FSDP2 on a CPU mesh, where every rank draws the same numbers) and from
``(seed, FQN)`` for the others (replicated values agree). Buffers of a module that holds shards
are then broadcast from shard rank 0, so they agree too. Deterministic for a given world size.

Either way the global RNG state is restored afterwards, and a tied parameter keeps the values
its canonical (first-registered) owner's initialization gives it, as in eager construction.
Ranks exchange anything here only after checking that they all materialize the same modules,
and never with ``sync_module_states`` (rank 0's weights overwrite the others' anyway).

Pieces: ``init_schedule`` (pure: seeds, blocks, scratch layout, who computes what, which rows),
``init_rows`` (the row-local way), ``init_jobs`` (one module's seeded init on full-size
stand-ins), ``init_exchange`` (sharing the work over gloo, and failing on every rank together);
this module is the step that runs them.
"""

from __future__ import annotations

import contextlib
import importlib
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from fprep.apply.init_exchange import (
    broadcast_buffers,
    check_same_fallbacks,
    check_same_modules,
    run_phase,
)
from fprep.apply.init_jobs import Init, Scratch, job_for, reach_of, run_everywhere
from fprep.apply.init_rows import init_by_rows, init_in_full
from fprep.apply.init_schedule import schedule, shares_work
from fprep.apply.lora_init import lora_inits
from fprep.apply.shard import carry_param_attributes, param_attributes
from fprep.apply.steps import handles_of, skipped, step
from fprep.errors import PrepareError
from fprep.progress import Progress
from fprep.state import PrepState, ShardSpec, need

#: Reproducible mode tries the row-local init first (``init_rows``); tests and
#: benchmarks/prepare_memory.py turn it off to measure the full computation alone.
ROW_LOCAL = True


def _reset(module: nn.Module) -> None:
    module.reset_parameters()  # type: ignore[operator]


def _init_weights(module: nn.Module) -> None:
    module.init_weights()  # type: ignore[operator]


def _hf(owner: nn.Module) -> Init:
    """Hugging Face's per-module step of ``initialize_weights``: the owner's ``_init_weights``
    under transformers' guard of ``torch.nn.init`` (which leaves tensors flagged
    ``_is_hf_initialized`` alone), then the module marked done. A stale module flag (a model
    built, then moved to meta) is not obeyed: its tensors are on meta, so nothing loaded them."""
    guard = importlib.import_module("transformers.initialization").guard_torch_init_functions
    run: Init = getattr(owner, "_init_weights")  # noqa: B009 (an nn.Module attribute)

    def init(module: nn.Module) -> None:
        with guard():
            run(module)
        setattr(module, "_is_hf_initialized", True)  # noqa: B010

    return init


def _inits(state: PrepState, model: nn.Module) -> list[Init]:
    """What runs on each visit of the plan, in order: a peft model's LoRA factors as peft
    initializes them, everything else by the plan's method."""
    plan = need(state.param_handles, "init_param_handles", "materialize").materialize
    lora = lora_inits(state, model)
    by_method = _method_inits(state, model)
    return [lora.get(v, init) for v, init in zip(plan.visits, by_method, strict=True)]


def _method_inits(state: PrepState, model: nn.Module) -> list[Init]:
    plan = need(state.param_handles, "init_param_handles", "materialize").materialize
    fn = state.config.param_init_fn
    if plan.method == "hf_init_weights":
        default = getattr(fn, "__self__", model)
        owners: dict[str | None, Init] = {}
        out: list[Init] = []
        for owner in plan.owners:
            if owner is None and plan.outside == "reset_parameters":
                out.append(_reset)  # outside every Hugging Face sub-model: the module's own
                continue
            if owner not in owners:
                owners[owner] = _hf(default if owner is None else model.get_submodule(owner))
            out.append(owners[owner])
        return out
    one: Init = (
        fn
        if plan.method == "param_init_fn" and fn is not None
        else _init_weights
        if plan.method == "init_weights"
        else _reset
    )
    return [one] * len(plan.visits)


@contextlib.contextmanager
def _loaded_flagged(model: nn.Module, materialized: set[int], on: bool) -> Iterator[None]:
    """Hugging Face: flag the parameters that are not materialized (real values: loaded or set
    by the user) ``_is_hf_initialized`` for the walk, as transformers' loader does, so that a
    parent's ``_init_weights`` leaves them alone; flags fprep set are removed after."""
    flagged: list[nn.Parameter] = []
    if on:
        for m in model.modules():
            if id(m) in materialized:
                continue
            for p in m._parameters.values():
                if p is not None and not getattr(p, "_is_hf_initialized", False):
                    setattr(p, "_is_hf_initialized", True)  # noqa: B010
                    flagged.append(p)
    try:
        yield
    finally:
        for p in flagged:
            delattr(p, "_is_hf_initialized")


def _mark_unwritten(modules: list[tuple[str, nn.Module]]) -> None:
    """Fill floating-point buffers with NaN, so that one no init writes is noticed."""
    for _, module in modules:
        for b in module._buffers.values():
            if b is not None and b.is_floating_point():
                b.fill_(float("nan"))


def _check_written(modules: list[tuple[str, nn.Module]], method: str) -> None:
    """Refuse a floating-point buffer that no init wrote (all NaN): it would hold garbage."""
    for fqn, module in modules:
        for name, b in module._buffers.items():
            if b is not None and b.is_floating_point() and b.numel() and bool(b.isnan().all()):
                where = f"{fqn}.{name}" if fqn else name
                raise PrepareError(
                    f"buffer {where!r} was on the meta device and its module's initialization "
                    f"({method}) did not write it: it would hold garbage.",
                    subject=where,
                    hint="Initialize the buffer in reset_parameters() / _init_weights / "
                    "init_weights (or your param_init_fn), or build the model with real buffers.",
                )


def _agreed_initial_seed(groups: list[Any], device: torch.device) -> int:
    """``PrepConfig.seed=None``: the first rank's ``torch.initial_seed()``, on every rank. A
    process that never called ``manual_seed`` starts from a random seed of its own, and ranks
    seeding from different values would compute different full tensors and keep slices of each
    (hsdp replicas would even hold different weights). ``groups``: the mesh's dimension groups,
    outermost first (none: this process's own seed); broadcast along the innermost first, so
    the value of coordinate (0, ..., 0) reaches every rank."""
    seed = torch.initial_seed()
    if not groups or not dist.is_initialized():
        return seed
    value = torch.tensor([seed % (2**63 - 1)], dtype=torch.int64, device=device)
    for group in reversed(groups):
        dist.broadcast(value, group=group, group_src=0)
    return int(value.item())


def _retie(model: nn.Module, specs: dict[str, ShardSpec]) -> None:
    """Point every name of a tied parameter at its canonical object again.

    ``to_empty`` gives a meta parameter a new ``Parameter`` object per module, which silently
    unties weights the model tied (e.g. input and output embeddings).
    """
    for name, spec in specs.items():
        if name == spec.fqn:
            continue
        canonical = model.get_parameter(spec.fqn)
        owner, _, local = name.rpartition(".")
        module = model.get_submodule(owner)
        if module._parameters[local] is not canonical:
            module._parameters[local] = canonical


@step("materialize")
def materialize(state: PrepState, model: nn.Module) -> tuple[PrepState, nn.Module]:
    handles = need(state.param_handles, "init_param_handles", "materialize")
    plan = handles.materialize
    core = need(state.core, "init_core", "materialize")
    pg = need(state.process_group, "init_process_group", "materialize")
    world, rank = (pg.shard_size, pg.shard_rank) if core.is_sharded else (1, 0)
    live = handles_of(state)
    device = live.device
    cfg = state.config
    # Ranks talk to each other here only where every rank materializes the same modules. With
    # sync_module_states, rank 0 may hold real weights while the others hold meta tensors,
    # and whatever the others compute is overwritten by rank 0's weights anyway. Checked over
    # every mesh dimension: hsdp replicas that built the model differently would train from
    # different weights. Under tensor parallelism, over the whole mesh (dp dims..., tp): the
    # ranks of a tp group compute blocks of the same full tensors.
    mesh_groups: list[Any] = []
    tp_mesh = live.world_mesh
    if tp_mesh is not None and live.pp_mesh is not None:
        # under pp, the ranks of one stage: other stages materialize other modules
        names = tuple(n for n in tp_mesh.mesh_dim_names if n != "pp")
        tp_mesh = tp_mesh[names[0] if len(names) == 1 else names]
    talk = tp_mesh is not None or (core.is_sharded and pg.world_size > 1)
    if talk and not cfg.sync_module_states:
        mesh = tp_mesh if tp_mesh is not None else live.mesh
        mesh_groups = (
            [mesh.get_group(d) for d in range(mesh.ndim)]
            if mesh is not None
            else [live.process_group]
        )
        check_same_modules(plan.modules, mesh_groups, device)
    group = live.process_group if mesh_groups and world > 1 else None
    if plan.method == "none":
        return skipped(state, model)
    plan.check()
    storage = torch.device("cpu") if core.offload == "cpu" else device
    inits = _inits(state, model)
    default = inits[0] if inits else _reset
    seed = cfg.seed
    if seed is None:
        # Only where every rank materializes (checked above); DDP, fast_ddp and
        # sync_module_states overwrite the other ranks' weights with rank 0's anyway.
        seed = _agreed_initial_seed(mesh_groups, device)
    specs = {name: s for s in (*handles.specs, *handles.ignored) for name in s.names}
    modules = [(fqn, model.get_submodule(fqn)) for fqn in plan.modules]
    # Modules PrepConfig.weights fills completely: allocated here, never initialized
    # (load_weights, the next step, writes every one of their values).
    loaded = frozenset(plan.loaded)
    inited = [(fqn, module) for fqn, module in modules if fqn not in loaded]
    materialized = {id(m) for _, m in inited}
    # A parent's init (everything but reset_parameters) may write its children: in reproducible
    # mode its whole subtree is behind row windows, seeded from the parent's FQN.
    parents = cfg.reproducible_init and plan.method != "reset_parameters"
    with torch.no_grad(), contextlib.ExitStack() as flags:
        # Allocate everything first: a tied parameter is reachable from several modules, and
        # allocating it again after one of them initialized it would lose those values.
        for _, module in modules:
            attrs = param_attributes(module, recurse=False)
            module.to_empty(device=storage, recurse=False)
            carry_param_attributes(module, attrs, recurse=False)  # to_empty made new objects
        _retie(model, specs)
        _mark_unwritten(inited)
        # Flagged once allocated: to_empty swaps a DTensor parameter's contents, flags included.
        flags.enter_context(_loaded_flagged(model, materialized, plan.method == "hf_init_weights"))
        jobs = []
        visited: set[int] = set()
        for fqn, init in zip(plan.visits, inits, strict=True):
            module = model.get_submodule(fqn)
            below = parents and any(
                id(m) in materialized for m in module.modules() if m is not module
            )
            reach = (
                reach_of(fqn, module, specs, device, materialized=materialized, visited=visited)
                if below
                else None
            )
            jobs.append(
                job_for(
                    fqn,
                    module,
                    specs,
                    device,
                    reproducible=cfg.reproducible_init,
                    can_skip=plan.method == "reset_parameters",
                    seed=seed,
                    shard_rank=rank,
                    reach=reach,
                    init=init,
                )
            )
            visited.add(id(module))
        todo = [job for job in jobs if not job.skip]
        backend = need(state.device, "init_device", "materialize").backend
        sharing = (
            group is not None
            and shares_work(backend, world)
            and (dist.get_rank(group), dist.get_world_size(group)) == (rank, world)
        )
        work = schedule([sharing and job.shareable for job in todo])
        by_rows = cfg.reproducible_init and ROW_LOCAL
        scratch = Scratch(todo)
        progress = Progress(
            "fprep: materialize", len(jobs), enabled=None if state.topology.rank == 0 else False
        )
        # Modules computed in full on every rank although the row-local way was tried: the ranks
        # exchange nothing for them, but must still have gone the same way (else the ranks'
        # rows would come from two different draws); checked once, at the end.
        in_full: list[str] = []
        with progress:
            progress.advance(len(jobs) - len(todo))
            for item in work:
                if isinstance(item, int):
                    job = todo[item]
                    init = job.init or default
                    blamed: set[str] = set()
                    if not (by_rows and init_by_rows(job, init, device, world, rank, blamed)):
                        in_full.append(job.fqn)
                        if job.reach:
                            init_in_full(job, init, scratch, device, world, rank, group, blamed)
                        else:
                            run_everywhere(job, init, scratch, device, world, rank)
                    if job.broadcast_buffers and group is not None:
                        broadcast_buffers(job.module, group, device)
                    progress.advance()
                    continue
                phase = [todo[i] for i in item]
                if by_rows:
                    phase = [
                        j
                        for j in phase
                        if not init_by_rows(j, j.init or default, device, world, rank)
                    ]
                    progress.advance(len(item) - len(phase))
                    assert group is not None  # phases exist only where ranks share the work
                    check_same_fallbacks([j.fqn for j in phase], group, device)
                if phase:
                    run_phase(phase, default, scratch, device, group, world, rank, progress)
            if by_rows and group is not None:
                check_same_fallbacks(in_full, group, device)
        _check_written(inited, plan.method)
    return state, model
