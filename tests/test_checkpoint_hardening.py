"""``load`` against crafted files: work that grows with what a file claims, files swapped while
they are opened, pointers that lead outside the root.

* ``metadata.json``'s chunks are checked (inside their tensor, no overlap, full coverage) in
  O(n log n): 4x the chunks cost about 4x the Python lines run, counted (it was quadratic: 34 s
  for 8,000);
* every file is opened with ``O_NOFOLLOW | O_NONBLOCK`` and checked through the descriptor
  (a regular file of the expected size), so a FIFO swapped in after the first check cannot
  block ``load`` forever;
* ``latest`` naming a symlinked step directory (leading outside the root) is refused.
"""

from __future__ import annotations

import itertools
import os
import threading
from pathlib import Path
from typing import Any

import _checkpoint_workers as W
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import fprep
from fprep.checkpoint.format import files
from fprep.checkpoint.format import metadata as md_json
from fprep.errors import CheckpointError


def chunked(rows: int, cols: int, per_row: int, dim: int) -> dict[str, Any]:
    """Metadata of one float32 (rows, cols) tensor cut into chunks of ``per_row`` elements along
    ``dim`` (each chunk a full extent of the other dimension)."""
    n = (cols if dim == 1 else rows) // per_row
    chunks, storage = [], []
    for i in range(n):
        offsets = [0, i * per_row] if dim == 1 else [i * per_row, 0]
        sizes = [rows, per_row] if dim == 1 else [per_row, cols]
        chunks.append({"offsets": offsets, "sizes": sizes})
        length = sizes[0] * sizes[1] * 4
        storage.append(
            {
                "key": "w",
                "chunk": offsets,
                "file": "__0_0.distcp",
                "offset": i * length,
                "length": length,
            }
        )
    return {
        "format": md_json.FORMAT,
        "version": md_json.VERSION,
        "tensors": {"w": {"dtype": "float32", "size": [rows, cols], "chunks": chunks}},
        "storage": storage,
    }


def _lines_run(work: Any) -> int:
    """Python lines executed by ``work()`` (``sys.settrace`` line events): a count of the work
    done that the machine's speed and load cannot move."""
    import sys

    count = 0

    def trace(frame: Any, event: str, arg: Any) -> Any:
        nonlocal count
        count += event == "line"
        return trace

    sys.settrace(trace)
    try:
        work()
    finally:
        sys.settrace(None)
    return count


@pytest.mark.parametrize("dim", [0, 1])
def test_many_chunks_are_checked_in_n_log_n(dim: int) -> None:
    def check(n: int) -> int:
        data = chunked(n if dim == 0 else 2, 2 if dim == 0 else n, 1, dim)
        parsed: list[Any] = []
        lines = _lines_run(lambda: parsed.append(md_json.from_json(data, {"__0_0.distcp": n * 8})))
        assert len(parsed[0].state_dict_metadata["w"].chunks) == n
        return lines

    n = 2048
    growth = check(4 * n) / check(n)
    # n log n: about 4x the lines for 4x the chunks (log 8192 / log 2048 = 1.18); the quadratic
    # check this replaced grew 16x (34 s for 8,000 chunks)
    assert growth < 4 * 1.5, f"{growth:.1f}x the work for 4x the chunks"
    data = chunked(n if dim == 0 else 2, 2 if dim == 0 else n, 1, dim)
    sizes = {"__0_0.distcp": n * 2 * 4}
    # the same checks still refuse what they refused: an overlap, a gap
    data["tensors"]["w"]["chunks"][5]["offsets"] = [0, 4] if dim == 1 else [4, 0]
    data["storage"][5]["chunk"] = data["tensors"]["w"]["chunks"][5]["offsets"]
    with pytest.raises(CheckpointError, match="overlap"):
        md_json.from_json(data, sizes)


