"""Training-loop helpers on real gloo process groups (2 CPU ranks; hsdp at 4).

Each world size is spawned once per module (the fixtures below); its rank function
(tests/_loop_workers.py) runs every case and the tests assert on what the ranks returned.

* optimizers built (and stepped) before ``prepare``, passed to it or to ``prepare_optimizer``,
  train like the single-process reference; their state is sharded like the parameters;
* data loaders: each rank its share, with and without even batches, split batches, seeded
  shuffling, resume, workers, two loaders at once; ``gather_for_metrics`` counts every sample once;
* one training loop per strategy (ddp, fsdp, fast_ddp; fp16 with a forced overflow; hsdp at 4
  ranks) with ``accumulate`` (sync really skipped), ``clip_grad_norm`` (the single-process norm)
  and ``optimizer_step`` with a scheduler (once per real step): the final parameters, norms and
  learning rates equal the big-batch single-process run;
* ``unwrap`` gives plain modules of the original classes, names and full weights.
"""

from __future__ import annotations

import math
import os
import time
from typing import Any

import _loop_workers as W
import pytest
import torch
import torch.distributed as dist

from fprep.data import LoaderSpec, padded_count, rank_indices
from fprep.testing.distributed import run_ranks

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(not (dist.is_available() and dist.is_gloo_available()), reason="needs gloo"),
]

TIMEOUT_S = 240.0


@pytest.fixture(scope="module")
def two() -> list[dict[str, Any]]:
    # Not daemons: the data-loading case starts DataLoader workers inside the ranks.
    return run_ranks(W.two_ranks, 2, timeout_s=TIMEOUT_S, daemon=False)


@pytest.fixture(scope="module")
def four() -> list[dict[str, Any]]:
    return run_ranks(W.four_ranks, 4, timeout_s=TIMEOUT_S)


@pytest.fixture(scope="module")
def sgd_reference() -> dict[str, Any]:
    return W.reference_sgd()


@pytest.fixture(scope="module")
def adamw_reference() -> W.Params:
    return W.reference_adamw()


def max_diff(a: W.Params, b: W.Params) -> float:
    assert sorted(a) == sorted(b), "different parameter names"
    return max((a[k].float() - b[k].float()).abs().max().item() for k in b)


def assert_params(result: dict[str, Any], reference: W.Params, atol: float) -> W.Params:
    params = W.load(result["params"])
    assert sorted(params) == sorted(reference)
    for name, ref in reference.items():
        torch.testing.assert_close(params[name], ref, atol=atol, rtol=atol, msg=name)
    return params


# -- data loaders --------------------------------------------------------------------------------
def spec(rank: int, *, batch_size: int = 2, shuffle: bool = False, seed: int = 5) -> LoaderSpec:
    return LoaderSpec(rank=rank, world=2, batch_size=batch_size, shuffle=shuffle, seed=seed)


def chunks(items: list[int], size: int) -> list[list[int]]:
    return [items[i : i + size] for i in range(0, len(items), size)]


def flat(batches: list[list[int]]) -> list[int]:
    return [i for batch in batches for i in batch]


@pytest.mark.parametrize("case", ["shuffled", "plain", "split", "wide", "workers"])
def test_even_batches_cover_the_dataset_and_gather_counts_each_sample_once(
    case: str, two: list[dict[str, Any]]
) -> None:
    n = 12 if case == "split" else W.N
    epochs = [rank["data"][case] for rank in two]
    runs = list(zip(*epochs, strict=True)) if isinstance(epochs[0], list) else [tuple(epochs)]
    for per_rank in runs:
        local = [r["local"] for r in per_rank]
        assert set(flat(local[0])) | set(flat(local[1])) == set(range(n))  # the union
        assert len(local[0]) == len(local[1])  # even batches: the same number on every rank
        assert [len(b) for b in local[0]] == [len(b) for b in local[1]]
        repeated = len(flat(local[0])) + len(flat(local[1])) - n
        assert repeated == padded_count(n, spec(0)) == (2 - n % 2) % 2
        gathered = [r["gathered"] for r in per_rank]
        assert gathered[0] == gathered[1]  # every rank sees the same metrics
        assert sorted(gathered[0]) == list(range(n))  # each sample exactly once


def test_gather_spans_the_data_parallel_ranks_not_the_world(four: list[dict[str, Any]]) -> None:
    hsdp = [rank["gather"]["hsdp"]["gathered"] for rank in four]
    assert all(g == hsdp[0] for g in hsdp) and sorted(hsdp[0]) == list(range(W.N))
    local = [sorted(i for batch in rank["gather"]["hsdp"]["local"] for i in batch) for rank in four]
    assert sorted(set().union(*map(set, local))) == list(range(W.N))  # 4 shares of one epoch
    pairs = [rank["gather"]["pair"]["gathered"] for rank in four]
    assert pairs[0] == pairs[1] and pairs[2] == pairs[3]
    for gathered in pairs:  # each pair read the whole dataset: gathered once, not twice
        assert sorted(gathered) == list(range(W.N))


