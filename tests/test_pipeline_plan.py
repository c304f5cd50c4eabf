"""init_pipeline: the split, each rank's stages and part of the model, and every refusal, planned
for any world size without a process (pure; the runs are in tests/test_pipeline.py)."""

from __future__ import annotations

import dataclasses

import pytest
import transformers as tf
from _tiny_transformers import meta_llama
from hypothesis import given, settings
from hypothesis import strategies as st
from returns.result import Failure, Success
from torch import nn

import fprep
from fprep.config import PipelineSchedule
from fprep.layout.stages import SCHEDULES, V_SCHEDULES, stages_of_rank
from fprep.snapshot import STAGE_GAP_CLS, ModuleTree
from fprep.testing.models import GPT, GPTConfig, LlamaConfig, llama

SCHEDULE_NAMES: tuple[str, ...] = PipelineSchedule.__args__  # type: ignore[attr-defined]


def tiny(layers: int = 6, **config: object) -> nn.Module:
    return llama(LlamaConfig(dim=32, n_layers=layers, n_heads=4, n_kv_heads=2, **config))  # type: ignore[arg-type]


def planned(
    model: nn.Module | ModuleTree, world: int, rank: int, **fields: object
) -> fprep.PrepState:
    result = fprep.plan(
        model, fprep.PrepConfig(**fields), fprep.Topology(world_size=world, rank=rank)
    )  # type: ignore[arg-type]
    assert isinstance(result, Success), result
    return result.unwrap()


def refused(model: nn.Module, world: int = 2, **fields: object) -> fprep.PrepError:
    result = fprep.plan(model, fprep.PrepConfig(**fields), fprep.Topology(world_size=world, rank=0))  # type: ignore[arg-type]
    assert isinstance(result, Failure), result
    error = result.failure()
    assert isinstance(error, fprep.PrepError)
    return error


def test_the_schedules_pp_schedule_accepts_are_the_layout_rooms() -> None:
    assert set(SCHEDULE_NAMES) == set(SCHEDULES)


def test_llama_splits_by_torchtitans_rule_under_its_own_names() -> None:
    state = planned(tiny(6), 2, 1, pp=2)
    plan = state.pipeline
    assert plan is not None and plan.source == "model"
    assert plan.split == (
        ("tok_embeddings", "layers.0", "layers.1", "layers.2"),
        ("layers.3", "layers.4", "layers.5", "norm", "output"),
    )
    assert plan.stages == (1,) and plan.holds_last and not plan.holds_first
    assert plan.microbatches == 2  # one per stage by default
    # rank 1's part: its stage's modules under their own names, a pass-through for the rest
    tree = state.tree
    assert {p.fqn.split(".")[0] for p in tree.params} == {"layers", "norm", "output"}
    assert tree.module("layers.0").cls == STAGE_GAP_CLS  # type: ignore[union-attr]
    assert tree.module("tok_embeddings").is_stage_gap  # type: ignore[union-attr]
    assert tree.module("layers.3.attention.wq") is not None
    # every later transition planned the part only
    assert state.param_handles is not None
    assert {s.fqn for s in state.param_handles.specs} == {p.fqn for p in tree.params}


def test_transformers_llama_splits_by_its_base_model_pp_plan() -> None:
    model = meta_llama(num_hidden_layers=4)
    plan = planned(model, 4, 0, pp=4).pipeline
    assert plan is not None
    # 4 layers + embedding + head = 6 weighted layers on 4 stages: 2, 2, 1, 1
    assert plan.split == (
        ("model.embed_tokens", "model.layers.0"),
        ("model.layers.1", "model.layers.2"),
        ("model.layers.3",),
        ("model.norm", "lm_head"),
    )
    # the rotary embedding has no parameters and no stage: every stage keeps it
    assert plan.shared == ("model.rotary_emb",)


