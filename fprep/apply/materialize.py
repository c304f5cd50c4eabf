"""materialize: turn meta-device parameters into real ones, as the plan says.

Runs after sharding, so a sharded rank only ever allocates its own shards plus, in reproducible
mode, one module's full parameters at a time, in one scratch buffer reused for every module
(fresh full-size tensors per module cost about as much in page faults as the init itself).

Reproducible mode (``PrepConfig.reproducible_init=True``, the default) seeds each module from
``(seed, module FQN)``, computes its full parameters and keeps this rank's rows. The result is
the same for any world size — 1, 2 or 3 ranks give bitwise the same full parameters — which raw
FSDP2 (each rank running ``reset_parameters`` on its shard) does not give. Who computes:

* on gloo (CPU), the ranks of a shard group share the work: each module is computed in full on
  one rank (largest first, to the rank with the least work so far), which sends every other
  rank its rows, point to point, straight into their shards; each rank computes about
  ``1/world`` of the model. On a CPU, drawing the random numbers (~0.4 G elements/s per core)
  costs more than moving the bytes: at 2 ranks this took 20-35% less CPU time than
  every rank computing everything (benchmarks/prepare_memory.py), and the gap grows with the
  world size. Only leaf modules without buffers whose parameters are all sharded are shared;
  the others (a module whose init may write its children's parameters, as
  ``nn.MultiheadAttention`` does, or one with buffers) are computed on every rank, in plan
  order.
* on other backends (NCCL, HCCL, ...) every rank computes every module in full: accelerators
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
"""

from __future__ import annotations

import contextlib
import heapq
import itertools
import zlib
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from fprep.apply.steps import handles_of, step
from fprep.errors import PrepareError
from fprep.progress import Progress
from fprep.sharding import local_rows
from fprep.state import PrepState, ShardSpec, need

#: Byte alignment of views carved from a scratch buffer: at least what a fresh allocation gets
#: (64 bytes on CPU, 512 with the CUDA caching allocator), so kernels see the same alignment.
ALIGN = 512
#: Backends whose shard groups share the full computation (see the module docstring).
SHARING_BACKENDS = frozenset({"gloo"})

Init = Callable[[nn.Module], None]
#: One item of a schedule: a module index (initialized on every rank), or a phase of module
#: indices (each computed on one shard rank, which sends the others their rows).
Work = int | tuple[int, ...]


# -- pure core ------------------------------------------------------------------------------------
def module_seed(base: int, fqn: str, shard_rank: int | None = None) -> int:
    """A stable per-module seed: the same on every rank and every run; with ``shard_rank``
    (non-reproducible mode, modules holding shards) one per shard."""
    key = fqn if shard_rank is None else f"{fqn}\x00{shard_rank}"
    return (base * 1_000_003 + zlib.crc32(key.encode())) % (2**63 - 1)


