"""``fprep.prepare`` on real gloo process groups (2, 3 and 4 CPU ranks).

Spawning ranks costs seconds, so each world size is spawned once per module (the fixtures
below) and its rank function (tests/_prepare_workers.py) runs many cases; the tests then assert
on what the ranks returned. Several models are prepared in the same process and the fp32 ones
are trained interleaved, step by step: two preparations in one process must not interfere.

Numerics: each rank trains on its slice of a global batch; the full parameters after three
steps must equal a single-process, full-batch run of the same model (plain PyTorch) to 1e-5
in fp32. Lower precision and compressed communication are checked with loose tolerances, and
checked to differ from the exact result (so that they really ran).
"""

from __future__ import annotations

from typing import Any

import _prepare_workers as W
import pytest
import torch
import torch.distributed as dist

from fprep.testing.distributed import run_ranks
from fprep.testing.models import tiny_gpt

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(not (dist.is_available() and dist.is_gloo_available()), reason="needs gloo"),
]

TIMEOUT_S = 240.0


@pytest.fixture(scope="module")
def two() -> list[dict[str, Any]]:
    return run_ranks(W.two_ranks, 2, timeout_s=TIMEOUT_S)


@pytest.fixture(scope="module")
def three() -> list[dict[str, Any]]:
    return run_ranks(W.three_ranks, 3, timeout_s=TIMEOUT_S)


@pytest.fixture(scope="module")
def four() -> list[dict[str, Any]]:
    return run_ranks(W.four_ranks, 4, timeout_s=TIMEOUT_S)


@pytest.fixture(scope="module")
def references() -> dict[str, W.Params]:
    return {name: W.reference(name) for name in W.MODEL_CONFIGS}


def max_diff(a: W.Params, b: W.Params) -> float:
    assert sorted(a) == sorted(b), "different parameter names"
    return max((a[k].float() - b[k].float()).abs().max().item() for k in b)


def assert_matches(result: dict[str, Any], reference: W.Params, atol: float) -> W.Params:
    params = W.load(result["params"])
    assert sorted(params) == sorted(reference), "gathered names differ from the model's"
    for name, ref in reference.items():
        torch.testing.assert_close(params[name], ref, atol=atol, rtol=atol, msg=name)
    return params


# -- connect -------------------------------------------------------------------------------------
def test_connect_creates_a_gloo_group_and_owns_it(two: list[dict[str, Any]]) -> None:
    for facts in (rank["connect"] for rank in two):
        assert facts["initialized_before"] is False and facts["initialized_after"] is True
        assert facts["backend"] == "gloo" and facts["world"] == 2
        assert facts["owns"] is True  # fprep created the default group ...
        assert facts["owns_second"] is False  # ... and a second prepare reuses it
        assert facts["mesh_shape"] == (2,) and facts["mesh_dim_names"] == ("dp",)
        assert facts["ddp_group_is_world"] is True


# -- numerics ------------------------------------------------------------------------------------
@pytest.mark.parametrize("case", sorted(W.FP32_CASES))
def test_fp32_training_matches_one_process(
    case: str, two: list[dict[str, Any]], references: dict[str, W.Params]
) -> None:
    cfg, optimizer = W.FP32_CASES[case]
    result = two[0]["fp32"][case]
    assert result["strategy"] == cfg.strategy
    assert result["applied"][-1] == "mark_prepared"
    assert_matches(result, references[optimizer], atol=1e-5)
    if result["strategy"] in ("ddp", "fast_ddp"):  # replicas stay identical, bitwise
        other = W.load(two[1]["fp32"][case]["params"])
        assert max_diff(W.load(result["params"]), other) == 0.0
    # The mean of the ranks' local losses is the full-batch loss (equal slices).
    local = torch.tensor([rank["fp32"][case]["losses"] for rank in two]).mean(0)
    model = W.build(optimizer)
    x, y = next(W.batches(steps=1))
    with torch.no_grad():
        first = W.lm_loss(model(x), y).item()
    assert local[0].item() == pytest.approx(first, rel=1e-5)