@settings(max_examples=60, deadline=None)
@given(
    layers=st.integers(1, 12),
    pp=st.integers(2, 4),
    dp=st.integers(1, 2),
    schedule=st.sampled_from(SCHEDULES),
    per_rank=st.integers(1, 3),
)
def test_the_parts_of_every_rank_cover_the_model_once(
    layers: int, pp: int, dp: int, schedule: str, per_rank: int
) -> None:
    if schedule in V_SCHEDULES:
        per_rank = 2
    tree = ModuleTree.of(tiny(layers))
    world = pp * dp
    results = [
        fprep.plan(
            tree,
            fprep.PrepConfig(pp=pp, pp_schedule=schedule, pp_stages_per_rank=per_rank),  # type: ignore[arg-type]
            fprep.Topology(world_size=world, rank=r),
        )
        for r in range(world)
    ]
    if any(isinstance(r, Failure) for r in results):
        # only one reason: more stages than the layers plus embedding and head
        errors = {r.failure().subject for r in results if isinstance(r, Failure)}
        assert errors == {"pp"}
        assert len(results[0].failure().message) > 0
        return
    states = [r.unwrap() for r in results]
    whole = {p.fqn for p in tree.params}
    for dp_rank in range(dp):
        held: list[str] = []
        for pp_rank in range(pp):
            state = states[pp_rank * dp + dp_rank]  # pp outermost: blocks of dp ranks
            plan = state.pipeline
            assert plan is not None
            assert plan.rank == pp_rank
            assert plan.stages == stages_of_rank(pp_rank, pp, schedule, per_rank)
            held += [p.fqn for p in state.tree.params]
        assert sorted(held) == sorted(whole)  # each parameter on exactly one pipeline rank
    for state in states:
        assert state.pipeline is not None and state.pipeline.split == states[0].pipeline.split  # type: ignore[union-attr]


def test_a_user_split_is_checked_against_the_forward() -> None:
    model = tiny(4)
    good = [["tok_embeddings", "layers.0", "layers.1"], ["layers.2", "layers.3", "norm", "output"]]
    plan = planned(model, 2, 0, pp=2, pp_split=good).pipeline
    assert plan is not None and plan.source == "config" and plan.split[0][-1] == "layers.1"
    cases = {
        "inside a block": [["tok_embeddings", "layers.0.attention"], ["layers.1", "norm"]],
        "out of order": [
            ["layers.0", "tok_embeddings", "layers.1"],
            ["layers.2", "layers.3", "norm", "output"],
        ],
        "left out": [["tok_embeddings", "layers.0", "layers.1"], ["layers.2", "norm", "output"]],
        "three stages for two": [
            ["tok_embeddings", "layers.0"],
            ["layers.1", "layers.2"],
            ["layers.3", "norm", "output"],
        ],
    }
    for why, split in cases.items():
        error = refused(model, pp=2, pp_split=split)
        assert error.subject == "pp_split", why
    assert "cut" in refused(model, pp=2, pp_split=cases["inside a block"]).message
    assert "layers.3" in refused(model, pp=2, pp_split=cases["left out"]).message


def test_a_model_without_a_pipeline_plan_is_refused() -> None:
    # GPT adds position embeddings to the token embeddings in its forward: a pass-through for
    # wte on a later stage would add them to the hidden states again, silently wrong.
    error = refused(GPT(GPTConfig()), pp=2)
    assert isinstance(error, fprep.ModelError) and error.subject == "pp"
    assert "_pp_plan" in error.hint


def test_tied_embeddings_across_stages_are_refused() -> None:
    error = refused(tiny(4, tie_embeddings=True), pp=2)
    assert isinstance(error, fprep.ModelError)
    assert "tok_embeddings.weight" in error.message and "Untie" in error.hint


@pytest.mark.parametrize(
    ("fields", "subject", "words"),
    [
        ({"pp_microbatches": 1}, "pp_microbatches", "at least as many micro-batches"),
        ({"pp_schedule": "Interleaved1F1B", "pp_microbatches": 5}, "pp_microbatches", "rounds"),
        ({"pp_schedule": "ZBVZeroBubble", "pp_microbatches": 3}, "pp_microbatches", "at least"),
        ({"pp_schedule": "ZBVZeroBubble", "pp_stages_per_rank": 3}, "pp_stages_per_rank", "two"),
        (
            {"pp_schedule": "DualPipeV", "compile": "regional", "wrap": ("LlamaBlock",)},
            "compile",
            "zero-bubble",
        ),
        ({"strategy": "ddp"}, "strategy", "pipeline stages with FSDP2"),
        ({"compile": "whole"}, "compile", "no rank runs the whole model"),
        ({"activation_checkpointing": True}, "wrap", "never runs"),
        ({"compile": "regional"}, "wrap", "never runs"),
        ({"sync_module_states": True}, "sync_module_states", "only the first stage"),
        ({"precision": "fp16"}, "precision", "overflow"),
    ],
)
def test_what_a_schedule_cannot_run_is_refused_by_its_field(
    fields: dict[str, object], subject: str, words: str
) -> None:
    world = 4 if fields.get("strategy") == "ddp" else 2
    error = refused(tiny(6), world, pp=2, **fields)
    assert error.subject == subject and words in error.message, error


def test_more_stages_than_layers_is_refused() -> None:
    error = refused(tiny(1), 4, pp=4)
    assert error.subject == "pp" and "some stage would hold nothing" in error.message


