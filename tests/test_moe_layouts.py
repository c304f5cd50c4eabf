"""Mixture-of-experts models trained for real (gloo, CPU) under every layout, against one process:
fprep's MoE and transformers' Qwen3-MoE, Mixtral and GPT-OSS under ddp and fsdp at 2 and 4
ranks and hsdp 2 x 2, fprep's MoE and Qwen3-MoE under pp 2 and pp 2 x dp 2. Losses, every
gradient and the parameters after AdamW steps equal one process within 1e-5, and the routers'
token counts summed over the data-parallel ranks equal one process's exactly. Adversarial data:
experts that receive no token on some ranks, and every token routed to one expert. Several
cases train the load-balancing loss too (``pipeline_step(aux_loss_coef=)``), under pp in each
stage's own backward; the loop-facing API (``fprep.watch_routers``) is checked in one process
against transformers' own auxiliary loss."""

from __future__ import annotations

from typing import Any

import _moe_workers as W
import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from transformers.models.qwen3_moe.modeling_qwen3_moe import load_balancing_loss_func

import fprep
from fprep.layout.stages import SCHEDULES
from fprep.testing.distributed import run_ranks
from fprep.testing.models import lm_loss, moe_tiny

TOL = 1e-5
AUX = 0.1  # large enough that its gradient stands far above the tolerance
KINDS = ("moe", "qwen3", "mixtral", "gptoss")
HSDP = {"hsdp_shard_size": 2}  # 2 x 2 at 4 ranks


def _wrap(kind: str) -> dict[str, Any]:
    return {"wrap": ("MoEBlock",)} if kind == "moe" else {}


def _cases_2() -> list[W.Case]:
    cases: list[W.Case] = []
    for kind in KINDS:
        aux = AUX if kind == "moe" else None
        cases.append((f"{kind}_ddp", kind, {"strategy": "ddp"}, "random", aux))
        cases.append((f"{kind}_fsdp", kind, {"strategy": "fsdp", **_wrap(kind)}, "random", aux))
    cases += [
        # the load-balancing loss in each stage's backward under every schedule (the V and
        # looped ones give a rank stages without a router)
        *(
            (f"moe_pp_{name}", "moe", {"pp": 2, "pp_schedule": name}, "random", AUX)
            for name in SCHEDULES
        ),
        ("qwen3_pp", "qwen3", {"pp": 2, "pp_schedule": "GPipe"}, "random", AUX),
        ("moe_ddp_starved", "moe", {"strategy": "ddp"}, "starved", None),
        ("mixtral_ddp_starved", "mixtral", {"strategy": "ddp"}, "starved", None),
        ("moe_fsdp_one_expert", "moe", {"strategy": "fsdp", **_wrap("moe")}, "one_expert", AUX),
        ("qwen3_ddp_one_expert", "qwen3", {"strategy": "ddp"}, "one_expert", None),
        # experts as separate modules: DDP must find the unused ones (fprep turns it on)
        ("listed_ddp_starved", "listed", {"strategy": "ddp"}, "starved", AUX),
    ]
    return cases


def _cases_4() -> list[W.Case]:
    cases: list[W.Case] = []
    for kind in KINDS:
        aux = AUX if kind in ("moe", "gptoss") else None
        cases.append((f"{kind}_ddp", kind, {"strategy": "ddp"}, "random", aux))
        cases.append((f"{kind}_fsdp", kind, {"strategy": "fsdp", **_wrap(kind)}, "random", None))
        hsdp = {"strategy": "hsdp", **HSDP, **_wrap(kind)}
        cases.append((f"{kind}_hsdp", kind, hsdp, "random", aux))
    cases += [
        ("moe_pp2_dp2", "moe", {"pp": 2, **_wrap("moe")}, "random", AUX),
        ("qwen3_pp2_dp2", "qwen3", {"pp": 2}, "starved", AUX),
        ("gptoss_fsdp_starved", "gptoss", {"strategy": "fsdp"}, "starved", None),
        # experts as separate modules: FSDP2 must reduce-scatter the unused ones' zeros
        ("listed_fsdp_starved", "listed", {"strategy": "fsdp", **_wrap("moe")}, "starved", AUX),
        ("listed_hsdp_starved", "listed", {"strategy": "hsdp", **HSDP}, "starved", None),
        ("mixtral_hsdp_one_expert", "mixtral", {"strategy": "hsdp", **HSDP}, "one_expert", None),
    ]
    return cases