def test_several_strategies_in_one_process_do_not_interfere(
    two: list[dict[str, Any]], references: dict[str, W.Params]
) -> None:
    """The fp32 cases were all prepared first, in one process, then stepped in turn; each
    still matches its own single-process run."""
    results = two[0]["fp32"]
    assert {r["strategy"] for r in results.values()} == {"ddp", "fast_ddp", "fsdp"}
    for case, (_, optimizer) in W.FP32_CASES.items():
        assert max_diff(W.load(results[case]["params"]), references[optimizer]) <= 1e-5, case


#: Lower-precision runs: loose tolerance against the fp32 reference.
LOW_PRECISION = {
    "ddp_bf16/sgd": 1e-2,  # bf16 autocast
    "fsdp_bf16/sgd": 1e-2,  # bf16 parameters (MixedPrecisionPolicy), fp32 reduction
    "ddp_fp16/sgd": 1e-3,  # fp16 autocast + GradScaler
    "fast_ddp_fp16/sgd": 1e-3,  # fp16 autocast + GradScaler + fused all-reduce
    "fast_ddp_bf16_buffer/sgd": 5e-3,  # fp32 compute, gradients all-reduced in bf16
}


@pytest.mark.parametrize("case", sorted(LOW_PRECISION))
def test_low_precision_training_is_close_but_really_low_precision(
    case: str, two: list[dict[str, Any]], references: dict[str, W.Params]
) -> None:
    result = two[0]["loose"][case]
    assert result["strategy"] == W.LOOSE_CASES[case][0].strategy
    params = assert_matches(result, references["sgd"], atol=LOW_PRECISION[case])
    assert max_diff(params, references["sgd"]) > 1e-6  # not the fp32 result
    assert all(p.dtype == torch.float32 for p in params.values())  # fp32 master weights
    if result["strategy"] != "fsdp":
        assert max_diff(params, W.load(two[1]["loose"][case]["params"])) == 0.0


def test_checkpointing_and_regional_compile_under_fsdp(two: list[dict[str, Any]]) -> None:
    blocks = ["blocks.0", "blocks.1"]
    for rank in two:
        checkpointed = rank["fp32"]["fsdp_checkpointed/sgd"]
        assert checkpointed["checkpointed"] == blocks and checkpointed["compiled"] == []
        both = rank["fp32"]["fsdp_checkpointed_compiled/adamw"]
        assert both["checkpointed"] == blocks and both["compiled"] == blocks
    # (and both train exactly like one process: test_fp32_training_matches_one_process)


def test_fsdp_bf16_computes_in_bf16_and_returns_fp32(two: list[dict[str, Any]]) -> None:
    for facts in (rank["precision"] for rank in two):
        assert facts["inner"] == "torch.bfloat16"
        assert facts["output"] == "torch.float32"
        assert facts["param_dtypes"] == {"torch.float32"}  # sharded storage stays fp32
        assert facts["grad_dtypes"] == {"torch.float32"}  # reduced in fp32


def test_sharding_full_reshards_after_forward_and_grad_op_does_not(
    two: list[dict[str, Any]],
) -> None:
    for facts in (rank["resharding"] for rank in two):
        assert facts["full"] is True  # sharded DTensor again right after forward
        assert facts["grad_op"] is False  # still the unsharded parameter until backward
        assert facts["full_after_backward"] is True and facts["grad_op_after_backward"] is True