def carve(sizes: Sequence[int], align: int = ALIGN) -> tuple[tuple[int, ...], int]:
    """Byte offsets of blocks of ``sizes`` bytes laid end to end, each starting ``align``-aligned,
    and the bytes they span; blocks never overlap."""
    offsets: list[int] = []
    end = 0
    for size in sizes:
        offsets.append(end)
        end += -(-size // align) * align
    return tuple(offsets), end


def shares_work(backend: str, shard_size: int) -> bool:
    """Whether a shard group computes each module once and sends the rows (else every rank
    computes every module in full): where random numbers cost more than bytes moved."""
    return shard_size > 1 and backend in SHARING_BACKENDS


def schedule(shareable: Sequence[bool]) -> list[Work]:
    """Modules (by index, in plan order) grouped into the order of work.

    A module that cannot be shared is initialized on every rank, in plan order: it is a
    barrier, since its init may write what another module's init writes
    (``nn.MultiheadAttention`` sets its child's bias). Consecutive shareable modules (leaves
    that touch only their own, sharded parameters, so their order does not matter) form one
    phase, shared out by ``assign``.
    """
    out: list[Work] = []
    phase: list[int] = []
    for i, ok in enumerate(shareable):
        if ok:
            phase.append(i)
            continue
        if phase:
            out.append(tuple(phase))
            phase = []
        out.append(i)
    if phase:
        out.append(tuple(phase))
    return out


def assign(costs: Sequence[int], world: int) -> list[int]:
    """The shard rank that computes each module of a phase: largest first, each to the rank
    with the least work so far (the lowest on ties), so that the ranks finish together."""
    loads = [(0, k) for k in range(world)]  # a heap of (work so far, rank)
    owners = [0] * len(costs)
    for i in sorted(range(len(costs)), key=lambda i: (-costs[i], i)):
        load, k = heapq.heappop(loads)
        owners[i] = k
        heapq.heappush(loads, (load + costs[i], k))
    return owners


def row_span(spec: ShardSpec, world: int, rank: int) -> tuple[int, int]:
    """The rows ``[start, stop)`` of the full parameter that shard rank ``rank`` holds."""
    start = spec.padded_shape[0] * rank
    rows = local_rows(spec.shape[0], world, rank) if all(spec.shape[1:]) else 0
    return start, start + rows


# -- what each module needs ---------------------------------------------------------------------
@dataclass(frozen=True, eq=False)
class _StandIn:
    """A parameter replaced by a full-size tensor for the duration of its module's init."""

    name: str
    original: nn.Parameter
    shape: torch.Size
    dtype: torch.dtype
    device: torch.device
    spec: ShardSpec | None  # set where this rank keeps rows of the result (canonical, sharded)

    @property
    def nbytes(self) -> int:
        return self.shape.numel() * self.dtype.itemsize


@dataclass(frozen=True, eq=False)
class _Job:
    fqn: str
    module: nn.Module
    stand_ins: tuple[_StandIn, ...]
    seed: int
    skip: bool  # nothing its init writes is kept: a leaf whose parameters are all tied elsewhere
    shareable: bool  # a leaf without buffers whose parameters are all sharded
    broadcast_buffers: bool  # non-reproducible mode: holds shards and buffers

    @property
    def cost(self) -> int:
        return sum(s.shape.numel() for s in self.stand_ins)

    @property
    def kept(self) -> tuple[_StandIn, ...]:
        return tuple(s for s in self.stand_ins if s.spec is not None)


def _is_sharded(p: torch.Tensor) -> bool:
    return hasattr(p, "to_local")


def _local(p: nn.Parameter) -> torch.Tensor:
    local: torch.Tensor = p.to_local() if _is_sharded(p) else p  # type: ignore[attr-defined]
    return local


def _job(
    fqn: str,
    module: nn.Module,
    specs: dict[str, ShardSpec],
    device: torch.device,
    *,
    reproducible: bool,
    can_skip: bool,
    seed: int,
    shard_rank: int,
) -> _Job:
    prefix = f"{fqn}." if fqn else ""
    stand_ins: list[_StandIn] = []
    holds_shards, all_sharded, keeps_any = False, True, False
    for name, p in module._parameters.items():
        if p is None:
            continue
        spec = specs.get(prefix + name)
        canonical = spec is None or spec.fqn == prefix + name
        sharded = _is_sharded(p)
        holds_shards |= sharded
        all_sharded &= sharded
        keeps_any |= canonical
        if not canonical or (reproducible and sharded):
            stand_ins.append(
                _StandIn(
                    name=name,
                    original=p,
                    shape=p.shape,
                    dtype=p.dtype,
                    device=device if sharded else p.device,
                    spec=spec if canonical and sharded else None,
                )
            )
    has_buffers = any(b is not None for b in module._buffers.values())
    leaf = all(
        next(itertools.chain(child.parameters(), child.buffers()), None) is None
        for child in module.children()
    )
    alone = leaf and not has_buffers
    return _Job(
        fqn=fqn,
        module=module,
        stand_ins=tuple(stand_ins),
        seed=module_seed(seed, fqn, None if reproducible or not holds_shards else shard_rank),
        skip=can_skip and alone and not keeps_any,
        shareable=reproducible and alone and holds_shards and all_sharded,
        broadcast_buffers=not reproducible and holds_shards and has_buffers,
    )


class _Scratch:
    """Memory for full-size stand-ins: one byte buffer per device, sized to the largest module's
    stand-ins and allocated on first use, so its pages are touched once, not once per module."""

    def __init__(self, jobs: Sequence[_Job]) -> None:
        self._need: dict[torch.device, int] = {}
        for job in jobs:
            for device, group in _by_device(job.stand_ins).items():
                size = carve([s.nbytes for s in group])[1]
                self._need[device] = max(self._need.get(device, 0), size)
        self._buffers: dict[torch.device, torch.Tensor] = {}

    def views(self, stand_ins: Sequence[_StandIn]) -> dict[str, torch.Tensor]:
        """Non-overlapping tensors of the stand-ins' shapes; valid until the next call."""
        out: dict[str, torch.Tensor] = {}
        for device, group in _by_device(stand_ins).items():
            buffer = self._buffers.get(device)
            if buffer is None:
                buffer = torch.empty(self._need[device], dtype=torch.uint8, device=device)
                self._buffers[device] = buffer
            offsets, _ = carve([s.nbytes for s in group])
            for s, offset in zip(group, offsets, strict=True):
                out[s.name] = buffer[offset : offset + s.nbytes].view(s.dtype).view(s.shape)
        return out


def _by_device(stand_ins: Sequence[_StandIn]) -> dict[torch.device, list[_StandIn]]:
    out: dict[torch.device, list[_StandIn]] = {}
    for s in stand_ins:
        out.setdefault(s.device, []).append(s)
    return out


# -- initializing ---------------------------------------------------------------------------------
def _initializer(state: PrepState) -> Init:
    fn = state.config.param_init_fn
    if fn is not None:
        return fn

    def reset(module: nn.Module) -> None:
        module.reset_parameters()  # type: ignore[operator]

    return reset


@contextlib.contextmanager
def _blame(job: _Job) -> Iterator[None]:
    """Turn a failing init into a PrepareError naming the module."""
    try:
        yield
    except PrepareError:
        raise
    except Exception as e:
        raise PrepareError(
            f"initializing module {job.fqn or '<root>'!r} ({type(job.module).__name__}) from "
            f"the meta device failed: {type(e).__name__}: {e}",
            subject=job.fqn,
            hint="Check its reset_parameters() (or your param_init_fn): it must "
            "initialize the module's own parameters and buffers in place.",
        ) from e


@contextlib.contextmanager
def _seeded(seed: int, device: torch.device) -> Iterator[None]:
    """Seed the CPU generator (and the compute device's) for one init; restore them after.

    On a CPU, only the CPU generator is touched: ``torch.manual_seed`` would also queue a lazy
    reseed of every CUDA (XPU, MTIA) device, which ``fork_rng`` does not undo, and formats a
    stack trace for each (about 1 ms per module).
    """
    devices = [device] if device.type != "cpu" else []
    with torch.random.fork_rng(devices=devices, device_type=device.type):
        if devices:
            torch.manual_seed(seed)
        else:
            torch.default_generator.manual_seed(seed)
        yield


def _compute(
    job: _Job, init: Init, scratch: _Scratch, device: torch.device
) -> list[tuple[_StandIn, torch.Tensor]]:
    """Run ``job``'s seeded init with its stand-ins in place; the full tensors of the kept ones
    (views of ``scratch``: use them before the next call). The module gets its own parameters
    back even when the init fails, so no stand-in outlives this call through the module."""
    module = job.module
    kept: list[tuple[_StandIn, torch.Tensor]] = []
    try:
        views = scratch.views(job.stand_ins)
        for s in job.stand_ins:
            module._parameters[s.name] = nn.Parameter(
                views[s.name], requires_grad=s.original.requires_grad
            )
        with _seeded(job.seed, device):
            init(module)
        for s in job.kept:
            full = module._parameters.get(s.name)
            if full is None or full.shape != s.shape or full.dtype != s.dtype:
                what = "removed" if full is None else f"replaced it with {full.dtype} {full.shape}"
                raise PrepareError(
                    f"initializing module {job.fqn or '<root>'!r} {what}: its parameter "
                    f"{s.name!r} must stay {s.dtype} {s.shape}.",
                    subject=job.fqn,
                )
            kept.append((s, full.detach()))
    finally:
        for s in job.stand_ins:
            module._parameters[s.name] = s.original
    return kept


def _check_shard(s: _StandIn) -> torch.Tensor:
    """This rank's shard of ``s``, after checking it has the shape the plan predicted."""
    assert s.spec is not None
    local = _local(s.original)
    if tuple(local.shape) != s.spec.local_shape:
        raise PrepareError(
            f"parameter {s.spec.fqn!r} holds a shard of shape {tuple(local.shape)} but the plan "
            f"predicted {s.spec.local_shape}.",
            subject=s.spec.fqn,
        )
    return local


def _keep_rows(s: _StandIn, full: torch.Tensor, world: int, rank: int) -> None:
    assert s.spec is not None
    start, stop = row_span(s.spec, world, rank)
    _check_shard(s).copy_(full[start:stop])


def _bytes(t: torch.Tensor) -> torch.Tensor:
    """A contiguous tensor as flat bytes: sent bit for bit, whatever the backend's dtypes."""
    return t.reshape(-1).view(torch.uint8)


def _run_everywhere(
    job: _Job, init: Init, scratch: _Scratch, device: torch.device, world: int, rank: int
) -> None:
    """Initialize ``job`` on this rank alone (every rank does the same)."""
    with _blame(job):
        for s in job.kept:
            _check_shard(s)
        for s, full in _compute(job, init, scratch, device):
            _keep_rows(s, full, world, rank)


def _agree(error: PrepareError | None, group: Any, rank: int, device: torch.device) -> None:
    """Raise on every rank if one rank failed, instead of the others waiting for it forever."""
    flag = torch.tensor([0 if error is None else rank + 1], dtype=torch.int32, device=device)
    dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=group)
    if error is not None:
        raise error
    failed = int(flag.item()) - 1
    if failed >= 0:
        raise PrepareError(
            f"materializing failed on shard rank {failed}; see that rank's error.",
            subject="materialize",
        )


