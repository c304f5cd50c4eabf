"""Pipeline parallelism trained for real (gloo, CPU), against one process: every schedule at pp 2,
pp 2 x dp 2 and pp 2 x tp 2 on 4 ranks, pp 2 x dp 2 x tp 2 on 8; fprep's Llama and transformers'
Llama / Qwen2, with ``weights=`` read by each stage. Losses, clipped norms, every gradient and
the parameters after SGD steps equal the single-process run within 1e-5."""

from __future__ import annotations

from typing import Any

import _pipeline_workers as W
import numpy as np
import pytest

from fprep.layout.stages import SCHEDULES
from fprep.testing.distributed import run_ranks

TOL = 1e-5


@pytest.fixture(scope="module")
def weights(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("pp_weights")
    return {kind: W.save(kind, root / kind) for kind in ("hf_llama", "hf_qwen2")}


@pytest.fixture(scope="module")
def references() -> dict[tuple[str, bool], Any]:
    out = {(kind, False): W.reference(kind) for kind in ("llama", "hf_llama", "hf_qwen2")}
    out["llama", True] = W.reference("llama", "meta")
    return out


#: Cases whose numerics differ from one fp32 process by design: bf16 compute.
TOLERANCE = {"llama_bf16": 5e-2}


def _cases_2(weights: dict[str, str]) -> list[W.Case]:
    cases: list[W.Case] = [
        (f"llama_{schedule}", "llama", {"pp": 2, "pp_schedule": schedule}, None)
        for schedule in SCHEDULES
    ]
    cases.append(("hf_llama_weights", "hf_llama", {"pp": 2}, weights["hf_llama"]))
    blocks = {"wrap": ("LlamaBlock",)}
    cases += [
        # fprep's initialization of a meta model, per stage, equals one process's
        (
            "llama_meta_checkpointed",
            "llama",
            {"pp": 2, "activation_checkpointing": True, **blocks},
            "meta",
        ),
        (
            "llama_compiled",
            "llama",
            {"pp": 2, "compile": "regional", "compile_backend": "aot_eager", **blocks},
            None,
        ),
        ("llama_bf16", "llama", {"pp": 2, "precision": "bf16", **blocks}, None),
        ("llama_optimizer_first", "llama", {"pp": 2}, None),
        ("misuse", "llama", {}, None),
    ]
    return cases


def _cases_4(weights: dict[str, str]) -> list[W.Case]:
    return [
        # gradient accumulation over two half batches beside FSDP2 (pp 2 x dp 2)
        ("llama_pp2_dp2_accumulate", "llama", {"pp": 2, "wrap": ("LlamaBlock",)}, None),
        (
            "llama_pp2_dp2_interleaved",
            "llama",
            {"pp": 2, "pp_schedule": "Interleaved1F1B", "wrap": ("LlamaBlock",)},
            None,
        ),
        ("hf_qwen2_pp2_tp2_weights", "hf_qwen2", {"pp": 2, "tp": 2}, weights["hf_qwen2"]),
        # the sequence-sharded stream crosses the stage boundary as a DTensor
        ("llama_pp2_tp2_sequence", "llama", {"pp": 2, "tp": 2, "sequence_parallel": True}, None),
    ]


def _cases_8(weights: dict[str, str]) -> list[W.Case]:
    return [
        ("hf_llama_pp2_dp2_tp2_weights", "hf_llama", {"pp": 2, "tp": 2}, weights["hf_llama"]),
        ("llama_pp2_hsdp", "llama", {"pp": 2, "strategy": "hsdp", "hsdp_shard_size": 2}, None),
    ]


@pytest.fixture(scope="module", params=[2, 4, 8], ids=lambda n: f"world{n}")
def ranks(request: pytest.FixtureRequest, weights: dict[str, str]) -> tuple[int, list[Any]]:
    world = request.param
    cases = {2: _cases_2, 4: _cases_4, 8: _cases_8}[world](weights)
    return world, run_ranks(W.run, world, cases, timeout_s=1500)


def _kind(name: str) -> str:
    return (
        "hf_llama"
        if name.startswith("hf_llama")
        else "hf_qwen2"
        if name.startswith("hf_qwen2")
        else "llama"
    )


def _close(got: np.ndarray, want: np.ndarray) -> float:
    return float(np.abs(got - want).max()) if got.size else 0.0


def test_training_equals_one_process(
    ranks: tuple[int, list[Any]], references: dict[str, Any]
) -> None:
    world, results = ranks
    for index, first in enumerate(results[0]):
        name = first["name"]
        if name == "misuse":
            continue
        ref = references[_kind(name), "meta" in name]
        tol = TOLERANCE.get(name, TOL)
        per_rank = [results[r][index] for r in range(world)]
        for step, want in enumerate(ref["steps"]):
            losses = [
                r["steps"][step]["loss"] for r in per_rank if r["steps"][step]["loss"] is not None
            ]
            # the loss is known on the ranks of the last stage, one per data-parallel x tp rank
            assert losses, name
            shares = first["shares"]
            if shares == 1:
                for loss in losses:
                    assert abs(loss - want["loss"]) < tol, (name, step)
            else:  # each dp rank's loss is the mean over its share: their mean is the batch's
                mean = float(np.mean(losses))
                assert abs(mean - want["loss"]) < tol, (name, step)
            for r in per_rank:
                assert abs(r["steps"][step]["norm"] - want["norm"]) < tol * max(1.0, want["norm"])
                for fqn, grad in r["steps"][step]["grads"].items():
                    assert _close(grad, want["grads"][fqn]) < tol, (name, step, fqn)
        held: set[str] = set()
        for r in per_rank:
            assert r["calling"].startswith("PrepareError") and "pipeline_step" in r["calling"]
            for fqn, value in r["params"].items():
                assert _close(value, ref["params"][fqn]) < tol, (name, fqn)
                held.add(fqn)
        assert held == set(ref["params"]), name  # every parameter on some stage, under its name


def test_every_schedule_ran(ranks: tuple[int, list[Any]]) -> None:
    world, results = ranks
    if world != 2:
        pytest.skip("the schedules run at pp 2")
    names = [case["name"] for case in results[0]]
    ran = [n.removeprefix("llama_") for n in names if n.removeprefix("llama_") in SCHEDULES]
    assert ran == list(SCHEDULES)
    v_stages = [case["stages"] for case in results[0] if case["name"] == "llama_ZBVZeroBubble"]
    assert v_stages == [(0, 3)]  # rank 0 runs the first and the last stage of the V


def test_batches_a_pipeline_cannot_run_are_refused_on_every_rank(
    ranks: tuple[int, list[Any]],
) -> None:
    world, results = ranks
    if world != 2:
        pytest.skip("checked at pp 2")
    for rank in range(world):
        said = next(case for case in results[rank] if case["name"] == "misuse")["said"]
        assert said == {
            "rows": ("ConfigError", "pp_microbatches"),
            "targets": ("ConfigError", "targets"),
            "zero_d": ("ConfigError", "inputs"),
            "shape": ("ConfigError", "inputs"),
        }


def test_without_pp_the_step_is_the_plain_one() -> None:
    import torch

    import fprep
    from fprep.testing.models import lm_loss

    state, model = fprep.prepare(W.build("llama"), fprep.PrepConfig())
    reference = W.build("llama")
    x, y = W.batches()[0]
    loss = fprep.pipeline_step(state, model, x, y, lm_loss)
    want = lm_loss(reference(x), y)
    want.backward()
    assert loss is not None and torch.equal(loss, want.detach())
    for (name, p), q in zip(model.named_parameters(), reference.parameters(), strict=True):
        assert p.grad is not None and torch.equal(p.grad, q.grad), name