@pytest.fixture(scope="module", params=[2, 4], ids=lambda n: f"world{n}")
def ranks(request: pytest.FixtureRequest) -> tuple[int, list[W.Case], list[Any]]:
    world = request.param
    cases = _cases_2() if world == 2 else _cases_4()
    return world, cases, run_ranks(W.run, world, cases, timeout_s=1500)


_REFERENCES: dict[tuple[str, str, int, float | None], dict[str, Any]] = {}


def _reference(kind: str, data: str, chunks: int, coef: float | None) -> dict[str, Any]:
    key = (kind, data, chunks, coef)
    if key not in _REFERENCES:
        _REFERENCES[key] = W.reference(kind, data, chunks, coef)
    return _REFERENCES[key]


def _worst(got: np.ndarray, want: np.ndarray) -> float:
    return float(np.abs(got - want).max()) if got.size else 0.0


def test_training_equals_one_process(ranks: tuple[int, list[W.Case], list[Any]]) -> None:
    world, cases, results = ranks
    for index, (name, kind, _, data, coef) in enumerate(cases):
        per_rank = [results[r][index] for r in range(world)]
        first = per_rank[0]
        assert first["name"] == name
        # each data-parallel rank's share, cut into its micro-batches: the rows the routers and
        # the load-balancing loss saw together
        ref = _reference(kind, data, first["shares"] * first["microbatches"], coef)
        for step, want in enumerate(ref["steps"]):
            losses = [r["steps"][step]["loss"] for r in per_rank]
            known = [loss for loss in losses if loss is not None]
            assert known, name  # known on the last stage
            assert abs(float(np.mean(known)) - want["loss"]) < TOL, (name, step)
            counted: set[str] = set()
            for r in per_rank:
                for fqn, grad in r["steps"][step]["grads"].items():
                    assert _worst(grad, want["grads"][fqn]) < TOL, (name, step, fqn)
                for router, counts in r["steps"][step]["counts"].items():
                    np.testing.assert_array_equal(counts, want["counts"][router], err_msg=name)
                    counted.add(router)
            assert counted == set(want["counts"]), name  # every router on some stage
        held: set[str] = set()
        for r in per_rank:
            for fqn, value in r["params"].items():
                assert _worst(value, ref["params"][fqn]) < TOL, (name, fqn)
                held.add(fqn)
        assert held == set(ref["params"]), name


def test_the_auxiliary_loss_changed_the_gradients(
    ranks: tuple[int, list[W.Case], list[Any]],
) -> None:
    """The cases that train the load-balancing loss check its gradient path: without it the
    routers' gradients differ from those the ranks computed by far more than the tolerance."""
    world, cases, results = ranks
    trained = [(i, case) for i, case in enumerate(cases) if case[4]]
    assert trained
    for index, (name, kind, _, data, _) in trained:
        first = results[0][index]
        without = _reference(kind, data, first["shares"] * first["microbatches"], None)
        gaps = [
            _worst(grad, without["steps"][0]["grads"][fqn])
            for r in range(world)
            for fqn, grad in results[r][index]["steps"][0]["grads"].items()
            if "gate" in fqn or "router" in fqn
        ]
        assert max(gaps) > 100 * TOL, name


