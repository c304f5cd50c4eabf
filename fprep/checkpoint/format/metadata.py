"""DCP's ``Metadata`` as JSON, written and read without pickle.

DCP's own ``FileSystemWriter`` pickles its ``Metadata`` into ``.metadata`` and the reader
unpickles it, so a crafted checkpoint runs code. fprep writes ``metadata.json`` instead: for each
tensor its dtype, global size and chunks (offsets, sizes), and for each stored chunk the file,
byte offset and length of its raw bytes. Parsing validates everything a reader relies on: known
dtypes, chunks inside their tensor, chunks that tile it exactly (no gap, no overlap), one stored
record per chunk, byte ranges inside files the manifest lists.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    TensorProperties,
    TensorStorageMetadata,
)

from fprep.errors import CheckpointError

FORMAT = "fprep-dcp-metadata"
VERSION = 1
METADATA_FILE = "metadata.json"
#: Data files as DCP names them: ``__<rank>_<n>.distcp``.
DATA_FILE = re.compile(r"__\d{1,9}_\d{1,9}\.distcp")

#: Dtypes a checkpoint may hold (name -> dtype); anything else is refused when reading.
DTYPES: dict[str, torch.dtype] = {
    str(d).removeprefix("torch."): d
    for d in (
        torch.float64,
        torch.float32,
        torch.float16,
        torch.bfloat16,
        torch.complex64,
        torch.complex128,
        torch.int64,
        torch.int32,
        torch.int16,
        torch.int8,
        torch.uint8,
        torch.uint16,
        torch.uint32,
        torch.uint64,
        torch.bool,
        torch.float8_e4m3fn,
        torch.float8_e5m2,
    )
}


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


@dataclass(frozen=True)
class StoredChunk:
    """Where one chunk's raw bytes are: file (a name in the checkpoint directory), range."""

    file: str
    offset: int
    length: int


