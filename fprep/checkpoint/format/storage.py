"""DCP storage without pickle: raw tensor bytes, JSON metadata, a BLAKE3 digest of every file.

``SafeWriter`` is a DCP ``StorageWriter``: each rank writes the chunks DCP planned for it as raw,
contiguous, little-endian bytes (64-byte aligned) into ``__<rank>_<n>.distcp`` files (one, or a
few written in parallel when the rank has many bytes), hashing as it writes (BLAKE3 on a worker
thread; ``files.py`` says why BLAKE3); the coordinator writes ``metadata.json`` (see
``metadata.py``). Non-tensor entries (DCP's ``BYTE_IO`` items, which DCP's planner would load
with ``torch.load(weights_only=False)``) are refused: fprep keeps every non-tensor value in its
JSON manifest.

``SafeReader`` is the matching ``StorageReader``. It never reads ``.metadata`` and never calls
``pickle`` or ``torch.load``: the metadata is parsed JSON handed to it, each file is opened once
and checked against the size and digest the manifest records (the whole file, before any of it
is used, several files in parallel; sha256 for checkpoints written before BLAKE3), all ranks
agree that every check passed, and only then are chunks read into the tensors DCP asks for (the
live model's: nothing has been written to them before that point) — straight from the file
into the tensor's memory where both are one contiguous run, else viewed through a private
memory map (``torch.frombuffer``) and copied.

Both show a progress line on a terminal when asked to (rank 0) and the work is slow: bytes
written (``fprep: save``), bytes verified (``fprep: verify``) and bytes copied into the model
(``fprep: load``). ``Progress`` is thread-safe; worker threads advance it directly.

For reference, torch 2.13's own ``FileSystemReader`` reads tensor payloads with
``torch.load(weights_only=True)`` (a restricted unpickler) and its ``.metadata`` with plain
``pickle.load``; neither is used here.
"""

from __future__ import annotations

import collections
import contextlib
import ctypes
import dataclasses
import mmap
import os
import sys
from collections.abc import Callable, Mapping
from concurrent.futures import Future as Job
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import IO, Any

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

from fprep.checkpoint.format import metadata as md_json
from fprep.checkpoint.format.files import (
    ALGORITHM,
    FileRecord,
    check_digest,
    check_size,
    dump_json,
    new_hasher,
    open_regular,
    os_failure,
    read_failure,
    record_of,
    write_durable,
)
from fprep.errors import CheckpointError
from fprep.progress import Progress
from fprep.tensor_bytes import byte_view, is_wrapper

ALIGN = 64
_IN_FLIGHT = 256 * 1024 * 1024  # bytes written but not yet hashed, at most
MIN_FILE = 64 * 1024 * 1024  # a rank's data is split into files of at least this size ...
MAX_FILES = 4  # ... and at most this many (and no more than there are CPUs)
_ZEROS = bytes(ALIGN)
_HASH_CHUNK = 1024 * 1024  # files are hashed through a buffer of this size (fits in L2)
#: Seconds of work before a progress line appears (tests set 0).
PROGRESS_AFTER_S = 1.0
_WRITEBACK_EVERY = 8 * 1024 * 1024  # bytes written between two starts of their write-out
_SAVE_FAILED = "The previous checkpoints are untouched; the next save removes what this one left."


def progress(label: str, total: int, show: bool) -> Progress:
    """A byte-counting progress line: shown where ``show`` (rank 0), on a terminal, when slow."""
    return Progress(
        label, total, enabled=None if show else False, after_s=PROGRESS_AFTER_S, unit="B"
    )


def _sync_file_range() -> Callable[[int, int, int], object]:
    """Linux's ``sync_file_range(SYNC_FILE_RANGE_WRITE)``: start writing a range of a file to
    disk without waiting for it. Called as a save goes, the disk works while the next bytes are
    written and hashed, and the final ``fsync`` (still what makes the file durable) has little
    left to do: writing and fsyncing a 250 MB file takes 75 ms instead of 120 ms here. Elsewhere
    (or where libc lacks it) a no-op."""

    def nothing(fd: int, offset: int, nbytes: int) -> object:
        return None

    if not sys.platform.startswith("linux"):
        return nothing
    try:
        call = ctypes.CDLL(None, use_errno=True).sync_file_range
    except (OSError, AttributeError):
        return nothing
    call.argtypes = [ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint]
    call.restype = ctypes.c_int

    def start(fd: int, offset: int, nbytes: int) -> object:
        return call(fd, offset, nbytes, 2)  # SYNC_FILE_RANGE_WRITE; a failure is only a hint lost

    return start


