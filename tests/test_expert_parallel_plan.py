"""init_expert_parallel: the experts each rank holds of a transformers MoE, their bytes, and
every refusal, planned for any world size without a process (pure)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import transformers as tf
from _tiny_transformers import meta_llama, meta_mixtral, meta_qwen3_moe, qwen3_moe
from hypothesis import given, settings
from hypothesis import strategies as st
from returns.result import Failure, Success

import fprep
from fprep import ConfigError, ModelError, PrepConfig, PrepError, Topology
from fprep.testing.distributed import fake_world

QWEN = qwen3_moe()
QWEN_TREE = fprep.ModuleTree.of(QWEN)
EXPERTS = tuple(f"model.layers.{i}.mlp.experts" for i in range(2))


def planned(tree: object, world: int, rank: int, **fields: object) -> fprep.PrepState:
    result = fprep.plan(tree, PrepConfig(**fields), Topology(world_size=world, rank=rank))  # type: ignore[arg-type]
    assert isinstance(result, Success), result
    return result.unwrap()


def refused(tree: object, world: int, **fields: object) -> PrepError:
    result = fprep.plan(tree, PrepConfig(**fields), Topology(world_size=world, rank=0))  # type: ignore[arg-type]
    assert isinstance(result, Failure), result
    error = result.failure()
    assert isinstance(error, PrepError)
    return error


def test_the_model_plan_is_read_as_transformers_resolves_it() -> None:
    assert QWEN_TREE.ep_plan == tuple(sorted(QWEN.ep_plan.items()))  # type: ignore[operator]
    mixtral = meta_mixtral()
    assert fprep.ModuleTree.of(mixtral).ep_plan == tuple(sorted(mixtral.ep_plan.items()))  # type: ignore[operator]


@pytest.mark.parametrize(("world", "ep"), [(2, 2), (4, 2), (4, 4)])
def test_every_rank_holds_its_experts_and_their_bytes(world: int, ep: int) -> None:
    held: dict[tuple[str, int], list[int]] = {}
    for rank in range(world):
        state = planned(QWEN_TREE, world, rank, strategy="fsdp", ep=ep)
        plan = state.expert_parallel
        assert plan is not None and plan.source == "model"
        assert tuple(m.fqn for m in plan.modules) == EXPERTS
        assert (plan.ep, plan.efsdp, plan.gradient_divide_factor) == (ep, world // ep, world)
        for module in plan.modules:
            experts = plan.local_experts(module.fqn)
            assert len(experts) == 4 // ep
            held.setdefault((module.fqn, plan.mesh.efsdp_rank), []).extend(experts)
            for p in module.params:
                full = QWEN_TREE.param(p.fqn)
                assert full is not None and p.shape == full.shape and p.grouped_gemm
                assert p.local_shape[0] * ep * (world // ep) >= p.shape[0]
        total = sum(p.numel for p in QWEN_TREE.params if p.fqn.startswith(EXPERTS))
        assert plan.full_bytes == 4 * total
        assert plan.local_bytes == plan.full_bytes // world  # 4 experts divide evenly here
    # each copy of the experts (one per efsdp rank) is spread over its ep group exactly once
    for experts in held.values():
        assert sorted(experts) == [0, 1, 2, 3]


@settings(max_examples=15, deadline=None)
@given(st.sampled_from([1, 2, 4, 8]), st.sampled_from([2, 4, 8]), st.data())
def test_any_ep_is_planned_or_refused_as_a_value(world: int, ep: int, data: st.DataObject) -> None:
    """Any (world, ep, experts) gives a plan or a ConfigError naming ep, never a raw error."""
    experts = data.draw(st.sampled_from([2, 4, 6, 8]))
    tree = fprep.ModuleTree.of(qwen3_moe(num_experts=experts))
    result = fprep.plan(
        tree, PrepConfig(strategy="fsdp", ep=ep), Topology(world_size=world, rank=world - 1)
    )
    if world % ep == 0 and experts % ep == 0 and world > 1:
        assert isinstance(result, Success), result
    else:
        assert isinstance(result, Failure)
        assert isinstance(result.failure(), ConfigError)


def test_an_ep_not_dividing_the_experts_is_refused_by_ep() -> None:
    error = refused(fprep.ModuleTree.of(qwen3_moe(num_experts=6)), 4, strategy="fsdp", ep=4)
    assert isinstance(error, ConfigError) and error.subject == "ep"
    assert "6 experts" in error.message and "model.layers.0.mlp.experts" in error.message


def test_ep_in_one_process_says_to_launch_more() -> None:
    error = refused(QWEN_TREE, 1, strategy="fsdp", ep=2)
    assert error.subject == "ep" and "one process" in error.message
    assert "torchrun --nproc-per-node 2" in (error.hint or "")


def test_an_ep_not_dividing_the_data_parallel_ranks_is_refused_by_ep() -> None:
    error = refused(QWEN_TREE, 6, strategy="fsdp", ep=4)
    assert isinstance(error, ConfigError) and error.subject == "ep"
    assert "dp_shard x tp = 6 x 1" in error.message and "1, 2, 3, 6" in (error.hint or "")


@pytest.mark.parametrize(
    ("fields", "subject"),
    [
        ({"pp": 2}, "pp"),
        ({"tp": 2}, "tp"),
        ({"tp": 2, "sequence_parallel": True}, "tp"),
        ({"strategy": "ddp"}, "strategy"),
        ({"strategy": "auto"}, "strategy"),  # ddp without tp
        ({"sync_module_states": True}, "sync_module_states"),
        ({"compile": "regional", "wrap": ("Qwen3MoeDecoderLayer",)}, "compile"),
    ],
)
def test_what_expert_parallelism_does_not_compose_with_yet_is_refused(
    fields: dict[str, object], subject: str
) -> None:
    error = refused(QWEN_TREE, 4, **{"strategy": "fsdp", "ep": 2, **fields})
    assert isinstance(error, ConfigError) and error.subject == subject
    assert "ep=2" in error.message and error.hint


def test_hsdp_borrows_ep_inside_each_replica() -> None:
    state = planned(QWEN_TREE, 8, 6, strategy="hsdp", hsdp_shard_size=4, ep=2)
    plan = state.expert_parallel
    assert plan is not None and plan.mesh.dp_replicate == 2
    assert (plan.mesh.ep_group, plan.mesh.efsdp_group) == ((6, 7), (4, 6))
    assert plan.gradient_divide_factor == 8


def test_a_model_without_an_ep_plan_needs_one() -> None:
    error = refused(meta_llama(), 2, strategy="fsdp", ep=2)
    assert isinstance(error, ConfigError) and error.subject == "ep_plan"
    assert "ep_dispatch_experts" in (error.hint or "")


def test_a_user_plan_naming_nothing_or_no_experts_is_refused() -> None:
    nothing = refused(
        QWEN_TREE, 2, strategy="fsdp", ep=2, ep_plan={"layers.*.moe": "ep_dispatch_experts"}
    )
    assert nothing.subject == "ep_plan" and "matches no module" in nothing.message
    dense = refused(
        QWEN_TREE,
        2,
        strategy="fsdp",
        ep=2,
        ep_plan={"model.layers.*.self_attn": "ep_dispatch_experts"},
    )
    assert isinstance(dense, ModelError) and dense.subject == "model.layers.0.self_attn"
    assert "not fused experts" in dense.message


def test_a_user_plan_replaces_the_models() -> None:
    state = planned(
        QWEN_TREE, 2, 0, strategy="fsdp", ep=2,
        ep_plan={"model.layers.1.mlp.experts": "ep_dispatch_experts"},
    )  # fmt: skip
    plan = state.expert_parallel
    assert plan is not None and plan.source == "config"
    assert [m.fqn for m in plan.modules] == [EXPERTS[1]]
    assert not any(p.grouped_gemm for p in plan.modules[0].params)


def test_ignored_experts_are_refused() -> None:
    error = refused(QWEN_TREE, 2, strategy="fsdp", ep=2, ignored_modules=(EXPERTS[0],))
    assert error.subject == "ignored_params" and EXPERTS[0] in error.message


def test_experts_on_meta_and_weights_files_are_refused_until_fprep_materializes_them(
    tmp_path: Path,
) -> None:
    meta = refused(meta_qwen3_moe(), 2, strategy="fsdp", ep=2)
    assert meta.subject == "ep" and "meta" in meta.message and "real weights" in (meta.hint or "")
    QWEN.save_pretrained(tmp_path)
    files = refused(meta_qwen3_moe(), 2, strategy="fsdp", ep=2, weights=str(tmp_path))
    assert files.subject == "weights" and "from_pretrained" in (files.hint or "")


def test_ep_one_plans_nothing() -> None:
    assert planned(QWEN_TREE, 2, 0, strategy="fsdp").expert_parallel is None


@pytest.mark.parametrize(
    ("fields", "subject"),
    [
        ({"ep": 0}, "ep"),
        ({"ep": True}, "ep"),
        ({"ep_plan": {"a": "ep_dispatch_experts"}}, "ep_plan"),  # ep=1
        ({"ep": 2, "ep_plan": {"a": "colwise"}}, "ep_plan"),
        ({"ep": 2, "ep_plan": ["a"]}, "ep_plan"),
    ],
)
def test_config_refuses_bad_expert_fields(fields: dict[str, object], subject: str) -> None:
    with pytest.raises(ConfigError) as caught:
        PrepConfig(**fields)  # type: ignore[arg-type]
    assert caught.value.subject == subject


def test_config_round_trips_the_ep_plan() -> None:
    cfg = PrepConfig(ep=2, ep_plan={"layers.*.experts": "ep_dispatch_experts"})
    assert cfg.ep_plan_pairs == (("layers.*.experts", "ep_dispatch_experts"),)
    assert PrepConfig.from_dict(cfg.to_dict()) == cfg


def test_from_transformers_reads_ep_size() -> None:
    dist = tf.DistributedConfig(fsdp_size=4, ep_size=2)
    cfg = PrepConfig.from_transformers(dist)
    assert (cfg.ep, cfg.strategy) == (2, "fsdp")
    assert planned(QWEN_TREE, 4, 3, **cfg.to_dict()).expert_parallel is not None


def test_a_refused_prepare_leaves_the_model_as_it_was() -> None:
    model = qwen3_moe()
    before = {n: (p, p.detach().clone()) for n, p in model.named_parameters()}
    with fake_world(4, 1), pytest.raises(ConfigError):
        fprep.prepare(
            model, PrepConfig(strategy="fsdp", ep=3), topology=Topology(world_size=4, rank=1)
        )
    after = dict(model.named_parameters())
    assert after.keys() == before.keys()
    for name, (param, value) in before.items():
        assert after[name] is param and torch.equal(param, value)
    assert "forward" not in vars(model.model.layers[0].mlp.experts)  # not dispatched
    assert not any(hasattr(m, "_get_fsdp_state") for m in model.modules())  # nor sharded


def test_checkpoints_are_refused_under_expert_parallelism(tmp_path: Path) -> None:
    """Each rank holds other experts under the same names: refused, not written as copies."""
    state = planned(QWEN_TREE, 2, 0, strategy="fsdp", ep=2)
    calls = {
        "fprep.save": lambda: fprep.save(tmp_path, state, QWEN),
        "fprep.load": lambda: fprep.load(tmp_path, state, QWEN),
        "fprep.export_full": lambda: fprep.export_full(tmp_path / "m.safetensors", state, QWEN),
        "fprep.save_pretrained": lambda: fprep.save_pretrained(tmp_path, state, QWEN),
    }
    for what, call in calls.items():
        with pytest.raises(fprep.CheckpointError) as caught:
            call()
        assert caught.value.subject == "ep" and caught.value.message.startswith(what)
    assert not any(tmp_path.iterdir())
