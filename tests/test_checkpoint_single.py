"""``fprep.save`` / ``fprep.load`` / ``fprep.export_full`` in one process.

* round trips: model, optimizer, scheduler, loader position, RNG states, step, extras; an
  optimizer that never stepped stays fresh; buffers keep their original dtype;
* layout: ``latest``, step directories, saving the same step twice, keep-last rotation, loading
  the root, a step directory, or a root without ``latest``;
* atomicity: a save failing in each of its phases, and a saving process killed with SIGKILL at
  random moments, leave a loadable checkpoint; leftovers are removed by the next save;
* safety: crafted files in place of each file of a checkpoint (pickle payloads that would run
  code, garbage, symlinks, consistent-but-crafted manifests) are refused or read as raw bytes,
  and never execute;
* bad input: missing or truncated files, shape / dtype mismatches, missing / unexpected keys
  (strict and not), another model, another optimizer: a ``CheckpointError`` naming what differs,
  and the model and optimizer unchanged;
* digests: BLAKE3 records in new manifests, sha256 records of older checkpoints still verified,
  unknown algorithms refused;
* OS errors (permissions, a full disk, a path that is a directory or runs through a file) in
  ``save`` / ``load`` / ``export_full``: a ``CheckpointError`` naming the path and what to do;
* progress lines: on a terminal, rank 0, when slow; they reach the total; silent otherwise;
* ``export_full``: one safetensors file, loadable by plain ``safetensors`` and torch.
"""

from __future__ import annotations

import copy
import errno
import hashlib
import io
import itertools
import json
import os
import pickle
import random
import re
import sys
import threading
from pathlib import Path
from typing import Any

import _checkpoint_workers as W
import blake3
import pytest
import torch
from safetensors.torch import load_file
from torch import nn

import fprep
from fprep.checkpoint import LoadedInfo
from fprep.checkpoint.format import files, manifest, storage
from fprep.checkpoint.format.storage import SafeWriter
from fprep.checkpoint.stores import layout
from fprep.errors import CheckpointError, PrepError


# -- helpers -------------------------------------------------------------------------------------
def trained(seed: int = W.SEED, steps: int = 3, **kw: Any) -> tuple[Any, ...]:
    state, model, opt, sched, loader = W.prepared("none", seed=seed, **kw)
    W.Trainer(state, model, opt, sched, loader).run(steps)
    return state, model, opt, sched, loader


def snapshot(model: nn.Module, opt: torch.optim.Optimizer | None = None) -> Any:
    return copy.deepcopy((model.state_dict(), None if opt is None else opt.state_dict()))


def same_snapshot(a: Any, b: Any) -> bool:
    def eq(x: Any, y: Any) -> bool:
        if isinstance(x, torch.Tensor):
            return isinstance(y, torch.Tensor) and x.dtype == y.dtype and torch.equal(x, y)
        if isinstance(x, dict):
            return isinstance(y, dict) and x.keys() == y.keys() and all(eq(x[k], y[k]) for k in x)
        if isinstance(x, list | tuple):
            return type(x) is type(y) and len(x) == len(y) and all(map(eq, x, y))
        return bool(x == y)

    return eq(a, b)


def step_dir(root: Path) -> Path:
    return layout.resolve(root).step_dir


def rewrite_manifest(directory: Path, change: Any) -> None:
    """An attacker's edit: change the manifest (e.g. hashes) so that it stays consistent (its
    seal and `latest` too)."""
    data = W.manifest_data(directory)
    change(data)
    W.write_manifest_data(directory, data)


def rehash(directory: Path, name: str) -> None:
    data = (directory / name).read_bytes()

    def change(m: dict[str, Any]) -> None:
        m["files"][name] = {"size": len(data), "blake3": blake3.blake3(data).hexdigest()}

    rewrite_manifest(directory, change)


def as_version_1(directory: Path) -> None:
    """Rewrite a checkpoint's manifest as fprep wrote it before BLAKE3: version 1, sha256."""

    def change(m: dict[str, Any]) -> None:
        m["version"] = 1
        del m["grad_scaler"]  # added in version 2
        for name in m["files"]:
            data = (directory / name).read_bytes()
            m["files"][name] = {"size": len(data), "sha256": hashlib.sha256(data).hexdigest()}

    rewrite_manifest(directory, change)


@pytest.fixture
def saved(tmp_path: Path) -> dict[str, Any]:
    state, model, opt, sched, loader = trained()
    root = tmp_path / "ckpt"
    fprep.save(
        root,
        state,
        model,
        optimizers=(opt,),
        scheduler=sched,
        loader=loader,
        step=3,
        extras={"best": 0.5},
    )
    return {
        "root": root,
        "state": state,
        "model": model,
        "opt": opt,
        "sched": sched,
        "loader": loader,
        "dir": step_dir(root),
    }


# -- round trips ---------------------------------------------------------------------------------
def test_round_trip_restores_everything(tmp_path: Path) -> None:
    state, model, opt, sched, loader = trained(steps=4)
    root = tmp_path / "ckpt"
    extras = {"tuple": (1, 2.5), "nan": float("nan"), "nested": {"a": [None, True]}, 3: "int key"}
    torch.manual_seed(1234)
    published = fprep.save(
        root, state, model, optimizers=opt, scheduler=sched, loader=loader, step=4, extras=extras
    )
    assert published == root / "step-00000004"
    expected_rand = torch.rand(5)  # what the RNG gives right after the save
    expected_py = random.random()
    want = snapshot(model, opt)

    state2, model2, opt2, sched2, loader2 = W.prepared("none", seed=99)
    torch.manual_seed(0)
    info = fprep.load(root, state2, model2, optimizers=opt2, scheduler=sched2, loader=loader2)
    assert isinstance(info, LoadedInfo)
    assert torch.equal(torch.rand(5), expected_rand) and random.random() == expected_py
    assert same_snapshot(snapshot(model2, opt2), want)
    assert sched2.state_dict() == sched.state_dict()
    assert loader2.state_dict() == loader.state_dict() == {"epoch": 0, "batches": 4}
    assert info.step == 4 and info.path == published and info.rng_restored
    assert info.world_size == 1 and info.strategy == "none" and info.state_dict_type == "sharded"
    assert info.missing_keys == () and info.unexpected_keys == () and info.notes == ()
    got = info.extras
    assert got["tuple"] == (1, 2.5) and got["nested"] == {"a": [None, True]} and got[3] == "int key"
    assert got["nan"] != got["nan"]