start_writeback = _sync_file_range()


def _little_endian() -> None:
    if sys.byteorder != "little":  # pragma: no cover - no big-endian CI
        raise CheckpointError(
            "fprep checkpoints store little-endian bytes; this machine is big-endian.",
            subject="byteorder",
        )


def plain(t: torch.Tensor) -> torch.Tensor:
    """``t`` as a plain tensor: a wrapper subclass (torchao's float8 all-gather weight,
    WeightWithDynamicFloat8CastTensor) has no storage of its own, and its ops rewrap their
    results, so its values are copied out (``copy_`` into a plain tensor)."""
    if not is_wrapper(t):
        return t
    out = torch.empty(t.shape, dtype=t.dtype, device=t.device)
    out.copy_(t)
    return out


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
    """The digest of a byte stream, computed on a worker thread while the caller writes and
    fsyncs.

    ``blake3`` releases the GIL on large buffers, so hashing overlaps the writes. At most
    ``_IN_FLIGHT`` bytes wait to be hashed; their tensors are kept alive until then.
    """

    def __init__(self) -> None:
        self._digest = new_hasher(ALGORITHM)
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="fprep-hash")
        self._pending: collections.deque[tuple[Any, Any, int]] = collections.deque()
        self._in_flight = 0

    def update(self, view: Any, owner: Any) -> None:
        """Hash ``view`` after what came before (``owner`` kept alive until it is hashed)."""
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
    the coordinator, ``metadata.json``'s record. ``progress``: show a progress line (rank 0).
    """

    def __init__(
        self,
        path: str | os.PathLike[str],
        *,
        sync_files: bool = True,
        progress: bool = False,
        opener: Callable[[str], IO[bytes]] | None = None,
    ) -> None:
        super().__init__()
        self.path = Path(path)
        self.sync_files = sync_files
        #: opens a file of the step for writing; None: ``open`` in ``path`` (``backend.py``)
        self.opener = opener
        self.progress = progress
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
        total = sum(_item_bytes(i) for i in plan.items)
        with progress("fprep: save", total, self.progress) as bar:
            if len(buckets) == 1:
                results += self._write_file(names[0], buckets[0], planner, bar)
            elif buckets:  # one thread per file: writes and hashes run in parallel (GIL released)
                with ThreadPoolExecutor(len(buckets), thread_name_prefix="fprep-write") as pool:
                    jobs = [
                        pool.submit(self._write_file, n, b, planner, bar)
                        for n, b in zip(names, buckets, strict=True)
                    ]
                for job in jobs:
                    results += job.result()
        future: Future[list[WriteResult]] = Future()
        future.set_result(results)
        return future

    def _write_file(
        self, name: str, items: list[Any], planner: SavePlanner, bar: Progress
    ) -> list[WriteResult]:
        try:
            return self._write(name, items, planner, bar)
        except OSError as e:  # disk full, permissions, ...: a CheckpointError naming the file
            raise os_failure(e, "write", self.path / name, subject=name, then=_SAVE_FAILED) from e

    def _write(
        self, name: str, items: list[Any], planner: SavePlanner, bar: Progress
    ) -> list[WriteResult]:
        results: list[WriteResult] = []
        with self._open(name) as f, _Hasher() as hasher:
            position = written_back = 0
            for item in items:
                pad = -position % ALIGN
                if pad:
                    f.write(_ZEROS[:pad])
                    hasher.update(_ZEROS[:pad], None)
                    position += pad
                t = self._tensor(planner, item)
                view = byte_view(t)
                try:
                    f.write(view)
                finally:
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
                bar.advance(nbytes)
                if self.sync_files and position - written_back >= _WRITEBACK_EVERY:
                    f.flush()
                    start_writeback(f.fileno(), written_back, position - written_back)
                    written_back = position
            f.flush()
            if self.sync_files:
                os.fsync(f.fileno())  # while the last bytes are being hashed
            digest = hasher.hexdigest()
        self.files[name] = FileRecord(size=position, algorithm=ALGORITHM, digest=digest)
        return results

    def _open(self, name: str) -> IO[bytes]:
        return open(self.path / name, "wb") if self.opener is None else self.opener(name)

    @staticmethod
    def _tensor(planner: SavePlanner, item: Any) -> torch.Tensor:
        data = planner.resolve_data(item)
        if not isinstance(data, torch.Tensor) or item.tensor_data is None:
            raise CheckpointError(
                f"checkpoint entry {item.index.fqn!r} is not a tensor.", subject=item.index.fqn
            )
        t = plain(data.detach()).to("cpu").contiguous()
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
        path = self.path / md_json.METADATA_FILE
        try:
            if self.opener is None:
                self.files[md_json.METADATA_FILE] = write_durable(path, data)
            else:
                with self.opener(md_json.METADATA_FILE) as f:
                    f.write(data)
                self.files[md_json.METADATA_FILE] = record_of(data)
        except OSError as e:
            raise os_failure(
                e, "write", path, subject=md_json.METADATA_FILE, then=_SAVE_FAILED
            ) from e

    def storage_meta(self) -> StorageMeta | None:
        return StorageMeta(checkpoint_id=str(self.path))

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike[str]) -> bool:
        return True


class Source:
    """One data file this rank reads, opened once: its digest is checked through this
    descriptor and its chunks are read through it, so what was verified is what is copied (a
    file swapped in under the same name later is never seen)."""

    def __init__(self, path: Path, record: FileRecord, what: str) -> None:
        check_size(path, record, what)  # missing, a link, truncated: the clear messages
        # and should the path change after that check: no link is followed, no FIFO blocks
        self.file = open_regular(path, what, record.size)
        self.path, self.record, self.what = path, record, what
        self._mapped: Any = None
        if hasattr(os, "posix_fadvise"):  # both passes read it in order: read ahead more
            with contextlib.suppress(OSError):
                os.posix_fadvise(self.file.fileno(), 0, 0, os.POSIX_FADV_SEQUENTIAL)

    def _changed(self) -> CheckpointError:
        return CheckpointError(
            f"{self.what} changed while it was read (now not a regular file of "
            f"{self.record.size} bytes).",
            subject=self.what,
            hint="Something modifies the checkpoint while it is loaded; load it when it is not.",
        )

    def read_into(self, view: memoryview, offset: int) -> None:
        """Fill ``view`` with the file's bytes from ``offset`` on (one copy, GIL released)."""
        self.file.seek(offset)
        done = 0
        while done < len(view):
            n = self.file.readinto(view[done:])
            if not n:
                raise self._changed()
            done += n

    def verify(self, bar: Progress | None) -> None:
        """Check the file's digest, reading it once through a small (cache-resident) buffer:
        faster than hashing a memory map, whose page faults cost as much as the hash."""
        hasher = new_hasher(self.record.algorithm)
        buffer = memoryview(bytearray(min(_HASH_CHUNK, self.record.size)))
        for start in range(0, self.record.size, _HASH_CHUNK):
            piece = buffer[: min(_HASH_CHUNK, self.record.size - start)]
            self.read_into(piece, start)
            hasher.update(piece)
            if bar is not None:
                bar.advance(len(piece))
        check_digest(hasher.hexdigest(), self.record, self.what)

    def mapping(self) -> Any:
        """A private memory map of the file (made on first use: most chunks are read directly)."""
        if self._mapped is None:
            if self.record.size == 0:
                return b""
            try:
                self._mapped = mmap.mmap(
                    self.file.fileno(), self.record.size, access=mmap.ACCESS_COPY
                )
            except OSError as e:
                raise os_failure(e, f"read {self.what} at", self.path, subject=self.what) from None
        return self._mapped

    def close(self) -> None:
        if self._mapped is not None:
            # BufferError: a tensor still views the map (an exception in flight); GC closes it
            with contextlib.suppress(BufferError):
                self._mapped.close()
        self.file.close()