def _prod(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


# -- writing ------------------------------------------------------------------------------------
def to_json(metadata: Metadata) -> dict[str, Any]:
    tensors: dict[str, Any] = {}
    for key, md in sorted(metadata.state_dict_metadata.items()):
        if not isinstance(md, TensorStorageMetadata):
            raise CheckpointError(
                f"checkpoint entry {key!r} is not a tensor; fprep stores only tensors through DCP.",
                subject=key,
            )
        tensors[key] = {
            "dtype": dtype_name(md.properties.dtype),
            "size": list(md.size),
            "chunks": [{"offsets": list(c.offsets), "sizes": list(c.sizes)} for c in md.chunks],
        }
    storage = [
        {
            "key": index.fqn,
            "chunk": list(index.offset) if index.offset is not None else None,
            "file": info.file,
            "offset": info.offset,
            "length": info.length,
        }
        for index, info in sorted(
            (metadata.storage_data or {}).items(),
            key=lambda kv: (kv[0].fqn, tuple(kv[0].offset or ())),
        )
    ]
    return {"format": FORMAT, "version": VERSION, "tensors": tensors, "storage": storage}


# -- reading ------------------------------------------------------------------------------------
def _fail(detail: str) -> CheckpointError:
    return CheckpointError(
        f"{METADATA_FILE} is not valid: {detail}.",
        subject=METADATA_FILE,
        hint="The file was not written by fprep.save, or was modified; it was not used.",
    )


def _int_list(value: Any, what: str) -> tuple[int, ...]:
    # type() is int: JSON gives plain ints (never subclasses) and bools are refused
    if type(value) is not list or not all(type(v) is int and v >= 0 for v in value):
        raise _fail(f"{what} must be a list of non-negative ints")
    if len(value) > 64:
        raise _fail(f"{what} has {len(value)} dimensions")
    return tuple(value)


MAX_CHUNKS = 1 << 16  # per tensor: far more than any world size writes


Box = tuple[tuple[int, ...], tuple[int, ...]]  # (offsets, sizes)
_PAIRWISE = 512  # boxes searched pair by pair for an overlap, at most (only to name it)


def _check_tiling(key: str, size: tuple[int, ...], chunks: list[Box]) -> None:
    """Chunks lie inside the tensor, do not overlap, and cover all of it: O(n log n) per
    dimension (a crafted file of many chunks costs little to refuse).

    DCP's chunks are the shards of a grid (each mesh dimension cuts a tensor dimension), so the
    tensor splits along some dimension into slabs whose chunks all span the slab there, and each
    slab again, one dimension fewer each time. Sorting the chunks by their interval along a
    dimension finds such a cut, its gaps and overlaps; chunks that admit no cut overlap (found
    and named) or do not form a grid, and are refused either way.
    """
    if len(chunks) > MAX_CHUNKS:
        raise _fail(f"{key!r} has {len(chunks)} chunks, more than {MAX_CHUNKS}")
    boxes: list[Box] = []
    for off, sz in chunks:
        if len(off) != len(size) or len(sz) != len(size):
            raise _fail(f"a chunk of {key!r} has the wrong number of dimensions")
        if any(o + s > n for o, s, n in zip(off, sz, size, strict=True)):
            raise _fail(f"a chunk of {key!r} at {list(off)} lies outside its size {list(size)}")
        if _prod(sz) > 0:
            boxes.append((off, sz))
    if _prod(size) == 0:
        return  # nothing to cover (and no chunk with elements fits inside)
    covered = sum(_prod(sz) for _, sz in boxes)
    gap = not boxes  # reported after every overlap has been looked for
    stack: list[tuple[list[Box], tuple[int, ...], tuple[int, ...]]] = (
        [(boxes, (0,) * len(size), size)] if boxes else []
    )
    while stack:
        region, lo, hi = stack.pop()
        slabs = next(
            (cut for d in range(len(size)) if (cut := _cut(region, d, lo, hi)) is not None), None
        )
        if slabs is None:
            if len(region) > 1:
                raise _fail(_no_cut(key, region))
            off, sz = region[0]
            gap = gap or any(off[d] != lo[d] or off[d] + sz[d] != hi[d] for d in range(len(size)))
            continue
        for d, start, end, slab in slabs:
            if start is None:  # nothing covers [previous end, end) along d
                gap = True
            else:
                stack.append((slab, (*lo[:d], start, *lo[d + 1 :]), (*hi[:d], end, *hi[d + 1 :])))
    if gap or covered != _prod(size):
        raise _fail(f"the chunks of {key!r} cover {covered} of its {_prod(size)} elements")


def _cut(
    region: list[Box], d: int, lo: tuple[int, ...], hi: tuple[int, ...]
) -> list[tuple[int, int | None, int, list[Box]]] | None:
    """The slabs ``region`` splits into along dimension ``d`` (``(d, start, end, boxes)``; a
    ``None`` start marks a gap), or None when ``d`` does not cut it: every box spans it, or two
    boxes' intervals along ``d`` overlap without being equal."""
    if all(off[d] == lo[d] and off[d] + sz[d] == hi[d] for off, sz in region):
        return None
    slabs: list[tuple[int, int | None, int, list[Box]]] = []
    end = lo[d]
    for box in sorted(region, key=lambda b: (b[0][d], b[1][d])):
        start, stop = box[0][d], box[0][d] + box[1][d]
        if slabs and start == slabs[-1][1] and stop == slabs[-1][2]:
            slabs[-1][3].append(box)
        elif start < end:
            return None
        else:
            if start > end:
                slabs.append((d, None, start, []))
            slabs.append((d, start, stop, [box]))
            end = stop
    if end != hi[d]:
        slabs.append((d, None, hi[d], []))
    return slabs


def _no_cut(key: str, region: list[Box]) -> str:
    """Why chunks that admit no cut are refused: the overlap when one is found."""
    few = sorted(region)[:_PAIRWISE]
    for i, (off, sz) in enumerate(few):
        for other_off, other_sz in few[i + 1 :]:
            if all(
                o < oo + os and oo < o + s
                for o, s, oo, os in zip(off, sz, other_off, other_sz, strict=True)
            ):
                return f"two chunks of {key!r} overlap at {list(other_off)}"
    return f"the chunks of {key!r} do not tile it as a grid (near {list(few[0][0])})"


def from_json(data: Any, file_sizes: Mapping[str, int]) -> Metadata:
    """A validated ``Metadata`` whose ``storage_data`` maps ``MetadataIndex -> StoredChunk``."""
    if not isinstance(data, dict) or data.get("format") != FORMAT:
        raise _fail(f"its format is not {FORMAT!r}")
    if data.get("version") != VERSION:
        raise _fail(f"version {data.get('version')!r} is not {VERSION} (a newer fprep?)")
    tensors, storage = data.get("tensors"), data.get("storage")
    if not isinstance(tensors, dict) or not isinstance(storage, list):
        raise _fail("'tensors' must be an object and 'storage' a list")
    state: dict[str, TensorStorageMetadata] = {}
    itemsize: dict[str, int] = {}
    all_boxes: dict[str, list[Box]] = {}
    chunk_index: dict[str, dict[tuple[int, ...], int]] = {}
    for key, entry in tensors.items():
        if not isinstance(entry, dict) or set(entry) != {"dtype", "size", "chunks"}:
            raise _fail(f"tensor {key!r} must have exactly 'dtype', 'size' and 'chunks'")
        dtype = DTYPES.get(entry["dtype"]) if isinstance(entry["dtype"], str) else None
        if dtype is None:
            raise _fail(f"tensor {key!r} has an unknown dtype {entry['dtype']!r}")
        size = _int_list(entry["size"], f"the size of {key!r}")
        if not isinstance(entry["chunks"], list):
            raise _fail(f"the chunks of {key!r} must be a list")
        boxes: list[Box] = []
        for c in entry["chunks"]:
            if not isinstance(c, dict) or set(c) != {"offsets", "sizes"}:
                raise _fail(f"a chunk of {key!r} must have exactly 'offsets' and 'sizes'")
            boxes.append(
                (
                    _int_list(c["offsets"], f"a chunk offset of {key!r}"),
                    _int_list(c["sizes"], f"a chunk size of {key!r}"),
                )
            )
        _check_tiling(key, size, boxes)
        state[key] = TensorStorageMetadata(
            properties=TensorProperties(dtype=dtype),
            size=torch.Size(size),
            chunks=[
                ChunkStorageMetadata(offsets=torch.Size(off), sizes=torch.Size(sz))
                for off, sz in boxes
            ],
        )
        itemsize[key] = torch.empty((), dtype=dtype).element_size()
        all_boxes[key] = boxes
        # a chunk's offsets -> its (first) position
        chunk_index[key] = {off: i for i, (off, _) in reversed(list(enumerate(boxes)))}
    stored: dict[MetadataIndex, StoredChunk] = {}
    for entry in storage:
        if not isinstance(entry, dict) or set(entry) != {
            "key",
            "chunk",
            "file",
            "offset",
            "length",
        }:
            raise _fail("a storage entry must have exactly key, chunk, file, offset, length")
        key, file = entry["key"], entry["file"]
        md = state.get(key) if isinstance(key, str) else None
        if md is None:
            raise _fail(f"a storage entry names an unknown tensor {key!r}")
        chunk_off = _int_list(entry["chunk"], f"the chunk of a storage entry of {key!r}")
        index = chunk_index[key].get(chunk_off)
        if index is None:
            raise _fail(f"a storage entry of {key!r} names no chunk of it ({list(chunk_off)})")
        if not isinstance(file, str) or file not in file_sizes or not DATA_FILE.fullmatch(file):
            raise _fail(f"a storage entry of {key!r} names a file the manifest does not list")
        offset, length = entry["offset"], entry["length"]
        if not all(isinstance(v, int) and not isinstance(v, bool) for v in (offset, length)):
            raise _fail(f"the byte range of {key!r} must be ints")
        expected = _prod(all_boxes[key][index][1]) * itemsize[key]
        if length != expected:
            raise _fail(
                f"a chunk of {key!r} is {length} bytes; its shape and dtype make {expected}"
            )
        if offset < 0 or offset + length > file_sizes[file]:
            raise _fail(f"a chunk of {key!r} lies outside {file} ({file_sizes[file]} bytes)")
        index_key = MetadataIndex(fqn=key, offset=chunk_off, index=index)
        if index_key in stored:
            raise _fail(f"a chunk of {key!r} is stored twice")
        stored[index_key] = StoredChunk(file=file, offset=offset, length=length)
    for key, boxes in all_boxes.items():
        for i, (off, _) in enumerate(boxes):
            if MetadataIndex(fqn=key, offset=off, index=i) not in stored:
                raise _fail(f"a chunk of {key!r} at {list(off)} is not stored anywhere")
    return Metadata(state_dict_metadata=dict(state), storage_data=stored, version="1.0.0")