def test_even_batches_off_repeats_nothing(two: list[dict[str, Any]]) -> None:
    for case, n, batches in [("uneven", W.N, [3, 3]), ("uneven_short", 9, [3, 2])]:
        local = [rank["data"][case]["local"] for rank in two]
        assert [len(b) for b in local] == batches  # ranks may differ by a batch
        assert sorted(flat(local[0]) + flat(local[1])) == list(range(n))
    gathered = [rank["data"]["uneven"]["gathered"] for rank in two]
    assert gathered[0] == gathered[1] and sorted(gathered[0]) == list(range(W.N))


def test_split_batches_gives_each_rank_its_part_of_the_global_batch(
    two: list[dict[str, Any]],
) -> None:
    for r, rank in enumerate(two):
        local = rank["data"]["split"]["local"]
        assert local == chunks(rank_indices(12, spec(r), 0), 2)  # global batch 4 = 2 x 2
        assert [len(b) for b in local] == [2, 2, 2]


def test_shuffling_is_seeded_and_the_epoch_advances_by_itself(two: list[dict[str, Any]]) -> None:
    for r, rank in enumerate(two):
        data = rank["data"]
        for e, result in enumerate(data["shuffled"]):
            assert result["local"] == chunks(rank_indices(W.N, spec(r, shuffle=True), e), 2)
            assert result["epoch_after"] == e + 1
        assert data["shuffled"][0]["local"] != data["shuffled"][1]["local"]
        # Workers do not change what a rank reads, nor its order.
        assert [x["local"] for x in data["workers"]] == [x["local"] for x in data["shuffled"]]
        assert data["types"] == ["PreparedDataLoader", "SGD", "PreparedDataLoader"]
        assert data["optimizer_is_same"] is True


def test_two_prepared_loaders_coexist(two: list[dict[str, Any]]) -> None:
    for r, rank in enumerate(two):
        data = rank["data"]
        # a was paused after one batch while b ran a whole epoch; neither noticed the other
        assert data["coexist_a"] == data["shuffled"][0]["local"]
        assert data["coexist_b"]["local"] == chunks(rank_indices(W.N, spec(r, seed=9), 0), 3)
        assert sorted(data["coexist_b"]["gathered"]) == list(range(W.N))


def test_resume_mid_epoch_reads_only_what_is_left(two: list[dict[str, Any]]) -> None:
    for r, rank in enumerate(two):
        data = rank["data"]
        assert data["resume_position"] == {"epoch": 1, "batches": 1}
        expected = chunks(rank_indices(W.N, spec(r, shuffle=True), 1), 2)[1:]
        assert data["resumed"] == expected
        assert data["resume_reads"] == flat(expected)  # the skipped batch was never read
        assert data["resumed_epoch_after"] == 2


# -- one loop per strategy: accumulate, clip_grad_norm, optimizer_step + scheduler ---------------
FP32_LOOPS = ["ddp", "fsdp", "fast_ddp"]
FP16_LOOPS = ["ddp_fp16", "fsdp_fp16"]


@pytest.mark.parametrize("case", [*FP32_LOOPS, "hsdp"])
def test_the_loop_equals_the_big_batch_single_process_run(
    case: str, request: pytest.FixtureRequest, sgd_reference: dict[str, Any]
) -> None:
    ranks = [
        rank["loops"][case] for rank in request.getfixturevalue("four" if case == "hsdp" else "two")
    ]
    for result in ranks:
        assert_params(result, sgd_reference["params"], atol=1e-5)
        # clip_grad_norm returns the single-process norm of the full gradient on every rank
        assert result["norms"] == pytest.approx(sgd_reference["norms"], rel=1e-5)
        assert all(norm > W.CLIP for norm in result["norms"])  # so clipping really scaled
        # the scheduler stepped once per optimizer step: the single-process curve
        assert result["lrs"] == pytest.approx(sgd_reference["lrs"], rel=1e-12)
        assert result["stepped"] == [True] * W.STEPS
        assert result["scheduler_steps"] == W.STEPS


def test_clipping_changed_the_result(sgd_reference: dict[str, Any]) -> None:
    """Sanity of the reference: without clipping the parameters would be different."""
    model = W.build_sgd_model()
    opt = W.make_sgd(model)
    sched = W.scheduler(opt)
    for x, y in W.global_batches():
        W.lm_loss(model(x), y).backward()
        opt.step()
        sched.step()
        opt.zero_grad()
    assert max_diff(dict(model.state_dict()), sgd_reference["params"]) > 1e-3


