"""One module's initialization in materialize: its stand-ins, the scratch memory they live in,
the seeded init, and keeping this rank's rows of the result.

A ``Job`` says what a module needs (which parameters get full-size stand-ins, its seed, whether
it can be shared out); ``compute`` runs its init on the stand-ins and always gives the module
its own parameters back; ``run_everywhere`` is the path where every rank computes the module.
"""

from __future__ import annotations

import contextlib
import itertools
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

import torch
from torch import nn

from fprep.apply.init_schedule import carve, col_span, module_seed, row_span
from fprep.errors import PrepareError
from fprep.state import ShardSpec

Init = Callable[[nn.Module], None]


@dataclass(frozen=True, eq=False)
class StandIn:
    """A parameter replaced by a full-size tensor for the duration of its module's init."""

    name: str
    original: nn.Parameter
    shape: torch.Size
    dtype: torch.dtype
    device: torch.device
    spec: ShardSpec | None  # set where this rank keeps rows of the result (canonical, sharded)
    #: Where the init sees it: (module, local name) pairs, more than one when tied in the scope;
    #: empty: the job's own module, under ``name``.
    at: tuple[tuple[nn.Module, str], ...] = ()
    tied: bool = False  # reached only by names other than its canonical one: values discarded
    written: bool = False  # an earlier init (a descendant's) already gave it values

    def places(self, module: nn.Module) -> tuple[tuple[nn.Module, str], ...]:
        return self.at or ((module, self.name),)

    @property
    def in_place(self) -> bool:
        """Not sharded and canonical: the init writes the parameter itself."""
        return self.spec is None and not self.tied and not is_sharded(self.original)

    @property
    def nbytes(self) -> int:
        return self.shape.numel() * self.dtype.itemsize


@dataclass(frozen=True, eq=False)
class Job:
    fqn: str
    module: nn.Module
    stand_ins: tuple[StandIn, ...]
    seed: int
    skip: bool  # nothing its init writes is kept: a leaf whose parameters are all tied elsewhere
    shareable: bool  # a leaf without buffers whose parameters are all sharded
    broadcast_buffers: bool  # non-reproducible mode: holds shards and buffers
    #: A parent's init that may write its descendants' parameters (Hugging Face, torchtitan,
    #: ``param_init_fn``): every parameter in its subtree, by its path below ``fqn`` (its own
    #: included); then ``stand_ins`` is empty. Empty for a module that inits only its own.
    reach: tuple[StandIn, ...] = ()
    init: Init | None = None  # what runs on ``module``; None: the caller's ``init``

    @property
    def cost(self) -> int:
        return sum(s.shape.numel() for s in self.stand_ins)

    @property
    def kept(self) -> tuple[StandIn, ...]:
        return tuple(s for s in (*self.stand_ins, *self.reach) if s.spec is not None)

    def own(self) -> frozenset[str]:
        """The paths of ``reach`` that ``module`` registers itself."""
        return frozenset(
            s.name for s in self.reach if any(m is self.module for m, _ in s.places(self.module))
        )


def is_sharded(p: torch.Tensor) -> bool:
    return hasattr(p, "to_local")


def local_of(p: nn.Parameter) -> torch.Tensor:
    local: torch.Tensor = p.to_local() if is_sharded(p) else p  # type: ignore[attr-defined]
    return local


def job_for(
    fqn: str,
    module: nn.Module,
    specs: dict[str, ShardSpec],
    device: torch.device,
    *,
    reproducible: bool,
    can_skip: bool,
    seed: int,
    shard_rank: int,
    reach: tuple[StandIn, ...] | None = None,
    init: Init | None = None,
) -> Job:
    prefix = f"{fqn}." if fqn else ""
    stand_ins: list[StandIn] = []
    holds_shards, all_sharded, keeps_any = False, True, False
    for name, p in module._parameters.items():
        if p is None:
            continue
        spec = specs.get(prefix + name)
        canonical = spec is None or spec.fqn == prefix + name
        sharded = is_sharded(p)
        holds_shards |= sharded
        all_sharded &= sharded
        keeps_any |= canonical
        if not canonical or (reproducible and sharded):
            stand_ins.append(
                StandIn(
                    name=name,
                    original=p,
                    shape=p.shape,
                    dtype=p.dtype,
                    device=device if sharded else p.device,
                    spec=spec if canonical and sharded else None,
                )
            )
    if reach is not None:  # (reproducible mode) a parent's init: its subtree through ``reach``
        return Job(
            fqn=fqn,
            module=module,
            stand_ins=(),
            seed=module_seed(seed, fqn),
            skip=False,
            shareable=False,
            broadcast_buffers=False,
            reach=reach,
            init=init,
        )
    has_buffers = any(b is not None for b in module._buffers.values())
    leaf = all(
        next(itertools.chain(child.parameters(), child.buffers()), None) is None
        for child in module.children()
    )
    alone = leaf and not has_buffers
    return Job(
        fqn=fqn,
        module=module,
        stand_ins=tuple(stand_ins),
        seed=module_seed(seed, fqn, None if reproducible or not holds_shards else shard_rank),
        skip=can_skip and alone and not keeps_any,
        shareable=reproducible and alone and holds_shards and all_sharded,
        broadcast_buffers=not reproducible and holds_shards and has_buffers,
        init=init,
    )


