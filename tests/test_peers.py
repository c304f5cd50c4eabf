"""Peers that are gone, ended or frozen are named within a bound, and a finished job exits 0.

Real gloo ranks. Each case is deterministic: the waiting rank waits for an event (a status the
peer wrote, a store that stopped answering), never for a lucky schedule; the bounds asserted are
generous, and far below what the same case took before (``timeout_s`` = 120 s, or without end).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import _collective_workers as W
import pytest
import torch.distributed as dist

from fprep.collectives import PROBE_GRACE_S, PROBE_S, STORE_GRACE_S
from fprep.config import PrepConfig
from fprep.peers import StoreSilent, bounded

pytestmark = [
    pytest.mark.slow,
    pytest.mark.timeout(180),
    pytest.mark.skipif(not (dist.is_available() and dist.is_gloo_available()), reason="needs gloo"),
]

#: Slack on two shared cores: the bounds stop a hang (these cases took 120 s, or had no end),
#: they do not measure speed.
MARGIN_S = 30.0


def _failed(out: Any) -> dict[str, Any]:
    assert isinstance(out, dict), out
    assert out["error"] == "CollectiveError", out
    return out


def test_save_names_a_peer_that_exited_at_once(tmp_path: Path) -> None:
    results = W.spawn(W.save_after_peer_exits, 2, str(tmp_path), exit_normally=True)
    assert results[1] == {"result": {"error": None}, "exitcode": 0}
    out = _failed(results[0]["result"])
    assert "fprep.save is collective: call it on every rank; rank 1 has exited" in out["message"]
    assert out["seconds"] < 30  # timeout_s is 120


def test_save_names_a_peer_in_end_training_at_once(tmp_path: Path) -> None:
    results = W.spawn(W.save_after_peer_ended, 2, str(tmp_path))
    assert results[1] == {"ended": False}
    out = _failed(results[0])
    assert "rank 1 has already called fprep.end_training" in out["message"]
    assert out["seconds"] < 30  # timeout_s is 120


@pytest.mark.parametrize("where", ["prepare", "save"])
def test_a_frozen_store_host_is_named_within_the_bound(tmp_path: Path, where: str) -> None:
    """Rank 0 hosts the store and stops (SIGSTOP): rank 1's waits all end. In prepare it is
    waiting to arrive (timeout_s + STORE_GRACE_S); in save a collective times out (timeout_s)
    and the probe ends within min(timeout_s, PROBE_S) + PROBE_GRACE_S."""
    results = W.spawn(W.store_host_frozen, 2, str(tmp_path), where, wait_for=[1], timeout_s=100)
    assert results[0] == "killed by the test"  # still stopped
    out = _failed(results[1])
    if where == "prepare":
        assert (
            "the job's store (hosted by rank 0, or by the launcher) does not answer"
            in (out["message"])
        )
        bound = W.TIMEOUT_S + STORE_GRACE_S
    else:
        assert out["message"].startswith("fprep.save failed in a collective: ranks [0]")
        bound = W.TIMEOUT_S + min(W.TIMEOUT_S, PROBE_S) + PROBE_GRACE_S
    assert out["seconds"] < bound + MARGIN_S


def test_bounded_gives_up_on_work_that_does_not_end() -> None:
    import threading

    never = threading.Event()
    with pytest.raises(StoreSilent, match=r"did not answer within 0\.05 s"):
        bounded(never.wait, 0.05)
    never.set()
    assert bounded(lambda: 7, 1.0) == 7
    with pytest.raises(KeyError):
        bounded(lambda: {}["x"], 1.0)


def test_default_timeout_is_nccls() -> None:
    assert PrepConfig().timeout_s == 600.0
    text = Path(__file__).parents[1].joinpath("docs", "training.md").read_text()
    assert "timeout_s=600" in text


def test_a_finished_job_exits_0_every_time() -> None:
    """prepare (meta GPT, fsdp, bf16), barriers, end_training, then the process ends: every
    rank exits 0, and no backend thread holds a barrier's token when fprep lets it go (the
    thread would free it at interpreter shutdown: ``terminate called without an active
    exception``)."""
    for _ in range(2):
        results = W.spawn(W.prepare_and_end, 2, 20, exit_normally=True)
        for r in (0, 1):
            assert results[r]["exitcode"] == 0, results
            out = results[r]["result"]
            assert out["ended"] is True
            assert len(out["leftover"]) >= 22 and set(out["leftover"]) == {0}, out
