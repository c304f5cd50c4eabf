"""``load`` against crafted files: work that grows with what a file claims, files swapped while
they are opened, pointers that lead outside the root.

* ``metadata.json``'s chunks are checked (inside their tensor, no overlap, full coverage) in
  O(n log n): 8,000+ chunks in well under a second (it was quadratic: 34 s for 8,000);
* every file is opened with ``O_NOFOLLOW | O_NONBLOCK`` and checked through the descriptor
  (a regular file of the expected size), so a FIFO swapped in after the first check cannot
  block ``load`` forever;
* ``latest`` naming a symlinked step directory (leading outside the root) is refused.
"""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path
from typing import Any

import _checkpoint_workers as W
import pytest

import fprep
from fprep.checkpoint import files
from fprep.checkpoint import metadata as md_json
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


@pytest.mark.parametrize("dim", [0, 1])
def test_many_chunks_are_checked_in_n_log_n(dim: int) -> None:
    n = 8192
    data = chunked(n if dim == 0 else 2, 2 if dim == 0 else n, 1, dim)
    sizes = {"__0_0.distcp": n * 2 * 4}
    start = time.process_time()  # CPU time: other processes on a busy machine do not count
    parsed = md_json.from_json(data, sizes)
    elapsed = time.process_time() - start
    assert len(parsed.state_dict_metadata["w"].chunks) == n  # type: ignore[union-attr]
    assert elapsed < 1.0, f"{elapsed:.2f} s for {n} chunks"
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
