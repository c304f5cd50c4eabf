"""fprep.processes on 2 gloo ranks, against Accelerate's own functions.

One spawn of 2 ranks (tests/_processes_workers.py ``two_ranks``) runs every case on a DDP
preparation, calling Accelerate (installed with the test extras) on the same inputs where it has
the same function: ``process_index`` / ``num_processes``, ``split_between_processes`` (uneven
tails, padding), ``pad_across_processes`` (any dim, at the start), ``gather`` and
``gather_for_metrics`` over whole epochs (each sample once, as Accelerate's loader gives them).
What Accelerate cannot do is checked against the inputs themselves: ``gather`` of uneven rows,
inputs that do not fit the other rank's (every rank raises the same ConfigError, nobody waits),
and ``main_process_first`` (the others run after the main process, and are released with its
error when it raises instead of hanging).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import _processes_workers as W
import pytest
import torch
import torch.distributed as dist

from fprep.testing.distributed import run_ranks

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(not (dist.is_available() and dist.is_gloo_available()), reason="needs gloo"),
]
pytest.importorskip("accelerate")

WORLD = 2


@pytest.fixture(scope="module")
def ranks(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    root = tmp_path_factory.mktemp("processes")
    return run_ranks(W.two_ranks, WORLD, str(root), timeout_s=300.0)


def test_index_and_count_are_accelerates(ranks: list[dict[str, Any]]) -> None:
    for rank, out in enumerate(ranks):
        assert out["index"] == (rank, rank)
        assert out["count"] == (WORLD, WORLD)


def test_split_between_processes_is_accelerates(ranks: list[dict[str, Any]]) -> None:
    cases = ranks[0]["split"].keys()
    assert len(cases) == 4 * (2 * len(W.SPLIT_LENGTHS) - 1)
    for out in ranks:
        for case, (ours, theirs) in out["split"].items():
            assert ours == theirs, case


def test_split_parts_make_up_the_inputs(ranks: list[dict[str, Any]]) -> None:
    for n in W.SPLIT_LENGTHS:
        parts = [out["split"][f"list/{n}/False"][0] for out in ranks]
        assert [item for part in parts for item in part] == [f"s{i}" for i in range(n)]
        assert [len(p) for p in parts] == sorted((len(p) for p in parts), reverse=True)


def test_pad_across_processes_is_accelerates(ranks: list[dict[str, Any]]) -> None:
    for out in ranks:
        for case, (ours, theirs) in out["pad"].items():
            if case == "nested":  # Accelerate pads a bool mask into an int64 one; fprep keeps bool
                (mask_dtype, mask_shape, mask), loss = ours["more"]
                (_, their_shape, their_mask), their_loss = theirs["more"]
                assert mask_dtype == "torch.bool" and mask_shape == their_shape
                assert [[int(v) for v in row] for row in mask] == their_mask
                assert loss == their_loss and ours["ids"] == theirs["ids"]
                continue
            assert ours == theirs, case
    longest = max(W.rank_inputs(r)["sequences"].shape[1] for r in range(WORLD))
    assert all(out["pad"]["columns"][0][1] == [2, longest] for out in ranks)


def test_gather_is_accelerates(ranks: list[dict[str, Any]]) -> None:
    for out in ranks:
        for case in ("gather", "gather_many"):
            ours, theirs = out[case]
            assert ours == theirs, case
        assert out["pad_then_gather"][0] == out["pad_then_gather"][1]


def test_gather_keeps_uneven_rows_in_rank_order(ranks: list[dict[str, Any]]) -> None:
    expected = torch.cat([W.rank_inputs(r)["uneven"] for r in range(WORLD)])
    for out in ranks:
        _, shape, values = out["gather_uneven"]
        assert shape == list(expected.shape)
        assert torch.equal(torch.tensor(values), expected)


@pytest.mark.parametrize(
    ("case", "words"),
    [
        ("gather_dtype", ["process 0: 1-d float32", "process 1: 1-d int64"]),
        ("gather_columns", ["[(2, 3), (2, 5)]", "first dimension only", "dim=1"]),
        ("gather_structure", ["different structure on process 1"]),
        ("pad_ndim", ["process 0: 1-d int64", "process 1: 2-d float32"]),
    ],
)
def test_inputs_that_do_not_fit_raise_on_every_rank(
    ranks: list[dict[str, Any]], case: str, words: list[str]
) -> None:
    for out in ranks:
        outcome = out[case]
        assert outcome.get("error") == "ConfigError", outcome
        for word in words:
            assert word in outcome["message"], (word, outcome["message"])
    assert all(out["after_refusals"] == WORLD for out in ranks)


def test_gather_for_metrics_counts_each_sample_once_like_accelerate(
    ranks: list[dict[str, Any]],
) -> None:
    for n, batch in W.EPOCHS:
        for out in ranks:
            epoch = out["epochs"][f"{n}/{batch}"]
            ours, theirs = epoch["ours"], epoch["theirs"]
            assert [len(b) for b in ours] == [len(b) for b in theirs], (n, batch)
            every = [sorted(v for b in batches for v in b) for batches in (ours, theirs)]
            assert every[0] == every[1] == list(range(n))
            # a tuple comes back a tuple, trimmed the same way
            for pair, single in zip(epoch["pairs"], ours, strict=True):
                assert isinstance(pair, tuple)
                assert pair[0][2] == single and pair[1][2] == [10 * v for v in single]


def test_main_process_first_runs_the_main_process_first(ranks: list[dict[str, Any]]) -> None:
    assert [out["first"]["found"] for out in ranks] == [False, True]


def test_main_process_first_releases_the_others_when_the_main_one_raises(
    ranks: list[dict[str, Any]],
) -> None:
    main, other = ranks[0]["first_raises"], ranks[1]["first_raises"]
    assert main == {"raised": "OSError", "message": "disk full while writing the cache", "ran": [0]}
    assert other["raised"] == "CollectiveError" and other["ran"] == []
    assert "OSError: disk full while writing the cache" in other["message"]
    assert all(out["after_first"] == WORLD for out in ranks)  # the group still works


def test_tensor_parallelism_alone_is_one_data_parallel_rank_of_two_processes(
    tmp_path: Path,
) -> None:
    """tp=2 over 2 ranks plans the strategy "none" on a mesh of two processes: both ranks
    read all the data (index 0 of 1), main_process_first still orders them, and once the
    group is ended it says so (a PrepareError) instead of failing inside torch."""
    out = run_ranks(W.tp_alone, WORLD, str(tmp_path), timeout_s=300.0)
    for rank, result in enumerate(out):
        assert result["strategy"] == "none"
        assert tuple(result["position"]) == (0, 1)
        assert result["part"] == list(range(6))
        assert result["in_order"] == {"found": rank != 0}
        assert result["after_end"]["error"] == "PrepareError", result["after_end"]
        assert result["after_end"]["subject"] == "fprep.main_process_first"