def test_fresh_optimizer_is_saved_without_creating_state(tmp_path: Path) -> None:
    state, model, opt, sched, _ = W.prepared("none")
    fprep.save(tmp_path, state, model, optimizers=(opt,), scheduler=sched)
    assert len(opt.state) == 0  # DCP's get_optimizer_state_dict would have stepped it
    # into an optimizer that has state: it comes back fresh, with the saved hyperparameters
    state2, model2, opt2, *_ = trained(seed=4)
    opt2.param_groups[0]["lr"] = 123.0
    fprep.load(tmp_path, state2, model2, optimizers=(opt2,))
    assert len(opt2.state) == 0 and opt2.param_groups[0]["lr"] == 0.05
    assert same_snapshot(model2.state_dict(), model.state_dict())


def test_buffers_are_saved_in_their_original_dtype(tmp_path: Path) -> None:
    state, model, *_ = W.prepared("none")
    model.scale = model.scale.to(torch.bfloat16) * 3  # cast after prepare (as mixed precision may)
    fprep.save(tmp_path, state, model)
    meta = json.loads((step_dir(tmp_path) / "metadata.json").read_text())
    assert meta["tensors"]["model/scale"]["dtype"] == "float32"
    state2, model2, *_ = W.prepared("none", seed=1)
    fprep.load(tmp_path, state2, model2)
    assert model2.scale.dtype == torch.float32 and torch.equal(model2.scale, torch.full((3,), 3.0))


def test_values_that_are_not_plain_data_are_refused_before_writing(tmp_path: Path) -> None:
    state, model, opt, *_ = W.prepared("none")

    class TensorScheduler:
        def state_dict(self) -> dict[str, Any]:
            return {"warmup": torch.ones(2)}

        def load_state_dict(self, sd: dict[str, Any]) -> None:
            pass

    with pytest.raises(CheckpointError, match="extras holds a value of type object at x") as e:
        fprep.save(tmp_path, state, model, extras={"x": object()})
    assert e.value.subject == "extras/x"
    with pytest.raises(CheckpointError, match="scheduler holds a tensor at warmup"):
        fprep.save(tmp_path, state, model, scheduler=TensorScheduler())
    with pytest.raises(CheckpointError, match="without state_dict"):
        fprep.save(tmp_path, state, model, loader=[1, 2])
    with pytest.raises(CheckpointError, match="step must be an int >= 0"):
        fprep.save(tmp_path, state, model, step=-1)
    with pytest.raises(CheckpointError, match="keep_last must be None or an int >= 1"):
        fprep.save(tmp_path, state, model, keep_last=0)
    with pytest.raises(CheckpointError, match=r"not a torch\.optim\.Optimizer"):
        fprep.save(tmp_path, state, model, optimizers=[opt, "adam"])  # type: ignore[list-item]

    class WithExtraState(nn.Linear):
        def get_extra_state(self) -> Any:
            return {"calibrated": True}

        def set_extra_state(self, state: Any) -> None:
            pass

    extra = WithExtraState(2, 2)
    s_extra, extra = fprep.prepare(extra, fprep.PrepConfig())
    with pytest.raises(CheckpointError, match="holds a dict under '_extra_state'"):
        fprep.save(tmp_path, s_extra, extra)
    assert os.listdir(tmp_path) == []  # nothing was written, not even a temporary directory
    assert isinstance(e.value, PrepError)


def test_large_ranks_write_several_files_in_parallel(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    if (os.cpu_count() or 1) < 2:
        pytest.skip("one CPU: one file per rank")
    monkeypatch.setattr(storage, "MIN_FILE", 1024)
    state, model, opt, *_ = trained()
    fprep.save(tmp_path, state, model, optimizers=(opt,))
    names = sorted(p.name for p in step_dir(tmp_path).glob("*.distcp"))
    assert len(names) == min(4, os.cpu_count() or 1) and names[0] == "__0_0.distcp"
    state2, model2, opt2, *_ = W.prepared("none", seed=1)
    fprep.load(tmp_path, state2, model2, optimizers=(opt2,))
    assert same_snapshot(snapshot(model2, opt2), snapshot(model, opt))
    last = step_dir(tmp_path) / names[-1]
    data = bytearray(last.read_bytes())
    data[-1] ^= 0x80
    last.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match=f"{names[-1]} does not match its blake3 digest"):
        fprep.load(tmp_path, state2, model2, optimizers=(opt2,))


def test_saving_starts_each_files_write_out_as_it_goes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """So that the disk works while later bytes are written and the final fsync is short."""
    real = storage.start_writeback
    monkeypatch.setattr(storage, "_WRITEBACK_EVERY", 1024)
    calls: list[tuple[int, int]] = []
    monkeypatch.setattr(storage, "start_writeback", lambda fd, at, n: calls.append((at, n)))
    state, model, opt, *_ = trained()
    fprep.save(tmp_path, state, model, optimizers=(opt,))
    size = (step_dir(tmp_path) / "__0_0.distcp").stat().st_size
    assert len(calls) > 2 and calls[0][0] == 0 and all(n >= 1024 for _, n in calls)
    assert all(at + n == nxt for (at, n), (nxt, _) in itertools.pairwise(calls))
    assert size - 1024 < calls[-1][0] + calls[-1][1] <= size  # all but the tail, fsynced after
    if sys.platform.startswith("linux"):  # the real call succeeds on a real file
        with open(tmp_path / "probe", "wb") as f:
            f.write(bytes(4096))
            f.flush()
            assert real(f.fileno(), 0, 4096) == 0


