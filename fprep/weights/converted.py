"""Parameters transformers assembles from several tensors of a checkpoint: what each rank reads.

A mixture-of-experts model keeps each layer's experts fused in one parameter
(``experts.gate_up_proj``: experts x 2I x H) while its checkpoints hold one tensor per expert
(``experts.E.gate_proj.weight``, ``experts.E.up_proj.weight``: I x H each). transformers'
conversion (``fprep.weights.hf_conversions`` reads it into a ``Conversion``) stacks each
source's experts (``MergeModulelist``) and concatenates the sources (``Concatenate``).

Both are joins along one dim, so the parameter, in row-major order, is a sequence of runs of
the file's tensors (for the layout above, whole tensors: gate 0, up 0, gate 1, up 1, ...).
``segments`` walks that sequence for any range of the parameter's elements, so a rank sharded
on dim 0 reads only its rows: its experts' tensors, and only their rows it holds when a shard
boundary falls inside an expert. Each run is one contiguous byte range of one file. Pure: no
I/O, no tensors.
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Sequence
from dataclasses import dataclass

from fprep.errors import CheckpointError
from fprep.weights.records import (
    ITEMSIZE,
    Conversion,
    ConvertedRead,
    ConvertedSource,
    Segment,
    WeightsTensor,
)

#: transformers' operations fprep reads: each joins its inputs along one dim.
SUPPORTED = frozenset({"MergeModulelist", "Concatenate"})
#: transformers' ``Transpose(check_dims=True)``: transposes a tensor only when its shape is not
#: already the model's (Qwen3-VL-MoE's fused experts); fprep reads it when it is.
TRANSPOSE_IF_NEEDED = "Transpose(check_dims)"


@dataclass(frozen=True)
class Leaf:
    """One tensor of the file, seen with ``shape`` (its own, or with a 1 where it is stacked)."""

    key: str
    shape: tuple[int, ...]


@dataclass(frozen=True)
class Joined:
    """``parts`` joined along ``dim`` (each has the others' shape except along ``dim``)."""

    dim: int
    parts: tuple[Leaf | Joined, ...]

    @property
    def shape(self) -> tuple[int, ...]:
        first = self.parts[0].shape
        width = sum(p.shape[self.dim] for p in self.parts)
        return (*first[: self.dim], width, *first[self.dim + 1 :])


Node = Leaf | Joined


def stacked(dim: int, leaves: Sequence[Leaf]) -> Joined:
    """``torch.stack(leaves, dim)`` as a join: each leaf seen with a 1 inserted at ``dim``."""
    return Joined(dim, tuple(Leaf(x.key, (*x.shape[:dim], 1, *x.shape[dim:])) for x in leaves))


def segments(node: Node, start: int, stop: int) -> list[tuple[str, int, int]]:
    """``(key, first element, elements)`` runs that hold elements ``[start, stop)`` of ``node``
    in row-major order, adjacent runs of one tensor merged."""
    out: list[tuple[str, int, int]] = []
    if start < stop:
        _walk(node, start, stop, out)
    merged: list[tuple[str, int, int]] = []
    for key, first, count in out:
        if merged and merged[-1][0] == key and merged[-1][1] + merged[-1][2] == first:
            merged[-1] = (key, merged[-1][1], merged[-1][2] + count)
        else:
            merged.append((key, first, count))
    return merged


def _walk(node: Node, start: int, stop: int, out: list[tuple[str, int, int]]) -> None:
    if isinstance(node, Leaf):
        out.append((node.key, start, stop - start))
        return
    # Row-major: for each index of the dims before ``dim`` ("outer"), each part's block of
    # ``width * inner`` elements in turn.
    inner = math.prod(node.shape[node.dim + 1 :])
    widths = [p.shape[node.dim] * inner for p in node.parts]
    ends = [sum(widths[: i + 1]) for i in range(len(widths))]
    block = ends[-1]
    if block == 0:
        return
    outer = start // block
    while outer * block < stop:
        base = outer * block
        first = bisect.bisect_right(ends, start - base) if start > base else 0
        for i in range(first, len(node.parts)):
            lo = base + (ends[i - 1] if i else 0)
            if lo >= stop:
                break
            hi = base + ends[i]
            a, b = max(start, lo), min(stop, hi)
            if a < b:
                _walk(node.parts[i], outer * widths[i] + a - lo, outer * widths[i] + b - lo, out)
        outer += 1


def _refuse(conv: Conversion, what: str, hint: str, subject: str | None = None) -> CheckpointError:
    return CheckpointError(
        f"{conv.family} checkpoints hold the model's {conv.target!r} as "
        f"{', '.join(repr(s.pattern) for s in conv.sources)}, which transformers converts "
        f"with {_ops(conv)}; {what}",
        subject=subject or conv.target,
        hint=hint,
    )


def _ops(conv: Conversion) -> str:
    return ", ".join(
        f"{name}(dim={dim})" if dim is not None else name for name, dim in conv.operations
    )


def tree(conv: Conversion, shape: tuple[int, ...], tensors: dict[str, WeightsTensor]) -> Node:
    """The model's ``shape`` as the join of the file's tensors ``conv`` names; raises
    ``CheckpointError`` for an operation fprep does not read, an expert the file lacks or
    has twice, or a tensor of another shape, naming it."""
    ops = conv.operations
    if ops == ((TRANSPOSE_IF_NEEDED, None),) and [len(s.keys) for s in conv.sources] == [1]:
        key = conv.sources[0].keys[0]
        if tensors[key].shape == shape:  # transformers does not transpose it either
            return Leaf(key, shape)
    unsupported = [name for name, _ in ops if name not in SUPPORTED]
    merge = [dim for name, dim in ops if name == "MergeModulelist"]
    concat = [dim for name, dim in ops if name == "Concatenate"]
    if (
        unsupported
        or len(merge) > 1
        or len(concat) > 1
        or (merge and ops[0][0] != "MergeModulelist")
        or any(d is None or not 0 <= d < len(shape) for d in merge + concat)
        or (not concat and len(conv.sources) != 1)
    ):
        raise _refuse(
            conv,
            f"fprep reads only {' and '.join(sorted(SUPPORTED))} (stacking experts, joining "
            f"sources along one dim), not {', '.join(unsupported) or 'this combination'}.",
            "Load this model with transformers' from_pretrained and pass it to fprep.prepare "
            "without weights= (each rank then reads the whole checkpoint).",
        )
    group = list(shape)  # the shape of each source's part of the parameter
    if concat:
        c = concat[0]
        assert c is not None
        if group[c] % len(conv.sources):
            raise _refuse(
                conv,
                f"the model's dim {c} ({group[c]}) does not split evenly into "
                f"{len(conv.sources)} sources.",
                "Build the model from the checkpoint's config.",
            )
        group[c] //= len(conv.sources)
    parts: list[Node] = []
    for source in conv.sources:
        if merge:
            k = merge[0]
            assert k is not None
            leaf_shape = tuple(group[:k] + group[k + 1 :])
            leaves = _experts(conv, source, group[k], leaf_shape, tensors)
            parts.append(stacked(k, leaves))
        else:
            if len(source.keys) != 1:
                raise _refuse(
                    conv,
                    f"the file holds {len(source.keys)} tensors for {source.pattern!r}, not one.",
                    "Check that the checkpoint belongs to this model class.",
                )
            parts.append(_leaf(conv, source.keys[0], tuple(group), tensors))
    if not concat:
        return parts[0]
    c = concat[0]
    assert c is not None
    return Joined(c, tuple(parts))


def _experts(
    conv: Conversion,
    source: ConvertedSource,
    count: int,
    shape: tuple[int, ...],
    tensors: dict[str, WeightsTensor],
) -> list[Leaf]:
    """``source``'s tensors for experts ``0 .. count - 1``, in that order."""
    numbers = source.experts or tuple(range(len(source.keys)))
    by_number: dict[int, str] = {}
    for number, key in zip(numbers, source.keys, strict=True):
        if number in by_number:  # "experts.3" and "experts.03"
            raise CheckpointError(
                f"{tensors[key].file} holds both {by_number[number]!r} and {key!r} for expert "
                f"{number} of the model's {conv.target!r}.",
                subject=key,
                hint="The checkpoint holds one expert twice: remove one of them.",
            )
        by_number[number] = key
    missing = [e for e in range(count) if e not in by_number]
    if missing:
        name = source.template.format(missing[0]) if source.template else source.pattern
        raise CheckpointError(
            f"{conv.family} checkpoints hold the model's {conv.target!r} as one tensor per "
            f"expert ({count} experts), but the file has no {name!r}"
            + (f" ({len(missing)} experts missing)." if len(missing) > 1 else "."),
            subject=name,
            hint="The checkpoint is incomplete (a shard missing from the index, an interrupted "
            "download) or was saved with fewer experts: download it again, or build the model "
            "from the checkpoint's config.",
        )
    extra = sorted(e for e in by_number if e >= count)
    if extra:
        key = by_number[extra[0]]
        raise CheckpointError(
            f"{key!r} in {tensors[key].file} is expert {extra[0]}, but the model's "
            f"{conv.target!r} has {count} experts.",
            subject=key,
            hint="The checkpoint was saved with more experts: build the model from the "
            "checkpoint's config.",
        )
    return [_leaf(conv, by_number[e], shape, tensors) for e in range(count)]


def _leaf(
    conv: Conversion, key: str, shape: tuple[int, ...], tensors: dict[str, WeightsTensor]
) -> Leaf:
    t = tensors[key]
    if t.shape != shape:
        raise CheckpointError(
            f"{key!r} in {t.file} has shape {list(t.shape)}, but the model's {conv.target!r} "
            f"({conv.family}: {_ops(conv)}) needs shape {list(shape)} from it.",
            subject=key,
            hint="The checkpoint was saved from a model with another configuration (hidden "
            "size, expert size, number of experts): build the model from the checkpoint's "
            "config.",
        )
    return Leaf(key, shape)


def converted_read(
    conv: Conversion,
    node: Node,
    tensors: dict[str, WeightsTensor],
    *,
    name: str,
    dtype: str,
    rows: tuple[int, int] | None,
    keep: bool,
) -> ConvertedRead:
    """This rank's read of the parameter ``name`` (of ``dtype``) that ``node`` assembles: rows
    ``[first, first + count)`` of dim 0 (``rows``), or all of it."""
    shape = node.shape
    row = math.prod(shape[1:])
    start, stop = (0, math.prod(shape)) if rows is None else (rows[0] * row, sum(rows) * row)
    parts = []
    for key, first, count in segments(node, start, stop):
        t = tensors[key]
        item = ITEMSIZE[t.dtype]
        parts.append(Segment(key, t.file, t.dtype, t.offset + first * item, count * item))
    head = parts[0] if parts else None
    first_key = conv.sources[0].keys[0] if conv.sources and conv.sources[0].keys else ""
    return ConvertedRead(
        name=name,
        key=head.key if head else first_key,
        kind="param",
        file=head.file if head else tensors[first_key].file,
        dtype=head.dtype if head else tensors[first_key].dtype,
        target_dtype=dtype,
        offset=head.offset if head else 0,
        nbytes=sum(p.nbytes for p in parts),
        keep=keep,
        segments=tuple(parts),
    )


def leaf_order(node: Node) -> list[str] | None:
    """The file's tensors in the order their bytes follow each other in ``node`` (row-major),
    when each is one run (so the parameter's bytes, streamed as they are, are the tensors'
    bytes one after the other); None otherwise."""
    runs = segments(node, 0, math.prod(node.shape))
    keys = [key for key, _, _ in runs]
    if len(set(keys)) != len(keys) or any(first != 0 for _, first, _ in runs):
        return None
    return keys
