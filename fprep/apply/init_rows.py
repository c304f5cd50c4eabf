"""Reproducible init that touches only this rank's rows: the fast path of materialize.

Each of a module's parameters is replaced, for its init, by a ``RowWindow``: a tensor subclass
with the full parameter's shape whose data is only the rows ``[start, stop)`` this rank keeps
(its shard; every row of a parameter that is not sharded; none of a tied parameter whose values
come from another module). The module's own init runs unchanged, and each op it issues on the
window reaches ``__torch_dispatch__``, which applies it to those rows:

* a random fill (``uniform_``, ``normal_``, ...) is drawn per fixed block of rows
  (``init_schedule.block_rows``: a function of the full shape), each block from a generator
  seeded by (module seed, parameter, fill number, block). A block's values do not depend on which
  rank draws it, so the full parameter is the same for every world size, while a rank draws only
  the blocks its rows touch;
* in-place ops that place values (``fill_``, ``zero_``, ``copy_``) or round the same wherever an
  element sits in the kernel (``EXACT``: ``mul_``, ``add_``, ``clamp_``, ...) apply to the rows
  (another tensor operand is cut to them, or broadcast);
* ``detach`` (``.data``), ``select`` and ``slice`` give windows onto the same rows (a random fill
  of a ``select``/``slice`` view is not row-local: it would need a seed per view).

Anything else (reading values, a reduction, a new tensor made from the parameter: ``orthogonal_``'s
QR, ``trunc_normal_``'s rejection loop, an explicit generator, ``.data =``, ``data_ptr``, a
pointwise op whose bits depend on its position, as ``sinh_``) raises ``NotRowLocal``, and
materialize computes that module the other way (full tensors from the module's seed,
``init_jobs``). Which way a module goes depends on its init code and the full shapes, never on
the world size, so both ways are reproducible; the two give different numbers for a module, but a
module always goes the same way.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from fprep.apply.init_jobs import (
    Init,
    Job,
    Scratch,
    StandIn,
    blame,
    check_shard,
    compute,
    keep_rows,
    local_of,
    seeded,
    span,
)
from fprep.apply.init_schedule import (
    BLOCK_ELEMENTS,
    block_rows,
    block_seed,
    blocks_over,
    row_span,
    tp_cut,
)
from fprep.apply.rollback import Rollback

aten = torch.ops.aten

#: Random fills: every one takes ``generator=`` and fills ``self`` in place.
RANDOM_FILLS = frozenset(
    {
        aten.uniform_.default,
        aten.normal_.default,
        aten.bernoulli_.float,
        aten.exponential_.default,
        aten.log_normal_.default,
        aten.cauchy_.default,
        aten.geometric_.default,
        aten.random_.default,
        getattr(aten.random_, "from"),
        aten.random_.to,
    }
)
#: In-place ops that only place values: any dtype.
PLACING = frozenset({aten.copy_.default, aten.fill_.Scalar, aten.fill_.Tensor, aten.zero_.default})
#: In-place elementwise ops whose result bits do not depend on where an element sits in the
#: kernel's loop (floating point only). Others (``sinh_``, ``pow_(1.7)``, ``add_`` with an
#: ``alpha``, ...) round differently in a CPU kernel's vectorized body and its scalar tail, so
#: their bits would depend on how many rows a rank holds: refused, to the full computation.
EXACT = frozenset(
    {
        aten.add_.Tensor,
        aten.add_.Scalar,
        aten.sub_.Tensor,
        aten.sub_.Scalar,
        aten.mul_.Tensor,
        aten.mul_.Scalar,
        aten.div_.Tensor,
        aten.div_.Scalar,
        aten.neg_.default,
        aten.abs_.default,
        aten.clamp_.default,
        aten.clamp_.Tensor,
        aten.clamp_min_.default,
        aten.clamp_max_.default,
        aten.floor_.default,
        aten.ceil_.default,
        aten.round_.default,
        aten.trunc_.default,
        aten.sign_.default,
        aten.sqrt_.default,
        aten.erfinv_.default,  # (scalar kernel only: inverse-CDF truncated normals)
    }
)
ALIASES = frozenset({aten.detach.default, aten.alias.default})


#: ``torch.Tensor.data``'s own descriptor (a window overrides the setter only).
_DATA: Any = vars(torch._C.TensorBase)["data"]


class NotRowLocal(Exception):
    """The init did something a window cannot do on its rows alone; ``keys``: the names of the
    windows it did it to (filled in by ``__torch_dispatch__``)."""

    def __init__(self, message: str, *windows: RowWindow) -> None:
        super().__init__(message)
        self.keys: set[str] = {w.track.key for w in windows if w.track is not None}


@dataclass(eq=False)
class Track:
    """One parameter's window, shared by its views: its name, and (for a parameter an earlier
    init already wrote) a copy of its rows taken before the first write, so that an attempt
    that is put back leaves them as they were."""

    key: str
    rows: torch.Tensor
    keep: bool = False
    backup: torch.Tensor | None = None
    #: Where tensor parallelism cuts columns: ``rows`` is a buffer of whole rows, and
    #: ``commit`` copies its columns ``cols`` into the shard ``home`` once the init succeeded.
    home: torch.Tensor | None = None
    cols: tuple[int, int] | None = None

    def before_write(self) -> None:
        if self.keep and self.backup is None:
            self.backup = self.rows.clone()

    def undo(self) -> None:
        if self.backup is not None:
            self.rows.copy_(self.backup)
            self.backup = None

    def commit(self) -> None:
        if self.home is not None and self.cols is not None:
            self.home.copy_(self.rows[:, self.cols[0] : self.cols[1]])


@dataclass(eq=False)
class Fills:
    """One parameter's random fills so far: each fill gets its own block seeds."""

    seed: int
    name: str
    per_block: int
    count: int = 0
    drawn: int = 0  # elements this rank drew (evidence for the tests)
    generators: dict[torch.device, torch.Generator] = field(default_factory=dict)

    def generator(self, device: torch.device, seed: int) -> torch.Generator:
        gen = self.generators.get(device)
        if gen is None:
            gen = self.generators[device] = torch.Generator(device=device)
        gen.manual_seed(seed)
        return gen