def test_the_world_must_hold_the_pipeline() -> None:
    assert refused(tiny(4), 1, pp=2).subject == "pp"  # one process: launch with torchrun
    error = refused(tiny(4), 3, pp=2)
    assert error.subject == "pp" and "divide" in error.message
    with pytest.raises(fprep.ConfigError, match="pp=1"):
        fprep.PrepConfig(pp_split=[["a"], ["b"]])


def test_pp_with_dp_and_tp_lays_out_one_mesh() -> None:
    # 8 ranks: pp 2 x dp 2 x tp 2, pp outermost, tp innermost (torchtitan's order)
    for rank in range(8):
        state = planned(tiny(4), 8, rank, pp=2, tp=2)
        mesh = state.process_group.mesh  # type: ignore[union-attr]
        assert (mesh.pp, mesh.dp_shard, mesh.tp) == (2, 2, 2)
        assert mesh.coordinate("pp") == rank // 4 and mesh.coordinate("tp") == rank % 2
        assert state.core.strategy == "fsdp"  # type: ignore[union-attr]
        assert state.pipeline.stages == (rank // 4,)  # type: ignore[union-attr]
        tps = state.tensor_parallel
        assert tps is not None
        # the tp plan names 'output'; on stage 0 it is another stage's module, not refused
        styled = {fqn for fqn, _ in tps.modules}
        assert ("output" in styled) == (rank >= 4)
        assert ("tok_embeddings" in styled) == (rank < 4)


def test_pp_alone_keeps_parameters_gathered_between_microbatches() -> None:
    core = planned(tiny(4), 4, 0, pp=2).core
    assert core is not None and core.strategy == "fsdp" and core.reshard_after_forward is False
    assert any("micro-batch" in note for note in core.notes)
    explicit = planned(tiny(4), 4, 0, pp=2, reshard_after_forward=True).core
    assert explicit is not None and explicit.reshard_after_forward is True


def test_planning_again_splits_the_whole_model() -> None:
    state = planned(tiny(4), 2, 1, pp=2)
    again = fprep.init_pipeline(state)
    assert isinstance(again, Success) and again.unwrap() == state


@settings(max_examples=80, deadline=None)
@given(
    pp=st.integers(1, 5),
    world=st.integers(1, 12),
    schedule=st.sampled_from(SCHEDULES),
    microbatches=st.none() | st.integers(1, 12),
    layers=st.integers(1, 6),
)
def test_any_pipeline_request_is_planned_or_refused_as_a_value(
    pp: int, world: int, schedule: str, microbatches: int | None, layers: int
) -> None:
    try:
        cfg = fprep.PrepConfig(pp=pp, pp_schedule=schedule, pp_microbatches=microbatches)  # type: ignore[arg-type]
    except fprep.ConfigError as e:
        assert e.subject == "pp_microbatches" and pp == 1
        return
    result = fprep.plan(tiny(layers), cfg, fprep.Topology(world_size=world, rank=world - 1))
    if isinstance(result, Failure):
        error = result.failure()
        assert isinstance(error, fprep.PrepError) and not isinstance(error, fprep.PlanOrderError)
        fields = {f.name for f in dataclasses.fields(fprep.PrepConfig)}
        assert error.subject in fields, error
    else:
        state = result.unwrap()
        assert state.is_complete and (state.pipeline is None) == (pp == 1)


def test_transformers_qwen2_parts_hold_their_layers() -> None:
    with pytest.MonkeyPatch.context():
        import torch

        with torch.device("meta"):
            model = tf.Qwen2ForCausalLM(
                tf.Qwen2Config(
                    hidden_size=32,
                    intermediate_size=64,
                    num_hidden_layers=3,
                    vocab_size=64,
                    num_attention_heads=4,
                    num_key_value_heads=2,
                    tie_word_embeddings=False,
                )
            )
    last = planned(model, 2, 1, pp=2)
    names = {p.fqn for p in last.tree.params}
    assert "lm_head.weight" in names and "model.embed_tokens.weight" not in names
    assert any(n.startswith("model.layers.2.") for n in names)


def test_the_summary_says_which_stages_this_rank_runs() -> None:
    text = planned(tiny(6), 8, 5, pp=2, tp=2, pp_schedule="Interleaved1F1B").summary()
    assert "mesh        pp=2xdp=2xtp=2" in text
    assert (
        "pipeline    pp=2 (model split), Interleaved1F1B, 4 micro-batches, 4 stages; this "
        "rank: stage 1 (layers.1 .. layers.2); stage 3 (layers.5 .. output)"
    ) in text
    assert "this rank's part of" in text
    assert "pipeline" not in planned(tiny(6), 2, 0).summary()


# -- the plan against torch: each rank's part under FSDP2 on a fake world ------------------------
@settings(max_examples=25, deadline=None)
@given(
    pp=st.sampled_from([2, 4]),
    dp=st.integers(1, 3),
    schedule=st.sampled_from(["1F1B", "Interleaved1F1B", "ZBVZeroBubble"]),
    data=st.data(),
)
def test_each_ranks_part_is_what_fully_shard_builds(
    pp: int, dp: int, schedule: str, data: st.DataObject
) -> None:
    """Carve this rank's stage modules as prepare does, shard them with torch's fully_shard on
    the pp x dp mesh of a fake world of any size, and compare every parameter with the plan:
    the same names, local shards and global shapes, on the planned ranks."""
    import torch
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from fprep.apply.pipeline_stages import StageGap, carve
    from fprep.testing.distributed import fake_world

    world = pp * dp
    rank = data.draw(st.integers(0, world - 1), label="rank")
    with torch.device("meta"):
        model = tiny(8)
    state = planned(model, world, rank, pp=pp, pp_schedule=schedule, wrap=("LlamaBlock",))
    plan = state.pipeline
    assert plan is not None and state.param_handles is not None
    specs = {s.fqn: s for s in state.param_handles.specs}
    with fake_world(world, rank):
        mesh = init_device_mesh("cpu", (pp, dp), mesh_dim_names=("pp", "dp"))
        assert mesh["pp"].get_local_rank() == plan.rank
        part = carve(model, plan.gaps())
        stages = [carve(model, plan.gaps(s)) for s in plan.stages]
        for unit in state.param_handles.units:
            targets = stages if unit.fqn == "" else [part.get_submodule(unit.fqn)]
            for module in targets:
                fully_shard(module, mesh=mesh["dp"], reshard_after_forward=False)
        named = dict(part.named_parameters())
        assert set(named) == set(specs)
        for name, param in named.items():
            spec = specs[name]
            assert tuple(param.shape) == spec.shape
            assert tuple(param.to_local().shape) == spec.local_shape, name  # type: ignore[attr-defined]
        # the stage modules share every parameter with the part, and hold their stage's only
        for index, stage in zip(plan.stages, stages, strict=True):
            assert all(named[n] is p for n, p in stage.named_parameters())
            owners = {n.rsplit(".", 1)[0] for n, _ in stage.named_parameters()}
            assert all(
                any(o == m or o.startswith(m + ".") for m in plan.split[index]) for o in owners
            )
            gaps = {n for n, m in stage.named_modules() if isinstance(m, StageGap)}
            assert gaps == set(plan.gaps(index))
    assert not any(isinstance(m, StageGap) for m in model.modules())  # the model is untouched


def test_sequence_parallelism_is_planned_per_stage() -> None:
    """The embedding shards the stream on the first stage, the head reads it back on the last;
    the stages between pass it on sharded."""
    first = planned(tiny(4), 4, 0, pp=2, tp=2, sequence_parallel=True).tensor_parallel
    last = planned(tiny(4), 4, 2, pp=2, tp=2, sequence_parallel=True).tensor_parallel
    assert first is not None and last is not None
    first_styles, last_styles = dict(first.modules), dict(last.modules)
    assert first_styles["tok_embeddings"] == "embedding_rowwise_sequence"
    assert "output" not in first_styles and "tok_embeddings" not in last_styles
    assert (
        last_styles["output"].endswith("_sequence") and last_styles["norm"] == "sequence_parallel"
    )


def test_a_wrap_policy_matching_nothing_names_the_blocks_not_the_pass_throughs() -> None:
    error = refused(tiny(6), pp=2, wrap=("Block",))
    assert error.subject == "wrap" and "LlamaBlock" in error.hint and "StageGap" not in error.hint


def test_units_prefetch_only_within_their_stage() -> None:
    state = planned(tiny(6), 4, 0, pp=2, pp_schedule="Interleaved1F1B", wrap=("LlamaBlock",))
    plan, prefetch = state.pipeline, state.prefetching
    assert plan is not None and prefetch is not None and plan.stages == (0, 2)
    stage_of = {m: i for i, names in enumerate(plan.split) for m in names}
    assert prefetch.backward  # layers.2 -> layers.1 ... within each stage
    for fqn, targets in (*prefetch.forward, *prefetch.backward):
        assert all(stage_of[t] == stage_of[fqn] for t in targets), (fqn, targets)
