"""``fprep.weights.pipeline.pour``: values, ordering, buffer reuse and bounds, on the CPU.

The accelerator path runs against ``DeferredLane`` (tests/_lanes.py): copies run only when a
mark after them is waited for, as on a stream, so reusing a host buffer before its copy is done,
or returning before every copy is, gives wrong values here. The CPU path runs the real
``fprep.devices.Lane('cpu')`` (every copy done when enqueued).
"""

from __future__ import annotations

import os
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from _lanes import DeferredLane
from hypothesis import given, settings
from hypothesis import strategies as st

from fprep.devices import Lane
from fprep.errors import CheckpointError
from fprep.weights import pipeline
from fprep.weights.pipeline import Chunk, chunks_of, pour

DTYPES = [torch.float32, torch.bfloat16, torch.float16]


def _file(tmp_path: Path, values: list[torch.Tensor]) -> tuple[int, list[int]]:
    """The raw bytes of ``values`` one after the other; (fd, offset of each)."""
    path = tmp_path / "data.bin"
    offsets, data = [], b""
    for v in values:
        offsets.append(len(data))
        data += v.view(torch.uint8).numpy().tobytes()
    path.write_bytes(data)
    fd = os.open(path, os.O_RDONLY)
    return fd, offsets


@pytest.fixture
def fds() -> Iterator[list[int]]:
    opened: list[int] = []
    yield opened
    for fd in opened:
        os.close(fd)


def _case(
    tmp_path: Path, fds: list[int], sources: list[torch.dtype], targets: list[torch.dtype]
) -> tuple[list[torch.Tensor], list[torch.Tensor], list[tuple[int, int, torch.dtype]]]:
    gen = torch.Generator().manual_seed(len(sources))
    values = [
        torch.randn(37 + 11 * i, generator=gen).to(s) for i, s in enumerate(sources)
    ]  # odd sizes: chunks end mid-tensor
    fd, offsets = _file(tmp_path, values)
    fds.append(fd)
    dests = [
        torch.full_like(v, float("nan"), dtype=t) for v, t in zip(values, targets, strict=True)
    ]
    return values, dests, [(fd, o, s) for o, s in zip(offsets, sources, strict=True)]


def _chunks(
    where: list[tuple[int, int, torch.dtype]], dests: list[torch.Tensor], chunk_bytes: int
) -> list[Chunk]:
    out: list[Chunk] = []
    for (fd, offset, source), dest in zip(where, dests, strict=True):
        out.extend(chunks_of(fd, "data.bin", offset, source, dest, chunk_bytes))
    return out


@settings(max_examples=25, deadline=None)
@given(
    pairs=st.lists(
        st.tuples(st.sampled_from(DTYPES), st.sampled_from(DTYPES)), min_size=1, max_size=5
    ),
    readers=st.integers(1, 3),
    chunk_bytes=st.sampled_from([8, 12, 64, 1 << 12]),
)
def test_deferred_copies_give_the_values_with_bounded_buffers(
    tmp_path_factory: pytest.TempPathFactory,
    pairs: list[tuple[torch.dtype, torch.dtype]],
    readers: int,
    chunk_bytes: int,
) -> None:
    tmp_path = tmp_path_factory.mktemp("pour")
    opened: list[int] = []
    try:
        values, dests, where = _case(tmp_path, opened, [s for s, _ in pairs], [t for _, t in pairs])
        lane = DeferredLane()
        chunks = _chunks(where, dests, chunk_bytes)
        stats = pour(chunks, lane, readers=readers, chunk_bytes=chunk_bytes)
        for v, d in zip(values, dests, strict=True):  # done when pour returns: no drain
            assert torch.equal(d, v.to(d.dtype))
        assert lane.queue == []
        # bounded: a host buffer per slot (readers + 2), two device buffers only to cast
        assert lane.host_buffers <= readers + 2
        assert stats.slots == readers + 2
        casts = any(s != t for s, t in pairs)
        assert lane.device_buffers == (2 if casts else 0)
        assert stats.device_buffer_bytes == (2 * chunk_bytes if casts else 0)
        # at most the copies of the slots not being read are outstanding (2 per chunk: h2d, cast)
        assert lane.most_queued <= 2 * (readers + 2)
        assert stats.chunks == len(chunks)
        assert stats.bytes == sum(c.nbytes for c in chunks)
        # the side stream followed the current one before copying; the current one waits last
        assert lane.log[0] == "after_current" and lane.log[-1] == "current_waits"
    finally:
        for fd in opened:
            os.close(fd)


