"""Tensor parallelism's blocks of pretrained weights: what each rank reads of a file.

A parameter tensor parallelism cuts is a block of the file's tensor (``fprep.sharding.TPLayout``:
the tp chunk, then FSDP2's rows of it), read straight from the file, never whole:

* cut along dim 0 (colwise rows, an ``embedding_rowwise`` vocabulary): the tp chunk's rows,
  then this shard rank's rows of them: contiguous rows of the file, one byte range;
* cut along dim 1 (rowwise columns): this shard rank's rows of the full tensor, and in each the
  tp chunk's columns: one run of bytes per row, ``stride`` (a file row) apart (``StridedRead``),
  each read into its row of the parameter (memory: the rank's block and nothing else).

Parameters the plan replicates over tp, and the ones outside it, keep their reads
(``fprep.weights.plan``: dim-0 shards under FSDP2, whole otherwise). Pure: no I/O, no tensors.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator, Mapping
from typing import TYPE_CHECKING

from fprep.sharding import chunk_rows, local_rows
from fprep.weights.records import TensorRead, WeightsPlan, WeightsSnapshot, WeightsTensor

if TYPE_CHECKING:
    import torch


@dataclasses.dataclass(frozen=True)
class StridedRead(TensorRead):
    """``runs`` runs of ``nbytes // runs`` bytes, the first at ``offset``, each ``stride``
    bytes after the previous: the columns of a rank's rows (``nbytes``: all of them)."""

    runs: int = 1
    stride: int = 0


def _block(
    t: WeightsTensor, dim: int, tp: int, tp_rank: int, shard: tuple[int, int] | None
) -> tuple[int, int, int, int]:
    """``(first row, rows, first column, columns)`` of ``t`` (2-D) that this rank holds."""
    rows, cols = t.shape[0], t.shape[1]
    c0, width = 0, cols
    base, total = 0, rows
    if dim == 0:
        total = rows // tp
        base = total * tp_rank
    else:
        width = cols // tp
        c0 = width * tp_rank
    world, rank = shard if shard is not None else (1, 0)
    start = base + chunk_rows(total, world) * rank
    count = local_rows(total, world, rank) if width else 0
    return start, count, c0, width


def block_read(
    read: TensorRead,
    t: WeightsTensor,
    dim: int,
    tp: int,
    tp_rank: int,
    shard: tuple[int, int] | None,
) -> TensorRead:
    """This rank's read of ``t``, a parameter tensor parallelism cuts along ``dim``."""
    if len(t.shape) != 2 or dim not in (0, 1):  # the plan cuts Linear and Embedding weights
        raise ValueError(f"{t.key!r}: a tensor-parallel block of a {len(t.shape)}-D tensor")
    item = t.nbytes // (t.shape[0] * t.shape[1]) if t.nbytes else 0
    row_bytes = t.shape[1] * item
    start, count, c0, width = _block(t, dim, tp, tp_rank, shard)
    offset = t.offset + start * row_bytes + c0 * item
    if dim == 0 or count <= 1:
        return dataclasses.replace(read, offset=offset, nbytes=count * width * item)
    fields = {f.name: getattr(read, f.name) for f in dataclasses.fields(read)}
    fields.update(offset=offset, nbytes=count * width * item)
    return StridedRead(**fields, runs=count, stride=row_bytes)


def tp_weights(
    plan: WeightsPlan,
    snapshot: WeightsSnapshot,
    dims: Mapping[str, int | None],
    tp: int,
    tp_rank: int,
    shard: tuple[int, int] | None,
) -> WeightsPlan:
    """``plan`` with the reads of the parameters tensor parallelism cuts (``dims``: parameter
    FQN -> tp dim, None: replicated) replaced by this rank's blocks."""
    by_key = {t.key: t for t in snapshot.tensors}
    reads = []
    for read in plan.reads:
        dim = dims.get(read.name) if read.kind == "param" else None
        reads.append(
            read if dim is None else block_read(read, by_key[read.key], dim, tp, tp_rank, shard)
        )
    return dataclasses.replace(plan, reads=tuple(reads))


def pieces(read: TensorRead, dest: torch.Tensor) -> Iterator[tuple[TensorRead, torch.Tensor]]:
    """Contiguous byte ranges of ``read`` and where each lands in ``dest`` (contiguous): the
    read itself, or one row per run of a ``StridedRead``."""
    if not isinstance(read, StridedRead):
        yield read, dest
        return
    run = read.nbytes // read.runs
    for i in range(read.runs):
        part = TensorRead(**{f.name: getattr(read, f.name) for f in dataclasses.fields(TensorRead)})
        yield dataclasses.replace(part, offset=read.offset + i * read.stride, nbytes=run), dest[i]
