"""Chunks of weights files poured into tensors: reads in parallel, copies overlapped with them.

Each ``Chunk`` is one byte range of a file and the flat, contiguous part of a destination it
fills (cast from the file's dtype when the two differ). ``pour`` runs them through ``slots``
reused host buffers:

* a bounded pool of ``readers`` threads reads chunks (``os.preadv``: the GIL is released) while
  the caller's thread hands finished ones to the device;
* on an accelerator (``fprep.devices.Lane``) the buffers are pinned and each chunk is copied to
  the device on a side stream without waiting (the file's dtype travels: half the bytes of a
  bf16 file into fp32 parameters), then cast on the device, on the same stream, through one of
  two device chunk buffers (so device memory grows by two chunks, never by a tensor; the CPU
  never casts). A buffer is read into again only after the event recorded after its copy: the
  host waits on that event, not on the copy of the chunk it just read;
* on the CPU a chunk of the destination's dtype is read straight into the destination's bytes
  (no buffer at all); another dtype is read into a buffer and cast by the reader's thread.

Chunks are finished in their order; the side stream first waits for the current stream (values
kept aside, initialization), and ``pour`` returns only when every copy is done and the current
stream is ordered after them. On failure it still waits for every read in flight and every copy
enqueued before raising, so nothing writes into a destination afterwards (the caller restores).
"""

from __future__ import annotations

import os
import time
from collections import deque
from collections.abc import Callable, Iterable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field

import torch

from fprep.devices import Lane
from fprep.errors import CheckpointError
from fprep.tensor_bytes import byte_view

#: Bytes of one chunk (a read, a host buffer, a device buffer).
CHUNK_BYTES = 16 << 20
#: The most reader threads ``pour`` starts (page-cache reads are memory copies: a few threads
#: reach the memory bandwidth; more only compete with the training process's own threads).
MAX_READERS = 8
#: The most one read asks for (Linux transfers at most about 2 GiB per call).
_MAX_READ = 1 << 30


def read_exact(fd: int, view: memoryview, offset: int, file: str) -> None:
    """Fill ``view`` from ``fd`` at ``offset``; a short file is a ``CheckpointError``."""
    done = 0
    while done < len(view):
        part = view[done : done + _MAX_READ]
        if hasattr(os, "preadv"):
            n = os.preadv(fd, [part], offset + done)
        else:  # pragma: no cover - Windows
            os.lseek(fd, offset + done, os.SEEK_SET)
            n = os.readv(fd, [part])
        if n <= 0:
            raise CheckpointError(
                f"{file} ended at byte {offset + done}, inside a tensor its header placed there.",
                subject=file,
                hint="The file was truncated or replaced after prepare read its header.",
            )
        done += n


