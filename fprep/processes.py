"""The data-parallel processes as Accelerate scripts use them: count, index, split, gather, pad,
and let the main process go first.

``num_processes`` and ``process_index`` are the ranks a prepared data loader shards over (those
``reduce`` and ``gather_for_metrics`` span): the whole world unless ``prepare`` was given a
process group or mesh, or tensor parallelism takes some of the ranks (tp ranks of one data
shard have the same index). They come from the plan alone; ``split_between_processes`` too.
``gather`` and ``pad_across_processes`` exchange every rank's shapes first, so a rank whose
input does not fit the others' (another structure, dtype or number of dimensions) makes every
rank raise the same ``ConfigError`` instead of a backend crash, a hang or wrong data.

In one process every function gives the single-process answer, with no process group needed.
"""

from __future__ import annotations

import contextlib
import numbers
import zlib
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any, TypeVar

import torch
import torch.distributed as dist

from fprep.apply.steps import handles_of
from fprep.data import data_parallel_position
from fprep.errors import CollectiveError, ConfigError
from fprep.ranks import all_gather, all_reduce, data_parallel_groups, guarded, mesh_groups
from fprep.state import PrepState, need

T = TypeVar("T")

#: A tensor, or lists, tuples and mappings of them, nested to any depth.
Tensors = Any

#: The most dimensions a gathered or padded tensor may have (the shape exchange is fixed-size).
MAX_DIMS = 16
_ROW = 2 + MAX_DIMS  # a tensor's row in the shape exchange: ndim, dtype, the sizes
_INLINE = 4  # how many tensors' rows go with the structure in the first exchange
_ALIGN = 16  # bytes: where each tensor starts in the gathered buffer (any dtype can view it)
#: dtype names by the checksum ranks exchange for them
_DTYPE_NAMES = {
    zlib.crc32(str(d).encode()): str(d).removeprefix("torch.")
    for d in vars(torch).values()
    if isinstance(d, torch.dtype)
}
#: How much of the main process's error the other ranks of ``main_process_first`` are told.
_ERROR_BYTES = 400


# -- which process ---------------------------------------------------------------------------
def num_processes(state: PrepState) -> int:
    """How many data-parallel ranks there are: the ranks a prepared data loader shards over and
    ``reduce`` / ``gather`` span (1 in one process). Accelerate's ``num_processes``; for every
    process of the job (tensor-parallel ranks included) read ``state.topology.world_size``."""
    return data_parallel_position(state)[1]


def process_index(state: PrepState) -> int:
    """This rank's data-parallel index, ``0 <= index < num_processes(state)``: the share of the
    data it reads and its place in ``gather``'s output. Accelerate's ``process_index``; the
    global rank is ``state.topology.rank``."""
    return data_parallel_position(state)[0]


# -- splitting inputs (pure) ---------------------------------------------------------------------
def split_between_processes(state: PrepState, inputs: T, *, apply_padding: bool = False) -> T:
    """This rank's contiguous part of ``inputs`` (a list, tuple, range, tensor, or a dict of
    them whose values have one length), split as Accelerate does: the first
    ``len % num_processes`` ranks get one item more. ``apply_padding=True`` repeats the last
    item of ``inputs`` until every rank has as many as the first (so that ``gather`` lines up;
    drop the repeats afterwards). Accelerate's ``with accelerator.split_between_processes(x) as
    part:``; here ``part = fprep.split_between_processes(state, x)``. No collective.
    """
    index, count = data_parallel_position(state)
    length = _length(inputs, "inputs")
    if apply_padding and length == 0:
        raise ConfigError(
            "fprep.split_between_processes(apply_padding=True) got empty inputs: there is no "
            "last item to pad with.",
            subject="inputs",
            hint="Pass at least one item, or apply_padding=False.",
        )
    if count == 1:
        return inputs
    per, extra = divmod(length, count)
    start = index * per + min(index, extra)
    end = start + per + (1 if index < extra else 0)
    target = per + (1 if extra else 0) if apply_padding else None
    return _split(inputs, start, end, target)  # type: ignore[no-any-return]


