"""No fprep collective hangs without a word (real gloo process groups, ``timeout_s`` = 3 s).

A collective called on some ranks only, a launch whose peers never come, ranks that plan
differently and a rank killed mid-save each end in a ``PrepError`` on every rank still alive,
naming the call and the ranks, within ``timeout_s`` plus a margin; nothing is left waiting.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import _collective_workers as W
import pytest
import torch
import torch.distributed as dist

import fprep
from fprep.collectives import FIRST_CONTACT_S, PROBE_S, collective, exchange
from fprep.errors import CollectiveError, TopologyError

pytestmark = [
    pytest.mark.slow,
    pytest.mark.timeout(120),
    pytest.mark.skipif(not (dist.is_available() and dist.is_gloo_available()), reason="needs gloo"),
]

#: Slack beyond the time an error is designed to take: a bound on a hang (spawn gives up at
#: 90 s), not a measurement, so generous enough for two cores shared with other jobs.
MARGIN_S = 30.0


def _failed(out: Any, cls: str = "CollectiveError") -> dict[str, Any]:
    assert isinstance(out, dict), out  # a string is a traceback or an exit code
    assert out["error"] == cls, out
    return out


def test_save_on_rank_0_only_names_rank_1_and_leaves_no_temp_dir(tmp_path: Path) -> None:
    results = W.spawn(W.save_on_rank0_only, 2, str(tmp_path))
    assert results[1] == {"error": None}  # alive, not calling: it just finishes
    out = _failed(results[0])
    assert (
        "fprep.save is collective: call it on every rank; ranks [1] did not arrive"
        in (out["message"])
    )
    assert out["subject"] == "fprep.save"
    assert W.TIMEOUT_S <= out["seconds"] < W.TIMEOUT_S + MARGIN_S
    assert out["left"] == []  # no .tmp-* directory


def test_unwrap_on_rank_0_only_names_rank_1() -> None:
    results = W.spawn(W.unwrap_on_rank0_only, 2)
    assert results[1] == {"error": None}
    out = _failed(results[0])
    assert "fprep.unwrap is collective" in out["message"]
    assert "ranks [1] did not arrive within 3 s" in out["message"]
    assert W.TIMEOUT_S <= out["seconds"] < W.TIMEOUT_S + MARGIN_S


def test_ranks_in_different_calls_name_each_other_at_once(tmp_path: Path) -> None:
    results = W.spawn(W.calls_differ, 2, str(tmp_path))
    save, unwrap = _failed(results[0]), _failed(results[1])
    assert (
        "ranks [1] arrived at another call instead (rank 1 called fprep.unwrap)"
        in (save["message"])
    )
    assert (
        "ranks [0] arrived at another call instead (rank 0 called fprep.save)"
        in (unwrap["message"])
    )
    assert max(save["seconds"], unwrap["seconds"]) < 30  # timeout_s is 60: no waiting for it


def test_launch_without_peer_fails_at_first_contact() -> None:
    """WORLD_SIZE=2 but only rank 0 runs: named within min(timeout_s, FIRST_CONTACT_S)."""
    out = _failed(W.spawn(W.prepare_without_peer, 2, ranks=[0])[0])
    assert "ranks [1] did not join at 127.0.0.1:" in out["message"]
    assert W.TIMEOUT_S <= out["seconds"] < W.TIMEOUT_S + MARGIN_S


def test_launch_without_rank_0_names_its_store() -> None:
    """Only rank 1 runs: it cannot reach rank 0's store (the client retries once: 2 x limit)."""
    out = _failed(W.spawn(W.prepare_without_peer, 2, ranks=[1])[1])
    assert "rank 1 could not reach rank 0's store at 127.0.0.1:" in out["message"]
    assert out["cause"] == "DistNetworkError"
    assert out["seconds"] < 2 * W.TIMEOUT_S + MARGIN_S


def test_plans_that_differ_fail_alike_on_every_rank_before_any_effect(tmp_path: Path) -> None:
    """One launch, three prepares: rank 1's plan fails alone; then every plan fails alike;
    then all succeed (a failed agreement leaves the launch usable), and save, load and unwrap
    on every rank pass the guards without waiting for a timeout (counted, not timed)."""
    results = W.spawn(W.plans_differ_then_alike_then_succeed, 2, str(tmp_path))
    assert all(isinstance(results[r], dict) for r in (0, 1)), results
    differ = [_failed(results[r]["differ"], "ModelError") for r in (0, 1)]
    assert differ[0]["message"] == differ[1]["message"]
    assert differ[0]["subject"] == differ[1]["subject"] == "leaf"
    assert differ[0]["message"].startswith("planning failed on rank 1: module 'leaf' (Leaf)")
    assert all(o["unchanged"] and not o["group_created"] for o in differ)  # no effect at all
    assert differ[1]["cause"] == "ModelError"  # rank 1's own error, chained

    alike = [_failed(results[r]["alike"], "IgnoredStateError") for r in (0, 1)]
    assert alike[0]["message"] == alike[1]["message"]
    assert alike[0]["message"].startswith("ignored_modules entry 'nope' is not a module")

    for r in (0, 1):
        assert results[r]["group_created"]
        ok = results[r]["ok"]
        assert ok["error"] is None, ok
        # prepare's plan agreement and the arrivals of save, load and unwrap: every wait met
        # every rank, none ran out, and no probe for a lost rank ran
        assert ok["slow_paths"]["waits"] >= 4, ok
        assert ok["slow_paths"]["ran_out"] == ok["slow_paths"]["probes"] == 0, ok


