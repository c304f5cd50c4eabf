"""Tensor parallelism composed with FSDP2 / HSDP: the plan, its refusals, plan versus the real
DTensors (fake groups for large worlds), and training equal to one process (4 gloo ranks)."""

from __future__ import annotations

import warnings
from typing import Any, ClassVar

import _tp_workers as W
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch import nn

import fprep
from fprep import ConfigError, ModelError, PrepConfig, Topology
from fprep.apply.placements import to_torch
from fprep.layout.placements import Replicate, Shard, StridedShard
from fprep.state import PrepState
from fprep.testing.distributed import fake_world, run_ranks
from fprep.testing.models import Llama, LlamaConfig, llama, llama_tiny, tiny_gpt


def plan(model: Any, cfg: PrepConfig, world: int, rank: int = 0, local: int = 8) -> PrepState:
    topo = Topology(world_size=world, rank=rank, local_world_size=min(local, world))
    return fprep.plan(model, cfg, topo).unwrap()


def refusal(model: Any, cfg: PrepConfig, world: int, local: int = 8) -> fprep.PrepError:
    topo = Topology(world_size=world, rank=0, local_world_size=min(local, world))
    result = fprep.plan(model, cfg, topo)
    error = result.failure()
    assert isinstance(error, fprep.PrepError)
    return error


# -- the plan ---------------------------------------------------------------------------------
def test_llama_own_plan_at_dp2_tp2() -> None:
    state = plan(llama_tiny("meta"), PrepConfig(strategy="fsdp", tp=2), world=4, rank=3)
    ext = state.extension
    assert ext is not None and ext.tensor_parallel is not None
    tps = ext.tensor_parallel
    assert (tps.size, tps.rank, tps.group) == (2, 1, (2, 3))
    assert tps.mesh_shape == (2, 2) and tps.mesh_dim_names == ("dp", "tp")
    assert tps.plan_source == "model"
    pg = state.process_group
    assert pg is not None and pg.shard_group == (1, 3)  # dp ranks: the same tp coordinate
    specs = {s.fqn: s for s in state.param_handles.specs}  # type: ignore[union-attr]
    wq = specs["layers.0.attention.wq.weight"]  # (64, 64): tp rows, then dp rows of those
    assert wq.local_shape == (16, 64)
    assert wq.placements == (StridedShard(0, split_factor=2), Shard(0))
    wo = specs["layers.0.attention.wo.weight"]  # rowwise: tp columns, dp rows
    assert wo.local_shape == (32, 32) and wo.placements == (Shard(0), Shard(1))
    norm = specs["norm.weight"]  # outside the plan: FSDP2 only
    assert norm.mesh_dims == ("dp",) and norm.placements == (Shard(0),)
    emb = specs["tok_embeddings.weight"]  # embedding_rowwise: vocabulary rows
    assert emb.local_shape == (64, 64)


def test_hsdp_tp_is_three_dimensional() -> None:
    cfg = PrepConfig(strategy="hsdp", tp=2, hsdp_shard_size=2)
    state = plan(llama_tiny("meta"), cfg, world=8, rank=5)
    tps = state.extension.tensor_parallel  # type: ignore[union-attr]
    assert tps is not None and tps.mesh_shape == (2, 2, 2)
    assert tps.mesh_dim_names == ("replicate", "shard", "tp")
    spec = next(s for s in state.param_handles.specs if s.fqn.endswith("wq.weight"))  # type: ignore[union-attr]
    assert spec.placements == (Replicate(), StridedShard(0, split_factor=2), Shard(0))


def test_transformers_plan_is_read_from_the_model() -> None:
    model = W.build("hf_llama")
    tree = fprep.ModuleTree.of(model)
    assert tree.tp_plan is not None
    own = dict(tree.tp_plan)
    assert own["model.layers.*.self_attn.q_proj"] == "colwise"
    assert own["lm_head"] == "colwise_gather_output"
    assert dict(tree.head_counts) == {"num_attention_heads": 4, "num_key_value_heads": 4}
    state = plan(model, PrepConfig(strategy="fsdp", tp=2), world=4)
    mods = dict(state.extension.tensor_parallel.modules)  # type: ignore[union-attr]
    assert mods["model.layers.0.mlp.down_proj"] == "rowwise"
    error = refusal(model, PrepConfig(strategy="fsdp", tp=8), world=8)
    assert isinstance(error, ConfigError) and "num_attention_heads=4" in error.message


