"""DCP storage without pickle: raw tensor bytes, JSON metadata, sha256 on every file.

``SafeWriter`` is a DCP ``StorageWriter``: each rank writes the chunks DCP planned for it as raw,
contiguous, little-endian bytes (64-byte aligned) into ``__<rank>_<n>.distcp`` files (one, or a
few written in parallel when the rank has many bytes), hashing as it writes; the coordinator
writes ``metadata.json`` (see ``metadata.py``). Non-tensor entries
(DCP's ``BYTE_IO`` items, which DCP's planner would load with ``torch.load(weights_only=False)``)
are refused: fprep keeps every non-tensor value in its JSON manifest.

``SafeReader`` is the matching ``StorageReader``. It never reads ``.metadata`` and never calls
``pickle`` or ``torch.load``: the metadata is parsed JSON handed to it, each file is checked
against the size and sha256 the manifest records (the whole file, before any of it is used,
several files in parallel), all ranks agree that every check passed, and only then are chunks
viewed in place (``torch.frombuffer`` over a private memory map) and copied into the tensors DCP
asks for (the live model's: nothing has been written to them before that point).

For reference, torch 2.13's own ``FileSystemReader`` reads tensor payloads with
``torch.load(weights_only=True)`` (a restricted unpickler) and its ``.metadata`` with plain
``pickle.load``; neither is used here.
"""

from __future__ import annotations

