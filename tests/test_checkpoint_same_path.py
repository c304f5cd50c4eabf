"""Every rank must name one place (``fprep/checkpoint/same_path.py``): ``save`` (sync and
``wait=False``), ``load``, ``export_full`` and ``save_pretrained`` given a different path on each
rank raise the same ``CheckpointError`` on every rank, naming the ranks and their paths, before
anything is written or read; one directory spelled differently on each rank (relative, through a
symbolic link, a ``file://`` URL) is one place, and works."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import _checkpoint_workers as W
import _same_path_workers as S
import pytest
import torch
import torch.distributed as dist
from hypothesis import assume, given
from hypothesis import strategies as st

from fprep.checkpoint.same_path import SHOWN, _differ, _spans, place
from fprep.errors import CheckpointError
from fprep.testing.distributed import run_ranks

pytestmark = pytest.mark.skipif(
    not (dist.is_available() and dist.is_gloo_available()), reason="needs gloo"
)

CALLS = ("save", "save_async", "export_full", "save_pretrained", "load")


@pytest.mark.slow
def test_different_paths_fail_alike_on_every_rank_and_write_nothing(tmp_path: Path) -> None:
    ranks = run_ranks(S.different_paths, 2, str(tmp_path), timeout_s=300)
    for call in CALLS:
        errors = [r[call] for r in ranks]
        assert errors[0]["type"] == "CheckpointError", (call, errors[0])
        assert errors[0] == errors[1], call  # the same error on both ranks
        message = errors[0]["message"]
        assert "different paths on different ranks" in message
        assert "every rank sees" in message  # says what to do
        assert errors[0]["subject"] == "path"
        if call != "load":  # the save-side calls name each rank's own directory
            assert f"rank 0: {ranks[0]['mine']}" in message, message
            assert f"rank 1: {ranks[1]['mine']}" in message, message
    load = ranks[0]["load"]["message"]
    assert f"rank 1: {tmp_path / 'copy'}" in load and f"rank 0: {tmp_path / 'shared'}" in load
    for r in ranks:
        assert r["left"] == []  # no lock, no staging directory, no file
        assert r["unchanged"]  # the load changed nothing either


@pytest.mark.slow
def test_one_directory_spelled_differently_on_each_rank_works(tmp_path: Path) -> None:
    ranks = run_ranks(S.one_place_spelled_twice, 2, str(tmp_path), timeout_s=300)
    real = tmp_path / "real"
    assert ranks[0]["step"] == ranks[1]["step"] == 2
    saved, loaded = W.undump(ranks[0]["saved"]), W.undump(ranks[0]["loaded"])
    for k, v in saved["model"].items():
        assert torch.equal(loaded["model"][k], v), k
    files = ranks[0]["files"]
    assert "ckpt/step-00000001/__1_0.distcp" in files  # rank 1 wrote beside rank 0
    assert "ckpt/step-00000002/__1_0.distcp" in files
    assert "m.safetensors" in files and "hf/model.safetensors" in files
    assert "hf/config.json" in files
    assert ranks[0]["published"] == str(real / "ckpt" / "step-00000001")


def test_place_resolves_local_spellings_and_keeps_urls(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    (tmp_path / "real").mkdir()
    os.symlink(tmp_path / "real", tmp_path / "link")
    monkeypatch.chdir(tmp_path)
    want = str((tmp_path / "real" / "ckpt").resolve())
    spellings: list[Any] = [
        tmp_path / "real" / "ckpt",
        "real/ckpt",
        "./real/ckpt/",
        "link/ckpt",
        f"file://{tmp_path}/link/ckpt/",
        Path("real") / "x" / ".." / "ckpt",
    ]
    for spelling in spellings:
        assert place(spelling) == (os.fspath(spelling), want), spelling
    assert place("s3://bucket/run/")[1] == "s3://bucket/run"
    assert place("memory://")[1] == place("memory:///")[1] == "memory://"
    assert place("s3://bucket/a")[1] != place("s3://bucket/b")[1]


@pytest.mark.parametrize("bad", [None, 3, b"/tmp/x", ["/tmp/x"]])
def test_what_is_not_a_path_is_a_checkpoint_error(bad: Any) -> None:
    with pytest.raises(CheckpointError, match="path must be") as e:
        place(bad)
    assert e.value.subject == "path"


@given(st.lists(st.sampled_from(["/a", "/b", "/c", "/d", "/e", "/f"]), min_size=2, max_size=40))
def test_the_message_names_every_rank_once_and_at_most_shown_places(paths: list[str]) -> None:
    assume(len(set(paths)) > 1)
    message = str(_differ("fprep.save", [(p, p) for p in paths]))
    distinct = list(dict.fromkeys(paths))
    for p in distinct[:SHOWN]:
        ranks = [r for r, q in enumerate(paths) if q == p]
        who = f"rank {ranks[0]}" if len(ranks) == 1 else f"ranks {_spans(ranks)}"
        assert f"{who}: {p}" in message
    if len(distinct) > SHOWN:
        assert f"and {len(distinct) - SHOWN} other paths" in message


@given(st.sets(st.integers(0, 200), min_size=1))
def test_spans_lists_exactly_the_ranks(ranks: set[int]) -> None:
    text = _spans(sorted(ranks))
    back: list[int] = []
    for part in text.split(", "):
        lo, _, hi = part.partition("-")
        back.extend(range(int(lo), int(hi or lo) + 1))
    assert back == sorted(ranks)