def _length(inputs: object, path: str) -> int:
    if isinstance(inputs, Mapping):
        lengths = {str(k): _length(v, f"{path}[{k!r}]") for k, v in inputs.items()}
        if not lengths:
            raise ConfigError(
                f"fprep.split_between_processes got an empty dict ({path}).",
                subject=path,
                hint="Pass a dict of lists or tensors, each as long as the others.",
            )
        if len(set(lengths.values())) > 1:
            raise ConfigError(
                f"fprep.split_between_processes needs every value of {path} to have the same "
                f"length; got {lengths}.",
                subject=path,
                hint="Split each value separately, or make them the same length.",
            )
        return next(iter(lengths.values()))
    if isinstance(inputs, torch.Tensor) and inputs.dim() > 0:
        return int(inputs.shape[0])
    if isinstance(inputs, Sequence) and not isinstance(inputs, str | bytes):
        return len(inputs)
    raise ConfigError(
        f"fprep.split_between_processes splits lists, tuples, ranges, tensors with a first "
        f"dimension and dicts of them; {path} is a {type(inputs).__qualname__}.",
        subject=path,
        hint="Split the indices instead: part = fprep.split_between_processes(state, "
        "range(len(data))), then select those (e.g. dataset.select(part)).",
    )


def _split(inputs: Any, start: int, end: int, target: int | None) -> Any:
    if isinstance(inputs, Mapping):
        cls: Any = type(inputs)
        return cls({k: _split(v, start, end, target) for k, v in inputs.items()})
    part = inputs[start:end]
    if target is None or len(part) == target:
        return part
    fill = target - len(part)
    if isinstance(inputs, torch.Tensor):
        return torch.cat([part, inputs[-1:].expand(fill, *inputs.shape[1:])])
    if isinstance(part, range):
        part = list(part)
    return part + type(part)([inputs[-1]] * fill)


# -- gathering and padding -----------------------------------------------------------------------
def gather(state: PrepState, data: Tensors) -> Tensors:
    """Every data-parallel rank's ``data`` concatenated on the first dimension, in
    ``process_index`` order; ``data`` is a tensor or lists, tuples and dicts of them (the same
    structure on every rank, which comes back). Call it on every rank.

    Ranks may pass different first dimensions (the last batch of an epoch); every other
    dimension and the dtype must agree. A 0-d tensor is one value per rank: it comes back with
    shape ``(num_processes,)``, also ``(1,)`` in one process. Every sample is kept: to drop
    the ones a prepared loader repeated to even out the last batches, use
    ``gather_for_metrics``. Accelerate's ``gather``.
    """
    rebuild, parts, _ = gather_parts(state, data, "fprep.gather")
    return rebuild([torch.cat(ranks) for ranks in parts])


def gather_parts(
    state: PrepState, data: Tensors, call: str
) -> tuple[Callable[[list[torch.Tensor]], Tensors], list[list[torch.Tensor]], list[bool]]:
    """For each tensor in ``data``, every data-parallel rank's rows (a 0-d tensor as one row),
    in rank order; a function putting one tensor per leaf back into ``data``'s structure; and
    which leaves were 0-d. ``call``: the public function this serves (``gather``,
    ``gather_for_metrics``)."""
    leaves, rebuild, spec = _flatten(data, call)
    scalar = [t.dim() == 0 for t in leaves]
    leaves = [t.reshape(1) if t.dim() == 0 else t for t in leaves]
    groups = data_parallel_groups(state, call)
    if groups is None:
        return rebuild, [[t] for t in leaves], scalar
    device = handles_of(state).device
    with guarded(state, groups, call, arrive=False):  # per batch: no arrival wait
        shapes = _exchange_shapes(leaves, spec, groups, device, call)
        _same_beyond_first(shapes, leaves, spec, call)
        counts = [[rank_shapes[i][0] for rank_shapes in shapes] for i in range(len(leaves))]
        parts = _gather_rows(leaves, counts, groups, device, call)
    return rebuild, parts, scalar