def test_experts_without_tokens_on_some_ranks(ranks: tuple[int, list[W.Case], list[Any]]) -> None:
    """The starved cases really starve: a rank whose tokens all took the same experts left the
    others without a token there, while other ranks sent them some (and DDP / FSDP neither hung
    nor failed on those experts' zero gradients: the run above finished and matched)."""
    world, cases, results = ranks
    starved = [(i, case[0]) for i, case in enumerate(cases) if case[3] == "starved"]
    assert starved
    for index, name in starved:
        found = False
        for r in range(world):
            step = results[r][index]["steps"][0]
            for router, mine in step["mine"].items():
                idle = (mine == 0) & (step["counts"][router] > 0)
                found = found or bool(idle.any())
        assert found, name


def test_every_token_to_one_expert(ranks: tuple[int, list[W.Case], list[Any]]) -> None:
    _, cases, results = ranks
    skewed = [(i, case[0]) for i, case in enumerate(cases) if case[3] == "one_expert"]
    assert skewed
    for index, name in skewed:
        for step in results[0][index]["steps"]:
            for counts in step["counts"].values():
                assert np.count_nonzero(counts) == 1, name
                assert counts.sum() == W.BATCH * W.SEQ, name  # top_k = 1


# -- the loop-facing API, one process -------------------------------------------------------------
@settings(max_examples=40, deadline=None)
@given(
    experts=st.integers(1, 8),
    tokens=st.integers(1, 24),
    data=st.data(),
    seed=st.integers(0, 2**16),
)
def test_balance_loss_is_transformers_loss_of_one_layer(
    experts: int, tokens: int, data: st.DataObject, seed: int
) -> None:
    top_k = data.draw(st.integers(1, experts))
    logits = torch.randn(tokens, experts, generator=torch.Generator().manual_seed(seed)) * 3
    indices = torch.topk(torch.softmax(logits, dim=-1), top_k, dim=-1).indices
    got = fprep.balance_loss(logits, indices, experts)
    want = load_balancing_loss_func((logits,), experts, top_k)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    assert 0 < got <= experts + 1e-5  # at most: every token on the same experts, sure of them


@pytest.mark.parametrize("kind", ["qwen3", "mixtral", "gptoss"])
def test_aux_loss_is_transformers_own_for_one_layer(kind: str) -> None:
    """For one MoE layer the watch's loss is transformers' ``outputs.aux_loss``; reading it
    changes nothing the model computes."""
    model = W.build(kind, layers=1)
    state, prepared = fprep.prepare(model, fprep.PrepConfig())
    x, _ = W.batches("random")[0]
    before = prepared(x, output_router_logits=True)
    watch = fprep.watch_routers(state, prepared)
    after = prepared(x, output_router_logits=True)
    assert torch.equal(before.logits, after.logits)
    torch.testing.assert_close(watch.aux_loss(), after.aux_loss, rtol=0, atol=1e-6)
    counts = watch.token_counts()
    (router,) = counts
    assert counts[router].sum() == x.numel() * model.config.num_experts_per_tok
    assert watch.token_counts()[router].sum() == 0  # read once: counting starts anew


def test_aux_loss_is_the_sum_over_layers_of_fprep_moe() -> None:
    model = moe_tiny(n_layers=3, shared_expert=True)
    state, prepared = fprep.prepare(model, fprep.PrepConfig())
    watch = fprep.watch_routers(state, prepared)
    assert fprep.watch_routers(state, prepared) is watch
    x, y = W.batches("random")[0]
    fprep.pipeline_step(state, prepared, x, y, lm_loss, aux_loss_coef=AUX)
    assert len(watch.routers) == 3
    torch.testing.assert_close(watch.aux_loss(), model.aux_loss(), rtol=0, atol=1e-6)
    per_router = {
        name: int(router.tokens_per_expert.sum())  # the model's own record
        for name, router in watch.routers.items()
    }
    assert {n: int(c.sum()) for n, c in watch.token_counts().items()} == per_router


def test_checkpointing_recomputes_without_counting_twice() -> None:
    cfg = fprep.PrepConfig(activation_checkpointing=True, wrap=("MoEBlock",))
    state, prepared = fprep.prepare(moe_tiny(), cfg)
    watch = fprep.watch_routers(state, prepared)
    x, y = W.batches("random")[0]
    fprep.pipeline_step(state, prepared, x, y, lm_loss, aux_loss_coef=AUX)
    for counts in watch.token_counts().values():
        assert counts.sum() == x.numel() * 2  # top_k = 2, once per token


