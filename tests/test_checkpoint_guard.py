"""What makes an asynchronous save sound (issue 18): ``staging.py`` copies every tensor before
``save`` returns, and ``asynchronous/verify.py`` reads back each file written before anything is
published.

(Until issue 18 this file tested the live-read guard: tensors owned by the optimizers passed to
``save`` were read live in the background, their next ``step()`` copied what was left, and
version counters were to catch other changes. That contract was unsound: under fsdp the
DTensor's counter moves, not its local tensor's, and a counter moves only when a kernel ends.
It is gone; these tests state the contract that replaced it.)

* property (hypothesis): whatever the tensors (shapes, dtypes, views, DTensors) and whatever
  changes them right after ``stage`` returns, the staged copies hold the values at the call;
  the buffers of an unchanged key are reused, those of a key gone are released;
* a file that does not read back as written (a flipped byte, a truncation, in a data file or
  ``metadata.json``) fails the save on every rank and ``latest`` stays on the previous step.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import _checkpoint_workers as W
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.distributed.tensor import DTensor, Replicate, Shard

import fprep
from fprep.checkpoint.asynchronous.staging import Stager
from fprep.checkpoint.asynchronous.verify import verify_written
from fprep.checkpoint.format.files import record_of
from fprep.checkpoint.format.storage import SafeWriter
from fprep.checkpoint.stores import layout
from fprep.checkpoint.stores.backend import LocalStore
from fprep.errors import CheckpointError
from fprep.testing.distributed import fake_world

DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.int64, torch.bool]


def _tensor(shape: list[int], dtype: torch.dtype, seed: int, transposed: bool) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    t = (torch.rand(shape, generator=g) * 100).to(dtype)
    return t.t() if transposed and t.dim() == 2 else t


@settings(max_examples=40, deadline=None)
@given(
    specs=st.lists(
        st.tuples(
            st.lists(st.integers(0, 9), min_size=0, max_size=3),
            st.sampled_from(DTYPES),
            st.booleans(),
        ),
        min_size=1,
        max_size=6,
    ),
    seed=st.integers(0, 2**16),
)
def test_staged_copies_hold_the_values_at_the_call(
    specs: list[tuple[list[int], torch.dtype, bool]], seed: int
) -> None:
    live = {f"k{i}": _tensor(s, d, seed + i, tr) for i, (s, d, tr) in enumerate(specs)}
    at_call = {k: v.clone() for k, v in live.items()}
    stager = Stager()
    staged = stager.stage(live)
    for t in live.values():  # every live tensor changes the moment stage returns
        if t.numel():
            t.fill_(1 if t.dtype == torch.bool and not bool(t.flatten()[0]) else 0)
    assert staged.keys() == live.keys()
    for key, copy in staged.items():
        assert copy.is_contiguous() and copy.device.type == "cpu"
        if copy.numel():  # (empty tensors have no storage to share)
            assert copy.untyped_storage().data_ptr() != live[key].untyped_storage().data_ptr()
        assert torch.equal(copy, at_call[key]), key
    pointers = {k: b.data_ptr() for k, b in stager.buffers.items()}
    again = stager.stage({k: v for k, v in live.items() if k != "k0"})
    assert "k0" not in stager.buffers  # released
    for key, copy in again.items():  # reused, now holding the new values
        assert copy.data_ptr() == pointers[key] and torch.equal(copy, live[key])


def test_dtensors_are_staged_as_dtensors_over_host_copies() -> None:
    with fake_world(2, 0):
        from torch.distributed.device_mesh import init_device_mesh

        mesh = init_device_mesh("cpu", (2,))
        p = DTensor.from_local(torch.arange(6.0).reshape(3, 2), mesh, [Shard(0)])
        r = DTensor.from_local(torch.ones(2), mesh, [Replicate()])
        stager = Stager()
        staged = stager.stage({"p": p, "r": r})
        p.add_(1.0)  # through the DTensor: its local tensor's version does not move
        assert isinstance(staged["p"], DTensor) and staged["p"].placements == (Shard(0),)
        assert torch.equal(staged["p"]._local_tensor, torch.arange(6.0).reshape(3, 2))
        assert torch.equal(staged["r"]._local_tensor, torch.ones(2))
        again = stager.stage({"p": p, "r": r})
        assert again["p"] is staged["p"]  # the same wrapper over the same buffer, refreshed
        assert torch.equal(again["p"]._local_tensor, torch.arange(6.0).reshape(3, 2) + 1)


def test_verify_written_names_a_file_that_does_not_read_back(tmp_path: Path) -> None:
    (tmp_path / ".tmp-x").mkdir()
    data = os.urandom(4096)
    (tmp_path / ".tmp-x" / "__0_0.distcp").write_bytes(data)
    records = {"__0_0.distcp": record_of(data)}
    store = LocalStore(tmp_path)
    verify_written(store, ".tmp-x", records, 7)  # as written: passes
    flipped = bytearray(data)
    flipped[1234] ^= 1
    (tmp_path / ".tmp-x" / "__0_0.distcp").write_bytes(bytes(flipped))
    with pytest.raises(CheckpointError) as caught:
        verify_written(store, ".tmp-x", records, 7)
    assert caught.value.message.startswith(
        "step 7 is not published: a file this rank wrote does not read back as written: "
        "__0_0.distcp does not match its blake3 digest"
    )
    assert caught.value.subject == "__0_0.distcp"
    assert "The previous checkpoint stays the latest." in caught.value.hint


def _damage(path: Path, how: str) -> None:
    data = bytearray(path.read_bytes())
    if how == "flip":
        data[len(data) // 2] ^= 0x40
    else:
        data = data[: len(data) - 1]
    path.write_bytes(bytes(data))


@pytest.mark.parametrize("how", ["flip", "truncate"])
@pytest.mark.parametrize("which", ["data", "metadata"])
def test_a_step_that_does_not_verify_is_never_published(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, which: str, how: str
) -> None:
    """The bytes reach the file changed after their digest was taken (a lost write, a failing
    disk): the save fails, ``latest`` stays on the previous step, nothing is left behind."""
    state, model, opt, *_ = W.prepared("none")
    fprep.save(tmp_path, state, model, optimizers=(opt,), step=1)
    pointer = (tmp_path / layout.LATEST).read_text()
    if which == "data":
        real_write = SafeWriter._write

        def damaged_write(self: SafeWriter, name: str, *args: Any) -> Any:
            out = real_write(self, name, *args)
            _damage(self.path / name, how)
            return out

        monkeypatch.setattr(SafeWriter, "_write", damaged_write)
    else:
        real_finish = SafeWriter.finish

        def damaged_finish(self: SafeWriter, *args: Any, **kwargs: Any) -> None:
            real_finish(self, *args, **kwargs)
            _damage(self.path / "metadata.json", how)

        monkeypatch.setattr(SafeWriter, "finish", damaged_finish)
    handle = fprep.save(tmp_path, state, model, optimizers=(opt,), step=2, wait=False)
    with pytest.raises(CheckpointError, match=r"^step 2 is not published: a file this rank"):
        handle.wait()
    monkeypatch.undo()
    assert (tmp_path / layout.LATEST).read_text() == pointer
    assert sorted(p.name for p in tmp_path.iterdir() if p.name != ".lock") == [
        layout.LATEST,
        "step-00000001",
    ]
    s2, m2, *_ = W.prepared("none", seed=5)
    assert fprep.load(tmp_path, s2, m2).step == 1