def pad_across_processes(
    state: PrepState,
    data: Tensors,
    *,
    dim: int = 0,
    pad_index: float = 0,
    pad_first: bool = False,
) -> Tensors:
    """``data`` with dimension ``dim`` of each tensor padded with ``pad_index`` to the longest
    any data-parallel rank has (at the end, or at the start with ``pad_first``), so that
    ``gather`` can stack them; tensors with fewer than ``dim + 1`` dimensions stay as they are
    (as in Accelerate), but ``dim`` must fit at least one. Call it on every rank; the same
    structure and number of dimensions on each. Accelerate's ``pad_across_processes``.
    """
    call = "fprep.pad_across_processes"
    if isinstance(dim, bool) or not isinstance(dim, int):
        raise ConfigError(f"{call} needs an int dim; got {dim!r}.", subject="dim")
    raw: object = pad_index  # checked at run time: callers pass anything
    if isinstance(raw, bool) or not isinstance(raw, numbers.Real):
        raise ConfigError(
            f"{call} needs a number as pad_index; got {pad_index!r}.", subject="pad_index"
        )
    leaves, rebuild, spec = _flatten(data, call)
    if not any(-t.dim() <= dim < t.dim() for t in leaves):
        dims = sorted({t.dim() for t in leaves})
        raise ConfigError(
            f"{call}: dim={dim} is not a dimension of any of the tensors (they have "
            f"{' or '.join(map(str, dims))} dimensions), so nothing would be padded.",
            subject="dim",
            hint="Pass the dimension that differs between the ranks (0: the batch).",
        )
    for t in leaves:
        if not t.is_floating_point() and not t.is_complex() and pad_index != int(pad_index):
            raise ConfigError(
                f"{call}: pad_index={pad_index!r} does not fit a {t.dtype} tensor.",
                subject="pad_index",
                hint="Pad integer tensors with an integer (e.g. -100 for labels).",
            )
    groups = data_parallel_groups(state, call)
    if groups is None:
        return data
    with guarded(state, groups, call, arrive=False):
        shapes = _exchange_shapes(leaves, spec, groups, handles_of(state).device, call)
    out = []
    for i, leaf in enumerate(leaves):
        if not -leaf.dim() <= dim < leaf.dim():
            out.append(leaf)
            continue
        axis = dim % leaf.dim()
        longest = max(rank_shapes[i][axis] for rank_shapes in shapes)
        out.append(_pad(leaf, axis, longest, pad_index, pad_first))
    return rebuild(out)


def _pad(tensor: torch.Tensor, axis: int, longest: int, value: float, first: bool) -> torch.Tensor:
    have = tensor.shape[axis]
    if have == longest:
        return tensor
    size = list(tensor.shape)
    size[axis] = longest - have
    filler = torch.full(size, value, dtype=tensor.dtype, device=tensor.device)
    return torch.cat([filler, tensor] if first else [tensor, filler], dim=axis)


def _flatten(
    data: Tensors, call: str
) -> tuple[list[torch.Tensor], Callable[[list[torch.Tensor]], Tensors], str]:
    """The tensors in ``data`` (depth first), a function putting new ones in their places, and
    a text naming the structure (the same on every rank that passed the same structure)."""
    leaves: list[torch.Tensor] = []

    def walk(node: Any, path: str) -> tuple[Callable[[Iterator[torch.Tensor]], Any], str]:
        if isinstance(node, torch.Tensor):
            leaves.append(node)
            return (lambda it: next(it)), "T"
        if isinstance(node, Mapping):
            parts = {k: walk(v, f"{path}[{k!r}]") for k, v in node.items()}
            cls: Any = type(node)
            return (
                lambda it: cls({k: make(it) for k, (make, _) in parts.items()}),
                "{" + ",".join(f"{k!r}:{s}" for k, (_, s) in parts.items()) + "}",
            )
        if isinstance(node, list | tuple):
            items = [walk(v, f"{path}[{i}]") for i, v in enumerate(node)]
            cls2 = type(node)
            named = hasattr(node, "_fields")  # a namedtuple takes its fields as arguments

            def make_seq(it: Iterator[torch.Tensor]) -> Any:
                values = [make(it) for make, _ in items]
                return cls2(*values) if named else cls2(values)

            return make_seq, f"{cls2.__name__}(" + ",".join(s for _, s in items) + ")"
        raise ConfigError(
            f"{call} works on tensors and lists, tuples and dicts of them; {path} is a "
            f"{type(node).__qualname__}.",
            subject=path,
            hint="Convert it to a tensor first (torch.tensor(...)), or leave it out.",
        )

    make, spec = walk(data, "data")

    def rebuild(new: list[torch.Tensor]) -> Any:
        return make(iter(new))

    return leaves, rebuild, spec


