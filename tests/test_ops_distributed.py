"""The ranks helpers, the optimizer guard, 0-d gathers and iterable resume on 2 gloo ranks.

One spawn of 2 ranks (tests/_ops_workers.py ``two_ranks``) runs every case; the tests compare
what the ranks returned with the same computation done in this one process:

* ``reduce`` (sum / mean / max / min of tensors, ints, bools and numbers) over DDP's group and
  FSDP's mesh; ``wait_for_everyone`` waits for the late rank; ``print_once`` prints on rank 0;
  ``set_seed`` with and without the per-rank offset; ``end_training`` ends the group prepare
  made, and a second ``prepare`` in the same process makes a new one;
* an optimizer built before an fsdp ``prepare`` and not passed to it is refused (issue 12.1);
* ``gather_for_metrics`` of a 0-d loss (issue 12.8);
* a prepared loader over an iterable dataset resumes where it stopped (issue 12.4).
"""

from __future__ import annotations

import math
from typing import Any

import _ops_workers as W
import pytest
import torch
import torch.distributed as dist

import fprep
from fprep.testing.distributed import run_ranks

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(not (dist.is_available() and dist.is_gloo_available()), reason="needs gloo"),
]

WORLD = 2


@pytest.fixture(scope="module")
def two() -> list[dict[str, Any]]:
    # Not daemons: the resume cases start DataLoader workers inside the ranks.
    return run_ranks(W.two_ranks, WORLD, timeout_s=240.0, daemon=False)


def reference(name: str, op: str) -> Any:
    """The reduction of every rank's value, computed here."""
    values = [W.rank_values(r)[name] for r in range(WORLD)]
    if not isinstance(values[0], torch.Tensor):
        total = {"sum": sum, "max": max, "min": min}.get(op)
        return total(values) if total else sum(values) / WORLD
    stacked = torch.stack(values)
    if stacked.dtype == torch.bool:
        stacked = stacked.long() if op in ("sum", "mean") else stacked
    if op == "sum":
        return stacked.sum(0)
    if op == "mean":
        return stacked.sum(0) / WORLD
    return stacked.amax(0) if op == "max" else stacked.amin(0)


@pytest.mark.parametrize("case", ["reduce", "reduce_fsdp"])
@pytest.mark.parametrize("name", ["float", "int", "bool", "number", "count"])
@pytest.mark.parametrize("op", ["sum", "mean", "max", "min"])
def test_reduce_equals_the_single_process_reduction(
    two: list[dict[str, Any]], case: str, name: str, op: str
) -> None:
    expected = reference(name, op)
    for rank in two:
        got = W.unplain(rank[case][f"{name}/{op}"])
        if isinstance(expected, torch.Tensor):
            assert isinstance(got, torch.Tensor) and got.dtype == expected.dtype
            torch.testing.assert_close(got, expected)
        else:
            assert not isinstance(got, torch.Tensor) and math.isclose(got, expected)
            assert type(got) is type(expected)
        assert rank[case]["input_unchanged"]


def test_mean_of_the_ranks_losses_is_the_whole_batch_loss(two: list[dict[str, Any]]) -> None:
    ref = W.reference_losses(WORLD)
    for case in ("loss", "loss_fsdp"):
        for rank in two:
            assert math.isclose(rank[case]["mean"], ref["full"], rel_tol=1e-6)


def test_gather_of_a_0d_loss_is_one_entry_per_rank(two: list[dict[str, Any]]) -> None:
    ref = W.reference_losses(WORLD)["per_rank"]
    for case in ("loss", "loss_fsdp"):
        for rank in two:
            result = rank[case]
            assert result["shape"] == [WORLD]
            torch.testing.assert_close(torch.tensor(result["gathered"]), torch.tensor(ref))
            # a loss is per rank, not per sample: even batches' trimming does not apply to it
            torch.testing.assert_close(
                torch.tensor(result["gathered_with_loader"]), torch.tensor(ref)
            )
            assert sorted(result["samples"]) == list(range(5))  # ... while samples are trimmed


def test_wait_for_everyone_waits_for_the_late_rank(two: list[dict[str, Any]]) -> None:
    late = two[1]["barrier"]["arrived"]
    assert late - two[0]["barrier"]["arrived"] > 0.3  # rank 1 really arrived late
    assert all(rank["barrier"]["left"] >= late for rank in two)


def test_print_once_prints_on_the_main_process_only(two: list[dict[str, Any]]) -> None:
    assert [rank["printed"] for rank in two] == ["loss=1.5\n", ""]
    assert [rank["main"] for rank in two] == [True, False]


def test_set_seed_is_the_same_on_every_rank_unless_per_rank(two: list[dict[str, Any]]) -> None:
    assert [rank["seeded"] for rank in two] == [W.seeded_draws(7)] * WORLD
    for r, rank in enumerate(two):
        used, drawn = rank["seeded_per_rank"]
        assert used == 7 + r and drawn == W.seeded_draws(7 + r)


def test_an_optimizer_from_before_an_fsdp_prepare_is_refused(two: list[dict[str, Any]]) -> None:
    for rank in two:
        result = rank["guard_fsdp"]
        for call in ("optimizer_step", "clip_grad_norm"):
            refused = result[call]
            assert refused is not None, f"{call} stepped an optimizer of replaced parameters"
            assert call in refused["message"] and "prepare_optimizer" in refused["message"]
            assert refused["subject"].startswith("optimizer[0].param_groups[0].params[")
        assert result["stepped"] and all(result["changed"].values())  # rebound, it trains
    assert two[0]["guard_fsdp"]["after"] == two[1]["guard_fsdp"]["after"]


@pytest.mark.parametrize("case", ["plain", "workers", "persistent"])
def test_an_iterable_loader_resumes_where_it_stopped(two: list[dict[str, Any]], case: str) -> None:
    for rank in two:
        result = rank["resume"][case]
        consumed = len(result["head"])
        assert result["epoch0"] == result["epoch1"]  # an iterable has one order
        assert result["head"] == result["epoch0"][:consumed]
        assert result["position"] == {"epoch": 0, "batches": consumed}
        assert result["rest"] == result["epoch0"][consumed:]  # not batch 0 again
        assert result["next_epoch"] == result["epoch0"]  # the skip held for one pass
        assert result["epoch_after"] == 2
    union = {i for rank in two for batch in rank["resume"][case]["epoch0"] for i in batch}
    assert union == set(range(11))


def test_end_training_ends_the_group_and_a_second_prepare_works(
    two: list[dict[str, Any]],
) -> None:
    for rank in two:
        end = rank["end"]
        assert end["ended"] and not end["initialized_after"]
        assert end["reduce_after"] is not None and "no longer exists" in end["reduce_after"]
        assert end["ended_again"] is False
        assert end["second_sum"] == sum(r + 1 for r in range(WORLD))
        assert end["old_state_ends_new_group"] is False and end["still_initialized"]
        assert end["second_ended"] is True


def test_the_helpers_are_exported() -> None:
    for name in ("reduce", "wait_for_everyone", "print_once", "set_seed", "end_training"):
        assert callable(getattr(fprep, name)) and name in fprep.__all__
