"""A published checkpoint is never saved into, however its path is spelled: plain, relative,
``file://``, through a symbolic link, with ``..`` or a trailing slash, or under another name (a
renamed copy, ``best/``). Steps are recognised by their files (``layout.STEP_FILES``), not by
their ``step-N`` name. A directory that already is both a step and a root (what such a save
left) is refused by ``load`` instead of silently read as the old step.
"""

from __future__ import annotations

import os
import shutil
import uuid
from collections.abc import Callable
from pathlib import Path

import _checkpoint_workers as W
import fsspec
import pytest
import torch

import fprep
from fprep.checkpoint.stores import layout
from fprep.errors import CheckpointError


def _value(path: str | Path) -> tuple[int, float]:
    """(step, the weights' value) of the checkpoint at ``path``, fully verified."""
    state, model = W.wide_model(-1.0)
    info = fprep.load(path, state, model)
    weight = model[0].weight
    assert torch.equal(weight, torch.full_like(weight, weight[0, 0].item()))
    return info.step, weight[0, 0].item()


def _tree(root: Path) -> list[str]:
    return sorted(str(p.relative_to(root)) for p in root.rglob("*"))


@pytest.fixture
def published(tmp_path: Path) -> Path:
    """``tmp_path/ckpt/step-00000001`` (weights 1.0), a renamed copy ``tmp_path/best`` and a
    link ``tmp_path/link`` to the step."""
    state, model = W.wide_model(1.0)
    step = Path(fprep.save(tmp_path / "ckpt", state, model, step=1))
    shutil.copytree(step, tmp_path / "best")
    os.symlink(step, tmp_path / "link")
    return step


#: Spellings of a published step (or of a directory inside one), from ``tmp_path``.
SPELLINGS: dict[str, Callable[[Path], str]] = {
    "link": lambda t: str(t / "link"),
    "link/": lambda t: f"{t}/link/",
    "file://link": lambda t: f"file://{t}/link",
    "file://link/": lambda t: f"file://{t}/link/",
    "file://link/nested": lambda t: f"file://{t}/link/nested",
    "best": lambda t: str(t / "best"),
    "best/": lambda t: f"{t}/best/",
    "relative best": lambda t: "best",
    "ckpt/../best": lambda t: f"{t}/ckpt/../best",
    "best/nested/deeper": lambda t: str(t / "best" / "nested" / "deeper"),
    "file://best": lambda t: f"file://{t}/best",
    "file://best/": lambda t: f"file://{t}/best/",
    "file://best/nested": lambda t: f"file://{t}/best/nested",
    "link/..-to-step": lambda t: f"{t}/link/../step-00000001",  # the link's parent: ckpt
}


@pytest.mark.parametrize("spelling", sorted(SPELLINGS))
def test_no_spelling_of_a_published_step_is_saved_into(
    published: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, spelling: str
) -> None:
    monkeypatch.chdir(tmp_path)
    before = _tree(tmp_path)
    state, model = W.wide_model(2.0)
    with pytest.raises(CheckpointError, match=r"cannot save into .*a published checkpoint"):
        fprep.save(SPELLINGS[spelling](tmp_path), state, model, step=2)
    assert _tree(tmp_path) == before  # no latest, no step, no lock inside a step
    assert _value(tmp_path / "ckpt") == (1, 1.0)
    assert _value(tmp_path / "best") == (1, 1.0)


def test_the_message_says_where_a_link_leads(published: Path, tmp_path: Path) -> None:
    state, model = W.wide_model(2.0)
    with pytest.raises(CheckpointError) as refused:
        fprep.save(f"file://{tmp_path}/link", state, model, step=2)
    assert refused.value.message == (
        f"cannot save into file://{tmp_path}/link (it resolves to {published}): it is a "
        "published checkpoint."
    )
    assert refused.value.subject == f"file://{tmp_path}/link"


def test_a_directory_beside_the_steps_is_still_a_root(published: Path, tmp_path: Path) -> None:
    """Only a step's own files make a step: its root, and a sibling, take saves."""
    state, model = W.wide_model(3.0)
    assert Path(fprep.save(tmp_path / "ckpt", state, model, step=3)).name == "step-00000003"
    assert _value(tmp_path / "ckpt") == (3, 3.0)
    fprep.save(f"file://{tmp_path}/other", state, model, step=3)
    assert _value(tmp_path / "other") == (3, 3.0)


def test_a_renamed_copy_on_an_object_store_is_refused() -> None:
    name = f"fprep-test-{uuid.uuid4().hex}"
    url, fs = f"memory://{name}", fsspec.filesystem("memory")
    try:
        state, model = W.wide_model(1.0)
        step = str(fprep.save(url, state, model, step=1)).removeprefix("memory:/")
        fs.copy(step, f"/{name}/best", recursive=True)
        before = sorted(fs.find(f"/{name}"))
        for where in (f"{url}/best", f"{url}/best/", f"{url}/best/nested"):
            with pytest.raises(CheckpointError, match=r"cannot save into .*a published checkpoint"):
                fprep.save(where, state, model, step=2)
        assert sorted(fs.find(f"/{name}")) == before
        assert _value(f"{url}/best") == (1, 1.0)
    finally:
        if fs.exists(f"/{name}"):
            fs.rm(f"/{name}", recursive=True)


@pytest.mark.parametrize("prefix", ["", "file://"])
def test_a_step_that_is_also_a_root_is_not_loaded(published: Path, prefix: str) -> None:
    """What an earlier save into ``best/`` left: its manifest and a ``latest`` beside it."""
    best = published.parent.parent / "best"
    layout.write_latest(best, "step-00000001", "0" * 64)
    with pytest.raises(CheckpointError, match=r"is both a checkpoint .* and a checkpoint root"):
        _value(f"{prefix}{best}")


def test_a_step_directory_missing_its_metadata_is_still_a_step(published: Path) -> None:
    """By name and manifest, as before: a damaged step-N directory is not saved into either."""
    (published / "metadata.json").unlink()
    state, model = W.wide_model(2.0)
    with pytest.raises(CheckpointError, match=r"cannot save into .*a published checkpoint"):
        fprep.save(published / "nested", state, model, step=2)
    assert not (published / "nested").exists()