# -- layout, latest, rotation --------------------------------------------------------------------
def test_latest_rotation_and_resolving(tmp_path: Path) -> None:
    state, model, *_ = W.prepared("none")
    for step in (1, 2, 2, 3, 4):
        with torch.no_grad():
            model.odd.fill_(float(step))
        fprep.save(tmp_path, state, model, step=step, keep_last=3, extras=step)
    names = sorted(p.name for p in tmp_path.iterdir())
    assert names == [".lock", "latest", "step-00000002.1", "step-00000003", "step-00000004"]
    digest = blake3.blake3((tmp_path / "step-00000004" / "manifest.json").read_bytes())
    assert (tmp_path / "latest").read_text() == f"step-00000004 blake3:{digest.hexdigest()}\n"

    def loaded(path: Path) -> int:
        s, m, *_ = W.prepared("none", seed=1)
        info = fprep.load(path, s, m)
        assert torch.equal(m.odd, torch.full_like(m.odd, float(info.extras)))
        return info.step

    assert loaded(tmp_path) == 4
    assert loaded(tmp_path / "step-00000002.1") == 2
    (tmp_path / "latest").write_text("step-00000002.1\n")  # an older fprep's pointer: a name
    assert loaded(tmp_path) == 2
    (tmp_path / "latest").unlink()  # no pointer: the newest step directory
    assert loaded(tmp_path) == 4
    # rotation never removes the checkpoint `latest` names, even when it is not the newest
    with torch.no_grad():
        model.odd.fill_(0.0)
    fprep.save(tmp_path, state, model, step=0, keep_last=1, extras=0)
    assert sorted(p.name for p in tmp_path.iterdir()) == [".lock", "latest", "step-00000000"]


def test_no_checkpoint_and_dangling_pointer(tmp_path: Path) -> None:
    state, model, *_ = W.prepared("none")
    with pytest.raises(CheckpointError, match="no checkpoint at"):
        fprep.load(tmp_path, state, model)
    with pytest.raises(CheckpointError, match="not a directory"):
        fprep.load(tmp_path / "nothing", state, model)
    (tmp_path / "latest").write_text("step-00000009\n")
    with pytest.raises(CheckpointError, match="names step-00000009, which does not exist"):
        fprep.load(tmp_path, state, model)


# -- atomicity -----------------------------------------------------------------------------------
def _fail(*args: Any, **kwargs: Any) -> Any:
    raise OSError("injected failure")


PHASES = {
    "writing tensors": (SafeWriter, "write_data"),
    "writing metadata": (SafeWriter, "finish"),
    "writing the manifest": (files, "write_durable"),
    "publishing (rename)": (os, "rename"),
    "replacing latest": (os, "replace"),
}


@pytest.mark.parametrize("phase", sorted(PHASES))
def test_a_failed_save_leaves_the_previous_checkpoint(
    tmp_path: Path, phase: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    state, model, *_ = W.prepared("none")
    fprep.save(tmp_path, state, model, step=1)
    with torch.no_grad():
        model.odd.fill_(7.0)
    with monkeypatch.context() as m:
        m.setattr(*PHASES[phase], _fail)
        with pytest.raises(CheckpointError, match="injected failure"):
            fprep.save(tmp_path, state, model, step=2)
    s, m2, *_ = W.prepared("none", seed=1)
    info = fprep.load(tmp_path, s, m2)
    # the pointer still names step 1, unless only the pointer update failed (step 2 is complete)
    expected = 1
    assert info.step == expected
    # the next save removes whatever the failed one left behind
    fprep.save(tmp_path, state, model, step=3)
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".tmp-")]
    assert fprep.load(tmp_path, s, m2).step == 3 and torch.equal(m2.odd, model.odd)


CHILD = W.saver_script(
    'fprep.save(root, state, model, step=step, keep_last=3, extras={"step": step})'
)


def test_killed_saves_leave_a_loadable_checkpoint(tmp_path: Path) -> None:
    root = tmp_path / "ckpt"
    W.killed_save_rounds(root, CHILD, rounds=4, seed=2024)
    state, model = fprep.prepare(nn.Linear(256, 256), fprep.PrepConfig())
    fprep.save(root, state, model, step=999, keep_last=3)
    names = sorted(p.name for p in root.iterdir())
    assert not [n for n in names if n.startswith(".tmp-")]  # stale temp dirs and files removed
    assert len([n for n in names if n.startswith("step-")]) == 3