def reach_of(
    fqn: str,
    module: nn.Module,
    specs: dict[str, ShardSpec],
    device: torch.device,
    *,
    materialized: set[int],
    visited: set[int],
) -> tuple[StandIn, ...]:
    """Every parameter a parent's init may write: those of the modules in ``module``'s subtree
    that are materialized (ids in ``materialized``), one entry per parameter object with every
    name it has there. ``visited``: ids of the modules whose init already ran (children first),
    so their parameters hold values a parent's init may read."""
    prefix = f"{fqn}." if fqn else ""
    found: dict[int, list[tuple[str, nn.Module, str]]] = {}
    params: dict[int, nn.Parameter] = {}
    for sub, m in module.named_modules():
        if id(m) not in materialized:
            continue
        dot = f"{sub}." if sub else ""
        for name, p in m._parameters.items():
            if p is not None:
                found.setdefault(id(p), []).append((dot + name, m, name))
                params[id(p)] = p
    out: list[StandIn] = []
    for key, names in found.items():
        p = params[key]
        spec = specs.get(prefix + names[0][0])
        canonical = next((n for n in names if spec is None or spec.fqn == prefix + n[0]), None)
        path = (canonical or names[0])[0]
        out.append(
            StandIn(
                name=path,
                original=p,
                shape=p.shape,
                dtype=p.dtype,
                device=device if is_sharded(p) else p.device,
                spec=spec if canonical is not None and is_sharded(p) else None,
                at=tuple((m, n) for _, m, n in names),
                tied=canonical is None,
                written=any(id(m) in visited for _, m, _ in names),
            )
        )
    return tuple(out)


class Scratch:
    """Memory for full-size stand-ins: one byte buffer per device, sized to the largest module's
    stand-ins and allocated on first use, so its pages are touched once, not once per module."""

    def __init__(self, jobs: Sequence[Job]) -> None:
        self._need: dict[torch.device, int] = {}
        for job in jobs:
            for device, group in by_device(job.stand_ins).items():
                size = carve([s.nbytes for s in group])[1]
                self._need[device] = max(self._need.get(device, 0), size)
        self._buffers: dict[torch.device, torch.Tensor] = {}

    def views(self, stand_ins: Sequence[StandIn]) -> dict[str, torch.Tensor]:
        """Non-overlapping tensors of the stand-ins' shapes; valid until the next call. (A
        parent's init computed in full may need more than planned: the buffer then grows.)"""
        out: dict[str, torch.Tensor] = {}
        for device, group in by_device(stand_ins).items():
            offsets, size = carve([s.nbytes for s in group])
            buffer = self._buffers.get(device)
            if buffer is None or buffer.numel() < size:
                need = max(size, self._need.get(device, 0))
                buffer = torch.empty(need, dtype=torch.uint8, device=device)
                self._buffers[device] = buffer
            for s, offset in zip(group, offsets, strict=True):
                out[s.name] = buffer[offset : offset + s.nbytes].view(s.dtype).view(s.shape)
        return out


def by_device(stand_ins: Sequence[StandIn]) -> dict[torch.device, list[StandIn]]:
    out: dict[torch.device, list[StandIn]] = {}
    for s in stand_ins:
        out.setdefault(s.device, []).append(s)
    return out


@contextlib.contextmanager
def blame(job: Job) -> Iterator[None]:
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
def seeded(seed: int, device: torch.device) -> Iterator[None]:
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


