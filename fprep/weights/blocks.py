"""Tensor parallelism's blocks of pretrained weights: what each rank reads of a file.

A parameter tensor parallelism cuts is a block of the file's tensor (``fprep.sharding.TPLayout``:
the tp chunk along its tp dim, then FSDP2's rows of that chunk), read straight from the file,
never whole. The file's tensor is row-major; seen as ``(rows, outer, cut, inner)`` around the
cut dim (``outer``, ``inner``: the products of the dims between, and after):

* cut along dim 0 (colwise weights and biases, an ``embedding_rowwise`` vocabulary): the tp
  chunk's rows, then this shard rank's rows of them: contiguous rows of the file, one byte
  range, whatever the tensor's rank (a bias's rows are single elements);
* cut along a later dim (rowwise columns): this shard rank's rows of the full tensor, and in
  each the tp chunk of the cut dim: one run of bytes per (row, outer) pair, ``stride`` bytes
  apart (``StridedRead``), each read into its place in the parameter (memory: the rank's block
  and nothing else).

Parameters the plan replicates over tp (rowwise biases, sequence-parallel norms), and the ones
outside it, keep their reads (``fprep.weights.plan``: dim-0 shards under FSDP2, whole
otherwise). Pure: no I/O, no tensors.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterator, Mapping
from typing import TYPE_CHECKING

from fprep.errors import CheckpointError, ConfigError
from fprep.sharding import chunk_rows, local_rows
from fprep.weights.records import (
    ITEMSIZE,
    ConvertedRead,
    TensorRead,
    WeightsPlan,
    WeightsSnapshot,
    WeightsTensor,
)

if TYPE_CHECKING:
    import torch


@dataclasses.dataclass(frozen=True)
class StridedRead(TensorRead):
    """``runs`` runs of ``nbytes // runs`` bytes, the first at ``offset``, each ``stride``
    bytes after the previous: the tp chunks of a rank's rows (``nbytes``: all of them)."""

    runs: int = 1
    stride: int = 0


def _rows(rows: int, shard: tuple[int, int] | None) -> tuple[int, int]:
    """``(first row, rows)`` of ``rows`` that this shard rank holds (FSDP2's even chunks)."""
    world, rank = shard if shard is not None else (1, 0)
    return chunk_rows(rows, world) * rank, local_rows(rows, world, rank)


def block_read(
    read: TensorRead,
    t: WeightsTensor,
    dim: int,
    tp: int,
    tp_rank: int,
    shard: tuple[int, int] | None,
) -> TensorRead:
    """This rank's read of ``t``, a parameter tensor parallelism cuts along ``dim`` into ``tp``
    equal chunks (the plan checked that ``tp`` divides it), of which it holds ``tp_rank``'s;
    ``shard``: ``(dp shard group size, this rank's index)`` under FSDP2, else None."""
    shape = t.shape
    if not 0 <= dim < len(shape) or shape[dim] % tp:
        raise ConfigError(
            f"tensor parallelism cuts {read.name!r} along dim {dim} into {tp} chunks, but its "
            f"tensor {t.key!r} in {t.file} has shape {list(shape)}.",
            subject=read.name,
            hint="Leave this parameter's module out of PrepConfig.tp_plan (or 'replicate').",
        )
    item = ITEMSIZE[t.dtype]
    width = shape[dim] // tp  # the tp chunk along the cut dim
    if dim == 0:
        row_bytes = math.prod(shape[1:]) * item
        start, count = _rows(width, shard)
        offset = t.offset + (width * tp_rank + start) * row_bytes
        return dataclasses.replace(read, offset=offset, nbytes=count * row_bytes)
    inner = math.prod(shape[dim + 1 :]) * item  # bytes of one element of the cut dim
    stride = shape[dim] * inner  # bytes from one (row, outer) pair's cut dim to the next
    start, count = _rows(shape[0], shard)
    runs = count * math.prod(shape[1:dim])
    offset = t.offset + start * math.prod(shape[1:dim]) * stride + width * tp_rank * inner
    nbytes = runs * width * inner
    if runs <= 1:
        return dataclasses.replace(read, offset=offset, nbytes=nbytes)
    fields = {f.name: getattr(read, f.name) for f in dataclasses.fields(read)}
    fields.update(offset=offset, nbytes=nbytes)
    return StridedRead(**fields, runs=runs, stride=stride)


def tp_weights(
    plan: WeightsPlan,
    snapshot: WeightsSnapshot,
    dims: Mapping[str, int | None],
    tp: int,
    tp_rank: int,
    shard: tuple[int, int] | None,
) -> WeightsPlan:
    """``plan`` with the reads of the parameters tensor parallelism cuts (``dims``: parameter
    FQN -> tp dim, None: replicated) replaced by this rank's blocks. (Tied parameters, whose
    other names ``plan.same_as`` reads, are never cut: the plan refuses them under tp.)"""
    by_key = {t.key: t for t in snapshot.tensors}
    reads = []
    for read in plan.reads:
        dim = dims.get(read.name) if read.kind == "param" else None
        if dim is not None and isinstance(read, ConvertedRead):
            raise CheckpointError(
                f"tensor parallelism cuts {read.name!r}, which {plan.source} holds as one "
                f"tensor per expert ({read.key!r}, ...): fprep does not yet read a "
                "converted parameter's tensor-parallel block.",
                subject=read.name,
                hint="Leave this parameter's module out of PrepConfig.tp_plan (or give it "
                "'replicate'), or prepare without tensor parallelism (tp=1).",
            )
        reads.append(
            read if dim is None else block_read(read, by_key[read.key], dim, tp, tp_rank, shard)
        )
    return dataclasses.replace(plan, reads=tuple(reads))


def pieces(read: TensorRead, dest: torch.Tensor) -> Iterator[tuple[TensorRead, torch.Tensor]]:
    """Contiguous byte ranges of ``read`` and where each lands in ``dest`` (contiguous, the
    rank's block): the read itself, one slice of ``dest`` per run of a ``StridedRead``, or
    per segment of a ``ConvertedRead``."""
    if isinstance(read, ConvertedRead):
        flat, at = dest.view(-1), 0
        base = TensorRead(**{f.name: getattr(read, f.name) for f in dataclasses.fields(TensorRead)})
        for s in read.segments:
            count = s.nbytes // ITEMSIZE[s.dtype]
            part = dataclasses.replace(
                base, key=s.key, file=s.file, dtype=s.dtype, offset=s.offset, nbytes=s.nbytes
            )
            yield part, flat[at : at + count]
            at += count
        return
    if not isinstance(read, StridedRead):
        yield read, dest
        return
    run = read.nbytes // read.runs
    plain = TensorRead(**{f.name: getattr(read, f.name) for f in dataclasses.fields(TensorRead)})
    for i, part in enumerate(dest.view(read.runs, -1)):
        yield dataclasses.replace(plain, offset=read.offset + i * read.stride, nbytes=run), part