# -- safety: crafted files -----------------------------------------------------------------------
class Payload:
    """Unpickling this creates the marker file: proof that code from the checkpoint ran."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple[Any, ...]:
        return (exec, (f"open({str(self.marker)!r}, 'w').close()",))


def pickle_payload(marker: Path) -> bytes:
    return pickle.dumps(Payload(marker))


def torch_payload(marker: Path) -> bytes:
    import io

    buffer = io.BytesIO()
    torch.save({"x": Payload(marker)}, buffer)
    return buffer.getvalue()


FILES = ["latest", "manifest.json", "metadata.json", "__0_0.distcp"]


@pytest.mark.parametrize("name", FILES)
@pytest.mark.parametrize("content", ["pickle", "torch.save", "garbage", "empty", "symlink"])
def test_crafted_file_is_refused_and_never_executed(
    saved: dict[str, Any], tmp_path: Path, name: str, content: str
) -> None:
    marker = tmp_path / "marker"
    path = (saved["root"] if name == "latest" else saved["dir"]) / name
    path.unlink()
    if content == "pickle":
        path.write_bytes(pickle_payload(marker))
    elif content == "torch.save":
        path.write_bytes(torch_payload(marker))
    elif content == "garbage":
        path.write_bytes(os.urandom(4096))
    elif content == "empty":
        path.write_bytes(b"")
    else:
        target = tmp_path / "elsewhere"
        target.write_bytes(pickle_payload(marker))
        path.symlink_to(target)
    state, model, opt, sched, loader = W.prepared("none", seed=1)
    before = snapshot(model, opt)
    with pytest.raises(CheckpointError) as e:
        fprep.load(saved["root"], state, model, optimizers=(opt,), scheduler=sched, loader=loader)
    assert not marker.exists()
    assert same_snapshot(snapshot(model, opt), before)
    assert e.value.subject  # names the file (or the pointer) at fault
    assert name in str(e.value) or name == "latest"


@pytest.mark.parametrize("name", ["metadata.json", "__0_0.distcp"])
def test_a_flipped_byte_is_caught_by_the_hash(saved: dict[str, Any], name: str) -> None:
    path = saved["dir"] / name
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x01
    path.write_bytes(bytes(data))
    state, model, opt, sched, _ = W.prepared("none", seed=1)
    before = snapshot(model, opt)
    with pytest.raises(CheckpointError, match=rf"{name} does not match its blake3 digest") as e:
        fprep.load(saved["root"], state, model, optimizers=(opt,), scheduler=sched)
    assert e.value.subject == name
    assert same_snapshot(snapshot(model, opt), before) and len(opt.state) == 0
    if name == "__0_0.distcp":  # trusted storage: hashes skipped, sizes and structure checked
        info = fprep.load(saved["root"], state, model, optimizers=(opt,), verify_hashes=False)
        assert info.step == 3


def test_dcp_pickle_metadata_is_never_read(saved: dict[str, Any], tmp_path: Path) -> None:
    marker = tmp_path / "marker"
    (saved["dir"] / ".metadata").write_bytes(pickle_payload(marker))  # what DCP would unpickle
    state, model, *_ = W.prepared("none", seed=1)
    fprep.load(saved["root"], state, model)  # loads, ignoring the stray file
    assert not marker.exists()
    # a checkpoint written by plain DCP (pickled .metadata, no manifest) is refused, unread
    import torch.distributed.checkpoint as dcp

    plain = tmp_path / "plain"
    with pytest.warns(UserWarning, match="single process"):
        dcp.save({"w": torch.ones(2)}, checkpoint_id=plain, no_dist=True)
    (plain / ".metadata").write_bytes(pickle_payload(marker))
    with pytest.raises(CheckpointError, match=r"no manifest\.json"):
        fprep.load(plain, state, model)
    assert not marker.exists()


def test_consistent_but_crafted_files_are_still_never_executed(
    saved: dict[str, Any], tmp_path: Path
) -> None:
    """An attacker who also rewrites the manifest's hashes: tensor bytes are read as raw
    numbers, never unpickled, so the worst outcome is wrong weights."""
    marker = tmp_path / "marker"
    directory = saved["dir"]
    data = directory / "__0_0.distcp"
    size = data.stat().st_size
    payload = torch_payload(marker)
    data.write_bytes((payload * (size // len(payload) + 1))[:size])
    rehash(directory, "__0_0.distcp")
    state, model, *_ = W.prepared("none", seed=1)
    fprep.load(directory, state, model)  # garbage weights, no code
    assert not marker.exists()


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        (lambda m: m["storage"][0].update(file="../../outside.distcp"), "names a file"),
        (lambda m: m["storage"][0].update(offset=10**9), "lies outside"),
        (lambda m: m["storage"].pop(0), "is not stored anywhere"),
        (lambda m: m["storage"][0].update(length=1), "bytes; its shape and dtype make"),
        (lambda m: m["tensors"]["model/head.weight"].update(dtype="object"), "unknown dtype"),
        (
            lambda m: m["tensors"]["model/head.weight"]["chunks"].append(
                {"offsets": [0, 0], "sizes": [1, 8]}
            ),
            "overlap",
        ),
        (lambda m: m["tensors"]["model/head.weight"].update(size=[4, 8]), "cover"),
        (lambda m: m.update(format="torch"), "format is not"),
    ],
)
def test_crafted_metadata_with_a_matching_hash_is_refused(
    saved: dict[str, Any], edit: Any, message: str
) -> None:
    directory = saved["dir"]
    meta = json.loads((directory / "metadata.json").read_text())
    edit(meta)
    (directory / "metadata.json").write_text(json.dumps(meta))
    rehash(directory, "metadata.json")
    state, model, *_ = W.prepared("none", seed=1)
    before = snapshot(model)
    with pytest.raises(CheckpointError, match=message):
        fprep.load(directory, state, model)
    assert same_snapshot(snapshot(model), before)


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        (lambda m: m["files"].update({"../x.distcp": {"size": 1, "blake3": "0" * 64}}), "not a"),
        (
            lambda m: m["files"]["metadata.json"].update(sha256="0" * 64),
            "exactly 'size' and one digest",
        ),
        (lambda m: m["files"]["metadata.json"].update(blake3="0" * 63), "64 lowercase hex"),
        (lambda m: m.update(version=True), "version True"),
        (lambda m: m.update(version=99), "version 99"),
        (lambda m: m.update(step=-1), "'step' must be an int"),
        (lambda m: m.update(extras={"$eval": "print(1)"}), "unknown tag"),
        (lambda m: m["ranks"][0].update(rng={"torch": "00"}), "RNG state is not valid"),
        (
            lambda m: m["optimizers"][0]["state_dict"].update(
                state={"$tensor": "model/emb.weight"}
            ),
            "refers to",
        ),
        (lambda m: m.pop("files"), "missing fields"),
    ],
)
def test_crafted_manifest_is_refused(saved: dict[str, Any], edit: Any, message: str) -> None:
    rewrite_manifest(saved["dir"], edit)
    state, model, opt, *_ = W.prepared("none", seed=1)
    before = snapshot(model, opt)
    with pytest.raises(CheckpointError, match=message):
        fprep.load(saved["dir"], state, model, optimizers=(opt,))
    assert same_snapshot(snapshot(model, opt), before)


def test_duplicate_json_keys_and_nan_are_refused(saved: dict[str, Any]) -> None:
    body = manifest.unseal((saved["dir"] / "manifest.json").read_bytes())[0]
    W.write_manifest_bytes(saved["dir"], body[:-1] + b',"step": 5}')
    state, model, *_ = W.prepared("none", seed=1)
    with pytest.raises(CheckpointError, match="duplicate key 'step'"):
        fprep.load(saved["dir"], state, model)
    W.write_manifest_bytes(saved["dir"], body.replace(b'"step":3', b'"step":NaN'))
    with pytest.raises(CheckpointError, match="non-standard JSON constant NaN"):
        fprep.load(saved["dir"], state, model)


# -- bad input -----------------------------------------------------------------------------------
def test_missing_and_truncated_files(saved: dict[str, Any]) -> None:
    directory = saved["dir"]
    state, model, *_ = W.prepared("none", seed=1)
    data = directory / "__0_0.distcp"
    content = data.read_bytes()
    data.write_bytes(content[:100])
    with pytest.raises(CheckpointError, match=r"__0_0.distcp is truncated: 100 bytes on disk"):
        fprep.load(directory, state, model)
    data.unlink()
    with pytest.raises(CheckpointError, match=r"__0_0\.distcp is missing"):
        fprep.load(directory, state, model)
    data.write_bytes(content)
    (directory / "manifest.json").unlink()
    with pytest.raises(CheckpointError, match="no checkpoint"):
        fprep.load(directory, state, model)


def test_shape_and_dtype_mismatch_name_the_tensor(saved: dict[str, Any]) -> None:
    wide = W.build(classes=4)
    s_wide, wide = fprep.prepare(wide, fprep.PrepConfig())
    before = snapshot(wide)
    for strict in (True, False):
        with pytest.raises(
            CheckpointError,
            match=r"model 'head.weight': the checkpoint has "
            r"\(3, 8\) float32, the live one is \(4, 8\) float32",
        ) as e:
            fprep.load(saved["root"], s_wide, wide, strict=strict)
        assert e.value.subject == "head.bias"  # the first of the two, in key order
        assert "3 tensor(s) differ" in str(e.value)  # head.weight, head.bias, scale
    assert same_snapshot(snapshot(wide), before)
    half = W.build().to(torch.float64)
    s_half, half = fprep.prepare(half, fprep.PrepConfig())
    with pytest.raises(
        CheckpointError,
        match=r"17 tensor\(s\) differ.*model 'blocks.0.down.weight': the checkpoint has "
        r"\(8, 16\) float32, the live one is \(8, 16\) float64",
    ):
        fprep.load(saved["root"], s_half, half)


class Bigger(W.Net):
    def __init__(self) -> None:
        super().__init__()
        self.extra = nn.Linear(3, 3)


class Smaller(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        net = W.build()
        self.emb, self.blocks, self.head, self.odd = net.emb, net.blocks, net.head, net.odd


def test_missing_and_unexpected_keys(saved: dict[str, Any]) -> None:
    model = Bigger()
    state, model = fprep.prepare(model, fprep.PrepConfig())
    extra_before = copy.deepcopy(model.extra.state_dict())
    with pytest.raises(
        CheckpointError, match=r"missing from the checkpoint: model 'extra\.bias'"
    ) as e:
        fprep.load(saved["root"], state, model)
    assert e.value.subject == "extra.bias"
    info = fprep.load(saved["root"], state, model, strict=False)
    assert info.missing_keys == ("model/extra.bias", "model/extra.weight")
    assert same_snapshot(model.extra.state_dict(), extra_before)  # kept as it was
    assert torch.equal(model.head.weight, saved["model"].head.weight)  # the rest was loaded

    small = Smaller()
    state, small = fprep.prepare(small, fprep.PrepConfig())
    with pytest.raises(
        CheckpointError, match="in the checkpoint but not in the live objects: model 'scale'"
    ):
        fprep.load(saved["root"], state, small)
    info = fprep.load(saved["root"], state, small, strict=False)
    assert info.unexpected_keys == ("model/scale",)
    assert torch.equal(small.head.weight, saved["model"].head.weight)


def test_another_models_checkpoint(saved: dict[str, Any]) -> None:
    other = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 2))
    state, other = fprep.prepare(other, fprep.PrepConfig())
    before = snapshot(other)
    with pytest.raises(CheckpointError, match="looks like another model's checkpoint"):
        fprep.load(saved["root"], state, other)
    assert same_snapshot(snapshot(other), before)


def test_optimizer_mismatches(saved: dict[str, Any]) -> None:
    state, model, opt, *_ = W.prepared("none", seed=1)
    sgd = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model(torch.zeros(2, dtype=torch.long)).sum().backward()
    sgd.step()
    sgd.zero_grad()
    before = snapshot(model, sgd)
    with pytest.raises(
        CheckpointError,
        match=r"optimizer 0 is a torch.optim.sgd.SGD; the "
        r"checkpoint's is a torch.optim.adamw.AdamW",
    ):
        fprep.load(saved["root"], state, model, optimizers=(sgd,))
    assert same_snapshot(snapshot(model, sgd), before)
    # strict=False: the model loads; SGD keeps its own state and hyperparameters
    info = fprep.load(saved["root"], state, model, optimizers=(sgd,), strict=False)
    assert "optimizer 0 is a torch.optim.sgd.SGD" in info.notes[0]
    assert "optimizer/0/state/emb.weight/momentum_buffer" in info.missing_keys
    assert "optimizer/0/state/emb.weight/exp_avg" in info.unexpected_keys
    assert same_snapshot(copy.deepcopy(sgd.state_dict()), before[1])
    assert torch.equal(model.head.weight, saved["model"].head.weight)
    # the same optimizer over other parameters
    partial = torch.optim.AdamW([model.head.weight], lr=0.1)
    with pytest.raises(CheckpointError, match="param groups hold different parameters"):
        fprep.load(saved["root"], state, model, optimizers=(partial,))
    assert len(partial.state) == 0  # the state DCP created to compare with was removed again
    # more optimizers than saved
    with pytest.raises(CheckpointError, match="2 optimizer"):
        fprep.load(saved["root"], state, model, optimizers=(opt, partial))
    info = fprep.load(saved["root"], state, model, optimizers=(opt, partial), strict=False)
    assert any("2 optimizer" in n for n in info.notes)


def test_objects_without_saved_state(tmp_path: Path) -> None:
    state, model, opt, sched, loader = W.prepared("none")
    fprep.save(tmp_path, state, model)
    with pytest.raises(CheckpointError, match="no scheduler state"):
        fprep.load(tmp_path, state, model, scheduler=sched)
    with pytest.raises(CheckpointError, match="no data-loader position"):
        fprep.load(tmp_path, state, model, loader=loader)
    with pytest.raises(CheckpointError, match=r"1 optimizer.* the checkpoint has 0"):
        fprep.load(tmp_path, state, model, optimizers=(opt,))
    info = fprep.load(tmp_path, state, model, scheduler=sched, loader=loader, strict=False)
    assert len(info.notes) == 2


def test_fp16_grad_scaler_state_is_saved_and_restored(tmp_path: Path) -> None:
    """The loss scale and its growth tracker come back: a resumed fp16 run neither restarts
    from the initial scale nor skips steps finding it again."""
    state, model, *_ = trained(precision="fp16")
    scaler = state.handles.grad_scaler
    scaler.update(1024.0)  # a scale no fresh scaler has
    scaler._growth_tracker.fill_(7)
    saved_scaler = scaler.state_dict()
    fprep.save(tmp_path, state, model)
    assert W.manifest_data(step_dir(tmp_path))["grad_scaler"]

    fresh_state, fresh_model, *_ = W.prepared("none", precision="fp16")
    assert fresh_state.handles.grad_scaler.state_dict() != saved_scaler
    info = fprep.load(tmp_path, fresh_state, fresh_model)
    assert fresh_state.handles.grad_scaler.state_dict() == saved_scaler
    assert info.notes == ()

    fp32_state, fp32_model, *_ = W.prepared("none")  # another precision: a note, not an error
    info = fprep.load(tmp_path, fp32_state, fp32_model)
    assert any("grad-scaler" in note for note in info.notes)


def test_a_checkpoint_without_scaler_state_gives_fp16_a_fresh_scale(tmp_path: Path) -> None:
    state, model, *_ = trained()
    fprep.save(tmp_path, state, model)
    assert W.manifest_data(step_dir(tmp_path))["grad_scaler"] is None
    fp16_state, fp16_model, *_ = W.prepared("none", precision="fp16")
    before = fp16_state.handles.grad_scaler.state_dict()
    info = fprep.load(tmp_path, fp16_state, fp16_model)
    assert fp16_state.handles.grad_scaler.state_dict() == before
    assert any("loss scale starts anew" in note for note in info.notes)


# -- export --------------------------------------------------------------------------------------
def test_export_full_is_plain_safetensors(tmp_path: Path) -> None:
    from fprep.testing.models import tiny_gpt

    gpt = tiny_gpt(seed=1)
    assert gpt.lm_head.weight is gpt.wte.weight  # tied
    state, gpt = fprep.prepare(gpt, fprep.PrepConfig())
    state, model, *_ = W.prepared("none")
    model.scale = model.scale.to(torch.bfloat16)  # cast after prepare: exported as float32
    fprep.export_full(tmp_path / "net.safetensors", state, model)
    got = load_file(tmp_path / "net.safetensors")
    assert got["scale"].dtype == torch.float32
    W.build(seed=0).load_state_dict(got)
    s_gpt, gpt2 = fprep.prepare(tiny_gpt(seed=1), fprep.PrepConfig())
    fprep.export_full(tmp_path / "gpt.safetensors", s_gpt, gpt2)
    tensors = load_file(tmp_path / "gpt.safetensors")
    assert {"wte.weight", "lm_head.weight"} <= set(tensors)
    fresh = tiny_gpt(seed=2)
    fresh.load_state_dict(tensors)
    for name, value in gpt2.state_dict().items():
        assert torch.equal(fresh.state_dict()[name], value), name
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]
    with pytest.raises(CheckpointError, match="safetensors cannot store"):
        bad = nn.Linear(2, 2)
        bad.register_buffer("z", torch.zeros(2, dtype=torch.complex128))
        s_bad, bad = fprep.prepare(bad, fprep.PrepConfig())
        fprep.export_full(tmp_path / "bad.safetensors", s_bad, bad)
    assert not (tmp_path / "bad.safetensors").exists()


# -- digests -------------------------------------------------------------------------------------
def test_new_checkpoints_record_blake3_digests_of_every_file(saved: dict[str, Any]) -> None:
    m = W.manifest_data(saved["dir"])
    assert m["version"] == manifest.VERSION == 3
    assert sorted(m["files"]) == ["__0_0.distcp", "metadata.json"]
    for name, record in m["files"].items():
        data = (saved["dir"] / name).read_bytes()
        assert record == {"size": len(data), "blake3": blake3.blake3(data).hexdigest()}, name


def test_sha256_checkpoints_of_the_previous_format_still_load_and_verify(
    saved: dict[str, Any],
) -> None:
    directory = saved["dir"]
    as_version_1(directory)
    state, model, opt, sched, loader = W.prepared("none", seed=1)
    info = fprep.load(directory, state, model, optimizers=(opt,), scheduler=sched, loader=loader)
    assert info.step == 3 and info.extras == {"best": 0.5}
    assert same_snapshot(snapshot(model, opt), snapshot(saved["model"], saved["opt"]))
    data = directory / "__0_0.distcp"  # the sha256 is verified, not just accepted
    content = bytearray(data.read_bytes())
    content[len(content) // 3] ^= 0x04
    data.write_bytes(bytes(content))
    state, model, *_ = W.prepared("none", seed=1)
    before = snapshot(model)
    with pytest.raises(CheckpointError, match=r"__0_0\.distcp does not match its sha256 digest"):
        fprep.load(directory, state, model)
    assert same_snapshot(snapshot(model), before)


def test_an_unknown_digest_algorithm_is_refused(saved: dict[str, Any]) -> None:
    def change(m: dict[str, Any]) -> None:
        record = m["files"]["__0_0.distcp"]
        m["files"]["__0_0.distcp"] = {"size": record["size"], "blake5": record["blake3"]}

    rewrite_manifest(saved["dir"], change)
    state, model, *_ = W.prepared("none", seed=1)
    with pytest.raises(
        CheckpointError, match=r"'__0_0\.distcp' with a 'blake5' digest, which this fprep cannot"
    ) as e:
        fprep.load(saved["dir"], state, model)
    assert e.value.subject == "manifest.json" and "upgrade fprep" in e.value.hint
    with pytest.raises(CheckpointError, match="unknown hash algorithm 'md5'"):
        files.new_hasher("md5")


@pytest.mark.parametrize(
    ("shape", "offsets", "lengths", "span"),
    [
        ((4, 6), (1, 0), (2, 6), (6, 12)),  # whole rows
        ((4, 6), (2, 3), (1, 2), (15, 2)),  # part of one row
        ((4, 6), (0, 2), (4, 2), None),  # a column band: one run per row
        ((2, 3, 4), (1, 1, 0), (1, 2, 4), (16, 8)),
        ((2, 3, 4), (0, 1, 0), (2, 1, 4), None),
        ((), (), (), (0, 1)),
    ],
)
def test_contiguous_runs_of_a_stored_chunk(
    shape: tuple[int, ...], offsets: Any, lengths: Any, span: Any
) -> None:
    assert storage._span(shape, offsets, lengths) == span
    if span is not None:  # the run is exactly the box's elements, in order
        whole = torch.arange(int(torch.tensor(shape).prod())).view(shape)
        box = whole[tuple(slice(o, o + n) for o, n in zip(offsets, lengths, strict=True))]
        first, count = span
        assert torch.equal(whole.flatten()[first : first + count], box.flatten())


def test_a_target_that_is_not_one_contiguous_run_is_read_through_the_mapping(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    state, model = fprep.prepare(nn.Linear(4, 3), fprep.PrepConfig())
    with torch.no_grad():
        model.weight.copy_(torch.arange(12.0).view(3, 4))
    fprep.save(tmp_path, state, model)
    other = nn.Linear(4, 3)
    other.weight = nn.Parameter(torch.zeros(4, 3).t())  # a transposed view: not contiguous
    state2, other = fprep.prepare(other, fprep.PrepConfig())
    assert not other.weight.is_contiguous()
    mapped: list[str] = []
    real = storage.Source.mapping

    def mapping(self: storage.Source) -> Any:
        mapped.append(self.what)
        return real(self)

    monkeypatch.setattr(storage.Source, "mapping", mapping)
    fprep.load(tmp_path, state2, other)
    assert mapped == ["__0_0.distcp"]  # the weight; the bias was read straight into its memory
    assert torch.equal(other.weight, model.weight) and torch.equal(other.bias, model.bias)


def open_checkpoint_files() -> list[str]:
    fds = Path("/proc/self/fd")
    return [str(fd.readlink()) for fd in fds.iterdir() if fd.is_symlink()] if fds.is_dir() else []


def test_checks_started_while_dcp_plans_are_cleaned_up_when_it_fails_before_reading(
    saved: dict[str, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The digests are checked from DCP's local planning on; a failure after it (here in the
    global planning step) must leave no thread running and no file open."""
    from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner

    started: list[str] = []
    real_start = storage.SafeReader._start

    def start(self: storage.SafeReader, names: list[str]) -> None:
        started.extend(names)
        real_start(self, names)

    monkeypatch.setattr(storage.SafeReader, "_start", start)
    monkeypatch.setattr(DefaultLoadPlanner, "create_global_plan", _raise(OSError("planning")))
    state, model, opt, *_ = W.prepared("none", seed=1)
    before = snapshot(model, opt)
    with pytest.raises(CheckpointError, match="planning"):
        fprep.load(saved["root"], state, model, optimizers=(opt,))
    assert started == ["__0_0.distcp"]
    assert not [f for f in open_checkpoint_files() if f.endswith(".distcp")]
    assert not [t for t in threading.enumerate() if t.name.startswith("fprep-verify")]
    assert same_snapshot(snapshot(model, opt), before)


