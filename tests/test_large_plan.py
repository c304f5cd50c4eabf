"""Planning very large models without hardware: Llama 405B and 8B built on the meta device.

Every expected figure here is computed independently of fprep: parameter counts from the
published shapes, shards from the ``torch.chunk`` rule written out again, and the per-rank memory
as a closed form over the layer shapes (and, separately, from the torch model's own parameters).
"""

from __future__ import annotations

import dataclasses
import math

import pytest
from torch import nn

import fprep
from fprep.state import PrepState
from fprep.testing.models import LLAMA_8B, LLAMA_405B, LlamaBlock, LlamaConfig, llama

FSDP_BF16 = fprep.PrepConfig(strategy="fsdp", wrap=LlamaBlock, precision="bf16")

# Llama 3.1 405B as published: dim 16384, 126 layers, 128 heads / 8 kv heads, SwiGLU 53248,
# vocab 128256, untied embeddings.
D, L, H, KV, F, V = 16384, 126, 128, 8, 53248, 128256
KV_DIM = KV * (D // H)  # 1024


def ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def expected_shards(
    shape: tuple[int, ...], world: int, rank: int
) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """``torch.chunk`` over dim 0, as FSDP2 does it, written out without fprep."""
    rows, rest = shape[0], shape[1:]
    chunk = ceil_div(rows, world)
    start = chunk * rank
    local = max(0, min(rows, start + chunk) - start) if all(rest) else 0
    return (local, *rest), (chunk, *rest)


@pytest.fixture(scope="module")
def model_405b() -> nn.Module:
    return llama(LLAMA_405B)  # meta device


@pytest.fixture(scope="module")
def plan_405b(model_405b: nn.Module) -> PrepState:
    return fprep.plan(model_405b, FSDP_BF16, fprep.Topology(world_size=1024, rank=3)).unwrap()


def test_405b_config_is_the_published_shape() -> None:
    c = LLAMA_405B
    assert (c.dim, c.n_layers, c.n_heads, c.n_kv_heads, c.ffn_dim, c.vocab_size) == (
        D,
        L,
        H,
        KV,
        F,
        V,
    )
    assert not c.tie_embeddings


def test_405b_plan_succeeds_at_world_1024(plan_405b: PrepState) -> None:
    assert plan_405b.is_complete
    core, pg, handles = plan_405b.core, plan_405b.process_group, plan_405b.param_handles
    assert core is not None and pg is not None and handles is not None
    assert core.strategy == "fsdp"
    assert core.precision.param_dtype == "bfloat16"
    assert (pg.world_size, pg.rank, pg.shard_size, pg.shard_rank) == (1024, 3, 1024, 3)
    # One unit per block, inner units first, the root last.
    assert [u.fqn for u in handles.units] == [f"layers.{i}" for i in reversed(range(L))] + [""]
    assert all(u.cls.endswith("LlamaBlock") for u in handles.units[:-1])
    assert handles.ignored == ()
    assert handles.materialize.method == "reset_parameters"  # meta model, reset_parameters


def test_405b_parameter_count_is_the_analytic_count(
    model_405b: nn.Module, plan_405b: PrepState
) -> None:
    per_layer = D * D + 2 * D * KV_DIM + D * D + 3 * D * F + 2 * D  # wq wk wv wo, w1 w2 w3, norms
    analytic = 2 * V * D + L * per_layer + D  # embedding, output, blocks, final norm
    assert analytic == 405_853_388_800
    assert LLAMA_405B.num_params == analytic
    assert sum(p.numel() for p in model_405b.parameters()) == analytic
    assert plan_405b.tree.numel == analytic
    handles = plan_405b.param_handles
    assert handles is not None
    assert sum(s.numel for s in handles.specs) == analytic
    assert len(handles.specs) == len(list(model_405b.parameters())) == 9 * L + 3
    # Each block unit holds exactly its block's parameters.
    for unit in handles.units[:-1]:
        assert unit.numel == per_layer
        assert all(s.fqn.startswith(unit.fqn + ".") for s in unit.params)
    root = handles.units[-1]
    assert {s.fqn for s in root.params} == {"tok_embeddings.weight", "norm.weight", "output.weight"}


def test_405b_shards_obey_the_chunk_rule(plan_405b: PrepState) -> None:
    handles = plan_405b.param_handles
    assert handles is not None
    for spec in handles.specs:
        assert spec.dtype == "float32"
        assert spec.requires_grad
        assert (spec.local_shape, spec.padded_shape) == expected_shards(spec.shape, 1024, 3)
    specs = {s.fqn: s for s in handles.specs}
    # Spot checks by hand: 128256 / 1024 = 125.25 -> chunks of 126 rows; 1024 kv rows -> 1.
    assert specs["tok_embeddings.weight"].padded_shape == (126, D)
    assert specs["tok_embeddings.weight"].local_shape == (126, D)
    assert specs["layers.0.attention.wk.weight"].local_shape == (1, D)
    assert specs["layers.0.feed_forward.w2.weight"].local_shape == (16, F)
    assert specs["norm.weight"].local_shape == (16,)


def test_405b_shards_at_other_ranks(model_405b: nn.Module) -> None:
    """The last ranks get a short or empty embedding shard; the padded shard never changes."""
    tree = fprep.ModuleTree.of(model_405b)  # one snapshot, several plans
    by_rank = {}
    for rank in (0, 1017, 1018, 1023):
        state = fprep.plan(tree, FSDP_BF16, fprep.Topology(world_size=1024, rank=rank)).unwrap()
        assert state.param_handles is not None
        by_rank[rank] = {s.fqn: s for s in state.param_handles.specs}
        for spec in state.param_handles.specs:
            assert (spec.local_shape, spec.padded_shape) == expected_shards(spec.shape, 1024, rank)
    # 128256 rows in chunks of 126: rank 1017 holds 128256 - 1017 * 126 = 114 rows, 1018 none.
    assert by_rank[0]["output.weight"].local_shape == (126, D)
    assert by_rank[1017]["output.weight"].local_shape == (114, D)
    assert by_rank[1018]["output.weight"].local_shape == (0, D)
    assert by_rank[1023]["output.weight"].local_shape == (0, D)
    assert {s.padded_shape for s in (r["output.weight"] for r in by_rank.values())} == {(126, D)}


def test_405b_memory_estimate(model_405b: nn.Module, plan_405b: PrepState) -> None:
    est = fprep.estimate_memory(plan_405b)
    # Closed form per rank (float32 storage, world 1024): padded rows of each weight.
    per_layer_elems = (
        (D // 1024) * D * 2  # wq, wo: 16 rows of 16384
        + (KV_DIM // 1024) * D * 2  # wk, wv: 1 row
        + (F // 1024) * D * 2  # w1, w3: 52 rows
        + (D // 1024) * F  # w2: 16 rows of 53248
        + (D // 1024) * 2  # two norms: 16 elements each
    )
    root_elems = 2 * ceil_div(V, 1024) * D + D // 1024  # embedding, output (padded), norm
    param_bytes = 4 * (L * per_layer_elems + root_elems)
    assert est.params == param_bytes
    # The same figure straight from the torch model's parameters.
    from_torch = sum(
        4 * ceil_div(p.shape[0], 1024) * math.prod(p.shape[1:]) for p in model_405b.parameters()
    )
    assert from_torch == param_bytes
    assert est.grads == param_bytes  # every parameter trains
    assert est.adam == 2 * param_bytes
    assert est.sgd_momentum == param_bytes
    assert est.total("adam") == 4 * param_bytes
    assert est.total("sgd") == 2 * param_bytes
    # The transient all-gather: the root (embedding + output + norm) in bf16 is the biggest unit.
    assert est.largest_unit_unsharded == 2 * (2 * V * D + D)
    assert est.fused_grad_buffer == 0
    assert not est.on_host
    # Sanity: about 1.6 GB of float32 parameters per rank; padding costs only the embeddings.
    assert 1.58e9 < est.params < 1.60e9
    assert est.params * 1024 - 4 * LLAMA_405B.num_params == 4 * 2 * (126 * 1024 - V) * D


@pytest.mark.parametrize("world", [2, 8, 24, 64, 1000, 4096])
def test_8b_at_several_world_sizes(world: int) -> None:
    model = llama(LLAMA_8B)
    tree = fprep.ModuleTree.of(model)
    assert tree.numel == LLAMA_8B.num_params == 8_030_261_248
    rank = world - 1 - world // 3
    state = fprep.plan(tree, FSDP_BF16, fprep.Topology(world_size=world, rank=rank)).unwrap()
    handles = state.param_handles
    assert handles is not None and state.core is not None
    assert state.core.strategy == "fsdp"
    assert len(handles.units) == LLAMA_8B.n_layers + 1
    assert sum(s.numel for s in handles.specs) == LLAMA_8B.num_params
    for spec in handles.specs:
        assert (spec.local_shape, spec.padded_shape) == expected_shards(spec.shape, world, rank)
    expected = sum(
        4 * ceil_div(p.shape[0], world) * math.prod(p.shape[1:]) for p in model.parameters()
    )
    assert fprep.estimate_memory(state).params == expected


def test_8b_shards_partition_every_parameter() -> None:
    """Planned for each of 24 ranks, the local shards of every parameter add up to the whole
    parameter, and every rank pads to the same shape."""
    tree = fprep.ModuleTree.of(llama(LLAMA_8B))
    world = 24  # divides none of 4096, 1024, 14336: uneven shards and padding everywhere
    rows: dict[str, int] = {}
    padded: dict[str, set[tuple[int, ...]]] = {}
    for rank in range(world):
        state = fprep.plan(tree, FSDP_BF16, fprep.Topology(world_size=world, rank=rank)).unwrap()
        assert state.param_handles is not None
        for spec in state.param_handles.specs:
            rows[spec.fqn] = rows.get(spec.fqn, 0) + spec.local_shape[0]
            padded.setdefault(spec.fqn, set()).add(spec.padded_shape)
    for p in tree.params:
        assert rows[p.fqn] == p.shape[0], p.fqn
        assert len(padded[p.fqn]) == 1
        (pad,) = padded[p.fqn]
        assert pad[0] * world >= p.shape[0] > (pad[0] - 1) * world


def test_8b_grad_op_and_fp16_plan() -> None:
    cfg = FSDP_BF16.replace(sharding="grad_op", precision="fp16")
    state = fprep.plan(llama(LLAMA_8B), cfg, fprep.Topology(world_size=64, rank=5)).unwrap()
    assert state.core is not None and state.param_handles is not None
    assert state.core.reshard_after_forward is False
    assert state.core.precision.param_dtype == "float16"
    assert state.core.precision.grad_scaling
    assert all(u.reshard_after_forward is False for u in state.param_handles.units)


def test_405b_hsdp_plan(model_405b: nn.Module) -> None:
    """128 nodes of 8: shard within the node, replicate across nodes."""
    cfg = FSDP_BF16.replace(strategy="hsdp")
    topo = fprep.Topology(world_size=1024, rank=1021, local_world_size=8)
    state = fprep.plan(model_405b, cfg, topo).unwrap()
    core, pg, handles = state.core, state.process_group, state.param_handles
    assert core is not None and pg is not None and handles is not None
    assert core.strategy == "hsdp"
    assert pg.mesh_shape == (128, 8)
    assert pg.mesh_dim_names == ("replicate", "shard")
    assert pg.coordinate == (127, 5)  # 1021 = 127 * 8 + 5
    assert pg.shard_group == tuple(range(1016, 1024))
    assert pg.replicate_group == tuple(range(5, 1024, 8))
    assert (pg.shard_size, pg.shard_rank, pg.replicate_size) == (8, 5, 128)
    for spec in handles.specs:
        assert (spec.local_shape, spec.padded_shape) == expected_shards(spec.shape, 8, 5)
    est = fprep.estimate_memory(state)
    expected = sum(
        4 * ceil_div(p.shape[0], 8) * math.prod(p.shape[1:]) for p in model_405b.parameters()
    )
    assert est.params == expected
    # 405.9e9 float32 parameters over 8 shards: about 203 GB per rank.
    assert est.params == pytest.approx(4 * LLAMA_405B.num_params / 8, rel=1e-6)


def test_hsdp_shard_size_option() -> None:
    cfg = FSDP_BF16.replace(strategy="hsdp", hsdp_shard_size=32)
    state = fprep.plan(llama(LLAMA_8B), cfg, fprep.Topology(world_size=256, rank=77)).unwrap()
    pg, handles = state.process_group, state.param_handles
    assert pg is not None and handles is not None
    assert pg.mesh_shape == (8, 32)
    assert (pg.shard_size, pg.shard_rank) == (32, 77 % 32)
    for spec in handles.specs:
        assert (spec.local_shape, spec.padded_shape) == expected_shards(spec.shape, 32, 77 % 32)


def test_variable_depth_plans_scale_with_the_model() -> None:
    """Units and specs grow with the number of layers and nothing else changes per block."""
    shapes = {}
    for layers in (1, 4, 16):
        config: LlamaConfig = dataclasses.replace(LLAMA_405B, n_layers=layers)
        state = fprep.plan(
            llama(config), FSDP_BF16, fprep.Topology(world_size=1024, rank=3)
        ).unwrap()
        assert state.param_handles is not None
        assert len(state.param_handles.units) == layers + 1
        assert len(state.param_handles.specs) == 9 * layers + 3
        shapes[layers] = [
            (s.fqn.split(".", 2)[-1], s.local_shape, s.padded_shape)
            for s in state.param_handles.units[0].params
        ]
    assert shapes[1] == shapes[4] == shapes[16]