@pytest.mark.parametrize("case", [*FP32_LOOPS, *FP16_LOOPS, "hsdp"])
def test_accumulate_really_skips_gradient_sync(case: str, request: pytest.FixtureRequest) -> None:
    ranks = [
        rank["loops"][case] for rank in request.getfixturevalue("four" if case == "hsdp" else "two")
    ]
    strategy = W.LOOP_CASES.get(case, W.HSDP_LOOP_CASES.get(case, ("", "")))[0]
    for result in ranks:
        micro = result["micro"]
        assert len(micro) == W.STEPS * W.MICRO
        for seen in micro:
            synced = seen["ddp_buckets"] + seen["all_reduce"] + seen["reduce_scatter"]
            if not seen["last"]:
                assert synced == 0, seen  # no collective at all while accumulating
                if strategy in ("fsdp", "hsdp"):
                    assert seen["grads_none"] is True  # nothing reduce-scattered yet
                else:
                    assert seen["grads_differ"] is True  # local gradients, not averaged
                continue
            if strategy == "ddp":
                # one all-reduce per bucket, from the (counting) comm hook
                assert seen["ddp_buckets"] >= 1 and seen["all_reduce"] == seen["ddp_buckets"]
            elif strategy == "fast_ddp":
                assert seen["all_reduce"] == 1  # one fused all-reduce, after the last micro-step
            elif strategy == "fsdp":
                assert seen["reduce_scatter"] >= 1
            elif strategy == "hsdp":
                assert seen["reduce_scatter"] >= 1 and seen["all_reduce"] >= 1
            if strategy in ("ddp", "fast_ddp") and case not in FP16_LOOPS:
                assert seen["grads_differ"] is False  # averaged: identical on every rank


@pytest.mark.parametrize("case", FP16_LOOPS)
def test_fp16_overflow_skips_the_step_and_the_scheduler(
    case: str, two: list[dict[str, Any]]
) -> None:
    """Rank 0's loss is multiplied by 1e30 in one micro-step of step 1: every rank skips that
    optimizer step and leaves the scheduler alone, exactly as one process does."""
    single = W.single_process_loop("fp16")
    skipped = W.reference_sgd(skip=(W.OVERFLOW_STEP,))
    expected = [k != W.OVERFLOW_STEP for k in range(W.STEPS)]
    assert single["stepped"] == expected
    for result in (rank["loops"][case] for rank in two):
        assert result["stepped"] == expected
        assert result["scheduler_steps"] == W.STEPS - 1
        assert result["lrs"] == single["lrs"] == pytest.approx(skipped["lrs"], rel=1e-12)
        norms = result["norms"]
        assert not math.isfinite(norms[W.OVERFLOW_STEP])
        for k in (0, 2):  # unscaled (optimizer=) before measuring: the fp32 norm, roughly
            assert norms[k] == pytest.approx(skipped["norms"][k], rel=2e-2)
        assert_params(result, skipped["params"], atol=5e-3)


def test_lr_curve_of_two_ranks_equals_one_process(
    two: list[dict[str, Any]], sgd_reference: dict[str, Any]
) -> None:
    single = W.single_process_loop("no")
    for case in FP32_LOOPS:
        for rank in two:
            assert rank["loops"][case]["lrs"] == single["lrs"]
    assert single["lrs"] == pytest.approx(sgd_reference["lrs"], rel=1e-12)
    assert single["norms"] == pytest.approx(sgd_reference["norms"], rel=1e-5)


# -- optimizers ----------------------------------------------------------------------------------
@pytest.mark.parametrize("case", [*W.OPTIMIZER_CASES, *W.HSDP_OPTIMIZER_CASES])
def test_optimizers_built_before_prepare_train_like_the_reference(
    case: str, request: pytest.FixtureRequest, adamw_reference: W.Params
) -> None:
    hsdp = case in W.HSDP_OPTIMIZER_CASES
    ranks = [
        rank["optimizers"][case] for rank in request.getfixturevalue("four" if hsdp else "two")
    ]
    strategy, _build, stepped, via = {**W.OPTIMIZER_CASES, **W.HSDP_OPTIMIZER_CASES}[case]
    for result in ranks:
        if via != "after":
            assert result["returned_in_order"] is True  # the same objects, in input order
        assert result["bound_to_model"] is True  # every param group points at the model
        assert result["hyperparameters_kept"] is True  # lr, weight decay, betas, extra keys
        assert result["state_layout"] == []  # exp_avg / exp_avg_sq sharded like the params
        if stepped:
            assert result["state_entries"] == ["exp_avg", "exp_avg_sq", "step"]
            assert result["state_count"] == len(adamw_reference) - 1  # lm_head is tied to wte
        if strategy in ("fsdp", "hsdp"):
            assert result["sharded_params"] > 0
        assert_params(result, adamw_reference, atol=1e-5)