def test_tp_crossing_nodes_is_noted() -> None:
    state = plan(llama_tiny("meta"), PrepConfig(strategy="fsdp", tp=2), world=6, local=3)
    assert "cross nodes" in state.extension.tensor_parallel.notes[0]  # type: ignore[union-attr]


def test_config_round_trip_and_styles() -> None:
    cfg = PrepConfig(tp=2, tp_plan={"b": "rowwise", "a": "colwise"})
    assert cfg.tp_plan_pairs == (("a", "colwise"), ("b", "rowwise"))
    assert PrepConfig.from_dict(cfg.to_dict()) == cfg
    with pytest.raises(ConfigError, match="expert-parallel") as info:
        PrepConfig(tp=2, tp_plan={"mlp.experts": "ep_dispatch_experts"})
    assert info.value.subject == "tp_plan"
    with pytest.raises(ConfigError, match="unknown style") as info:
        PrepConfig(tp=2, tp_plan={"a": "colwize"})
    assert "colwise" in info.value.hint
    with pytest.raises(ConfigError, match="sequence_parallel=True"):
        PrepConfig(tp=2, tp_plan={"norm": "sequence_parallel"})
    with pytest.raises(ConfigError) as info:
        PrepConfig(tp=0)
    assert info.value.subject == "tp"


def mlp() -> nn.Module:
    return nn.Sequential(nn.Linear(8, 6), nn.ReLU(), nn.Linear(6, 8))


@pytest.mark.parametrize(
    ("model", "cfg", "world", "subject", "words"),
    [
        (llama_tiny, PrepConfig(strategy="fsdp", tp=3), 4, "tp", "does not divide the world"),
        (tiny_gpt, PrepConfig(strategy="fsdp", tp=2), 4, "tp_plan", "no tensor-parallel plan"),
        (mlp, PrepConfig(tp=2, tp_plan={"5": "colwise"}), 4, "tp_plan", "matches no module"),
        (mlp, PrepConfig(tp=2, tp_plan={"1": "colwise"}), 4, "tp_plan", "it is a ReLU"),
        (mlp, PrepConfig(tp=4, tp_plan={"0": "colwise"}), 4, "tp", "dim 0 (size 6)"),
        (mlp, PrepConfig(tp=4, tp_plan={"2": "rowwise"}), 4, "tp", "dim 1 (size 6)"),
        (mlp, PrepConfig(tp=2, tp_plan={"0": "embedding_rowwise"}), 2, "tp_plan", "Embedding"),
        (mlp, PrepConfig(tp=2, tp_plan={"*": "colwise", "0": "rowwise"}), 2, "tp_plan", "and"),
        (llama_tiny, PrepConfig(strategy="ddp", tp=2), 4, "strategy", "DDP cannot"),
        (llama_tiny, PrepConfig(strategy="none", tp=2), 4, "strategy", "never synchronize"),
        (
            llama_tiny,
            PrepConfig(strategy="hsdp", tp=2, hsdp_shard_size=3),
            8,
            "hsdp_shard_size",
            "does not divide",
        ),
        (
            mlp,
            PrepConfig(strategy="fsdp", tp=2, tp_plan={"0": "colwise"}, ignored_modules=("0",)),
            4,
            "tp_plan",
            "ignored",
        ),
    ],
)
def test_refusals_name_the_field(
    model: Any, cfg: PrepConfig, world: int, subject: str, words: str
) -> None:
    error = refusal(model(), cfg, world)
    assert isinstance(error, ConfigError), error
    assert error.subject == subject and words in str(error), str(error)


def test_tied_parameter_laid_out_alike_by_every_use_is_planned_once() -> None:
    """The embedding ('embedding_rowwise') and the head ('colwise_gather_output') both cut the
    vocabulary: the tied weight is planned once, Shard(0)."""
    model = llama(LlamaConfig(tie_embeddings=True), "meta")
    tps = plan(model, PrepConfig(strategy="fsdp", tp=2), world=4).tensor_parallel
    assert tps is not None
    assert dict(tps.placements)["tok_embeddings.weight"] == Shard(0)
    assert "output.weight" not in dict(tps.placements)