def test_a_fifo_swapped_in_after_the_first_check_does_not_block_load(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    state, model, *_ = W.prepared("none")
    fprep.save(tmp_path, state, model, step=1)
    real = files.regular_file_size

    def swap(path: Path, what: str) -> int:  # lstat sees the file, open meets a FIFO
        size = real(path, what)
        if path.name == "metadata.json":
            path.unlink()
            os.mkfifo(path)
        return size

    monkeypatch.setattr(files, "regular_file_size", swap)
    outcome: list[BaseException | None] = []

    def load() -> None:
        try:
            fprep.load(tmp_path, state, model)
            outcome.append(None)
        except BaseException as e:
            outcome.append(e)

    thread = threading.Thread(target=load, daemon=True)
    thread.start()
    thread.join(timeout=30)
    assert not thread.is_alive(), "load blocked on a FIFO"
    assert isinstance(outcome[0], CheckpointError)
    assert "metadata.json at" in str(outcome[0]) and "is not a regular file" in str(outcome[0])


def test_latest_naming_a_symlinked_step_directory_is_refused(tmp_path: Path) -> None:
    state, model, *_ = W.prepared("none")
    outside = fprep.save(tmp_path / "outside", state, model, step=9)
    root = tmp_path / "root"
    fprep.save(root, state, model, step=1)
    (root / "step-00000009").symlink_to(outside, target_is_directory=True)
    pointer = (tmp_path / "outside" / "latest").read_text().replace("step-00000009", "")
    (root / "latest").write_text("step-00000009" + pointer)
    with pytest.raises(CheckpointError, match=r"names step-00000009, which is a symbolic link"):
        fprep.load(root, state, model)
    assert fprep.load(outside, state, model).step == 9  # named directly, it is the user's call


# -- the O(n log n) chunk check agrees with counting every element ---------------------------------
def covered_once(size: tuple[int, ...], boxes: list[Any]) -> bool:
    """The reference: every element of the tensor lies in exactly one box."""
    count = torch.zeros(size, dtype=torch.int32)
    for off, sz in boxes:
        count[tuple(slice(o, o + s) for o, s in zip(off, sz, strict=True))] += 1
    return bool((count == 1).all())


@st.composite
def grid_tilings(draw: st.DrawFn) -> tuple[tuple[int, ...], list[Any]]:
    """A tensor shape and a tiling of it as DCP makes them: cut along one dimension into slabs,
    each slab cut again along another dimension (possibly differently), and so on."""
    ndim = draw(st.integers(1, 3))
    size = tuple(draw(st.lists(st.integers(1, 6), min_size=ndim, max_size=ndim)))

    def cut(lo: tuple[int, ...], hi: tuple[int, ...], dims: list[int]) -> list[Any]:
        if not dims or draw(st.booleans()):
            return [(lo, tuple(h - lo_ for lo_, h in zip(lo, hi, strict=True)))]
        d, rest = dims[0], dims[1:]
        points: list[int] = []
        if hi[d] - lo[d] >= 2:
            points = sorted(set(draw(st.lists(st.integers(lo[d] + 1, hi[d] - 1), max_size=3))))
        out = []
        for a, b in itertools.pairwise([lo[d], *points, hi[d]]):
            out += cut((*lo[:d], a, *lo[d + 1 :]), (*hi[:d], b, *hi[d + 1 :]), rest)
        return out

    order = draw(st.permutations(list(range(ndim))))
    return size, cut((0,) * ndim, size, list(order))


def accepted(size: tuple[int, ...], boxes: list[Any]) -> bool:
    try:
        md_json._check_tiling("w", size, boxes)
    except CheckpointError:
        return False
    return True


@given(tiling=grid_tilings(), data=st.data())
@settings(max_examples=200)
def test_the_chunk_check_agrees_with_counting_elements(
    tiling: tuple[tuple[int, ...], list[Any]], data: st.DataObject
) -> None:
    size, boxes = tiling
    assert covered_once(size, boxes) and accepted(size, boxes)
    # damage it: drop a box, repeat one, move one
    boxes = list(boxes)
    kind = data.draw(st.sampled_from(["drop", "repeat", "move"]))
    i = data.draw(st.integers(0, len(boxes) - 1))
    if kind == "drop":
        boxes.pop(i)
    elif kind == "repeat":
        boxes.append(boxes[i])
    else:
        off, sz = boxes[i]
        d = data.draw(st.integers(0, len(size) - 1))
        shift = data.draw(st.integers(-off[d], size[d] - off[d] - sz[d]))
        boxes[i] = ((*off[:d], off[d] + shift, *off[d + 1 :]), sz)
    # every damage breaks the tiling, except a move by 0: accepted exactly when it still tiles
    assert accepted(size, boxes) == covered_once(size, boxes)
