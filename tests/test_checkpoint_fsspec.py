"""``fprep.save`` / ``fprep.load`` at fsspec URLs: the same format and checks, published without
rename (objects, then the sealed manifest, then ``latest``), resharding on load.

``memory://`` is one process's store, so the multi-process test uses ``file://`` (an fsspec file
system too: the same object-store publishing, no rename of the step, no lock).
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import _checkpoint_workers as W
import fsspec
import pytest
import torch
import torch.distributed as dist

import fprep
from fprep.checkpoint.stores import layout
from fprep.checkpoint.stores.fsspec_store import FsspecStore
from fprep.errors import CheckpointError
from fprep.testing.distributed import run_ranks


@pytest.fixture
def url() -> Iterator[str]:
    root = f"memory://fprep-test-{uuid.uuid4().hex}"
    yield root
    fs = fsspec.filesystem("memory")
    if fs.exists(root):
        fs.rm(root, recursive=True)


def trained(steps: int = 2, seed: int = W.SEED) -> tuple[Any, ...]:
    state, model, opt, sched, loader = W.prepared("none", seed=seed)
    W.Trainer(state, model, opt, sched, loader).run(steps)
    return state, model, opt, sched, loader


def fresh() -> tuple[Any, ...]:
    return W.prepared("none", seed=1)


def exact(got: Any, want: Any) -> None:
    torch.testing.assert_close(got, want, rtol=0, atol=0)


def names(url: str) -> list[str]:
    fs, path = fsspec.core.url_to_fs(url)
    return sorted(p.rsplit("/", 1)[-1] for p in fs.ls(path, detail=False))


def test_memory_round_trip(url: str) -> None:
    state, model, opt, sched, _ = trained()
    published = fprep.save(
        url, state, model, optimizers=opt, scheduler=sched, step=2, extras={"k": [1, 2]}
    )
    assert published == f"{url}/step-00000002"
    assert names(url) == ["latest", "step-00000002"]  # no staging, no lock object
    s, m, o, sc, _ = fresh()
    info = fprep.load(url, s, m, optimizers=o, scheduler=sc)
    assert (info.step, info.extras, info.path) == (2, {"k": [1, 2]}, published)
    assert info.rng_restored
    exact(W.full_state(m, o), W.full_state(model, opt))
    assert sc.state_dict() == sched.state_dict()
    # a step directory's URL loads too
    s, m, o, *_ = fresh()
    assert fprep.load(published, s, m, optimizers=o).step == 2
    exact(W.full_state(m, o), W.full_state(model, opt))


def test_file_url_writes_the_same_format(tmp_path: Path) -> None:
    state, model, opt, *_ = trained()
    fprep.save(f"file://{tmp_path}", state, model, optimizers=opt, step=5)
    # the plain local path reads what the URL wrote: one format, one manifest, one pointer
    s, m, o, *_ = fresh()
    info = fprep.load(tmp_path, s, m, optimizers=o)
    assert info.step == 5 and info.path == tmp_path / "step-00000005"
    exact(W.full_state(m, o), W.full_state(model, opt))


def test_a_flipped_byte_in_an_object_is_refused(url: str) -> None:
    state, model, *_ = trained()
    fprep.save(url, state, model, step=1)
    fs, root = fsspec.core.url_to_fs(url)
    data_file = f"{root}/step-00000001/__0_0.distcp"
    data = bytearray(fs.cat_file(data_file))
    data[len(data) // 2] ^= 0x01
    fs.pipe_file(data_file, bytes(data))
    s, m, *_ = fresh()
    before = W.full_state(m)
    with pytest.raises(CheckpointError, match=r"__0_0\.distcp does not match its blake3 digest"):
        fprep.load(url, s, m)
    exact(W.full_state(m), before)  # nothing was copied into the model


def saved_then_changed(url: str, value: float) -> tuple[Any, Any, dict[str, Any]]:
    """A model saved as step 1 (and its state then), then changed."""
    state, model, *_ = trained()
    fprep.save(url, state, model, step=1)
    first = W.full_state(model)
    with torch.no_grad():
        model.odd.fill_(value)
    return state, model, first


def _fail(*args: Any, **kwargs: Any) -> Any:
    raise OSError(5, "injected failure")


@pytest.mark.parametrize("phase", ["metadata", "manifest", "pointer"])
def test_an_interrupted_save_stays_invisible(
    url: str, phase: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A save that dies after some objects (the process killed: nothing cleaned up) leaves the
    previous checkpoint the one ``load`` reads; the next save removes the leftovers."""
    state, model, first = saved_then_changed(url, 7.0)
    opener = FsspecStore._opener

    def dying_opener(self: FsspecStore, name: str) -> Any:
        open_file = opener(self, name)

        def open_or_die(file: str) -> Any:
            if (phase, file) in (("metadata", "metadata.json"), ("manifest", "manifest.json")):
                raise OSError(5, "injected failure")
            return open_file(file)

        return open_or_die

    with monkeypatch.context() as m:
        m.setattr(FsspecStore, "discard", lambda self, name: None)  # killed: no cleanup
        if phase == "pointer":
            m.setattr(FsspecStore, "publish", _fail)
        else:
            m.setattr(FsspecStore, "_opener", dying_opener)
        with pytest.raises(CheckpointError, match="injected failure"):
            fprep.save(url, state, model, step=2)
    assert "step-00000002" in names(url)  # objects of the dead save are there ...
    s, m2, *_ = fresh()
    assert fprep.load(url, s, m2).step == 1  # ... and invisible
    exact(W.full_state(m2), first)
    fprep.save(url, state, model, step=3)
    left = names(url)
    assert ("step-00000002" in left) == (phase == "pointer")  # complete (sealed) steps stay
    assert fprep.load(url, s, m2).step == 3 and torch.equal(m2.odd, model.odd)