def test_an_optimizer_made_before_prepare_trains_exactly_like_one_made_after(
    two: list[dict[str, Any]],
) -> None:
    for rank in two:
        before = W.load(rank["optimizers"]["fsdp/fresh/passed"]["params"])
        after = W.load(rank["optimizers"]["fsdp/fresh/built_after"]["params"])
        assert max_diff(before, after) == 0.0


# -- unwrap --------------------------------------------------------------------------------------
def _unwrap_results(two: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    out = {}
    for r, rank in enumerate(two):
        for name, result in rank["unwrap"].items():
            out[f"rank{r}/{name}"] = result
        for name, result in rank["optimizers"].items():
            out[f"rank{r}/{name}"] = result["unwrap"]
    return out


ORIGINAL_CLASSES = {
    "GPT",
    "GPTBlock",
    "CausalSelfAttention",
    "MLP",
    "Linear",
    "LayerNorm",
    "Embedding",
    "ModuleList",
    "GELU",
    "Dropout",
}


def test_unwrap_gives_plain_modules_of_the_original_classes(two: list[dict[str, Any]]) -> None:
    sgd_keys = list(W.build_sgd_model().state_dict())
    adamw_keys = list(W.build_adamw_model().state_dict())
    wrapped_keys = list(W.build_wrapped_adamw_model().state_dict())
    for name, facts in _unwrap_results(two).items():
        ddp = name.endswith("/ddp") or "/ddp/" in name
        assert facts["is_ddp_module"] is ddp, name
        assert facts["fsdp_modules"] == 0 and facts["fsdp_state"] == 0, name
        assert not [o for o in facts["hook_owners"] if o.startswith("torch.distributed.fsdp")]
        assert not [o for o in facts["hook_owners"] if "_composable" in o], name
        assert facts["dtensors"] == 0, name  # full parameters
        assert facts["tied"] is True, name  # lm_head.weight is wte.weight
        assert facts["values_equal"] is True, name  # the trained weights, gathered
        assert facts["collectives_in_forward"] == 0, name  # evaluating needs no other rank
        assert facts["checkpointed"] == 0, name  # a copy has no activation checkpointing
        # DDP's .module is the trained module itself; an FSDP copy never runs the original
        assert (facts["prepared_model_ran"] > 0) is ddp, name
        assert facts["forward_max_diff"] <= 1e-6, name
        classes = set(facts["classes"])
        if "wrapped" in name:
            assert facts["keys"] == wrapped_keys, name  # the original model's keys
            assert classes - ORIGINAL_CLASSES == {"OptimizedModule", "CheckpointWrapper"}, name
        else:
            expected = adamw_keys if "/fresh/" in name or "stepped" in name else sgd_keys
            assert facts["keys"] == expected, name
            assert classes <= ORIGINAL_CLASSES, name


def test_unwrap_after_a_forward_that_kept_parameters_unsharded(two: list[dict[str, Any]]) -> None:
    """sharding="grad_op" leaves plain (unsharded) parameters between forward and backward:
    unwrap still returns a copy, not the FSDP module."""
    for rank in two:
        facts = rank["unwrap"]["fsdp/grad_op_after_forward"]
        assert facts["fsdp_modules"] == 0 and facts["is_ddp_module"] is False


# -- run_ranks(daemon=False) ---------------------------------------------------------------------
def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/status") as f:
            state = next(line for line in f if line.startswith("State:"))
    except (FileNotFoundError, ProcessLookupError, StopIteration):
        return False
    return "Z" not in state.split()[1]  # a zombie has exited


@pytest.mark.skipif(not os.path.isdir("/proc"), reason="reads /proc")
def test_non_daemon_ranks_and_their_workers_are_killed_on_failure(tmp_path: Any) -> None:
    from fprep.testing.distributed import RankError

    pid_file = tmp_path / "pids"
    start = time.monotonic()
    with pytest.raises(RankError, match="rank 1 gives up"):
        run_ranks(W.misbehave_with_workers, 2, str(pid_file), timeout_s=120, daemon=False)
    assert time.monotonic() - start < 60  # promptly, not after the timeout
    pids = [int(p) for p in pid_file.read_text().split()]
    assert len(pids) == 3  # rank 0 and its two DataLoader workers
    # Workers notice their parent is gone at their next status check (every 5 s when idle);
    # a generous bound, since a loaded machine may not schedule them for a while.
    deadline = time.monotonic() + 120
    while any(map(_alive, pids)) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not [p for p in pids if _alive(p)]