def test_tied_parameter_laid_out_differently_is_refused_in_a_users_plan() -> None:
    model = llama(LlamaConfig(tie_embeddings=True), "meta")
    own = dict(type(model)._tp_plan)
    own["output"] = "rowwise"
    error = refusal(model, PrepConfig(strategy="fsdp", tp=2, tp_plan=own), 4)
    assert isinstance(error, ModelError) and error.subject == "tok_embeddings.weight"
    assert "embedding_rowwise" in error.message and "rowwise" in error.message


def test_tied_parameter_laid_out_differently_by_the_models_plan_is_kept_whole() -> None:
    """A model's own plan that lays the uses of a tied weight out differently: both modules are
    kept whole on every tp rank, and the plan says why."""

    class Tied(Llama):
        _tp_plan: ClassVar[dict[str, str]] = {**Llama._tp_plan, "output": "rowwise"}

    model = llama(LlamaConfig(tie_embeddings=True), "meta")
    model.__class__ = Tied
    tps = plan(model, PrepConfig(strategy="fsdp", tp=2), world=4).tensor_parallel
    assert tps is not None
    assert "tok_embeddings.weight" not in dict(tps.placements)
    assert {"tok_embeddings", "output"}.isdisjoint(f for f, _ in tps.modules)
    assert any("is tied" in n and "kept whole" in n for n in tps.notes)


def test_a_mesh_with_tp_is_refused() -> None:
    tree = fprep.ModuleTree.of(llama_tiny("meta"))
    state = fprep.initial_state(
        tree,
        PrepConfig(strategy="fsdp", tp=2),
        Topology(world_size=4),
        mesh=fprep.MeshSpec(shape=(4,)),
    )
    error = fprep.init_process_group(state).failure()
    assert isinstance(error, ConfigError) and error.subject == "tp"


def test_data_loader_splits_by_the_data_parallel_rank() -> None:
    """Under tp the ranks of a tp group feed the same batch: the loader splits over dp only."""
    from torch.utils.data import DataLoader

    data = list(range(16))
    seen = []
    for rank in range(4):
        state = plan(llama_tiny("meta"), PrepConfig(strategy="fsdp", tp=2), world=4, rank=rank)
        loader = fprep.prepare_data_loader(state, DataLoader(data, batch_size=2))
        seen.append([b.tolist() for b in loader])
    assert seen[0] == seen[1] and seen[2] == seen[3] and seen[0] != seen[2]
    assert sorted(x for batch in seen[0] + seen[2] for x in batch) == data


# -- plan versus torch, any world (fake groups) ----------------------------------------------
KINDS = ("colwise", "rowwise", "replicate", None)


@st.composite
def layouts(draw: st.DrawFn) -> tuple[list[tuple[int, int]], list[str | None], PrepConfig, int]:
    tp = draw(st.sampled_from((1, 2, 4)))
    dp = draw(st.sampled_from((1, 2, 3, 4)))
    hybrid = draw(st.booleans()) and dp % 2 == 0
    kinds = draw(st.lists(st.sampled_from(KINDS), min_size=1, max_size=3))
    dims = []
    for kind in kinds:  # the tp-sharded dim divides by tp; the other is any size
        out = draw(st.integers(1, 9)) * (tp if kind == "colwise" else 1)
        inp = draw(st.integers(1, 9)) * (tp if kind == "rowwise" else 1)
        dims.append((out, inp))
    plan_pairs = {str(i): k for i, k in enumerate(kinds) if k is not None}
    strategy = "hsdp" if hybrid else ("fsdp" if dp > 1 else "none")
    cfg = PrepConfig(
        strategy=strategy,
        tp=tp,
        tp_plan=plan_pairs or None if tp > 1 else None,
        hsdp_shard_size=2 if hybrid else None,
        wrap=nn.Linear if dp > 1 else None,
    )
    if tp > 1 and not plan_pairs:
        cfg = cfg.replace(tp=1)
    return dims, list(kinds), cfg, dp * cfg.tp