def test_keep_last_rotates_after_the_pointer(url: str) -> None:
    state, model, *_ = trained(1)
    for step in range(1, 5):
        fprep.save(url, state, model, step=step, keep_last=2)
    assert names(url) == ["latest", "step-00000003", "step-00000004"]
    fs, root = fsspec.core.url_to_fs(url)
    assert layout.parse_latest(fs.cat_file(f"{root}/latest"))[0] == "step-00000004"  # type: ignore[index]
    # a second save at the same step gets its own prefix, never mixing objects
    fprep.save(url, state, model, step=4, keep_last=2)
    assert names(url) == ["latest", "step-00000004", "step-00000004.1"]
    s, m, *_ = fresh()
    assert fprep.load(url, s, m).path == f"{url}/step-00000004.1"


def test_a_url_without_fsspec_says_to_install_it(monkeypatch: pytest.MonkeyPatch) -> None:
    state, model, *_ = W.prepared("none")
    monkeypatch.setitem(sys.modules, "fsspec", None)  # import fsspec -> ImportError
    with pytest.raises(CheckpointError, match=r"pip install 'fprep\[fsspec\]'") as e:
        fprep.save("s3://bucket/run", state, model)
    assert "need fsspec, which is not installed" in str(e.value)
    with pytest.raises(CheckpointError, match="need fsspec"):
        fprep.load("memory://run", state, model)


def test_an_unknown_scheme_is_a_checkpoint_error() -> None:
    state, model, *_ = W.prepared("none")
    with pytest.raises(CheckpointError, match="cannot open nosuchfs://x with fsspec"):
        fprep.save("nosuchfs://x", state, model)