# -- DDP options and communication hooks ---------------------------------------------------------
def test_ddp_options_reach_ddp(two: list[dict[str, Any]]) -> None:
    for facts in (rank["ddp_options"] for rank in two):
        assert facts["default"] == {
            "bucket_bytes_cap": 25 * 1024 * 1024,
            "find_unused_parameters": False,
            "static_graph": False,
            "gradient_as_bucket_view": False,
            "forward_sync_buffers": True,
            "type": "DistributedDataParallel",
        }
        assert facts["custom"] == {
            "bucket_bytes_cap": int(2.5 * 1024 * 1024),
            "find_unused_parameters": True,
            "static_graph": False,
            "gradient_as_bucket_view": True,
            "forward_sync_buffers": False,
            "type": "DistributedDataParallel",
        }
        assert facts["static"]["static_graph"] is True
        # A model with an unused parameter trains only because find_unused_parameters arrived.
        assert len(facts["custom_losses"]) == W.STEPS
        assert facts["grads_are_views"] == [True, True]  # gradient_as_bucket_view
        assert len(facts["static_losses"]) == W.STEPS
    assert two[0]["ddp_options"]["custom_losses"] == two[0]["fp32"]["ddp/sgd"]["losses"]


HOOKS = {
    "hook_fp16/sgd": (
        "torch.distributed.algorithms.ddp_comm_hooks.default_hooks.fp16_compress_hook",
        1e-3,
    ),
    # torch refuses its own bf16 hook on gloo; fprep installs an equivalent one.
    "hook_bf16/sgd": ("fprep.apply.replicate.bf16_compress_allreduce", 5e-3),
    "hook_powersgd/sgd": (
        "torch.distributed.algorithms.ddp_comm_hooks.powerSGD_hook.powerSGD_hook",
        5e-2,
    ),
}


@pytest.mark.parametrize("case", sorted(HOOKS))
def test_comm_hooks_are_installed_and_train(
    case: str, two: list[dict[str, Any]], references: dict[str, W.Params]
) -> None:
    hook, atol = HOOKS[case]
    result = two[0]["loose"][case]
    assert [name for name, _ in result["hooks"]] == [hook]
    if case == "hook_powersgd/sgd":
        assert result["hooks"][0][1] == {"matrix_approximation_rank": 1, "start_powerSGD_iter": 2}
    params = assert_matches(result, references["sgd"], atol=atol)
    assert max_diff(params, references["sgd"]) > 1e-6  # compression really happened
    other = W.load(two[1]["loose"][case]["params"])
    assert max_diff(params, other) == 0.0  # and every rank applied the same update


def test_fast_ddp_all_reduce_averages_exactly_like_ddp(two: list[dict[str, Any]]) -> None:
    for facts in (rank["fast_ddp"] for rank in two):
        assert facts["equal_fast_vs_ddp"] is True, facts["max_fast_vs_ddp"]
        assert facts["max_fast_vs_mean"] == 0.0
        assert facts["max_local_vs_mean"] > 1e-3  # ranks really had different gradients
        assert facts["extra_grad"] == [0.0, 0.0, 0.0]  # unused parameter: zeros, not None
        assert facts["not_fast_ddp_error"] == ("PrepareError", "strategy")


# -- initialization ------------------------------------------------------------------------------
def test_rank0_weights_reach_every_rank(two: list[dict[str, Any]]) -> None:
    """Ranks build different weights (DDP, fast_ddp) or none at all (fsdp: meta on rank 1
    with sync_module_states); after prepare every rank holds rank 0's."""
    rank0 = {k: v.detach() for k, v in tiny_gpt(seed=5).state_dict().items()}
    for name in ("ddp", "fast_ddp", "fsdp_sync"):
        for rank in two:
            assert max_diff(W.load(rank["broadcast"][name]), rank0) == 0.0, name
    assert all(rank["broadcast"]["fsdp_sync_tied"] for rank in two)


