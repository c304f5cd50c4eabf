"""What ``weights=`` is not, said as it is, and cheaply.

A FIFO, a device or a URL is named for what it is (not "does not exist"); a FIFO or a link
swapped in for a weights file after planning is refused at once (the file is opened without
blocking or following links, and must be a regular file); a header or index too large for
any real checkpoint is refused from its length or an object count, before it is parsed.
"""

from __future__ import annotations

import json
import os
import threading
import tracemalloc
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from _weights_files import stamp_old, write_safetensors
from torch import nn

import fprep
from fprep.apply.load_weights import load_weights
from fprep.apply.steps import step
from fprep.errors import CheckpointError, ConfigError, PrepError
from fprep.weights.header import MAX_HEADER_BYTES, MAX_TENSORS, read_header
from fprep.weights.identity import disagreement, fingerprint
from fprep.weights.records import WeightsFile
from fprep.weights.source import MAX_INDEX_BYTES, MAX_INDEX_ENTRIES, snapshot


def test_a_fifo_a_device_and_urls_are_named_for_what_they_are(tmp_path: Path) -> None:
    fifo = tmp_path / "pipe"
    os.mkfifo(fifo)
    with pytest.raises(ConfigError, match="FIFO"):
        snapshot(str(fifo))
    with pytest.raises(ConfigError, match="character device"):
        snapshot("/dev/zero")
    for url in ("s3://bucket/llama", "hf://meta-llama/Llama-3", "simplecache::s3://b/x"):
        with pytest.raises(ConfigError, match="a URL; weights= reads local files only") as info:
            snapshot(url)
        assert "snapshot_download" in (info.value.hint or "")
    with pytest.raises(ConfigError, match="does not exist"):
        snapshot(str(tmp_path / "nope"))


def _prepare_swapped(tmp_path: Path, swap: Callable[[Path], None]) -> BaseException | None:
    """prepare with ``swap(file)`` just before load_weights, in a thread (a blocked ``open``
    would never return: the join's generous bound only turns that hang into a failure)."""
    path = write_safetensors(tmp_path / "model.safetensors", {"weight": torch.ones(2, 2)})

    @step("swap")
    def swapping(state, model):  # type: ignore[no-untyped-def]
        swap(path)
        return state, model

    steps = list(fprep.default_steps())
    steps.insert(steps.index(load_weights), swapping)  # type: ignore[attr-defined]
    outcome: list[BaseException | None] = []

    def run() -> None:
        try:
            fprep.prepare(
                nn.Linear(2, 2, bias=False), fprep.PrepConfig(weights=str(path)), steps=steps
            )
            outcome.append(None)
        except BaseException as e:
            outcome.append(e)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(timeout=120)
    assert not thread.is_alive(), "prepare blocked"
    return outcome[0]


def _fifo(path: Path) -> None:
    path.unlink()
    os.mkfifo(path)


def _link(path: Path) -> None:
    target = path.with_name("elsewhere.safetensors")
    os.replace(path, target)
    path.symlink_to(target)


def test_a_fifo_swapped_in_after_planning_is_refused_without_blocking(tmp_path: Path) -> None:
    error = _prepare_swapped(tmp_path, _fifo)
    assert isinstance(error, CheckpointError), error
    assert "FIFO" in error.message and "not a regular file" in error.message


def test_a_link_swapped_in_after_planning_is_not_followed(tmp_path: Path) -> None:
    error = _prepare_swapped(tmp_path, _link)
    assert isinstance(error, CheckpointError), error
    assert "model.safetensors" in error.message


def _peak(fn: Callable[[], Any]) -> tuple[int, BaseException | None]:
    tracemalloc.start()
    try:
        fn()
        error = None
    except PrepError as e:
        error = e
    finally:
        _, peak = tracemalloc.get_traced_memory()
        tracemalloc.stop()
    return peak, error


def test_a_95mb_header_is_refused_from_its_length_without_reading_it(tmp_path: Path) -> None:
    n = 95_000_000
    path = tmp_path / "huge.safetensors"
    with open(path, "wb") as f:
        f.write(n.to_bytes(8, "little") + b"{")
        f.truncate(8 + n + 64)  # sparse: costs no disk
    assert n > MAX_HEADER_BYTES
    peak, error = _peak(lambda: read_header(str(path)))
    assert isinstance(error, CheckpointError) and "header of 95000000 bytes" in error.message
    assert peak < 4 << 20  # not 95 MB of bytes, nor ~1 GB of parsed entries


