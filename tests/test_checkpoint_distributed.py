"""``fprep.save`` / ``fprep.load`` / ``fprep.export_full`` on real gloo process groups.

The groups run once per module, in order, sharing one checkpoint root (the ``runs`` fixture):

1. 4 ranks, hsdp (2 x 2): train, save;
2. 2 ranks, fsdp: load the hsdp checkpoint (4 -> 2, hsdp -> fsdp); train N steps, save (sharded,
   and with a "full" state-dict plan), train M more (the uninterrupted run), export;
3. this process, one rank: load both 2-rank checkpoints and the hsdp one (2 -> 1, 4 -> 1); save
   a single-process checkpoint;
4. 2 ranks, fsdp, a fresh process group: resume from step N and train M steps; load the
   single-process checkpoint (1 -> 2); load fsdp into ddp; damaged copies fail on every rank and
   change nothing; progress lines on a terminal appear on rank 0 only;
5. 3 ranks: load the 2-rank checkpoints (2 -> 3).

Every comparison is exact (``torch.equal``): resharding moves bytes, it never recomputes.
"""

from __future__ import annotations

import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import _checkpoint_workers as W
import pytest
import torch
import torch.distributed as dist
from safetensors.torch import load_file

import fprep
from fprep.testing.distributed import run_ranks

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(not (dist.is_available() and dist.is_gloo_available()), reason="needs gloo"),
]

TIMEOUT_S = 240.0


def single_process(root: Path) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for name in ("a", "a_full", "hsdp"):
        state, model, opt, sched, _ = W.prepared("none", seed=77)
        info = fprep.load(root / name, state, model, optimizers=(opt,))
        out[name] = W.full_state(model, opt)
        out[f"{name}_info"] = info
    state, model, opt, sched, loader = W.prepared("none", seed=3)
    W.Trainer(state, model, opt, sched, loader).run(2)
    fprep.save(root / "one", state, model, optimizers=(opt,), scheduler=sched, step=2)
    out["one"] = W.full_state(model, opt)
    return out


@pytest.fixture(scope="module")
def runs() -> Iterator[dict[str, Any]]:
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        out: dict[str, Any] = {"root": root}
        out["four"] = run_ranks(W.four_hsdp, 4, tmp, timeout_s=TIMEOUT_S)
        out["first"] = run_ranks(W.two_first, 2, tmp, timeout_s=TIMEOUT_S)
        out["single"] = single_process(root)
        out["second"] = run_ranks(W.two_second, 2, tmp, timeout_s=TIMEOUT_S)
        out["three"] = run_ranks(W.three, 3, tmp, timeout_s=TIMEOUT_S)
        out["export"] = load_file(root / "export.safetensors")
        out["export_hsdp"] = load_file(root / "hsdp.safetensors")
        out["export_three"] = load_file(root / "three.safetensors")
        yield out


def assert_state_equal(
    got: dict[str, Any], want: dict[str, Any], *, optimizer: bool = True
) -> None:
    assert sorted(got["model"]) == sorted(want["model"])
    for k, v in want["model"].items():
        assert got["model"][k].dtype == v.dtype, k
        assert torch.equal(got["model"][k], v), k
    if optimizer:
        assert sorted(got["optim"]) == sorted(want["optim"])
        for fqn, entry in want["optim"].items():
            for k, v in entry.items():
                assert torch.equal(got["optim"][fqn][k], v), (fqn, k)
        assert got["groups"] == want["groups"]


def test_layout_on_disk(runs: dict[str, Any]) -> None:
    first = runs["first"][0]
    assert first["files_a"] == ["__0_0.distcp", "__1_0.distcp", "manifest.json", "metadata.json"]
    # a "full" plan gathers on rank 0, which writes every tensor
    assert first["files_a_full"] == ["__0_0.distcp", "manifest.json", "metadata.json"]
    root: Path = runs["root"]
    assert (root / "a" / "latest").read_text().startswith(f"step-{W.N_STEPS:08d} blake3:")
    assert not list((root / "a").glob(".tmp-*"))


def test_save_leaves_rng_and_training_alone(runs: dict[str, Any]) -> None:
    assert runs["first"][0]["save_keeps_rng"] is True


def test_resume_in_a_fresh_process_group_equals_uninterrupted(runs: dict[str, Any]) -> None:
    first, second = runs["first"][0], runs["second"][0]
    step, extras, rng_restored, notes = second["resume_info"]
    assert step == W.N_STEPS and extras == {"rank_count": 2, "note": "mid-epoch"}
    assert rng_restored is True and notes == ()
    assert second["loader_after_load"] == first["loader_at_save"] == {"epoch": 0, "batches": 4}
    want, got = W.undump(first["uninterrupted"]), W.undump(second["resumed"])
    assert sorted(got) == sorted(want)
    for k in want:
        assert torch.equal(got[k], want[k]), k


def test_two_to_one(runs: dict[str, Any]) -> None:
    at_save = W.undump(runs["first"][0]["at_save"])
    single = runs["single"]
    assert_state_equal(single["a"], at_save)
    assert single["a_info"].world_size == 2 and single["a_info"].strategy == "fsdp"
    # RNG states are per rank: not restored at another world size, and said so
    assert single["a_info"].rng_restored is False
    assert any("RNG" in n for n in single["a_info"].notes)