def test_meta_init_is_identical_for_1_2_and_3_ranks(
    two: list[dict[str, Any]], three: list[dict[str, Any]]
) -> None:
    one = W.reproducible_init()  # this process: world size 1
    assert one["strategy"] == "none"
    results = {1: one, 2: two[0]["init"], 3: three[0]["init"]}
    params = {world: W.load(r["params"]) for world, r in results.items()}
    for world in (2, 3):
        assert results[world]["strategy"] == "fsdp"
        for name, tensor in params[1].items():
            assert torch.equal(params[world][name], tensor), f"{name} differs at {world} ranks"
    for result in [one, *(r["init"] for r in two), *(r["init"] for r in three)]:
        assert result["tied"] is True  # lm_head.weight is wte.weight after prepare
        assert result["rng_restored"] is True  # the global RNG is left as it was
        assert result["on_meta"] is False
    assert torch.equal(params[1]["lm_head.weight"], params[1]["wte.weight"])
    # The seed matters: another seed gives other weights.
    other = W.load(W.reproducible_init(seed=W.INIT_SEED + 1)["params"])
    assert not torch.equal(other["wte.weight"], params[1]["wte.weight"])


def test_meta_init_is_world_size_independent_for_every_strategy(
    two: list[dict[str, Any]], four: list[dict[str, Any]]
) -> None:
    """DDP at 2 ranks and FSDP / HSDP (2 x 2) at 4 ranks give the 1-rank weights bitwise."""
    one = W.load(W.reproducible_init()["params"])
    for result in (two[0]["init_ddp"], four[0]["init_fsdp"], four[0]["init_hsdp"]):
        params = W.load(result["params"])
        assert sorted(params) == sorted(one)
        for name, tensor in one.items():
            assert torch.equal(params[name], tensor), f"{result['strategy']}: {name}"
    for result in [
        *(r["init_ddp"] for r in two),
        *(r[k] for r in four for k in ("init_fsdp", "init_hsdp")),
    ]:
        assert result["tied"] and result["rng_restored"] and not result["on_meta"]
        assert result["shapes"][1] == []
    assert {four[0]["init_hsdp"]["strategy"], two[0]["init_ddp"]["strategy"]} == {"hsdp", "ddp"}


def test_hsdp_replicas_built_differently_are_refused(four: list[dict[str, Any]]) -> None:
    """Each shard group agrees with itself, but replica 1 holds real weights where replica 0
    is on the meta device: refused on every rank (they would train from different weights)."""
    for rank in four:
        assert rank["hsdp_replicas_differ"] is not None
        subject, message = rank["hsdp_replicas_differ"]
        assert subject == "materialize" and "disagree" in message


def test_unseeded_meta_init_works(two: list[dict[str, Any]]) -> None:
    """reproducible_init=False may give other values, but still real, finite, tied weights."""
    result = two[0]["init_unseeded"]
    assert result["tied"] is True and result["on_meta"] is False
    params = W.load(result["params"])
    assert all(torch.isfinite(p).all() for p in params.values())
    assert result["shapes"][1] == []


# -- refusals ------------------------------------------------------------------------------------
def test_a_prepared_model_is_refused_not_wrapped_twice(two: list[dict[str, Any]]) -> None:
    for facts in (rank["already_prepared"] for rank in two):
        for strategy in ("ddp", "fsdp", "fast_ddp"):
            assert facts[strategy] == ("PrepareError", "model"), strategy
        assert facts["ddp_inner"] == ("PrepareError", "model")  # the module inside DDP too
        assert facts["ddp_wrapped_once"] is True


# -- plan versus reality -------------------------------------------------------------------------
@pytest.mark.parametrize("world", [2, 3, 4])
def test_every_shard_is_what_the_plan_predicted(world: int, request: pytest.FixtureRequest) -> None:
    ranks = request.getfixturevalue({2: "two", 3: "three", 4: "four"}[world])
    expected = {name for name, _, _ in W.shape_cases(world)}
    assert len(ranks) == world
    for rank, result in enumerate(ranks):
        shapes = result["shapes"]
        assert set(shapes) == expected
        for name, (checked, mismatches) in shapes.items():
            assert checked > 0, name
            assert mismatches == [], f"rank {rank}, {name}: {mismatches}"