def test_a_header_with_too_many_entries_is_refused_before_parsing(tmp_path: Path) -> None:
    text = b"{" * (MAX_TENSORS + 8)
    path = tmp_path / "many.safetensors"
    path.write_bytes(len(text).to_bytes(8, "little") + text + bytes(64))
    peak, error = _peak(lambda: read_header(str(path)))
    assert isinstance(error, CheckpointError), error
    assert f"more than {MAX_TENSORS} tensors" in error.message
    assert peak < 4 << 20


def test_an_index_too_large_or_with_too_many_entries_is_refused_before_parsing(
    tmp_path: Path,
) -> None:
    index = tmp_path / "model.safetensors.index.json"
    with open(index, "wb") as f:
        f.write(b'{"weight_map": {')
        f.truncate(MAX_INDEX_BYTES + 1)
    peak, error = _peak(lambda: snapshot(str(tmp_path)))
    assert isinstance(error, CheckpointError) and "more than the" in error.message
    assert peak < 4 << 20
    index.write_bytes(b'{"weight_map": {' + b'"a":"b",' * MAX_INDEX_ENTRIES + b"}}")
    with pytest.raises(CheckpointError, match=f"more than {MAX_INDEX_ENTRIES} tensors"):
        snapshot(str(tmp_path))


def test_real_checkpoint_headers_are_far_below_the_bounds(tmp_path: Path) -> None:
    """~150k entries, more than any public checkpoint file (a whole large MoE in one file)."""
    names = [
        f"model.layers.{i // 2400}.mlp.experts.{i % 2400}.down_proj.weight" for i in range(150_000)
    ]
    body = {n: {"dtype": "BF16", "shape": [0, 7168], "data_offsets": [0, 0]} for n in names}
    text = json.dumps(body).encode()
    assert len(text) < MAX_HEADER_BYTES and len(names) < MAX_TENSORS
    path = tmp_path / "big.safetensors"
    path.write_bytes(len(text).to_bytes(8, "little") + text)
    tensors, _ = read_header(str(path))
    assert len(tensors) == len(names)


def _file(path: str, real: str, ino: int, digest: str = "d") -> WeightsFile:
    return WeightsFile(path, real, 100, 1, ino, 5, 16, (), digest)


def test_ranks_compare_digests_everywhere_and_identity_on_one_host() -> None:
    a = _file("/x/m.safetensors", "/x/m.safetensors", ino=7)
    same_elsewhere = _file("/local/m.safetensors", "/local/m.safetensors", ino=99)
    assert disagreement([fingerprint((a,), "h0"), fingerprint((same_elsewhere,), "h1")]) is None
    replaced = _file("/x/m.safetensors", "/x/m.safetensors", ino=8)
    error = disagreement([fingerprint((a,), "h0"), fingerprint((replaced,), "h0")])
    assert error is not None and "replaced between rank 0's and rank 1's" in error.message
    assert disagreement([fingerprint((a,), "h0"), fingerprint((replaced,), "h1")]) is None
    other = _file("/x/m.safetensors", "/x/m.safetensors", ino=7, digest="e")
    error = disagreement([fingerprint((a,), "h0"), fingerprint((other,), "h1")])
    assert error is not None and "different revisions" in error.message
    assert error.subject == "m.safetensors"


def test_a_file_touched_after_planning_with_its_mtime_kept_old_is_still_recognized(
    tmp_path: Path,
) -> None:
    """The identity compares exact nanoseconds: an untouched file always passes."""
    path = stamp_old(
        write_safetensors(tmp_path / "model.safetensors", {"weight": torch.ones(2, 2)})
    )
    _, model = fprep.prepare(nn.Linear(2, 2, bias=False), fprep.PrepConfig(weights=str(path)))
    assert torch.equal(model.weight, torch.ones(2, 2))


def test_paths_the_system_refuses_are_prep_errors(tmp_path: Path) -> None:
    """A NUL in PrepConfig.weights, and an index naming a file whose name is too long for
    the file system: each a PrepError naming it (os.stat and Path.exists raise bare ValueError
    and OSError for them), from fprep.plan as from snapshot."""
    index = tmp_path / "model.safetensors.index.json"
    long_name = "a" * 300 + ".safetensors"
    index.write_text(json.dumps({"weight_map": {"weight": long_name}}))
    for path, kind, culprit in (
        (str(tmp_path / "a\x00b"), ConfigError, "weights"),
        (str(tmp_path), CheckpointError, "weight"),
    ):
        with pytest.raises(kind) as e:
            snapshot(path)
        assert e.value.subject == culprit
        result = fprep.plan(nn.Linear(4, 4), fprep.PrepConfig(weights=path))
        failure = result.failure()
        assert isinstance(failure, kind) and failure.subject == culprit