@pytest.mark.parametrize("readers", [1, 3])
@pytest.mark.parametrize(
    ("source", "target"), [(torch.bfloat16, torch.float32), (torch.float32, torch.float32)]
)
def test_cpu_lane_values_and_buffers(
    tmp_path: Path, fds: list[int], readers: int, source: torch.dtype, target: torch.dtype
) -> None:
    values, dests, where = _case(tmp_path, fds, [source] * 4, [target] * 4)
    stats = pour(
        _chunks(where, dests, 24), Lane(torch.device("cpu")), readers=readers, chunk_bytes=24
    )
    for v, d in zip(values, dests, strict=True):
        assert torch.equal(d, v.to(target))
    # the CPU: a read of the file's dtype goes straight into the destination (no buffer);
    # a cast reads through one buffer per reader, no more
    assert stats.slots == readers
    assert stats.host_buffer_bytes == (0 if source == target else 24 * min(readers, stats.chunks))
    assert stats.device_buffer_bytes == 0


def test_a_failed_read_waits_for_everything_in_flight(
    tmp_path: Path, fds: list[int], monkeypatch: pytest.MonkeyPatch
) -> None:
    _, dests, where = _case(tmp_path, fds, [torch.bfloat16] * 6, [torch.float32] * 6)
    real = pipeline.read_exact
    lock = threading.Lock()
    calls: list[int] = []

    def failing(fd: int, view: memoryview, offset: int, file: str) -> None:
        with lock:
            calls.append(offset)
            n = len(calls)
        if n == 7:
            raise CheckpointError("disk gone", subject=file)
        real(fd, view, offset, file)

    monkeypatch.setattr(pipeline, "read_exact", failing)
    lane = DeferredLane()
    with pytest.raises(CheckpointError, match="disk gone"):
        pour(_chunks(where, dests, 16), lane, readers=3, chunk_bytes=16)
    assert lane.queue == []  # every copy enqueued was waited for before the error left
    assert lane.log[-1] == "current_waits"
    seen = len(calls)
    lane.drain()
    assert len(calls) == seen  # and no reader reads on


def test_chunks_of_cover_the_tensor_in_order() -> None:
    dest = torch.empty(10, dtype=torch.float32)
    parts = list(chunks_of(3, "f", 100, torch.bfloat16, dest, 8))
    assert [c.offset for c in parts] == [100, 108, 116]
    assert [c.dest.numel() for c in parts] == [4, 4, 2]
    assert sum(c.nbytes for c in parts) == 20
    assert all(c.dest.data_ptr() == dest[4 * i :].data_ptr() for i, c in enumerate(parts))


def test_default_readers_is_bounded() -> None:
    assert 1 <= pipeline.default_readers(torch.device("cpu")) <= pipeline.MAX_READERS


@settings(max_examples=30, deadline=None)
@given(
    rows=st.integers(1, 9),
    cols=st.integers(1, 12),
    parts=st.integers(1, 4),
    part=st.integers(0, 3),
    chunk_rows=st.integers(1, 5),
    source=st.sampled_from(DTYPES),
    target=st.sampled_from(DTYPES),
    device_lane=st.booleans(),
)
def test_strided_chunks_read_a_column_block(
    tmp_path_factory: pytest.TempPathFactory,
    rows: int,
    cols: int,
    parts: int,
    part: int,
    chunk_rows: int,
    source: torch.dtype,
    target: torch.dtype,
    device_lane: bool,
) -> None:
    """A rowwise tensor-parallel block (columns ``[c0, c0 + width)`` of every row) read as whole
    rows per chunk equals slicing the full tensor, whatever rows a chunk holds (also a row
    longer than a chunk: then one chunk per piece of it)."""
    part = min(part, parts - 1)
    width = max(1, cols // parts)
    c0 = min(part * width, cols - width)
    full = torch.randn(rows, cols, generator=torch.Generator().manual_seed(rows * cols)).to(source)
    path = tmp_path_factory.mktemp("strided") / "w.bin"
    path.write_bytes(b"\0" * 24 + full.view(torch.uint8).numpy().tobytes())
    fd = os.open(path, os.O_RDONLY)
    try:
        dest = torch.full((rows, width), float("nan"), dtype=target)
        item = source.itemsize
        chunk_bytes = chunk_rows * width * item if chunk_rows < 5 else max(item, width * item // 2)
        chunks = list(
            pipeline.strided_chunks_of(
                fd,
                str(path),
                24 + c0 * item,
                source,
                dest,
                runs=rows,
                stride=cols * item,
                chunk_bytes=chunk_bytes,
            )
        )
        assert sum(c.nbytes for c in chunks) == rows * width * item
        assert all(c.nbytes <= chunk_bytes for c in chunks)
        lane = DeferredLane() if device_lane else Lane(torch.device("cpu"))
        pour(chunks, lane, chunk_bytes=chunk_bytes)
    finally:
        os.close(fd)
    assert torch.equal(dest, full[:, c0 : c0 + width].to(target))