def _exchange_shapes(
    leaves: list[torch.Tensor], spec: str, groups: list[Any], device: torch.device, call: str
) -> list[list[tuple[int, ...]]]:
    """Every rank's leaf shapes, after checking that all ranks passed the same structure and,
    leaf by leaf, the same dtype and number of dimensions. A mismatch raises the same
    ``ConfigError`` on every rank (they all see the same exchanged rows)."""
    rows = torch.zeros(len(leaves), _ROW, dtype=torch.int64)
    for i, leaf in enumerate(leaves):
        rows[i, 0] = leaf.dim()
        rows[i, 1] = zlib.crc32(str(leaf.dtype).encode())
        if leaf.dim() <= MAX_DIMS:
            rows[i, 2 : 2 + leaf.dim()] = torch.tensor(leaf.shape, dtype=torch.int64)
    # One exchange of a fixed size: the structure, and the rows of the first few leaves (all
    # of them, usually); a second one for the rest once every rank knows how many there are.
    head = torch.zeros(2 + _INLINE * _ROW, dtype=torch.int64)
    head[0], head[1] = zlib.crc32(spec.encode()), len(leaves)
    inline = rows[:_INLINE].flatten()
    head[2 : 2 + len(inline)] = inline
    heads = all_gather(head.to(device), groups, call=call)
    structures = [h[:2].tolist() for h in heads]
    if any(k != structures[0] for k in structures):
        differ = [r for r, k in enumerate(structures) if k != structures[0]]
        raise ConfigError(
            f"{call} got a different structure on process {differ[0]} than on process 0 "
            f"(other keys, nesting or number of tensors; this process passed {spec}).",
            subject="data",
            hint="Pass the same structure of tensors on every rank.",
        )
    if len(leaves) <= _INLINE:
        everyone = [h[2 : 2 + len(leaves) * _ROW].reshape(-1, _ROW).tolist() for h in heads]
    else:
        everyone = [r.tolist() for r in all_gather(rows.to(device), groups, call=call)]
    for i in range(len(leaves)):
        ndims = [rank_rows[i][0] for rank_rows in everyone]
        dtypes = [rank_rows[i][1] for rank_rows in everyone]
        where = "data" if spec == "T" else f"tensor {i} of data ({spec})"
        if max(ndims) > MAX_DIMS:
            raise ConfigError(
                f"{call}: {where} has {max(ndims)} dimensions on some process; at most "
                f"{MAX_DIMS} are supported.",
                subject="data",
                hint="Reshape it first.",
            )
        if len(set(ndims)) > 1 or len(set(dtypes)) > 1:
            kinds = "; ".join(
                f"process {r}: {n}-d {_DTYPE_NAMES.get(d, 'unknown dtype')}"
                for r, (n, d) in enumerate(zip(ndims, dtypes, strict=True))
            )
            raise ConfigError(
                f"{call}: {where} differs between the processes ({kinds}).",
                subject="data",
                hint="Pass tensors of one dtype and number of dimensions on every rank.",
            )
    return [
        [tuple(rank_rows[i][2 : 2 + rank_rows[i][0]]) for i in range(len(leaves))]
        for rank_rows in everyone
    ]


def _same_beyond_first(
    shapes: list[list[tuple[int, ...]]], leaves: list[torch.Tensor], spec: str, call: str
) -> None:
    for i in range(len(leaves)):
        rests = [rank_shapes[i][1:] for rank_shapes in shapes]
        if any(r != rests[0] for r in rests):
            where = "data" if spec == "T" else f"tensor {i} of data ({spec})"
            raise ConfigError(
                f"{call}: {where} has shapes {[tuple(s[i]) for s in shapes]} on processes "
                f"0..{len(shapes) - 1}; they may differ in the first dimension only.",
                subject="data",
                hint="Pad the other dimensions first: fprep.pad_across_processes(state, data, "
                "dim=1).",
            )