import collections
import contextlib
import ctypes
import dataclasses
import hashlib
import mmap
import os
import sys
from collections.abc import Callable, Mapping
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint.metadata import (
    Metadata,
    MetadataIndex,
    StorageMeta,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import (
    LoadItemType,
    LoadPlan,
    LoadPlanner,
    SavePlan,
    SavePlanner,
    WriteItemType,
)
from torch.distributed.checkpoint.storage import StorageReader, StorageWriter, WriteResult
from torch.futures import Future

from fprep.checkpoint import metadata as md_json
from fprep.checkpoint.files import FileRecord, check_digest, check_size, dump_json, write_durable
from fprep.errors import CheckpointError

ALIGN = 64
_IN_FLIGHT = 256 * 1024 * 1024  # bytes written but not yet hashed, at most
MIN_FILE = 64 * 1024 * 1024  # a rank's data is split into files of at least this size ...
MAX_FILES = 4  # ... and at most this many (and no more than there are CPUs)
_ZEROS = bytes(ALIGN)


def _little_endian() -> None:
    if sys.byteorder != "little":  # pragma: no cover - no big-endian CI
        raise CheckpointError(
            "fprep checkpoints store little-endian bytes; this machine is big-endian.",
            subject="byteorder",
        )


def byte_view(t: torch.Tensor) -> memoryview:
    """The bytes of a contiguous CPU tensor, without a copy (keep ``t`` alive while used)."""
    n = t.numel() * t.element_size()
    if n == 0:
        return memoryview(b"")
    return memoryview((ctypes.c_ubyte * n).from_address(t.data_ptr())).cast("B")


def _item_bytes(item: Any) -> int:
    data = item.tensor_data
    if data is None:
        return 0
    n = 1
    for d in data.chunk.sizes:
        n *= d
    return int(n * data.properties.dtype.itemsize)


def split(items: list[Any]) -> list[list[Any]]:
    """A rank's items in up to ``MAX_FILES`` files of at least ``MIN_FILE`` bytes (balanced,
    largest first), so that several cores can write and hash them (and later verify them)."""
    if not items:
        return []
    total = sum(_item_bytes(i) for i in items)
    count = max(1, min(MAX_FILES, os.cpu_count() or 1, total // MIN_FILE, len(items)))
    if count == 1:
        return [list(items)]
    buckets: list[list[Any]] = [[] for _ in range(count)]
    sizes = [0] * count
    for item in sorted(items, key=_item_bytes, reverse=True):
        j = sizes.index(min(sizes))
        buckets[j].append(item)
        sizes[j] += _item_bytes(item)
    return buckets


class _Hasher:
    """sha256 of a byte stream, computed on a worker thread while the caller writes and fsyncs.

    ``hashlib`` releases the GIL on large buffers, so hashing overlaps the writes. At most
    ``_IN_FLIGHT`` bytes wait to be hashed; their tensors are kept alive until then.
    """

    def __init__(self) -> None:
        self._digest = hashlib.sha256()
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="fprep-sha256")
        self._pending: collections.deque[tuple[Any, Any, int]] = collections.deque()
        self._in_flight = 0

    def update(self, view: Any, owner: Any) -> None:
        job = self._pool.submit(self._digest.update, view)
        self._pending.append((job, (view, owner), len(view)))
        self._in_flight += len(view)
        while self._in_flight > _IN_FLIGHT and self._pending:
            self._wait_one()

    def _wait_one(self) -> None:
        job, _, size = self._pending.popleft()
        job.result()
        self._in_flight -= size

    def hexdigest(self) -> str:
        while self._pending:
            self._wait_one()
        return self._digest.hexdigest()

    def __enter__(self) -> _Hasher:
        return self

    def __exit__(self, *exc: object) -> None:
        self._pool.shutdown(wait=True)
        self._pending.clear()


class SafeWriter(StorageWriter):
    """Writes each rank's raw data files into ``path`` and ``metadata.json`` on the coordinator.

    After ``dcp.save`` returns, ``files`` holds this rank's data files (name -> record) and, on
    the coordinator, ``metadata.json``'s record.
    """

    def __init__(self, path: str | os.PathLike[str], *, sync_files: bool = True) -> None:
        super().__init__()
        self.path = Path(path)
        self.sync_files = sync_files
        self.files: dict[str, FileRecord] = {}
        self.rank = 0

    def reset(self, checkpoint_id: str | os.PathLike[str] | None = None) -> None:
        if checkpoint_id is not None:
            self.path = Path(checkpoint_id)
        self.files = {}

    def set_up_storage_writer(self, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        self.rank = int(kwargs.get("rank") or 0)

    def prepare_local_plan(self, plan: SavePlan) -> SavePlan:
        for item in plan.items:
            if item.type == WriteItemType.BYTE_IO:
                raise CheckpointError(
                    f"checkpoint entry {item.index.fqn!r} is not a tensor.",
                    subject=item.index.fqn,
                    hint="fprep stores non-tensor state in its JSON manifest, never as DCP bytes.",
                )
        return plan

    def prepare_global_plan(self, plans: list[SavePlan]) -> list[SavePlan]:
        return [dataclasses.replace(p, storage_data=f"__{i}_") for i, p in enumerate(plans)]

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> Future[list[WriteResult]]:
        _little_endian()
        buckets = split(plan.items)
        names = [f"{plan.storage_data}{j}.distcp" for j in range(len(buckets))]
        results: list[WriteResult] = []
        if len(buckets) == 1:
            results += self._write_file(names[0], buckets[0], planner)
        elif buckets:  # one thread per file: writes and hashes run in parallel (GIL released)
            with ThreadPoolExecutor(len(buckets), thread_name_prefix="fprep-write") as pool:
                jobs = [
                    pool.submit(self._write_file, n, b, planner)
                    for n, b in zip(names, buckets, strict=True)
                ]
            for job in jobs:
                results += job.result()
        future: Future[list[WriteResult]] = Future()
        future.set_result(results)
        return future

    def _write_file(self, name: str, items: list[Any], planner: SavePlanner) -> list[WriteResult]:
        results: list[WriteResult] = []
        with open(self.path / name, "wb") as f, _Hasher() as hasher:
            position = 0
            for item in items:
                t = self._tensor(planner, item)
                pad = -position % ALIGN
                if pad:
                    f.write(_ZEROS[:pad])
                    hasher.update(_ZEROS[:pad], None)
                    position += pad
                view = byte_view(t)
                f.write(view)
                hasher.update(view, t)  # hashed in order on another thread
                nbytes = t.numel() * t.element_size()
                results.append(
                    WriteResult(
                        index=item.index,
                        size_in_bytes=nbytes,
                        storage_data=md_json.StoredChunk(file=name, offset=position, length=nbytes),
                    )
                )
                position += nbytes
            f.flush()
            if self.sync_files:
                os.fsync(f.fileno())  # while the last bytes are being hashed
            digest = hasher.hexdigest()
        self.files[name] = FileRecord(size=position, sha256=digest)
        return results

    @staticmethod
    def _tensor(planner: SavePlanner, item: Any) -> torch.Tensor:
        data = planner.resolve_data(item)
        if not isinstance(data, torch.Tensor) or item.tensor_data is None:
            raise CheckpointError(
                f"checkpoint entry {item.index.fqn!r} is not a tensor.", subject=item.index.fqn
            )
        t = data.detach().to("cpu").contiguous()
        if tuple(t.shape) != tuple(item.tensor_data.chunk.sizes):
            raise CheckpointError(
                f"checkpoint entry {item.index.fqn!r}: DCP planned a chunk of "
                f"{tuple(item.tensor_data.chunk.sizes)}, the tensor has {tuple(t.shape)}.",
                subject=item.index.fqn,
            )
        return t

    def finish(self, metadata: Metadata, results: list[list[WriteResult]]) -> None:
        metadata.storage_data = {r.index: r.storage_data for rs in results for r in rs}
        data = dump_json(md_json.to_json(metadata))
        self.files[md_json.METADATA_FILE] = write_durable(self.path / md_json.METADATA_FILE, data)

    def storage_meta(self) -> StorageMeta | None:
        return StorageMeta(checkpoint_id=str(self.path))

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike[str]) -> bool:
        return True


def open_verified(path: Path, record: FileRecord, what: str, *, verify: bool) -> Any:
    """A private memory map of a file whose size (and, with ``verify``, sha256) match."""
    check_size(path, record, what)
    if record.size == 0:
        if verify:
            check_digest(hashlib.sha256(b"").hexdigest(), record, what)
        return b""
    with open(path, "rb") as f:
        mapped = mmap.mmap(f.fileno(), record.size, access=mmap.ACCESS_COPY)
    try:
        check_size(path, record, what)
        if verify:
            check_digest(hashlib.sha256(mapped).hexdigest(), record, what)
    except BaseException:
        mapped.close()
        raise
    return mapped


def _close(mapped: Any) -> None:
    # BufferError: a tensor still views the map (an exception in flight); GC closes it later
    if isinstance(mapped, mmap.mmap):
        with contextlib.suppress(BufferError):
            mapped.close()


def _narrow(t: torch.Tensor, offsets: Any, lengths: Any) -> torch.Tensor:
    for dim, (start, length) in enumerate(zip(offsets, lengths, strict=True)):
        if start != 0 or length != t.shape[dim]:
            t = t.narrow(dim, start, length)
    return t


class SafeReader(StorageReader):
    """Reads a checkpoint whose metadata was parsed (and verified) by the caller.

    ``read_data`` works in two phases: every file this rank needs is mapped and checked (size,
    sha256; several files are hashed in parallel), then all ranks agree that every check
    passed (``agree``), and only then is a byte copied into the tensors DCP asks for, which may
    be the live model's. ``verify=False`` skips the sha256 of data files (sizes and metadata are
    still checked; nothing is ever unpickled).
    """

    def __init__(
        self,
        path: str | os.PathLike[str],
        metadata: Metadata,
        files: Mapping[str, FileRecord],
        *,
        verify: bool = True,
        agree: Callable[[BaseException | None], object] | None = None,
    ) -> None:
        super().__init__()
        self.path = Path(path)
        self.metadata = metadata
        self.files = dict(files)
        self.verify = verify
        self.agree = agree
        self.storage_data: dict[MetadataIndex, md_json.StoredChunk] = {}
        #: each stored chunk's dtype and shape, from the (validated) metadata
        self.chunks: dict[MetadataIndex, tuple[torch.dtype, tuple[int, ...]]] = {
            MetadataIndex(fqn=key, offset=tuple(c.offsets)): (tmd.properties.dtype, tuple(c.sizes))
            for key, tmd in metadata.state_dict_metadata.items()
            if isinstance(tmd, TensorStorageMetadata)
            for c in tmd.chunks
        }

    def reset(self, checkpoint_id: str | os.PathLike[str] | None = None) -> None:
        if checkpoint_id is not None:
            self.path = Path(checkpoint_id)

    def read_metadata(self, *args: Any, **options: Any) -> Metadata:
        # Never a file read here: the caller parsed metadata.json as JSON after checking its hash.
        return dataclasses.replace(self.metadata, storage_meta=StorageMeta())

    def set_up_storage_reader(
        self, metadata: Metadata, is_coordinator: bool, *args: Any, **kwargs: Any
    ) -> None:
        self.storage_data = dict(metadata.storage_data)

    def prepare_local_plan(self, plan: LoadPlan) -> LoadPlan:
        return plan

    def prepare_global_plan(self, plans: list[LoadPlan]) -> list[LoadPlan]:
        return plans

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        per_file: dict[str, list[Any]] = {}
        maps: dict[str, Any] = {}
        error: BaseException | None = None
        try:
            _little_endian()
            for item in plan.items:
                if item.type == LoadItemType.BYTE_IO:
                    raise CheckpointError(
                        f"checkpoint entry {item.storage_index.fqn!r} is not a tensor; fprep "
                        "never deserializes bytes from a checkpoint.",
                        subject=item.storage_index.fqn,
                    )
                per_file.setdefault(self.storage_data[item.storage_index].file, []).append(item)
            maps = self._open_all(sorted(per_file))
        except Exception as e:
            error = e
        try:
            if self.agree is not None:
                self.agree(error)  # raises on every rank if any rank failed its checks
            elif error is not None:
                raise error
            for name in sorted(per_file):
                items = per_file[name]
                items.sort(key=lambda i: self.storage_data[i.storage_index].offset)
                for item in items:
                    self._copy(maps[name], item, planner)
        finally:
            for mapped in maps.values():
                _close(mapped)
        future: Future[None] = Future()
        future.set_result(None)
        return future

    def _open_all(self, names: list[str]) -> dict[str, Any]:
        def one(name: str) -> Any:
            return open_verified(self.path / name, self.files[name], name, verify=self.verify)

        workers = min(len(names), os.cpu_count() or 1, 8)
        if workers <= 1 or not self.verify:
            maps: dict[str, Any] = {}
            try:
                for name in names:
                    maps[name] = one(name)
            except BaseException:
                for mapped in maps.values():
                    _close(mapped)
                raise
            return maps
        with ThreadPoolExecutor(max_workers=workers, thread_name_prefix="fprep-verify") as pool:
            jobs = {name: pool.submit(one, name) for name in names}
        opened = {n: j.result() for n, j in jobs.items() if j.exception() is None}
        failed = [j.exception() for j in jobs.values() if j.exception() is not None]
        if failed:
            for mapped in opened.values():
                _close(mapped)
            raise failed[0]  # type: ignore[misc]
        return opened

    def _copy(self, mapped: Any, item: Any, planner: LoadPlanner) -> None:
        stored = self.storage_data[item.storage_index]
        dtype, shape = self.chunks[item.storage_index]
        numel = stored.length // dtype.itemsize
        if numel == 0:
            source = torch.empty(shape, dtype=dtype)
        else:
            source = torch.frombuffer(mapped, dtype=dtype, count=numel, offset=stored.offset)
            source = source.view(shape)
        part = _narrow(source, item.storage_offsets, item.lengths)
        target = planner.resolve_tensor(item).detach()
        if target.shape != part.shape:
            raise CheckpointError(
                f"checkpoint entry {item.storage_index.fqn!r}: a read of {tuple(part.shape)} "
                f"does not fit its target {tuple(target.shape)}.",
                subject=item.storage_index.fqn,
            )
        target.copy_(part)
        del source, part
        planner.commit_tensor(item, target)

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike[str]) -> bool:
        return True