def test_trained_models_are_what_the_plan_predicted(
    two: list[dict[str, Any]], four: list[dict[str, Any]]
) -> None:
    runs = [
        *(
            r
            for rank in two
            for group in ("fp32", "loose", "prebuilt")
            for r in rank[group].values()
        ),
        *(r for rank in four for r in rank["numerics"].values()),
        *(rank["init"] for rank in two),
    ]
    for result in runs:
        checked, mismatches = result["shapes"]
        assert checked > 0 and mismatches == []


# -- hybrid sharding at 4 ranks ------------------------------------------------------------------
def test_hsdp_mesh_is_the_planned_one(four: list[dict[str, Any]]) -> None:
    for rank, result in enumerate(four):
        mesh = result["mesh"]
        assert mesh["shape"] == (2, 2) and mesh["dim_names"] == ("replicate", "shard")
        assert mesh["coordinate"] == mesh["planned_coordinate"] == (rank // 2, rank % 2)
        assert mesh["shard_group"] == mesh["planned_shard_group"]
        assert mesh["replicate_group"] == mesh["planned_replicate_group"]
        assert rank in mesh["shard_group"] and rank in mesh["replicate_group"]


@pytest.mark.parametrize("case", sorted(W.HSDP_CASES))
def test_four_rank_training_matches_one_process(
    case: str, four: list[dict[str, Any]], references: dict[str, W.Params]
) -> None:
    cfg, optimizer = W.HSDP_CASES[case]
    result = four[0]["numerics"][case]
    assert result["strategy"] == cfg.strategy
    assert_matches(result, references[optimizer], atol=1e-5)


# -- the rank runner itself ----------------------------------------------------------------------
@pytest.mark.parametrize(
    ("kind", "message"),
    [("raise", "ValueError: rank 1 gives up"), ("crash", "exited without a result")],
)
def test_run_ranks_reports_a_failed_rank_promptly(kind: str, message: str) -> None:
    import time

    from fprep.testing.distributed import RankError

    start = time.monotonic()
    with pytest.raises(RankError, match="rank 1") as info:
        run_ranks(W.misbehave, 2, kind, timeout_s=120)
    assert message in str(info.value)
    assert time.monotonic() - start < 60  # not the 120 s timeout


def test_hsdp_sync_module_states_from_rank0(four: list[dict[str, Any]]) -> None:
    """Rank 0 holds real weights, ranks 1-3 start on the meta device; all end with rank 0's."""
    rank0 = {k: v.detach() for k, v in tiny_gpt(seed=5).state_dict().items()}
    for rank in four:
        assert max_diff(W.load(rank["hsdp_sync"]), rank0) == 0.0


# -- a data-parallel group that is not the whole job ---------------------------------------------
@pytest.mark.parametrize("strategy", ["ddp", "fast_ddp"])
def test_replicas_over_a_subgroup_start_from_its_first_rank(
    strategy: str, four: list[dict[str, Any]]
) -> None:
    for rank in four:
        assert rank["subgroups"][strategy]["weights_from_group_first_rank"] is True


def test_ddp_over_a_subgroup_averages_within_it(four: list[dict[str, Any]]) -> None:
    for rank in four:
        assert rank["subgroups"]["ddp"]["max_grad_diff"] <= 1e-6


def test_fast_ddp_over_a_subgroup_averages_within_it(four: list[dict[str, Any]]) -> None:
    for rank in four:
        assert rank["subgroups"]["fast_ddp"]["max_grad_diff"] <= 1e-6


# -- optimizers built before prepare -------------------------------------------------------------
@pytest.mark.parametrize("case", sorted(W.PREBUILT_CASES))
def test_an_optimizer_built_before_prepare_is_rebound_and_trains(
    case: str, two: list[dict[str, Any]], references: dict[str, W.Params]
) -> None:
    """fully_shard replaces every Parameter: prepare points the optimizer at the new ones."""
    _, optimizer = W.PREBUILT_CASES[case]
    for rank in two:
        assert rank["prebuilt"][case]["rebound"] is True
    assert_matches(two[0]["prebuilt"][case], references[optimizer], atol=1e-5)