# -- OS errors -----------------------------------------------------------------------------------
def _raise(error: OSError) -> Any:
    def fail(*args: Any, **kwargs: Any) -> Any:
        raise error

    return fail


def test_export_full_os_errors_name_the_path_and_what_to_do(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    state, model, *_ = W.prepared("none")
    with pytest.raises(CheckpointError, match=r"cannot export to .*: it is a directory") as e:
        fprep.export_full(tmp_path, state, model)
    assert e.value.subject == str(tmp_path) and "model.safetensors" in e.value.hint
    blocker = tmp_path / "a-file"
    blocker.write_text("in the way")
    for target in (blocker / "model.safetensors", blocker / "sub" / "model.safetensors"):
        with pytest.raises(CheckpointError, match=f"cannot write {re.escape(str(target))}") as e:
            fprep.export_full(target, state, model)
        assert e.value.subject == str(target)
        assert "is a file" in e.value.hint or "in the way" in e.value.hint
    assert blocker.read_text() == "in the way"
    # a full disk, found when the file is fsynced: an existing export is left as it was
    target = tmp_path / "model.safetensors"
    target.write_bytes(b"the previous export")
    with monkeypatch.context() as m:
        m.setattr(os, "fsync", _raise(OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))))
        with pytest.raises(CheckpointError, match="No space left on device") as e:
            fprep.export_full(target, state, model)
    assert "file system is full" in e.value.hint and "unchanged" in e.value.hint
    assert isinstance(e.value.__cause__, OSError)
    assert target.read_bytes() == b"the previous export"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a-file", "model.safetensors"]
    # permission denied (really where the tests do not run as root; else at the rename)
    locked = tmp_path / "locked"
    locked.mkdir()
    with monkeypatch.context() as m:
        if os.geteuid() == 0:
            denied = PermissionError(errno.EACCES, "Permission denied", str(locked))
            m.setattr(os, "replace", _raise(denied))
        else:
            locked.chmod(0o500)
        with pytest.raises(CheckpointError, match=r"Permission denied") as e:
            fprep.export_full(locked / "model.safetensors", state, model)
    locked.chmod(0o700)
    assert "permissions" in e.value.hint and os.listdir(locked) == []