def _done(fn: Callable[[str], Source], name: str) -> Job[Source]:
    """``fn(name)`` run here, as a finished job (its exception kept, not raised)."""
    future: Job[Source] = Job()
    try:
        future.set_result(fn(name))
    except Exception as e:
        future.set_exception(e)
    return future


def _span(shape: tuple[int, ...], offsets: Any, lengths: Any) -> tuple[int, int] | None:
    """(first element, element count) of a box of a C-contiguous array of ``shape`` when the box
    is one contiguous run of elements (whole rows below its first partial dimension), else None.
    """
    partial = [d for d in range(len(shape)) if offsets[d] != 0 or lengths[d] != shape[d]]
    if partial and any(lengths[d] != 1 for d in range(partial[-1])):
        return None
    first, stride, count = 0, 1, 1
    for d in reversed(range(len(shape))):
        first += offsets[d] * stride
        stride *= shape[d]
        count *= lengths[d]
    return first, count


def _narrow(t: torch.Tensor, offsets: Any, lengths: Any) -> torch.Tensor:
    for dim, (start, length) in enumerate(zip(offsets, lengths, strict=True)):
        if start != 0 or length != t.shape[dim]:
            t = t.narrow(dim, start, length)
    return t


class SafeReader(StorageReader):
    """Reads a checkpoint whose metadata was parsed (and verified) by the caller.

    ``read_data`` works in two phases: every file this rank needs is opened and checked (size,
    digest; several files are hashed in parallel, from ``prepare_local_plan`` on, while DCP
    exchanges plans), then all ranks agree that every check passed (``agree``), and only then
    is a byte copied into the tensors DCP asks for, which may be the live model's.
    ``verify=False`` skips the digests of data files (sizes and metadata are still checked;
    nothing is ever unpickled). ``progress``: show progress lines (rank 0).
    """

    def __init__(
        self,
        path: str | os.PathLike[str],
        metadata: Metadata,
        files: Mapping[str, FileRecord],
        *,
        verify: bool = True,
        agree: Callable[[BaseException | None], object] | None = None,
        progress: bool = False,
        source: Callable[[str, FileRecord], Source] | None = None,
    ) -> None:
        super().__init__()
        self.path = Path(path)
        #: opens a file of the step for reading; None: ``Source`` in ``path`` (``backend.py``)
        self.source = source
        self.metadata = metadata
        self.files = dict(files)
        self.verify = verify
        self.agree = agree
        self.progress = progress
        self.storage_data: dict[MetadataIndex, md_json.StoredChunk] = {}
        # files being opened and checked on worker threads (started by prepare_local_plan)
        self._opening: dict[str, Job[Source]] = {}
        self._pool: ThreadPoolExecutor | None = None
        self._bar: Progress | None = None
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
        """Start checking the files this rank reads: the hashing overlaps DCP's exchange of
        plans, in which a rank mostly waits for the others (``read_data`` collects it)."""
        if self.verify:
            self._start(self._files_of(plan))
        return plan

    def prepare_global_plan(self, plans: list[LoadPlan]) -> list[LoadPlan]:
        return plans

    def _files_of(self, plan: LoadPlan) -> list[str]:
        names = set()
        for item in plan.items:
            if item.type == LoadItemType.BYTE_IO:
                raise CheckpointError(
                    f"checkpoint entry {item.storage_index.fqn!r} is not a tensor; fprep "
                    "never deserializes bytes from a checkpoint.",
                    subject=item.storage_index.fqn,
                )
            names.add(self.storage_data[item.storage_index].file)
        return sorted(names)

    def _open_one(self, name: str) -> Source:
        if self.source is None:
            source = Source(self.path / name, self.files[name], name)
        else:
            source = self.source(name, self.files[name])
        try:
            if self.verify:
                source.verify(self._bar)
        except BaseException:
            source.close()
            raise
        return source

    def _start(self, names: list[str]) -> None:
        """Open and check ``names`` on worker threads (one file each, up to one per CPU)."""
        names = [n for n in names if n not in self._opening]
        if not names:
            return
        if self._pool is None:
            total = sum(self.files[name].size for name in names)
            self._bar = progress("fprep: verify", total, self.progress)
            workers = min(len(names), os.cpu_count() or 1, 8)
            self._pool = ThreadPoolExecutor(workers, thread_name_prefix="fprep-verify")
        elif self._bar is not None:
            self._bar.total += sum(self.files[name].size for name in names)
        for name in names:
            self._opening[name] = self._pool.submit(self._open_one, name)

    def check_files(self, names: list[str]) -> None:
        """Open and check ``names`` (in parallel), then close them: the files a save wrote, read
        back before it publishes (``asynchronous/verify.py``)."""
        try:
            opened = self._open_all(names)
        except OSError as e:
            raise read_failure(e, self.path) from e
        for source in opened.values():
            source.close()

    def close(self) -> None:
        """Wait for the checks still running and close every file (when ``read_data`` did not
        run: a failure on another rank during planning). Idempotent."""
        self._collect()

    def _collect(self) -> tuple[dict[str, Source], BaseException | None]:
        """The files opened so far, and the first error; the workers are gone afterwards."""
        opened: dict[str, Source] = {}
        error: BaseException | None = None
        for name, job in self._opening.items():
            failure = job.exception()
            if failure is None:
                opened[name] = job.result()
            elif error is None:
                error = failure
        self._opening = {}
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None
        if self._bar is not None:
            self._bar.__exit__(None, None, None)
            self._bar = None
        return opened, error

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        per_file: dict[str, list[Any]] = {}
        sources: dict[str, Source] = {}
        error: BaseException | None = None
        try:
            _little_endian()
            names = self._files_of(plan)  # and no BYTE_IO item
            for item in plan.items:
                per_file.setdefault(self.storage_data[item.storage_index].file, []).append(item)
            sources = self._open_all(names)
        except Exception as e:
            error = read_failure(e, self.path)
        try:
            if self.agree is not None:
                self.agree(error)  # raises on every rank if any rank failed its checks
            elif error is not None:
                raise error
            total = sum(self._read_bytes(item) for item in plan.items)
            with progress("fprep: load", total, self.progress) as bar:
                for name in sorted(per_file):
                    items = per_file[name]
                    items.sort(key=lambda i: self.storage_data[i.storage_index].offset)
                    for item in items:
                        self._copy(sources[name], item, planner)
                        bar.advance(self._read_bytes(item))
        except OSError as e:  # after every check passed: a failing disk (see docs/checkpoints.md)
            raise read_failure(e, self.path) from e
        finally:
            for source in sources.values():
                source.close()
        future: Future[None] = Future()
        future.set_result(None)
        return future

    def _read_bytes(self, item: Any) -> int:
        n = 1
        for length in item.lengths:
            n *= length
        return n * self.chunks[item.storage_index][0].itemsize

    def _open_all(self, names: list[str]) -> dict[str, Source]:
        """Every file of ``names``, opened and (with ``verify``) checked: the checks started by
        ``prepare_local_plan`` and any file it did not know of; files opened but not needed are
        closed again."""
        try:
            if self.verify:
                self._start(names)
            else:
                for name in names:  # only opened: no worker threads needed
                    self._opening.setdefault(name, _done(self._open_one, name))
        finally:
            opened, error = self._collect()
        keep = set(names) if error is None else set()
        for name in [name for name in opened if name not in keep]:
            opened.pop(name).close()
        if error is not None:
            raise error
        return opened

    def _copy(self, source: Source, item: Any, planner: LoadPlanner) -> None:
        """One chunk (or part of one) into its target: read straight from the file into the
        target's memory when both are one contiguous run of the same dtype on the CPU (no
        intermediate copy, no page faults on a mapping), else through the memory map."""
        stored = self.storage_data[item.storage_index]
        dtype, shape = self.chunks[item.storage_index]
        target = planner.resolve_tensor(item).detach()
        if tuple(target.shape) != tuple(item.lengths):
            raise CheckpointError(
                f"checkpoint entry {item.storage_index.fqn!r}: a read of {tuple(item.lengths)} "
                f"does not fit its target {tuple(target.shape)}.",
                subject=item.storage_index.fqn,
            )
        span = _span(shape, item.storage_offsets, item.lengths)
        if (
            span is not None
            and target.device.type == "cpu"
            and target.dtype == dtype
            and target.is_contiguous()
            and not is_wrapper(target)  # float8 all-gather weights: copy_ into their inner tensor
        ):
            first, count = span
            if count:
                source.read_into(byte_view(target), stored.offset + first * dtype.itemsize)
        else:
            numel = stored.length // dtype.itemsize
            if numel == 0:
                whole = torch.empty(shape, dtype=dtype)
            else:
                whole = torch.frombuffer(
                    source.mapping(), dtype=dtype, count=numel, offset=stored.offset
                ).view(shape)
            target.copy_(_narrow(whole, item.storage_offsets, item.lengths))
            del whole
        planner.commit_tensor(item, target)

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike[str]) -> bool:
        return True