def test_local_paths_do_not_import_fsspec(tmp_path: Path) -> None:
    code = textwrap.dedent(
        f"""
        import sys
        sys.path.insert(0, {str(Path(__file__).parent)!r})
        import _checkpoint_workers as W, fprep
        state, model, *_ = W.prepared("none")
        fprep.save({str(tmp_path)!r}, state, model, step=1)
        s, m, *_ = W.prepared("none", seed=1)
        assert fprep.load({str(tmp_path)!r}, s, m).step == 1
        assert "fsspec" not in sys.modules, "fsspec imported"
        """
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


# -- 2 ranks -------------------------------------------------------------------------------------
def two_ranks(url: str) -> dict[str, Any]:
    """fsdp on 2 ranks: save at a URL, load it back into a fresh 2-rank model."""
    state, model, opt, sched, loader = W.prepared("fsdp")
    W.Trainer(state, model, opt, sched, loader).run(2)
    published = fprep.save(url, state, model, optimizers=opt, scheduler=sched, step=2)
    saved = W.full_state(model, opt)
    s, m, o, sc, _ = W.prepared("fsdp", seed=1)
    info = fprep.load(url, s, m, optimizers=o, scheduler=sc)
    return {
        "published": published,
        "saved": W.dump(saved),  # bytes: tensors do not outlive the rank's process
        "loaded": W.dump(W.full_state(m, o)),
        "step": info.step,
        "rng": info.rng_restored,
    }


@pytest.mark.slow
@pytest.mark.skipif(not (dist.is_available() and dist.is_gloo_available()), reason="needs gloo")
def test_two_ranks_round_trip_and_reshard_to_one(tmp_path: Path) -> None:
    url = f"file://{tmp_path}/run"
    results = run_ranks(two_ranks, 2, url, timeout_s=240.0)
    for r in results:
        assert r["published"] == f"{url}/step-00000002"
        exact(W.undump(r["loaded"]), W.undump(r["saved"]))
        assert r["step"] == 2 and r["rng"]
    assert not list((tmp_path / "run").glob(".*"))  # no staging, no lock file
    # 2 -> 1: this process loads the 2-rank checkpoint (the RNG states stay per rank)
    s, m, o, *_ = fresh()
    info = fprep.load(url, s, m, optimizers=o)
    assert info.world_size == 2 and not info.rng_restored
    exact(W.full_state(m, o), W.undump(results[0]["saved"]))


def test_an_asynchronous_save_to_a_url_holds_the_values_at_the_call(url: str) -> None:
    state, model, opt, sched, loader = trained()
    want = W.full_state(model, opt)
    handle = fprep.save(url, state, model, optimizers=opt, step=2, wait=False)
    W.Trainer(state, model, opt, sched, loader).run(2)  # the optimizer steps while it writes
    assert handle.wait() == f"{url}/step-00000002"
    assert names(url) == ["latest", "step-00000002"]
    s, m, o, *_ = fresh()
    assert fprep.load(url, s, m, optimizers=o).step == 2
    exact(W.full_state(m, o), want)


def test_export_full_to_a_url_is_plain_safetensors_and_appears_whole(
    url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    from safetensors.torch import load as load_bytes

    from fprep.checkpoint.stores import sink

    state, model, *_ = trained()
    target = f"{url}/export/model.safetensors"
    assert fprep.export_full(target, state, model) == target
    fs, path = fsspec.core.url_to_fs(target)
    got = load_bytes(fs.cat_file(path))
    assert got.keys() == model.state_dict().keys()
    assert all(torch.equal(got[k], v) for k, v in model.state_dict().items())
    assert names(f"{url}/export") == ["model.safetensors"]  # nothing temporary left
    # a failure half way: the previous export stays whole, nothing else appears
    real_write = sink.UrlSink.write
    calls = [0]

    def failing_write(self: sink.UrlSink, data: Any) -> None:
        calls[0] += 1
        if calls[0] == 3:
            raise OSError(28, "No space left on device")
        real_write(self, data)

    monkeypatch.setattr(sink.UrlSink, "write", failing_write)
    with torch.no_grad():
        next(model.parameters()).add_(1)
    with pytest.raises(CheckpointError, match="No space left on device") as caught:
        fprep.export_full(target, state, model)
    assert caught.value.subject == target
    assert load_bytes(fs.cat_file(path)).keys() == got.keys()
    assert all(torch.equal(v, got[k]) for k, v in load_bytes(fs.cat_file(path)).items())
    assert names(f"{url}/export") == ["model.safetensors"]
    with pytest.raises(CheckpointError, match="it is a directory"):
        fprep.export_full(f"{url}/export", state, model)


# -- URL rules (issue 18.9) ----------------------------------------------------------------------
def test_a_file_url_with_dot_dot_cannot_write_into_a_published_step(tmp_path: Path) -> None:
    state, model, *_ = trained()
    fprep.save(f"file://{tmp_path}", state, model, step=1)
    step = tmp_path / "step-00000001"
    published = sorted(p.name for p in step.iterdir())
    for url in (f"file://{tmp_path}/x/../step-00000001", f"file://{tmp_path}/./step-00000001"):
        with pytest.raises(CheckpointError, match=r"'\.' or '\.\.' path segment") as refused:
            fprep.save(url, state, model, step=2)
        assert refused.value.subject == url
    assert sorted(p.name for p in step.iterdir()) == published  # no latest, no step inside
    assert sorted(p.name for p in tmp_path.iterdir()) == ["latest", "step-00000001"]
    s, m, *_ = fresh()
    with pytest.raises(CheckpointError, match=r"path segment"):
        fprep.load(f"file://{tmp_path}/x/../step-00000001", s, m)


def test_a_chained_url_is_refused_not_written_to_a_local_directory(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    state, model, *_ = trained()
    url = f"simplecache::file://{tmp_path}/run"
    with pytest.raises(CheckpointError, match="chained fsspec URL") as refused:
        fprep.save(url, state, model, step=1)
    assert f"file://{tmp_path}/run" in str(refused.value.hint)
    with pytest.raises(CheckpointError, match="chained fsspec URL"):
        fprep.export_full(f"simplecache::memory://x/{uuid.uuid4().hex}.safetensors", state, model)
    s, m, *_ = fresh()
    with pytest.raises(CheckpointError, match="chained fsspec URL"):
        fprep.load(url, s, m)
    assert list(tmp_path.iterdir()) == []  # nothing named after the URL


def test_the_root_of_a_file_system_saves_and_loads() -> None:
    fs = fsspec.filesystem("memory")
    before = set(fs.ls("/", detail=False))
    state, model, opt, *_ = trained()
    try:
        published = fprep.save("memory://", state, model, optimizers=opt, step=3)
        assert published == "memory://step-00000003"
        for where in ("memory://", "memory:///", published):
            s, m, o, *_ = fresh()
            info = fprep.load(where, s, m, optimizers=o)
            assert (info.step, info.path) == (3, published)
            exact(W.full_state(m, o), W.full_state(model, opt))
    finally:
        for path in set(fs.ls("/", detail=False)) - before:
            fs.rm(path, recursive=True)


def test_a_file_missing_at_publish_is_refused_and_latest_stays(
    url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """What the publishing rank cannot see is not published: the previous step stays latest."""
    state, model, first = saved_then_changed(url, 3.0)
    publish = FsspecStore.publish

    def unseen(self: FsspecStore, name: str, step: int, digest: str) -> str:
        self.fs.rm(self._join(name, "__0_0.distcp"))  # as if written where rank 0 cannot see
        return publish(self, name, step, digest)

    monkeypatch.setattr(FsspecStore, "publish", unseen)
    with pytest.raises(CheckpointError, match=r"rank 0's __0_0\.distcp is not there") as refused:
        fprep.save(url, state, model, step=2)
    assert "storage every rank sees" in str(refused.value.hint)
    assert names(url) == ["latest", "step-00000001"]  # discarded; the pointer did not move
    s, m, *_ = fresh()
    assert fprep.load(url, s, m).step == 1
    exact(W.full_state(m), first)


def private_storage(kind: str, root: str) -> dict[str, Any]:
    """2 ranks, each saving to storage the other cannot see: ``memory://`` is per process, and
    ``local`` gives rank 1 a directory of its own behind the same path (a node-local disk)."""
    from fprep.checkpoint.stores import backend

    if kind == "local" and os.environ["RANK"] == "1":
        own = Path(root).with_name("rank1-disk")
        writer = backend.LocalStore.writer

        def node_local(self: backend.LocalStore, name: str, *, progress: bool) -> Any:
            (own / name).mkdir(parents=True, exist_ok=True)
            return writer(backend.LocalStore(own), name, progress=progress)

        backend.LocalStore.writer = node_local  # type: ignore[method-assign]
    state, model, *_ = W.prepared("fsdp")
    try:
        fprep.save(root, state, model, step=1)
        return {"error": None}
    except CheckpointError as e:
        left = [] if kind == "memory" else sorted(p.name for p in Path(root).iterdir())
        return {"error": str(e), "left": left}


@pytest.mark.slow
@pytest.mark.skipif(not (dist.is_available() and dist.is_gloo_available()), reason="needs gloo")
@pytest.mark.parametrize("kind", ["memory", "local"])
def test_storage_only_one_rank_sees_is_refused_at_publish(tmp_path: Path, kind: str) -> None:
    root = "memory://fprep-private/run" if kind == "memory" else str(tmp_path / "run")
    results = run_ranks(private_storage, 2, kind, root, timeout_s=240.0)
    for r in results:
        assert r["error"] is not None, "a save no rank could load reported success"
        assert "rank 1's __1_0.distcp is not there" in r["error"]
        assert "do not share this storage" in r["error"]
    if kind == "local":
        assert results[0]["left"] == [".lock"]  # nothing published, the staging place removed