def _run_phase(
    jobs: Sequence[_Job],
    init: Init,
    scratch: _Scratch,
    device: torch.device,
    group: Any,
    world: int,
    rank: int,
    progress: Progress,
) -> None:
    """Share out ``jobs``: each is computed in full on one shard rank, which sends every other
    rank its rows.

    Every rank posts all its receives first (straight into its shards), then computes and sends
    its own modules: nobody waits for a peer to be ready, only for the bytes, and the ranks run
    in lockstep only at the two checks that make every rank raise if one failed.
    """
    owners = assign([job.cost for job in jobs], world)
    error: PrepareError | None = None
    try:
        for job in jobs:
            for s in job.kept:
                _check_shard(s)
    except PrepareError as e:
        error = e
    _agree(error, group, rank, device)
    tags = {
        (i, s.name): tag
        for tag, (i, s) in enumerate((i, s) for i, job in enumerate(jobs) for s in job.kept)
    }
    receiving: list[tuple[Any, torch.Tensor, torch.Tensor]] = []
    for i, job in enumerate(jobs):
        if owners[i] == rank:
            continue
        for s in job.kept:
            local = _local(s.original)
            if not local.numel():
                continue
            target = local
            if not local.is_contiguous() or local.device != device:
                target = torch.empty(local.shape, dtype=local.dtype, device=device)
            work = dist.irecv(_bytes(target), group=group, group_src=owners[i], tag=tags[i, s.name])
            receiving.append((work, local, target))
    try:
        for i, job in enumerate(jobs):
            if owners[i] != rank:
                continue
            with _blame(job):
                computed = _compute(job, init, scratch, device)
            sending = []
            for s, full in computed:
                assert s.spec is not None
                rows = full.contiguous()
                for j in range(world):
                    start, stop = row_span(s.spec, world, j)
                    if j != rank and rows[start:stop].numel():
                        chunk = _bytes(rows[start:stop])
                        sending.append(
                            dist.isend(chunk, group=group, group_dst=j, tag=tags[i, s.name])
                        )
                _keep_rows(s, rows, world, rank)
            for work in sending:  # the scratch buffer is reused by the next module
                work.wait()  # type: ignore[union-attr]
            progress.advance()
    except PrepareError as e:
        error = e
    _agree(error, group, rank, device)
    for work, local, target in receiving:
        work.wait()
        if target is not local:
            local.copy_(target)
    progress.advance(len(jobs) - owners.count(rank))


