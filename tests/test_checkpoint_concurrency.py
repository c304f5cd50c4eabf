"""Savers that meet: two processes saving into one root, and saves killed with SIGKILL.

A root has one saver at a time (an exclusive ``flock`` on ``root/.lock``): a second one is
refused with a ``CheckpointError`` naming the holder, so every path ``save`` returns is a
complete checkpoint, and no cleanup or rotation ever runs beside another save. A killed save's
``.tmp-*`` directory is removed when the next save starts (the lock proves nobody writes it).
"""

from __future__ import annotations

import multiprocessing
import re
import signal
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import _checkpoint_workers as W
import pytest
import torch

import fprep
from fprep.checkpoint.format.storage import SafeWriter
from fprep.errors import CheckpointError


def run_savers(root: Path, saves: int, keep_last: int | None) -> list[dict[str, Any]]:
    """Two processes saving into ``root`` at once; their results."""
    ctx = multiprocessing.get_context("spawn")
    with ctx.Pool(2) as pool:
        jobs = [
            pool.apply_async(W.concurrent_saver, (str(root), who, saves, keep_last))
            for who in (1, 2)
        ]
        return [job.get(timeout=300) for job in jobs]


def load_value(path: Path) -> tuple[int, float]:
    """(step, the weights' value) of the checkpoint at ``path``, fully verified."""
    state, model = W.wide_model(-1.0)
    info = fprep.load(path, state, model)
    weight = model[0].weight
    assert torch.equal(weight, torch.full_like(weight, weight[0, 0].item()))
    return info.step, weight[0, 0].item()


@pytest.mark.slow
def test_two_processes_saving_into_one_root_publish_only_complete_checkpoints(
    tmp_path: Path,
) -> None:
    root = tmp_path / "ckpt"
    results = run_savers(root, saves=30, keep_last=None)
    for who, result in zip((1, 2), results, strict=True):
        assert len(result["published"]) == 30
        for path in result["published"]:
            step, value = load_value(Path(path))  # complete: every file there and verified
            assert value == float(who) and step // 1000 == who
    assert not list(root.glob(".tmp-*"))
    refusals = [r for result in results for r in result["refused"]]
    for text in refusals:  # the refusal names the holder
        assert "another save into" in text and re.search(r"\(pid \d+ on .* since ", text)
    print(f"{len(refusals)} saves refused while the other process held the root")


HOLDER = textwrap.dedent(
    """
    import sys, time
    from pathlib import Path
    from fprep.checkpoint.stores.lock import lock_root

    root = Path(sys.argv[1])
    lock_root(root)
    (root / ".tmp-00000007-being-written").mkdir()
    print("locked", flush=True)
    time.sleep(60)
    """
)


def test_a_live_saver_holding_the_root_refuses_the_next_and_keeps_its_files(
    tmp_path: Path,
) -> None:
    root = tmp_path / "ckpt"
    holder = subprocess.Popen([sys.executable, "-c", HOLDER, str(root)], stdout=subprocess.PIPE)
    try:
        assert holder.stdout is not None and holder.stdout.readline() == b"locked\n"
        state, model = W.wide_model(1.0)
        with pytest.raises(CheckpointError, match=rf"another save into .* \(pid {holder.pid} on"):
            fprep.save(root, state, model, step=1)
        assert (root / ".tmp-00000007-being-written").is_dir()  # a live saver's: untouched
        assert not [p for p in root.iterdir() if p.name.startswith("step-")]
    finally:
        holder.send_signal(signal.SIGKILL)  # kill -9: the kernel drops its lock
        holder.wait()
    state, model = W.wide_model(1.0)
    assert fprep.save(root, state, model, step=1) == root / "step-00000001"
    assert not list(root.glob(".tmp-*"))  # its directory was stale once it died: removed


def _fail(*args: Any, **kwargs: Any) -> Any:
    raise OSError("injected failure")


def test_a_killed_saves_leftovers_are_removed_when_the_next_save_starts(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Also when that next save fails itself: they were removed before it wrote anything."""
    root = tmp_path / "ckpt"
    args = [sys.executable, "-c", SLOW_SAVER, str(root), str(Path(__file__).parent)]
    child = subprocess.Popen(args, stdout=subprocess.PIPE, text=True)
    assert child.stdout is not None and child.stdout.readline() == "writing\n"
    child.send_signal(signal.SIGKILL)  # kill -9 in the middle of writing its tensors
    child.wait()
    stale = [p.name for p in root.glob(".tmp-*")]
    assert stale and not (root / "latest").exists()
    state, model = W.wide_model(2.0)
    with monkeypatch.context() as m:
        m.setattr(SafeWriter, "write_data", _fail)
        with pytest.raises(CheckpointError, match="injected failure"):
            fprep.save(root, state, model, step=5)
    assert not [p for p in root.glob(".tmp-*") if p.name in stale]
    assert fprep.save(root, state, model, step=5) == root / "step-00000005"
    assert load_value(root) == (5, 2.0)
    assert sorted(p.name for p in root.iterdir()) == [".lock", "latest", "step-00000005"]


SLOW_SAVER = textwrap.dedent(
    """
    import sys, time
    sys.path.insert(0, sys.argv[2])
    import fprep
    from fprep.checkpoint.format import storage
    import _checkpoint_workers as W

    real = storage.SafeWriter._write

    def slow(self, *args, **kwargs):
        print("writing", flush=True)
        time.sleep(60)  # killed here
        return real(self, *args, **kwargs)

    storage.SafeWriter._write = slow
    state, model = W.wide_model(1.0)
    fprep.save(sys.argv[1], state, model, step=1)
    """
)


def test_saving_into_a_published_checkpoint_is_refused(tmp_path: Path) -> None:
    state, model = W.wide_model(1.0)
    published = fprep.save(tmp_path, state, model, step=1)
    for root in (published, published / "nested", published / "a" / "b"):
        with pytest.raises(CheckpointError, match=r"cannot save into .*a published checkpoint"):
            fprep.save(root, state, model, step=2)
    assert sorted(p.name for p in published.iterdir()) == [
        "__0_0.distcp",
        "manifest.json",
        "metadata.json",
    ]
    assert load_value(tmp_path) == (1, 1.0)