def test_load_os_errors_name_the_file_and_what_to_do(
    saved: dict[str, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    directory = saved["dir"]
    state, model, opt, *_ = W.prepared("none", seed=1)
    before = snapshot(model, opt)
    real_os_open = os.open

    def open_denied(path: Any, *args: Any, **kwargs: Any) -> int:
        if str(path).endswith("metadata.json"):
            raise PermissionError(errno.EACCES, "Permission denied", str(path))
        return real_os_open(path, *args, **kwargs)

    with monkeypatch.context() as m:
        if os.geteuid() == 0:  # root reads anything: inject what a locked file gives
            m.setattr(os, "open", open_denied)
        else:
            (directory / "metadata.json").chmod(0)
        with pytest.raises(CheckpointError, match=r"cannot read metadata\.json at .*Permission"):
            fprep.load(directory, state, model, optimizers=(opt,))
    (directory / "metadata.json").chmod(0o600)
    # a data file that cannot be opened (a stale handle on a network file system)

    def stale(path: Any, *args: Any, **kwargs: Any) -> int:
        if str(path).endswith(".distcp"):
            raise OSError(errno.ESTALE, "Stale file handle", str(path))
        return real_os_open(path, *args, **kwargs)

    with monkeypatch.context() as m:
        m.setattr(os, "open", stale)
        with pytest.raises(CheckpointError, match=r"cannot read __0_0\.distcp at .*Stale") as e:
            fprep.load(directory, state, model, optimizers=(opt,))
    assert e.value.subject == "__0_0.distcp" and "accessible" in e.value.hint
    # any other OSError on the way (here: an I/O error resolving `latest`) is one too
    with monkeypatch.context() as m:
        m.setattr(layout, "resolve", _raise(OSError(errno.EIO, "Input/output error", "/x")))
        with pytest.raises(CheckpointError, match=r"cannot read /x: Input/output error") as e:
            fprep.load(saved["root"], state, model, optimizers=(opt,))
    assert "I/O error" in e.value.hint
    assert same_snapshot(snapshot(model, opt), before) and len(opt.state) == 0
    fprep.load(directory, state, model, optimizers=(opt,))  # nothing was left broken


def test_a_full_disk_while_saving_names_the_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    state, model, *_ = W.prepared("none")
    fprep.save(tmp_path, state, model, step=1)
    with monkeypatch.context() as m:
        m.setattr(os, "fsync", _raise(OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))))
        with pytest.raises(CheckpointError, match=r"cannot write .*__0_0\.distcp: No space") as e:
            fprep.save(tmp_path, state, model, step=2)
    assert e.value.subject == "__0_0.distcp" and "file system is full" in e.value.hint
    s, m2, *_ = W.prepared("none", seed=1)
    assert fprep.load(tmp_path, s, m2).step == 1