@dataclass(frozen=True)
class Chunk:
    """Bytes ``[offset, offset + numel * itemsize)`` of ``file`` (open as ``fd``), stored as
    ``source``, for ``dest``: a flat contiguous tensor (part of a parameter or buffer).

    With ``stride``, the bytes are runs of ``run`` bytes, ``stride`` apart in the file, laid end
    to end in ``dest`` (a rowwise tensor-parallel block: its columns of consecutive rows)."""

    fd: int
    file: str
    offset: int
    source: torch.dtype
    dest: torch.Tensor
    run: int = 0
    stride: int = 0

    @property
    def nbytes(self) -> int:
        return self.dest.numel() * self.source.itemsize

    def fill(self, view: memoryview) -> None:
        """Read the chunk's bytes from its file into ``view`` (``nbytes`` long)."""
        if not self.stride:
            read_exact(self.fd, view, self.offset, self.file)
            return
        for i in range(len(view) // self.run):
            part = view[i * self.run : (i + 1) * self.run]
            read_exact(self.fd, part, self.offset + i * self.stride, self.file)


def chunks_of(
    fd: int, file: str, offset: int, source: torch.dtype, dest: torch.Tensor, chunk_bytes: int
) -> Iterable[Chunk]:
    """``dest`` (contiguous) in chunks of at most ``chunk_bytes`` of the file."""
    if chunk_bytes < source.itemsize:
        raise ValueError(f"chunks of {chunk_bytes} bytes cannot hold one {source} element")
    flat = dest.view(-1)
    per = chunk_bytes // source.itemsize
    for start in range(0, flat.numel(), per):
        part = flat[start : start + per]
        yield Chunk(fd, file, offset + start * source.itemsize, source, part)


def strided_chunks_of(
    fd: int,
    file: str,
    offset: int,
    source: torch.dtype,
    dest: torch.Tensor,
    *,
    runs: int,
    stride: int,
    chunk_bytes: int,
) -> Iterable[Chunk]:
    """``dest`` (contiguous, ``runs`` rows) from ``runs`` runs of the file ``stride`` bytes
    apart, as whole rows, as many per chunk as ``chunk_bytes`` holds (a row longer than that:
    one chunk per piece of it)."""
    flat = dest.view(-1)
    width = flat.numel() // runs if runs else 0
    run = width * source.itemsize
    if run == 0:
        return
    if run > chunk_bytes:
        for i in range(runs):
            yield from chunks_of(
                fd,
                file,
                offset + i * stride,
                source,
                flat[i * width : (i + 1) * width],
                chunk_bytes,
            )
        return
    rows = chunk_bytes // run
    for first in range(0, runs, rows):
        count = min(rows, runs - first)
        part = flat[first * width : (first + count) * width]
        yield Chunk(fd, file, offset + first * stride, source, part, run=run, stride=stride)


@dataclass
class PourStats:
    """What one ``pour`` did: the timing hook of benchmarks and the GPU check."""

    bytes: int = 0  # of the files
    chunks: int = 0
    readers: int = 1
    slots: int = 0
    host_buffer_bytes: int = 0  # pinned on an accelerator
    device_buffer_bytes: int = 0  # the two cast buffers, when any chunk is cast
    seconds: float = 0.0  # wall time, every copy done
    waited_s: float = 0.0  # the caller's thread waiting for reads and for buffers to free up

    @property
    def gb_per_s(self) -> float:
        return self.bytes / self.seconds / 1e9 if self.seconds else 0.0


def default_readers(device: torch.device) -> int:
    """Reader threads for ``device``: torch's intra-op thread budget, at most ``MAX_READERS``
    (one under ``torchrun``'s ``OMP_NUM_THREADS=1``: the ranks of a node read in parallel)."""
    del device  # the same budget either way: reads are host work
    return max(1, min(MAX_READERS, torch.get_num_threads()))


@dataclass
class _Slot:
    buffer: torch.Tensor | None = None
    mark: torch.Event | None = None


@dataclass
class _Pour:
    lane: Lane
    chunk_bytes: int
    stats: PourStats
    slots: list[_Slot] = field(default_factory=list)
    cast: list[torch.Tensor] = field(default_factory=list)  # the device chunk buffers
    done: int = 0  # chunks finished (which cast buffer is next)
    last: torch.Event | None = None

    def on_host(self, chunk: Chunk) -> bool:
        """Whether the chunk is done by its reader (a CPU destination): no copy to enqueue."""
        return self.lane.stream is None and chunk.dest.device.type == "cpu"

    def direct(self, chunk: Chunk) -> bool:
        """Read straight into the destination (a CPU tensor of the file's dtype)."""
        return self.on_host(chunk) and chunk.dest.dtype == chunk.source

    def buffer(self, slot: _Slot) -> torch.Tensor:
        if slot.buffer is None:
            slot.buffer = self.lane.host_buffer(self.chunk_bytes, torch.uint8)
            self.stats.host_buffer_bytes += self.chunk_bytes
        return slot.buffer

    def read(self, chunk: Chunk, slot: _Slot) -> None:
        """In a reader thread: the chunk's bytes into the destination or the slot's buffer;
        on the CPU, cast into the destination too."""
        if self.direct(chunk):
            chunk.fill(byte_view(chunk.dest))
            return
        assert slot.buffer is not None
        part = slot.buffer[: chunk.nbytes]
        chunk.fill(byte_view(part))
        if self.on_host(chunk):
            with torch.no_grad():  # grad mode is per thread
                chunk.dest.copy_(part.view(chunk.source))

    def finish(self, chunk: Chunk, slot: _Slot) -> None:
        """In the caller's thread, in chunk order: the chunk's copy to the device, enqueued."""
        self.stats.chunks += 1
        self.stats.bytes += chunk.nbytes
        if self.on_host(chunk):
            return
        assert slot.buffer is not None
        with torch.no_grad():
            self._enqueue(chunk, slot.buffer[: chunk.nbytes].view(chunk.source))
        self.done += 1
        slot.mark = self.last = self.lane.mark()

    def _enqueue(self, chunk: Chunk, host: torch.Tensor) -> None:
        if chunk.dest.dtype == chunk.source:
            self.lane.copy([chunk.dest], [host])
        else:  # the file's dtype to the device, cast there
            if not self.cast:
                self.cast = [self.lane.device_buffer(self.chunk_bytes, torch.uint8) for _ in "ab"]
                self.stats.device_buffer_bytes = 2 * self.chunk_bytes
            staged = self.cast[self.done % 2][: chunk.nbytes].view(chunk.source)
            self.lane.copy([staged], [host])
            self.lane.copy([chunk.dest], [staged])


def pour(
    chunks: Iterable[Chunk],
    lane: Lane,
    *,
    readers: int = 1,
    chunk_bytes: int = CHUNK_BYTES,
    on_bytes: Callable[[int], None] | None = None,
) -> PourStats:
    """Every chunk into its destination (see the module); ``on_bytes`` is called in the
    caller's thread as chunks finish."""
    start = time.perf_counter()
    # a buffer per read in flight, and on an accelerator two more for the copies in flight
    slots = [_Slot() for _ in range(readers + (0 if lane.stream is None else 2))]
    work = _Pour(lane, chunk_bytes, PourStats(readers=readers, slots=len(slots)))
    pool = ThreadPoolExecutor(readers, thread_name_prefix="fprep-read") if readers > 1 else None
    pending: deque[tuple[Future[None], Chunk, _Slot]] = deque()

    def finish_oldest() -> None:
        future, chunk, slot = pending.popleft()
        began = time.perf_counter()
        future.result()
        work.stats.waited_s += time.perf_counter() - began
        work.finish(chunk, slot)
        if on_bytes is not None:
            on_bytes(chunk.nbytes)

    lane.after_current()
    try:
        for i, chunk in enumerate(chunks):
            slot = slots[i % len(slots)]
            began = time.perf_counter()
            lane.wait(slot.mark)  # its last copy is done: the buffer may be read into again
            work.stats.waited_s += time.perf_counter() - began
            slot.mark = None
            if not work.direct(chunk):
                work.buffer(slot)
            future: Future[None]
            if pool is None:
                work.read(chunk, slot)
                future = Future()
                future.set_result(None)
            else:
                future = pool.submit(work.read, chunk, slot)
            pending.append((future, chunk, slot))
            if len(pending) >= readers:
                finish_oldest()
        while pending:
            finish_oldest()
    finally:
        for future, _, _ in pending:  # a failure: nothing may write after we return
            future.cancel()
        if pool is not None:
            pool.shutdown(wait=True)
        lane.wait(work.last)
        lane.current_waits(work.last)
    work.stats.seconds = time.perf_counter() - start
    return work.stats