def _gather_rows(
    leaves: list[torch.Tensor],
    counts: list[list[int]],
    groups: list[Any],
    device: torch.device,
    call: str,
) -> list[list[torch.Tensor]]:
    """Per leaf, every rank's rows (``counts[i][r]`` of leaf ``i`` on rank ``r``), on the
    leaf's device: one all-gather of a byte buffer holding every leaf, each padded to the most
    rows any rank has (the ranks agree on every dtype and row shape, so on the layout)."""
    layout: list[tuple[int, int]] = []  # per leaf: its offset in the buffer and its bytes
    pieces = []
    offset = 0
    for leaf, rows in zip(leaves, counts, strict=True):
        longest = max(rows)
        padded = leaf.to(device)
        if leaf.shape[0] < longest:
            filler = padded.new_zeros((longest - leaf.shape[0], *leaf.shape[1:]))
            padded = torch.cat([padded, filler])
        raw = padded.contiguous().reshape(-1).view(torch.uint8)
        gap = -raw.numel() % _ALIGN  # the next leaf starts aligned for any dtype's view
        pieces += [raw, raw.new_zeros(gap)]
        layout.append((offset, raw.numel()))
        offset += raw.numel() + gap
    everyone = all_gather(torch.cat(pieces), groups, call=call)
    out: list[list[torch.Tensor]] = []
    for leaf, rows, (start, size) in zip(leaves, counts, layout, strict=True):
        shape = (max(rows), *leaf.shape[1:])
        out.append(
            [
                buffer[start : start + size].view(leaf.dtype).reshape(shape)[:n].to(leaf.device)
                for buffer, n in zip(everyone, rows, strict=True)
            ]
        )
    return out


# -- the main process first ----------------------------------------------------------------------
@contextlib.contextmanager
def main_process_first(state: PrepState) -> Iterator[None]:
    """Run the block on the main process first, then on every other rank of the prepared model
    (Accelerate's ``main_process_first``): for work whose result the others reuse, such as
    downloading or preprocessing a dataset into a cache. Use it on every rank.

    The main process is the first of those ranks: global rank 0 unless ``prepare`` was given a
    process group without it. The others wait for its block at most ``PrepConfig.timeout_s``
    (a ``CollectiveError`` naming it otherwise). If its block raises, the others are released at
    once with a ``CollectiveError`` carrying its error, without running their block, and the main
    process re-raises its own: neither a hang nor a second run over a half-written cache. The
    block must not call fprep's collectives (``reduce``, ``save``, ...): the others are not in it.
    """
    call = "fprep.main_process_first"
    groups = _prepared_groups(state, call)
    if groups is None:
        yield
        return
    device = handles_of(state).device
    if not all(dist.get_rank(g) == 0 for g in groups):  # the others: wait for the main one
        failure = _meet(state, groups, device, call, None)
        if failure is not None:
            raise CollectiveError(
                f"the main process raised inside {call}, so this process did not run the "
                f"block: {failure}",
                subject=call,
                hint="See the main process's traceback (its log) for the cause.",
            )
        yield
        return
    try:
        yield
    except BaseException as error:
        _meet(state, groups, device, call, f"{type(error).__name__}: {error}")
        raise
    _meet(state, groups, device, call, None)


def _prepared_groups(state: PrepState, call: str) -> list[Any] | None:
    """Every rank of the prepared model, ``None`` in one process (the mesh record says which):
    the whole N-D mesh's groups where fprep built one (tensor parallelism), else the
    data-parallel groups."""
    pg = need(state.process_group, "init_process_group", call)
    if not pg.mesh.is_distributed:
        return None
    world_mesh = handles_of(state).world_mesh
    if world_mesh is None:
        return data_parallel_groups(state, call)
    return mesh_groups(world_mesh, call)


def _meet(
    state: PrepState, groups: list[Any], device: torch.device, call: str, failure: str | None
) -> str | None:
    """Every rank arrives (at most ``timeout_s`` apart); the main process passes its failure,
    if any (as bytes), which every rank returns."""
    message = torch.zeros(1 + _ERROR_BYTES, dtype=torch.int32)
    if failure is not None:
        raw = failure.encode()[:_ERROR_BYTES]
        message[0] = 1
        message[1 : 1 + len(raw)] = torch.tensor(list(raw), dtype=torch.int32)
    message = message.to(device)
    with guarded(state, groups, call, arrive=True):
        all_reduce(message, groups, "MAX", call=call)  # only the main process sends non-zeros
    values = message.cpu().tolist()
    if not values[0]:
        return None
    return bytes(v for v in values[1:] if v).decode(errors="ignore")


__all__ = [
    "MAX_DIMS",
    "gather",
    "main_process_first",
    "num_processes",
    "pad_across_processes",
    "process_index",
    "split_between_processes",
]