def test_full_state_dict_checkpoint_loads_at_one_and_three_ranks(runs: dict[str, Any]) -> None:
    at_save = W.undump(runs["first"][0]["at_save"])
    single = runs["single"]
    assert single["a_full_info"].state_dict_type == "full"
    assert_state_equal(single["a_full"], at_save)
    assert_state_equal(W.undump(runs["three"][0]["a_full"]), at_save)


def test_two_to_three(runs: dict[str, Any]) -> None:
    at_save = W.undump(runs["first"][0]["at_save"])
    assert_state_equal(W.undump(runs["three"][0]["a"]), at_save)


def test_one_to_two(runs: dict[str, Any]) -> None:
    assert_state_equal(W.undump(runs["second"][0]["from_one"]), runs["single"]["one"])


def test_hsdp_at_four_to_fsdp_at_two_and_to_one(runs: dict[str, Any]) -> None:
    assert runs["four"][0]["strategy"] == "hsdp"
    four = W.undump(runs["four"][0]["full"])
    first = runs["first"][0]
    assert_state_equal(W.undump(first["from_hsdp"]), four)
    assert first["from_hsdp_info"] == (2, 4, "hsdp", False)
    assert first["from_hsdp_lr"] == [0.05]  # StepLR(3) after 2 steps: not yet decayed
    assert_state_equal(runs["single"]["hsdp"], four)


def test_fsdp_to_ddp(runs: dict[str, Any]) -> None:
    at_save = W.undump(runs["first"][0]["at_save"])
    assert_state_equal(W.undump(runs["second"][0]["ddp_from_fsdp"]), at_save)


def test_damaged_files_fail_on_every_rank_and_change_nothing(runs: dict[str, Any]) -> None:
    for r in runs["second"]:
        assert r["error_truncated"].startswith("CheckpointError: __1_0.distcp is truncated")
        assert r["error_flipped"].startswith("CheckpointError: __1_0.distcp does not match")
        assert r["unchanged"] is True
        assert r["error_fresh"].startswith("CheckpointError: __1_0.distcp does not match")
        assert r["fresh_still_fresh"] is True


def test_export_full_is_the_full_model(runs: dict[str, Any]) -> None:
    want = W.undump(runs["first"][0]["uninterrupted"])
    got = runs["export"]
    assert sorted(got) == sorted(want)
    for k, v in want.items():
        assert got[k].dtype == v.dtype and torch.equal(got[k], v), k
    model = W.build()
    model.load_state_dict(got)  # plain torch, strict
    four = W.undump(runs["four"][0]["full"])["model"]  # hsdp at 4 ranks: rank 0's replica writes
    at_save = W.undump(runs["first"][0]["at_save"])["model"]  # loaded at 3 ranks, then exported
    for exported, full in ((runs["export_hsdp"], four), (runs["export_three"], at_save)):
        assert sorted(exported) == sorted(full)
        for k, v in full.items():
            assert torch.equal(exported[k], v), k


def test_progress_lines_are_drawn_on_rank_0_only(runs: dict[str, Any]) -> None:
    zero, one = (r["progress"] for r in runs["second"])
    lines = [line.split("\r")[-1] for line in zero.split("\n") if "fprep: " in line]
    assert [line.split(" [")[0] for line in lines] == [
        "fprep: verify",
        "fprep: load",
        "fprep: save",
    ]
    assert all("[" + "#" * 24 + "]" in line for line in lines), lines
    assert "fprep: " not in one


def test_load_is_transactional_and_agreed_at_two_ranks(tmp_path: Path) -> None:
    """A record only rank 1 cannot take (its RNG state) and one both cannot (a hyperparameter)
    are refused on both ranks before anything changes; a failure on rank 1 alone while applying
    (after every check passed) is raised on both (before: rank 0 returned success)."""
    results = run_ranks(W.two_transactional, 2, str(tmp_path), timeout_s=TIMEOUT_S)
    for r in results:
        assert r["error_rng"].startswith(
            "CheckpointError: the saved RNG state is not valid: the "
            "torch CPU state is refused by torch"
        ), r["error_rng"]
        assert r["error_lr"].startswith("CheckpointError: the checkpoint"), r["error_lr"]
        assert "param group 0 'lr' is 'abc'" in r["error_lr"]
        assert r["unchanged_rng"] is True and r["unchanged_lr"] is True
        assert r["error_apply"].startswith("CheckpointError: loading "), r["error_apply"]
        assert "ValueError: rank 1 does not like this position" in r["error_apply"]


def test_one_failed_load_raises_one_error_on_every_rank(tmp_path: Path) -> None:
    """Each rank raises the first failing rank's error, also when the ranks found the file
    damaged in different ways (it changed between their looks: before, each raised its own)."""
    zero, one = run_ranks(W.two_same_error, 2, str(tmp_path), timeout_s=TIMEOUT_S)
    expected = {
        "flipped": "CheckpointError: __0_0.distcp does not match its blake3 digest",
        "missing": "CheckpointError: __1_0.distcp is missing: ",
        "swapped": "CheckpointError: metadata.json does not match its blake3 digest",
        "removed": "CheckpointError: __1_0.distcp is truncated: ",
    }
    assert {case: zero[case] for case in expected} == {case: one[case] for case in expected}
    for case, start in expected.items():
        assert zero[case].startswith(start), (case, zero[case])
    assert zero["unchanged"] and one["unchanged"]