@pytest.mark.parametrize("victim", [1, 0])
def test_rank_killed_mid_save_is_named_on_the_survivor(tmp_path: Path, victim: int) -> None:
    results = W.spawn(W.killed_mid_save, 2, str(tmp_path), victim)
    assert results[victim] == "exit -9"
    out = _failed(results[1 - victim])
    assert out["message"].startswith(
        f"fprep.save failed in a collective: ranks [{victim}] did not answer"
    )
    assert out["cause"] == "RuntimeError"  # gloo's error, chained
    assert out["seconds"] < min(W.TIMEOUT_S, PROBE_S) + MARGIN_S
    if victim == 1:
        assert out["left"] == []  # rank 0 removed the .tmp-* directory


def test_rank_lost_before_a_per_batch_gather_is_named() -> None:
    """gather_for_metrics runs every batch, so it skips the arrival check; a lost peer is still
    named (after the failure, by the ranks' probe)."""
    results = W.spawn(W.killed_before_gather, 2)
    assert results[1] == "exit -9"
    out = _failed(results[0])
    assert out["message"].startswith(
        "fprep.gather_for_metrics failed in a collective: ranks [1] did not answer"
    )
    assert out["seconds"] < min(W.TIMEOUT_S, PROBE_S) + MARGIN_S


@pytest.mark.timeout(400)
@pytest.mark.parametrize("victim", [3, 0])
def test_a_rank_lost_under_a_2d_mesh_is_named_by_every_survivor(victim: int) -> None:
    """dp 2 x tp 2, one rank killed before the backward. Rank 3: its dp and tp peers (1, 2)
    fail at once, rank 0 only when one of them gives up (its collectives wait for ranks 1 and
    2, both alive). Rank 0: the store's host, so the probe itself meets the dead rank (bounded:
    the store is gone with it). Each survivor probes the whole job, not the group its
    collective failed in: every one names the victim, and none names a live rank (a rank
    blocked in a collective still beats)."""
    survivors = [r for r in range(4) if r != victim]
    results = W.spawn(W.lost_under_a_mesh, 4, victim, timeout_s=300)
    assert results[victim] == "exit -9", results
    for rank in survivors:
        out = _failed(results[rank])
        named = re.search(r"ranks (\[[\d, ]*\]) did not answer", out["message"])
        assert named is not None, (rank, out["message"])
        assert json.loads(named.group(1)) == [victim], (rank, out["message"])
        assert out["message"].startswith("fprep.backward failed in a collective"), out


# -- single process: the guard is free when nobody else takes part ----------------------------
def test_single_process_runs_the_block_as_it_is() -> None:
    assert not dist.is_initialized()
    with pytest.raises(ValueError, match="mine"), collective("fprep.test", 0.1):
        raise ValueError("mine")  # not a collective failure: passed through unchanged


def test_exchange_times_out_naming_missing_ranks() -> None:
    store = dist.HashStore()
    with pytest.raises(CollectiveError, match=r"ranks \[1, 2\] did not arrive within 0.2 s"):
        exchange("fprep.test", store, "t", 0, [0, 1, 2], {"ok": True}, 0.2)
    store.set("fprep/u/x/1", json.dumps("b"))
    assert exchange("fprep.test", store, "u", 0, [0, 1], "a", 1.0) == ["a", "b"]


def test_first_contact_limit_is_documented() -> None:
    text = Path(__file__).parents[1].joinpath("docs", "training.md").read_text()
    assert f"{FIRST_CONTACT_S:g} s" in text


def test_bad_master_port_is_named_before_any_effect(monkeypatch: pytest.MonkeyPatch) -> None:
    env = {"WORLD_SIZE": "2", "RANK": "0", "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "2"}
    for name, value in {**env, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "notaport"}.items():
        monkeypatch.setenv(name, value)
    model = W.Net()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(TopologyError, match="MASTER_PORT='notaport' is not a port") as info:
        fprep.prepare(model, fprep.PrepConfig(strategy="ddp", timeout_s=1))
    assert info.value.subject == "MASTER_PORT"
    assert not dist.is_initialized()
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