def _check_same_modules(fqns: Sequence[str], group: Any, device: torch.device) -> None:
    """Refuse, on every rank, when the shard group's ranks would materialize different modules
    (some ranks built the model on the meta device, others not): the ranks would otherwise wait
    for each other's transfers forever, or train from different weights."""
    mine = [len(fqns), zlib.crc32("\n".join(fqns).encode())]
    both = torch.tensor([*mine, *(-x for x in mine)], dtype=torch.int64, device=device)
    dist.all_reduce(both, op=dist.ReduceOp.MAX, group=group)
    high, low = both[:2].tolist(), [-x for x in both[2:].tolist()]
    if high != low:
        raise PrepareError(
            "the ranks disagree about which modules are on the meta device (this rank: "
            f"{len(fqns)} modules); every rank must build the model the same way.",
            subject="materialize",
            hint="Build the model on the meta device on every rank, or load real weights on "
            "rank 0 and set sync_module_states=True.",
        )


def _broadcast_buffers(module: nn.Module, group: Any, device: torch.device) -> None:
    """Shard rank 0's buffers to the other shard ranks (non-reproducible mode seeds per rank)."""
    for buffer in module._buffers.values():
        if buffer is None or not buffer.numel():
            continue
        work = buffer
        if not buffer.is_contiguous() or buffer.device != device:
            work = buffer.to(device).contiguous()
        dist.broadcast(_bytes(work), group=group, group_src=0)
        if work is not buffer:
            buffer.copy_(work)


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
    # and whatever the others compute is overwritten by rank 0's weights anyway.
    group = None
    if core.is_sharded and world > 1 and not cfg.sync_module_states:
        group = live.process_group
        _check_same_modules(plan.modules, group, device)
    if plan.method == "none":
        return state, model
    storage = torch.device("cpu") if core.offload == "cpu" else device
    init = _initializer(state)
    seed = cfg.seed if cfg.seed is not None else torch.initial_seed()
    specs = {name: s for s in (*handles.specs, *handles.ignored) for name in s.names}
    modules = [(fqn, model.get_submodule(fqn)) for fqn in plan.modules]
    with torch.no_grad():
        # Allocate everything first: a tied parameter is reachable from several modules, and
        # allocating it again after one of them initialized it would lose those values.
        for _, module in modules:
            module.to_empty(device=storage, recurse=False)
        _retie(model, specs)
        jobs = [
            _job(
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
        scratch = _Scratch(todo)
        progress = Progress(
            "fprep: materialize", len(jobs), enabled=None if state.topology.rank == 0 else False
        )
        with progress:
            progress.advance(len(jobs) - len(todo))
            for item in work:
                if isinstance(item, int):
                    job = todo[item]
                    _run_everywhere(job, init, scratch, device, world, rank)
                    if job.broadcast_buffers and group is not None:
                        _broadcast_buffers(job.module, group, device)
                    progress.advance()
                else:
                    phase = [todo[i] for i in item]
                    _run_phase(phase, init, scratch, device, group, world, rank, progress)
    return state, model