def test_close_removes_the_hooks() -> None:
    state, prepared = fprep.prepare(moe_tiny(), fprep.PrepConfig())
    hooks = {n: len(m._forward_hooks) for n, m in prepared.named_modules()}
    watch = fprep.watch_routers(state, prepared)
    watch.close()
    assert {n: len(m._forward_hooks) for n, m in prepared.named_modules()} == hooks
    assert fprep.watch_routers(state, prepared) is not watch  # a closed watch is not reused


def test_misuse_is_refused_clearly() -> None:
    from fprep.testing.models import llama_tiny

    state, prepared = fprep.prepare(llama_tiny(), fprep.PrepConfig())
    with pytest.raises(fprep.ConfigError) as no_router:
        fprep.watch_routers(state, prepared)
    assert no_router.value.subject == "model"
    state, prepared = fprep.prepare(moe_tiny(), fprep.PrepConfig())
    x, y = W.batches("random")[0]
    for bad in (-1.0, float("nan"), True, "0.01"):
        with pytest.raises(fprep.ConfigError) as coef:
            fprep.pipeline_step(state, prepared, x, y, lm_loss, aux_loss_coef=bad)  # type: ignore[arg-type]
        assert coef.value.subject == "aux_loss_coef"
    with pytest.raises(fprep.PrepareError) as early:
        fprep.watch_routers(state, prepared).aux_loss()
    assert early.value.subject == "aux_loss"


def _pp_with_model_aux() -> str:
    model = W.build("qwen3")
    model.config.output_router_logits = True
    state, prepared = fprep.prepare(model, fprep.PrepConfig(pp=2))
    x, y = W.batches("random")[0]
    try:
        fprep.pipeline_step(state, prepared, x, y, lm_loss, aux_loss_coef=AUX)
    except fprep.ConfigError as e:
        return e.subject
    return "ran"


def test_pipeline_refuses_a_model_computing_its_own_aux_loss() -> None:
    """Under pp a stage would compute transformers' auxiliary loss and drop it: every rank says
    so before the schedule runs."""
    assert run_ranks(_pp_with_model_aux, 2, timeout_s=300) == ["output_router_logits"] * 2


def test_moe_8x7b_is_mixtral_shaped() -> None:
    from fprep.testing.models import moe_8x7b

    model = moe_8x7b()
    assert next(model.parameters()).is_meta
    count = sum(p.numel() for p in model.parameters())
    assert count == model.config.num_params
    assert abs(count - 46.7e9) < 0.1e9  # Mixtral 8x7B's published size
    experts = model.layers[0].feed_forward.experts
    assert tuple(experts.gate_up_proj.shape) == (8, 2 * 14336, 4096)
    assert tuple(experts.down_proj.shape) == (8, 4096, 14336)


def _ddp_options(model: torch.nn.Module, **ddp: bool) -> Any:
    cfg = fprep.PrepConfig(strategy="ddp", ddp=fprep.DDPOptions(**ddp))
    return fprep.plan(model, cfg, fprep.Topology(world_size=2, rank=0))


def test_ddp_finds_unused_experts_only_when_they_are_separate_modules() -> None:
    """Fused experts always have a gradient (zero rows for an expert without tokens); experts in
    a module list do not, and the plan turns on DDP's search for unused parameters for them."""
    fused = dict(_ddp_options(W.build("moe")).unwrap().runtime.ddp_kwargs)
    listed = dict(_ddp_options(W.build("listed")).unwrap().runtime.ddp_kwargs)
    assert fused["find_unused_parameters"] is False
    assert listed["find_unused_parameters"] is True
    refused = _ddp_options(W.build("listed"), static_graph=True).failure()
    assert isinstance(refused, fprep.ConfigError) and refused.subject == "ddp.static_graph"
    assert "layers.0.feed_forward.experts" in str(refused)
