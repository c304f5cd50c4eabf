"""Expert parallelism trains a transformers MoE exactly as one process does: at 2 gloo ranks
(ep 2) and 4 (ep 2 x efsdp 2, also with 2 experts, which FSDP shards inside, and ep 4), the
losses and clipped norms of 3 AdamW steps and every parameter after them equal one process's on
the whole batch within 1e-5 (fp32), also when every token goes to one expert and the others
receive none. The plan and its refusals: test_expert_parallel_plan.py."""

from __future__ import annotations

from typing import Any

import _ep_workers as W
import numpy as np
import pytest

from fprep.testing.distributed import run_ranks

TOL = 1e-5
BLOCK = ("Qwen3MoeDecoderLayer",)

CASES: dict[int, list[W.Case]] = {
    2: [
        ("qwen_ep2", "qwen3_moe", {"strategy": "fsdp", "ep": 2}, "learned"),
        ("qwen_ep2_one_expert", "qwen3_moe", {"strategy": "fsdp", "ep": 2}, "one"),
        ("mixtral_ep2", "mixtral", {"strategy": "fsdp", "ep": 2}, "learned"),
        # backward recomputes each block's forward, its all-to-alls too, in the same order
        (
            "qwen_ep2_checkpointed",
            "qwen3_moe",
            {"strategy": "fsdp", "ep": 2, "activation_checkpointing": True, "wrap": BLOCK},
            "learned",
        ),
    ],
    4: [
        # each block its own FSDP unit, its experts one inside it (sharded first, over efsdp)
        ("qwen_dp2_ep2", "qwen3_moe", {"strategy": "fsdp", "ep": 2, "wrap": BLOCK}, "learned"),
        ("qwen_ep4_one_expert", "qwen3_moe", {"strategy": "fsdp", "ep": 4}, "one"),
        # 2 replicas x ep 2 (efsdp 1): the experts are replicated over the replicas (HSDP)
        (
            "qwen_hsdp2x2_ep2",
            "qwen3_moe",
            {"strategy": "hsdp", "hsdp_shard_size": 2, "ep": 2},
            "learned",
        ),
        # 2 experts over efsdp 2 x ep 2: FSDP shards inside each expert (dimension 1)
        ("qwen_2_experts_dp2_ep2", "qwen3_moe:2", {"strategy": "fsdp", "ep": 2}, "learned"),
    ],
}


@pytest.fixture(scope="module", params=[2, 4], ids=lambda n: f"world{n}")
def ranks(request: pytest.FixtureRequest) -> tuple[int, list[Any]]:
    world = request.param
    return world, run_ranks(W.run, world, CASES[world], timeout_s=900)


def _close(got: np.ndarray, want: np.ndarray) -> float:
    assert got.shape == want.shape
    return float(np.abs(got - want).max()) if got.size else 0.0


@pytest.mark.slow
def test_training_equals_one_process(ranks: tuple[int, list[Any]]) -> None:
    world, results = ranks
    for index, (name, kind, _, router) in enumerate(CASES[world]):
        per_rank = [results[r][index] for r in range(world)]
        dp = per_rank[0]["dp"]
        ref = W.reference(kind, router, dp)
        if router == "one":  # the case is what it claims: one expert took every token
            assert len(ref["chosen"]) == 1, (name, ref["chosen"])
        for step, want in enumerate(ref["losses"]):
            mean = float(np.mean([r["losses"][step] for r in per_rank]))
            assert abs(mean - want) < TOL, (name, step, mean, want)
            for r in per_rank:  # fprep.clip_grad_norm: the whole model's norm on every rank
                assert abs(r["norms"][step] - ref["norms"][step]) < TOL, (name, step)
        held: dict[str, list[int]] = {}
        for r in per_rank:
            for fqn, value in r["params"].items():
                want = ref["params"][fqn]
                module = fqn.rpartition(".")[0]
                if module in r["experts"]:  # this rank's experts of an expert parameter
                    start, stop = r["experts"][module]
                    want = want[start:stop]
                    held.setdefault(fqn, []).extend(range(start, stop))
                assert _close(value, want) < TOL, (name, fqn)
            assert r["params"].keys() == ref["params"].keys(), name
        inside = name == "qwen_2_experts_dp2_ep2"  # efsdp x ep exceeds the experts
        for r in per_rank:
            shards = set(r["placements"].values())
            dim = 1 if inside else 0
            want = "(Replicate(), Shard(dim=0))" if "hsdp" in name else f"(Shard(dim={dim}),)"
            assert shards == {want}, (name, shards)
        # every expert was trained somewhere: each one by world / ep ranks (its efsdp copies)
        for fqn, experts in held.items():
            assert sorted(set(experts)) == list(range(ref["params"][fqn].shape[0])), (name, fqn)


# -- the local experts, in one process ------------------------------------------------------------
@pytest.mark.parametrize("width", [16, 10])  # 10: rows not 16-byte aligned, so the loop runs
def test_grouped_gemm_and_loop_equal_the_models_own_experts(width: int) -> None:
    """``run_local_experts`` (grouped GEMM or loop) on rows grouped by expert, an expert with
    no rows among them, equals the model's own experts forward with one expert per token."""
    import torch
    from _tiny_transformers import qwen3_moe

    from fprep.apply.experts import run_local_experts

    experts = qwen3_moe(hidden_size=width, moe_intermediate_size=width).model.layers[0].mlp.experts
    experts.config._experts_implementation = "eager"  # the model's loop (its grouped_mm needs 16)
    sizes = [3, 0, 5, 1]
    rows = torch.randn(sum(sizes), width, requires_grad=True)
    chosen = torch.repeat_interleave(torch.arange(4), torch.tensor(sizes)).unsqueeze(-1)
    want = experts(rows, chosen, torch.ones(len(rows), 1))
    (want_rows,) = torch.autograd.grad(want.square().sum(), rows)
    for grouped in (False, True) if width % 4 == 0 else (False,):
        got = run_local_experts(experts, rows, sizes, grouped)
        (got_rows,) = torch.autograd.grad(got.square().sum(), rows)
        assert torch.allclose(got, want, atol=1e-6), grouped
        assert torch.allclose(got_rows, want_rows, atol=1e-5), grouped


def test_an_experts_layout_fprep_cannot_dispatch_is_refused_before_any_change() -> None:
    from _tiny_transformers import qwen3_moe

    import fprep
    from fprep.testing.distributed import fake_world

    model = qwen3_moe()
    model.model.layers[1].mlp.experts.is_transposed = True
    before = {n: p for n, p in model.named_parameters()}
    with fake_world(2, 0), pytest.raises(fprep.ConfigError) as caught:
        fprep.prepare(
            model,
            fprep.PrepConfig(strategy="fsdp", ep=2),
            topology=fprep.Topology(world_size=2, rank=0),
        )
    assert caught.value.subject == "model.layers.1.mlp.experts"
    assert "is_transposed" in caught.value.message
    after = dict(model.named_parameters())
    assert all(after[n] is p for n, p in before.items())
    assert all("forward" not in vars(layer.mlp.experts) for layer in model.model.layers)
    assert model.model.layers[0].mlp.experts.gate_up_proj.shape[0] == 4