def linears(dims: list[tuple[int, int]]) -> nn.Module:
    return nn.Sequential(*(nn.Linear(i, o) for o, i in dims))


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(layouts(), st.data())
def test_planned_local_blocks_are_torchs(layout: Any, data: st.DataObject) -> None:
    """For random shapes, styles and worlds, fprep.prepare on a fake group gives every
    parameter exactly the planned local shape, mesh dims and placements. (The real block is
    the reference: ``compute_local_shape_and_global_offset`` over FSDP2's concatenated mesh
    disagrees with the block FSDP2 allocates for uneven shards, so it is not used.)"""
    dims, _, cfg, world = layout
    if world == 1:
        return
    rank = data.draw(st.integers(0, world - 1), label="rank")
    model = linears(dims)
    with fake_world(world, rank), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        topo = Topology(world_size=world, rank=rank, local_world_size=world)
        state, prepared = fprep.prepare(model, cfg, topology=topo)
        params = dict(prepared.named_parameters())
        for spec in state.param_handles.specs:  # type: ignore[union-attr]
            p = params[spec.fqn]
            if not spec.placements:  # without tp: plain FSDP2 (tests/test_plan_vs_fsdp.py)
                local_tensor = p.to_local() if hasattr(p, "to_local") else p
                assert tuple(local_tensor.shape) == spec.local_shape
                continue
            assert tuple(p.to_local().shape) == spec.local_shape, spec
            assert tuple(p.placements) == tuple(to_torch(x) for x in spec.placements)
            assert tuple(repr(x) for x in p.placements) == tuple(map(str, spec.placements))
            assert tuple(p.device_mesh.mesh_dim_names) == spec.mesh_dims


@given(
    st.sampled_from((1, 2, 4)),
    st.integers(1, 5),
    st.integers(1, 12),
    st.integers(1, 6),
    st.sampled_from((0, 1, None)),
    st.booleans(),
)
def test_every_element_is_owned_once_per_replica(
    tp: int, dp: int, rows_per_tp: int, cols: int, tp_dim: int | None, hybrid: bool
) -> None:
    """Over all ranks of one data-parallel replica, the planned blocks partition the tensor."""
    from fprep.sharding import TPLayout
    from fprep.snapshot import ParamInfo

    shape = (rows_per_tp * tp, cols * tp)
    p = ParamInfo(names=("w",), shape=shape)
    owned = torch.zeros(shape, dtype=torch.int64)
    for t in range(tp):
        for d in range(dp):
            layout = TPLayout(
                tp=tp, tp_rank=t, dp_dims=("dp",), hybrid=hybrid, params={"w": tp_dim}
            )
            local, _, _, _, _ = layout.place(p, (dp, d))
            rows, cols_ = W.reference_block(shape, tp, tp_dim, t, dp, d)
            assert local == (len(rows), len(cols_))
            owned[rows[:, None], cols_[None, :]] += 1
    assert bool((owned == (tp if tp_dim is None else 1)).all())


# -- training at 4 ranks (gloo) --------------------------------------------------------------
@pytest.fixture(scope="module")
def four_ranks() -> list[dict[str, Any]]:
    return run_ranks(W.four_ranks, 4, timeout_s=900)


@pytest.mark.parametrize("model", W.MODELS)
@pytest.mark.parametrize("layout", tuple(W.LAYOUTS))
def test_training_equals_one_process(
    four_ranks: list[dict[str, Any]], model: str, layout: str
) -> None:
    """Losses (mean over dp ranks), clipped gradient norms and accumulation equal the
    single-process reference in fp32 within 1e-5, and every parameter's planned placement and
    local shape is the real DTensor's."""
    ref = W.reference(model)
    outs = [r[f"{model}/{layout}"] for r in four_ranks]
    by_dp: dict[int, list[float]] = {}
    for out in outs:
        assert out["mismatches"] == []
        by_dp.setdefault(out["dp_rank"], out["losses"])
        assert out["losses"] == pytest.approx(by_dp[out["dp_rank"]], abs=1e-6)  # tp ranks agree
    mean = [sum(v[i] for v in by_dp.values()) / len(by_dp) for i in range(W.STEPS)]
    assert mean == pytest.approx(ref["losses"], abs=1e-5)
    for out in outs:
        assert out["norms"] == pytest.approx(ref["norms"], abs=1e-5)
        assert all(n > W.MAX_NORM for n in out["norms"])  # clipping acted