def _nothing(shape: Sequence[int], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """The rows of a window none of whose rows are on this rank: zero rows (a scratch scalar for
    a 0-dim window). Ops still run on them, so an op that fails fails on every rank alike."""
    return torch.empty((0, *shape[1:]) if len(shape) else (), dtype=dtype, device=device)


class RowWindow(torch.Tensor):
    """A full-shape stand-in whose data is only rows ``[start, start + len(rows))`` (a 0-dim
    window: its one value). ``fills`` is None on views (no random fills there)."""

    rows: torch.Tensor
    start: int
    fills: Fills | None
    track: Track | None

    @staticmethod
    def __new__(
        cls,
        shape: Sequence[int],
        rows: torch.Tensor,
        start: int,
        fills: Fills | None,
        *,
        dtype: torch.dtype,
        device: torch.device,
        track: Track | None = None,
    ) -> RowWindow:
        window: RowWindow = torch.Tensor._make_wrapper_subclass(
            cls, tuple(shape), dtype=dtype, device=device, requires_grad=False
        )
        window.rows, window.start, window.fills, window.track = rows, start, fills, track
        return window

    __torch_function__ = torch._C._disabled_torch_function_impl  # type: ignore[assignment]

    def __repr__(self) -> str:  # type: ignore[override]
        return f"RowWindow(shape={tuple(self.shape)}, start={self.start})"

    def _like(
        self, shape: Sequence[int], rows: torch.Tensor, start: int, fills: Fills | None
    ) -> RowWindow:
        return RowWindow(
            shape, rows, start, fills, dtype=self.dtype, device=self.device, track=self.track
        )

    @classmethod
    def __torch_dispatch__(  # type: ignore[override]
        cls,
        func: Any,
        types: Any,
        args: Sequence[Any] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        kwargs = kwargs or {}
        try:
            return cls._dispatch(func, args, kwargs)
        except NotRowLocal as e:
            e.keys.update(
                a.track.key
                for a in (*args, *kwargs.values())
                if isinstance(a, RowWindow) and a.track is not None
            )
            raise

    @classmethod
    def _dispatch(cls, func: Any, args: Sequence[Any], kwargs: dict[str, Any]) -> Any:
        self = args[0] if args else None
        others = [*args[1:], *kwargs.values()]
        if not isinstance(self, RowWindow) or any(isinstance(a, RowWindow) for a in others):
            raise NotRowLocal(f"{func} on a parameter stand-in")
        if func in ALIASES:
            return self._like(self.shape, self.rows, self.start, self.fills)
        if func in RANDOM_FILLS:
            if self.track is not None:
                self.track.before_write()
            self._fill(func, args[1:], kwargs)
            return self
        if func is aten.select.int:
            return self._select(*args[1:])
        if func is aten.slice.Tensor:
            return self._slice(*args[1:])
        if func in PLACING or (func in EXACT and self._exact(kwargs)):
            rest = [self._operand(a) for a in args[1:]]
            named = {k: self._operand(v) for k, v in kwargs.items()}
            if self.track is not None:
                self.track.before_write()
            func(self.rows, *rest, **named)
            return self
        raise NotRowLocal(f"{func} on a parameter stand-in")

    # -- what the ops never reach -----------------------------------------------------------------
    @property
    def data(self) -> torch.Tensor:
        alias: torch.Tensor = _DATA.__get__(self)  # dispatched (detach): a window
        return alias

    @data.setter
    def data(self, value: torch.Tensor) -> None:
        raise NotRowLocal("assigning .data of a parameter stand-in", self)

    def data_ptr(self) -> int:
        raise NotRowLocal("the address of a parameter stand-in", self)

    def untyped_storage(self) -> torch.UntypedStorage:
        raise NotRowLocal("the storage of a parameter stand-in", self)

    # -- ops -------------------------------------------------------------------------------------
    def _exact(self, kwargs: dict[str, Any]) -> bool:
        """Whether an ``EXACT`` op stays exact: floating point (an integer division by zero
        would fail only on the ranks holding the zero), and no ``alpha`` (a fused multiply-add
        in the vectorized body only)."""
        return self.dtype.is_floating_point and kwargs.get("alpha", 1) == 1

    def _span(self) -> tuple[int, int]:
        return self.start, self.start + (self.rows.shape[0] if self.dim() else 1)

    def _operand(self, value: Any) -> Any:
        """Another operand, cut to this rank's rows where it has one value per row."""
        if not isinstance(value, torch.Tensor) or value.dim() < self.dim() or not self.dim():
            return value  # a scalar, or broadcast over the rows
        if value.dim() == self.dim() and value.shape[0] == 1:
            return value
        if value.dim() == self.dim() and value.shape[0] == self.shape[0]:
            start, stop = self._span()
            return value[start:stop]
        raise NotRowLocal("an operand with a row count of its own")

    def _fill(self, func: Any, args: Sequence[Any], kwargs: dict[str, Any]) -> None:
        fills = self.fills
        if fills is None or kwargs.get("generator") is not None:
            raise NotRowLocal("a random fill of a view, or with a generator of its own")
        draw = fills.count
        fills.count += 1
        rows = self.rows
        if not self.dim():  # one row, one block
            seed = block_seed(fills.seed, fills.name, draw, 0)
            func(rows, *args, **{**kwargs, "generator": fills.generator(rows.device, seed)})
            fills.drawn += 1
            return
        start, stop = self._span()
        row = math.prod(self.shape[1:])
        blocks = blocks_over(start, stop, self.shape[0], fills.per_block)
        if not blocks:  # still check the arguments, as the ranks holding rows do
            func(rows[:0], *args, **{**kwargs, "generator": fills.generator(rows.device, 0)})
        for lo, hi in blocks:
            seed = block_seed(fills.seed, fills.name, draw, lo // fills.per_block)
            gen = fills.generator(rows.device, seed)
            a, z = max(lo, start), min(hi, stop)
            target = rows[a - start : z - start]
            if (a, z) != (lo, hi) or not target.is_contiguous():
                block = rows.new_empty((hi - lo, *self.shape[1:]))
                func(block, *args, **{**kwargs, "generator": gen})
                target.copy_(block[a - lo : z - lo])
            else:  # drawn in place, as the same contiguous block shape would be anywhere
                func(target, *args, **{**kwargs, "generator": gen})
            fills.drawn += (hi - lo) * row

    def _dim(self, dim: int) -> int:
        if not -self.dim() <= dim < self.dim():
            raise IndexError(f"dimension {dim} is out of range for {self.dim()} dimensions")
        return dim % self.dim()

    def _select(self, dim: int, index: int) -> RowWindow:
        dim, shape = self._dim(dim), [*self.shape]
        if not -shape[dim] <= index < shape[dim]:
            raise IndexError(f"index {index} is out of bounds for size {shape[dim]}")
        index %= shape[dim]
        del shape[dim]
        if dim:
            return self._like(shape, self.rows.select(dim, index), self.start, None)
        start, stop = self._span()
        here = start <= index < stop
        rows = self.rows[index - start] if here else _nothing(shape, self.dtype, self.device)
        return self._like(shape, rows, 0, None)

    def _slice(
        self, dim: int = 0, begin: int | None = None, end: int | None = None, step: int = 1
    ) -> RowWindow:
        dim, shape = self._dim(dim), [*self.shape]
        begin, end, _ = slice(begin, end, step).indices(shape[dim])
        if step != 1:
            raise NotRowLocal("a strided slice of a parameter stand-in")
        shape[dim] = max(0, end - begin)
        if dim:
            return self._like(shape, self.rows.narrow(dim, begin, shape[dim]), self.start, None)
        start, stop = self._span()
        a, z = max(begin, start), min(end, stop)
        if a >= z:
            return self._like(shape, self.rows[:0], 0, None)
        return self._like(shape, self.rows[a - start : z - start], a - begin, None)


def window_for(
    p: torch.Tensor,
    rows: torch.Tensor | None,
    start: int,
    *,
    seed: int,
    name: str,
    device: torch.device,
    elements: int = BLOCK_ELEMENTS,
    keep: bool = False,
    home: tuple[torch.Tensor, tuple[int, int]] | None = None,
) -> nn.Parameter:
    """A window onto ``rows`` (rows ``start`` onwards of the full ``p``; None: none of them), as
    a parameter (a ``RowWindow`` that ``isinstance(..., nn.Parameter)`` accepts, as its init
    may check). ``home``: the shard and columns ``rows`` (whole rows) stand in for, where
    tensor parallelism cuts columns (``Track.commit``)."""
    if rows is None:
        rows, start = _nothing(p.shape, p.dtype, device), 0
    fills = Fills(seed=seed, name=name, per_block=block_rows(p.shape, elements))
    track = Track(key=name, rows=rows, keep=keep)
    if home is not None:
        track.home, track.cols = home
    window = RowWindow(p.shape, rows, start, fills, dtype=p.dtype, device=rows.device, track=track)
    return nn.Parameter(window, requires_grad=p.requires_grad)


def shard_rows(
    s: StandIn, world: int, rank: int
) -> tuple[torch.Tensor, int, tuple[torch.Tensor, tuple[int, int]] | None]:
    """The rows of the full ``s`` this rank keeps, the first one's index, and (where tensor
    parallelism cuts columns) the shard and columns they stand in for: the rows are then a
    buffer of whole rows (this rank's rows times tp elements), holding the shard's current
    values in its columns, so that every row-local op and random block sees whole rows."""
    (start, stop), cols = span(s, world, rank)
    local = check_shard(s)[: stop - start]
    if cols is None:
        return local, start, None
    rows = local.new_zeros((stop - start, *s.shape[1:]))
    rows[:, cols[0] : cols[1]].copy_(local)
    return rows, start, (local, cols)


def _window_of(s: StandIn, world: int, rank: int, seed: int) -> nn.Parameter:
    """A window for one entry of a parent's ``reach``, named by its path."""
    rows: torch.Tensor | None
    home = None
    if s.in_place:  # not sharded: every row, in place
        rows, start, device = s.original, 0, s.original.device
    elif s.spec is None:  # tied: another name's init gives its values
        rows, start, device = None, 0, s.device
    else:
        rows, start, home = shard_rows(s, world, rank)
        device = s.device
    return window_for(
        s.original, rows, start, seed=seed, name=s.name, device=device, keep=s.written, home=home
    )


def reach_windows(
    job: Job, world: int, rank: int, full: frozenset[str] = frozenset()
) -> dict[str, nn.Parameter]:
    """Windows for the entries of ``job.reach`` not in ``full`` (computed in full instead)."""
    return {s.name: _window_of(s, world, rank, job.seed) for s in job.reach if s.name not in full}


def _windows(job: Job, world: int, rank: int) -> dict[str, nn.Parameter]:
    stand_ins = {s.name: s for s in job.stand_ins}
    out: dict[str, nn.Parameter] = {}
    for name, p in job.module._parameters.items():
        if p is None:
            continue
        s = stand_ins.get(name)
        rows: torch.Tensor | None
        home = None
        if s is None:  # not sharded: every row, in place
            rows, start, device = p, 0, p.device
        elif s.spec is None:  # tied: another module's init gives its values
            rows, start, device = None, 0, s.device
        else:
            rows, start, home = shard_rows(s, world, rank)
            device = s.device
        out[name] = window_for(p, rows, start, seed=job.seed, name=name, device=device, home=home)
    return out


def _places(job: Job, windows: dict[str, nn.Parameter]) -> list[tuple[nn.Module, str]]:
    if not job.reach:
        return [(job.module, name) for name in windows]
    return [place for s in job.reach if s.name in windows for place in s.places(job.module)]


def _commit(windows: dict[str, nn.Parameter]) -> None:
    """Copy the columns of whole-row buffers into their shards (tensor parallelism)."""
    for w in windows.values():
        track = getattr(w, "track", None)
        if isinstance(track, Track):
            track.commit()


def _undo_writes(windows: dict[str, nn.Parameter]) -> None:
    """Put back the rows of parameters an earlier init wrote, as the attempt found them."""
    for w in windows.values():
        track = getattr(w, "track", None)
        if isinstance(track, Track):
            track.undo()


def init_by_rows(
    job: Job,
    init: Init,
    device: torch.device,
    world: int,
    rank: int,
    blamed: set[str] | None = None,
) -> bool:
    """Run ``job``'s init on row windows; whether every op it made was row-local.

    On False, whatever the attempt did is for the full computation to overwrite: the module and
    its children are rolled back as ``prepare`` rolls back a failed step (``Rollback``: their
    parameter, buffer and child tables and attributes as they were; an init that marks a module
    done, as Hugging Face's does, must not skip the second run), and the rows of parameters an
    earlier init wrote are put back. An init that keeps a window (as an attribute) is refused
    too: no window outlives its init. ``blamed`` collects the names of the parameters the
    refused op was applied to (the paths of a parent's ``reach``).
    """
    module = job.module
    undo = Rollback.of(module)
    placed: dict[str, nn.Parameter] = {}
    saved: list[tuple[nn.Module, str, nn.Parameter | None]] = []
    ok = False
    try:
        placed = reach_windows(job, world, rank) if job.reach else _windows(job, world, rank)
        by_place = _places(job, placed)
        for (m, n), w in zip(by_place, _values_at(job, placed), strict=True):
            saved.append((m, n, m._parameters.get(n)))
            m._parameters[n] = w
        with seeded(job.seed, device):
            init(module)
        ok = all(
            m._parameters.get(n) is w and isinstance(w, RowWindow)  # (swap_tensors)
            for (m, n), w in zip(by_place, _values_at(job, placed), strict=True)
        ) and not any(isinstance(v, RowWindow) for m, _ in by_place for v in m.__dict__.values())
    except NotRowLocal as e:
        if blamed is not None:
            blamed.update(e.keys)
    except Exception:  # anything the full computation will report
        ok = False
    finally:
        for m, n, v in reversed(saved):  # (a parameter the init added stays, as in eager)
            m._parameters[n] = v
    if ok:
        _commit(placed)
    else:
        _undo_writes(placed)
        undo.restore()
    return ok


def _values_at(job: Job, windows: dict[str, nn.Parameter]) -> list[nn.Parameter]:
    """The window for each of ``_places(job, windows)``, in the same order."""
    if not job.reach:
        return list(windows.values())
    return [windows[s.name] for s in job.reach if s.name in windows for _ in s.places(job.module)]


def current_full(
    s: StandIn, world: int, rank: int, group: Any, device: torch.device
) -> torch.Tensor | None:
    """The full current value of ``s`` (sharded: its rows gathered from the shard group, in
    order; None where the ranks do not talk, as with ``sync_module_states``; under tensor
    parallelism, gathered from the whole mesh)."""
    if s.spec is not None and tp_cut(s.spec) is not None:
        check_shard(s)
        full: torch.Tensor = s.original.full_tensor()  # type: ignore[attr-defined]
        return full
    local = check_shard(s) if s.spec is not None else local_of(s.original)
    if s.spec is None or world == 1:
        return local
    if group is None:
        return None
    padded = s.spec.padded_shape[0]
    chunk = torch.zeros((padded, *s.shape[1:]), dtype=s.dtype, device=device)
    start, stop = row_span(s.spec, world, rank)
    chunk[: stop - start].copy_(local[: stop - start])
    parts = [torch.empty_like(chunk) for _ in range(world)]
    dist.all_gather(parts, chunk, group=group)
    return torch.cat(parts)[: s.shape[0]]


def init_in_full(
    job: Job,
    init: Init,
    scratch: Scratch,
    device: torch.device,
    world: int,
    rank: int,
    group: Any,
    blamed: set[str],
) -> None:
    """A parent's init that is not row-local (on every rank, in walk order): the parameters it
    did that to, and its own, are computed in full on stand-ins (from their current values where
    an earlier init wrote them), every other one in its subtree stays a row window. An attempt
    that refuses another parameter is put back and retried with that one in full too, so which
    parameters go in full depends on the init code alone, never on the world size."""
    full = frozenset(blamed) | job.own()
    with blame(job):
        for s in job.kept:
            check_shard(s)
        while True:
            undo = Rollback.of(job.module)
            windows = reach_windows(job, world, rank, full)
            direct = {
                s.name: s.original.detach().clone()
                for s in job.reach
                if s.name in full and s.in_place and s.written
            }

            def prefill(views: dict[str, torch.Tensor]) -> None:
                for s in job.reach:
                    if s.written and s.name in views:
                        value = current_full(s, world, rank, group, device)
                        if value is not None:
                            views[s.name].copy_(value)

            try:
                computed = compute(
                    job, init, scratch, device, full=full, windows=windows, prefill=prefill
                )
            except NotRowLocal as e:
                more = (e.keys & {s.name for s in job.reach}) - full
                _undo_writes(windows)
                undo.restore()
                with torch.no_grad():
                    for s in job.reach:
                        if s.name in direct:
                            s.original.copy_(direct[s.name])
                if not more:
                    raise
                full |= more
                continue
            _commit(windows)
            for s, value in computed:
                keep_rows(s, value, world, rank)
            return