def compute(
    job: Job,
    init: Init,
    scratch: Scratch,
    device: torch.device,
    *,
    full: frozenset[str] = frozenset(),
    windows: dict[str, nn.Parameter] | None = None,
    prefill: Callable[[dict[str, torch.Tensor]], None] | None = None,
) -> list[tuple[StandIn, torch.Tensor]]:
    """Run ``job``'s seeded init with its stand-ins in place; the full tensors of the kept ones
    (views of ``scratch``: use them before the next call). The module gets its own parameters
    back even when the init fails, so no stand-in outlives this call through the module.

    A parent's job (``reach``) gets stand-ins for the paths in ``full`` (``prefill`` gives them
    their current values first) and ``windows`` (row windows) for the others."""
    module = job.module
    swapped = [*job.stand_ins, *(s for s in job.reach if s.name in full and not s.in_place)]
    kept: list[tuple[StandIn, torch.Tensor]] = []
    saved: list[tuple[nn.Module, str, nn.Parameter | None]] = []

    def put(s: StandIn, value: nn.Parameter) -> None:
        for m, n in s.places(module):
            saved.append((m, n, m._parameters.get(n)))
            m._parameters[n] = value

    try:
        views = scratch.views(swapped)
        if prefill is not None:
            prefill(views)
        for s in swapped:
            put(s, nn.Parameter(views[s.name], requires_grad=s.original.requires_grad))
        for s in job.reach:
            if windows is not None and s.name in windows:
                put(s, windows[s.name])
        with seeded(job.seed, device):
            init(module)
        for s in swapped:
            if s.spec is None:
                continue
            owner, local = s.places(module)[0]
            got = owner._parameters.get(local)
            if got is None or got.shape != s.shape or got.dtype != s.dtype:
                what = "removed" if got is None else f"replaced it with {got.dtype} {got.shape}"
                raise PrepareError(
                    f"initializing module {job.fqn or '<root>'!r} {what}: its parameter "
                    f"{s.name!r} must stay {s.dtype} {s.shape}.",
                    subject=job.fqn,
                )
            kept.append((s, got.detach()))
    finally:
        for m, n, v in reversed(saved):
            m._parameters[n] = v
    return kept


def check_shard(s: StandIn) -> torch.Tensor:
    """This rank's shard of ``s``, after checking it has the shape the plan predicted."""
    assert s.spec is not None
    local = local_of(s.original)
    if tuple(local.shape) != s.spec.local_shape:
        raise PrepareError(
            f"parameter {s.spec.fqn!r} holds a shard of shape {tuple(local.shape)} but the plan "
            f"predicted {s.spec.local_shape}.",
            subject=s.spec.fqn,
        )
    return local


def tp_rank_of(s: StandIn) -> int:
    """This rank's coordinate on the tensor-parallel mesh dim of ``s`` (0 without one)."""
    if s.spec is None or "tp" not in s.spec.mesh_dims:
        return 0
    rank: int = s.original.device_mesh.get_local_rank("tp")  # type: ignore[attr-defined]
    return rank


def span(s: StandIn, world: int, rank: int) -> tuple[tuple[int, int], tuple[int, int] | None]:
    """The rows ``[start, stop)`` of the full ``s`` that shard rank ``rank`` keeps, and its
    columns (None: all; a column range where tensor parallelism cuts columns)."""
    assert s.spec is not None
    tp_rank = tp_rank_of(s)
    return row_span(s.spec, world, rank, tp_rank), col_span(s.spec, tp_rank)


def block_of(
    full: torch.Tensor, rows: tuple[int, int], cols: tuple[int, int] | None
) -> torch.Tensor:
    """The block ``rows`` x ``cols`` of ``full`` (a view)."""
    out = full[rows[0] : rows[1]]
    return out if cols is None else out[:, cols[0] : cols[1]]


def keep_rows(s: StandIn, full: torch.Tensor, world: int, rank: int) -> None:
    rows, cols = span(s, world, rank)
    check_shard(s).copy_(block_of(full, rows, cols))


def run_everywhere(
    job: Job, init: Init, scratch: Scratch, device: torch.device, world: int, rank: int
) -> None:
    """Initialize ``job`` on this rank alone (every rank does the same)."""
    with blame(job):
        for s in job.kept:
            check_shard(s)
        for s, full in compute(job, init, scratch, device):
            keep_rows(s, full, world, rank)
