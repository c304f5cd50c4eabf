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
from fprep.apply.init_jobs import Init, Scratch, job_for, run_everywhere
from fprep.apply.init_rows import init_by_rows
from fprep.apply.init_schedule import schedule, shares_work
from fprep.apply.shard import carry_param_attributes, param_attributes
from fprep.apply.steps import handles_of, step
from fprep.progress import Progress
from fprep.state import PrepState, ShardSpec, need

#: Reproducible mode tries the row-local init first (``init_rows``); tests and
#: benchmarks/prepare_memory.py turn it off to measure the full computation alone.
ROW_LOCAL = True


def _initializer(state: PrepState) -> Init:
    fn = state.config.param_init_fn
    if fn is not None:
        return fn

    def reset(module: nn.Module) -> None:
        module.reset_parameters()  # type: ignore[operator]

    return reset


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
    # different weights.
    mesh_groups: list[Any] = []
    if core.is_sharded and pg.world_size > 1 and not cfg.sync_module_states:
        mesh = live.mesh
        mesh_groups = (
            [mesh.get_group(d) for d in range(mesh.ndim)]
            if mesh is not None
            else [live.process_group]
        )
        check_same_modules(plan.modules, mesh_groups, device)
    group = live.process_group if mesh_groups and world > 1 else None
    if plan.method == "none":
        return state, model
    storage = torch.device("cpu") if core.offload == "cpu" else device
    init = _initializer(state)
    seed = cfg.seed
    if seed is None:
        # Only where every rank materializes (checked above); DDP, fast_ddp and
        # sync_module_states overwrite the other ranks' weights with rank 0's anyway.
        seed = _agreed_initial_seed(mesh_groups, device)
    specs = {name: s for s in (*handles.specs, *handles.ignored) for name in s.names}
    modules = [(fqn, model.get_submodule(fqn)) for fqn in plan.modules]
    with torch.no_grad():
        # Allocate everything first: a tied parameter is reachable from several modules, and
        # allocating it again after one of them initialized it would lose those values.
        for _, module in modules:
            attrs = param_attributes(module, recurse=False)
            module.to_empty(device=storage, recurse=False)
            carry_param_attributes(module, attrs, recurse=False)  # to_empty made new objects
        _retie(model, specs)
        jobs = [
            job_for(
                fqn,
                module,
                specs,
                device,
                reproducible=cfg.reproducible_init,
                can_skip=plan.method == "reset_parameters",
                seed=seed,
                shard_rank=rank,
            )
            for fqn, module in modules
        ]
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
                    if not (by_rows and init_by_rows(job, init, device, world, rank)):
                        in_full.append(job.fqn)
                        run_everywhere(job, init, scratch, device, world, rank)
                    if job.broadcast_buffers and group is not None:
                        broadcast_buffers(job.module, group, device)
                    progress.advance()
                    continue
                phase = [todo[i] for i in item]
                if by_rows:
                    phase = [j for j in phase if not init_by_rows(j, init, device, world, rank)]
                    progress.advance(len(item) - len(phase))
                    assert group is not None  # phases exist only where ranks share the work
                    check_same_fallbacks([j.fqn for j in phase], group, device)
                if phase:
                    run_phase(phase, init, scratch, device, group, world, rank, progress)
            if by_rows and group is not None:
                check_same_fallbacks(in_full, group, device)
    return state, model