# -- progress ------------------------------------------------------------------------------------
class Terminal(io.StringIO):
    """What a terminal looks like to ``Progress``."""

    def isatty(self) -> bool:
        return True


def final_lines(text: str) -> list[str]:
    """The last state of each progress line (each is redrawn after a carriage return)."""
    assert text.endswith("\n")
    return [line.split("\r")[-1] for line in text[:-1].split("\n")]


def test_progress_lines_on_a_terminal_reach_the_total(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(storage, "PROGRESS_AFTER_S", 0.0)
    monkeypatch.setattr(storage, "_HASH_CHUNK", 4096)  # several steps per file
    state, model, opt, *_ = trained()
    terminal = Terminal()
    monkeypatch.setattr(sys, "stderr", terminal)
    fprep.save(tmp_path, state, model, optimizers=(opt,))
    state2, model2, opt2, *_ = W.prepared("none", seed=1)
    fprep.load(tmp_path, state2, model2, optimizers=(opt2,))
    fprep.load(tmp_path, state2, model2, optimizers=(opt2,), verify_hashes=False)
    monkeypatch.undo()
    data = (step_dir(tmp_path) / "__0_0.distcp").stat().st_size  # tensors and alignment
    meta = json.loads((step_dir(tmp_path) / "metadata.json").read_text())
    tensors = sum(entry["length"] for entry in meta["storage"])
    lines = final_lines(terminal.getvalue())
    assert [line.split(" [")[0] for line in lines] == [
        "fprep: save",
        "fprep: verify",
        "fprep: load",
        "fprep: load",  # verify_hashes=False: nothing to verify
    ]
    full = "[" + "#" * 24 + "]"
    assert all(full in line for line in lines), lines
    written = f"] {tensors / 1e3:.1f}/{tensors / 1e3:.1f} kB "
    assert written in lines[0] and written in lines[2] and written in lines[3]
    assert f"] {data / 1e3:.1f}/{data / 1e3:.1f} kB " in lines[1]  # every byte of the file
    assert same_snapshot(snapshot(model2, opt2), snapshot(model, opt))


def test_export_shows_its_progress_in_bytes_written(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(storage, "PROGRESS_AFTER_S", 0.0)
    state, model, *_ = trained()
    terminal = Terminal()
    monkeypatch.setattr(sys, "stderr", terminal)
    target = fprep.export_full(tmp_path / "model.safetensors", state, model)
    monkeypatch.undo()
    tensors = sum(t.numel() * t.element_size() for t in load_file(target).values())
    (line,) = final_lines(terminal.getvalue())
    assert line.startswith("fprep: export [" + "#" * 24 + "]")
    assert f"] {tensors / 1e3:.1f}/{tensors / 1e3:.1f} kB " in line


def test_progress_is_silent_off_a_terminal_or_when_quick(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    state, model, *_ = W.prepared("none")
    for stream, after_s in ((io.StringIO(), 0.0), (Terminal(), 60.0)):
        monkeypatch.setattr(storage, "PROGRESS_AFTER_S", after_s)
        monkeypatch.setattr(sys, "stderr", stream)
        fprep.save(tmp_path, state, model)
        fprep.load(tmp_path, state, model)
        monkeypatch.undo()
        assert stream.getvalue() == ""
