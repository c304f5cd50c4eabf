"""Tensor-parallel plans of transformers models as transformers resolves them: rules that name
parameters (fused experts), the styles beyond torch's classes, a model plan's patterns this
configuration lacks, and head counts that vary by layer. Pure planning; the numerics of each
style are tests/test_tp_module_styles.py's."""

from __future__ import annotations

from typing import Any, ClassVar

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from returns.result import Failure
from torch import nn

import fprep
from fprep import ConfigError, PrepConfig, Topology
from fprep.apply.placements import to_torch
from fprep.layout import Replicate, Shard, StridedShard
from fprep.layout.styles import STYLES, param_placement
from fprep.state import TensorParallelState
from fprep.testing.distributed import fake_world


def tiny_qwen3_moe(**extra: Any) -> nn.Module:
    import transformers as tf

    shape: dict[str, Any] = dict(
        hidden_size=32,
        intermediate_size=64,
        moe_intermediate_size=16,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        num_experts=4,
        num_experts_per_tok=2,
        vocab_size=64,
    )
    config = tf.Qwen3MoeConfig(**{**shape, **extra})
    with torch.device("meta"):
        return tf.Qwen3MoeForCausalLM(config)


def tp_state(model: nn.Module, cfg: PrepConfig | None = None, world: int = 4) -> Any:
    cfg = cfg or PrepConfig(strategy="fsdp", tp=2)
    return fprep.plan(model, cfg, Topology(world_size=world))


def tps_of(model: nn.Module, cfg: PrepConfig | None = None) -> TensorParallelState:
    tps = tp_state(model, cfg).unwrap().tensor_parallel
    assert tps is not None
    return tps


def test_fused_experts_are_planned_per_parameter() -> None:
    """Qwen3-MoE's plan names the experts' 3-D tensors: gate_up_proj packed (each half cut on
    its own over the intermediate dim), down_proj cut on its last (intermediate) dim; the
    experts module runs on its shards and sums its output over tp."""
    tps = tps_of(tiny_qwen3_moe())
    placed = dict(tps.placements)
    assert placed["model.layers.0.mlp.experts.gate_up_proj"] == StridedShard(1, 2)
    assert placed["model.layers.0.mlp.experts.down_proj"] == Shard(2)
    assert dict(tps.modules)["model.layers.1.mlp.experts"] == "moe_tp_experts"
    assert dict(tps.params)["model.layers.0.mlp.experts.gate_up_proj"] == 1
    # transformers' resolved plan shards the vocabulary of the input embedding
    assert placed["model.embed_tokens.weight"] == Shard(0)


def test_a_models_patterns_this_configuration_lacks_are_skipped_and_noted() -> None:
    """Every layer sparse: the plan's dense mlp patterns match nothing, as in transformers."""
    tps = tps_of(tiny_qwen3_moe(mlp_only_layers=[]))
    skipped = [n for n in tps.notes if "skipped" in n]
    assert skipped and "model.layers.*.mlp.down_proj" in skipped[0]


def test_the_same_pattern_in_a_users_plan_is_refused() -> None:
    model = tiny_qwen3_moe()
    plan = {"model.layers.*.mlp.down_proj": "rowwise"}
    error = tp_state(model, PrepConfig(strategy="fsdp", tp=2, tp_plan=plan)).failure()
    assert isinstance(error, ConfigError) and "matches no module or parameter" in error.message


def test_packed_halves_must_each_divide_by_tp() -> None:
    """moe_intermediate_size 6: gate_up_proj has 12 rows, 2 halves of 6, and tp 4 does not
    cut 6 evenly."""
    error = tp_state(tiny_qwen3_moe(moe_intermediate_size=6), PrepConfig(strategy="fsdp", tp=4), 8)
    failure = error.failure()
    assert isinstance(failure, ConfigError) and failure.subject == "tp"
    assert "in two halves" in failure.message and "gate_up_proj" in failure.message


def test_a_sharded_parameter_needs_a_module_that_runs_on_shards() -> None:
    model = tiny_qwen3_moe()
    plan = {"model.layers.*.mlp.experts.down_proj": "rowwise"}  # no 'moe_tp_experts'
    failure = tp_state(model, PrepConfig(strategy="fsdp", tp=2, tp_plan=plan)).failure()
    assert isinstance(failure, ConfigError) and "mix the shard" in failure.message


def test_per_layer_head_counts_are_read_per_layer() -> None:
    """dots3's config refuses a global num_attention_heads (it varies by layer): the plan
    reads each layer's (transformers raised AmbiguousGlobalPerLayerAttributeError)."""
    import _family_scan as S
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    model = S.build("dots3_note_text", CONFIG_MAPPING["dots3_note_text"]())
    tree = fprep.ModuleTree.of(model)
    assert ("num_attention_heads", 128) in tree.head_counts
    assert isinstance(tp_state(model).unwrap(), fprep.PrepState)


def test_deepseek_mla_rope_dim_is_planned() -> None:
    import transformers as tf

    config = tf.DeepseekV2Config(
        hidden_size=32,
        intermediate_size=64,
        moe_intermediate_size=16,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=4,
        n_routed_experts=4,
        num_experts_per_tok=2,
        kv_lora_rank=16,
        q_lora_rank=16,
        qk_rope_head_dim=8,
        qk_nope_head_dim=8,
        v_head_dim=8,
        vocab_size=64,
    )
    with torch.device("meta"):
        model = tf.DeepseekV2ForCausalLM(config)
    tps = tps_of(model)
    assert tps.rope_dim == 8
    assert dict(tps.modules)["model.layers.0.self_attn.kv_a_proj_with_mqa"] == "mla_kv_a_proj"


# -- the planned placement is the one transformers' own style gives (fake tp group) ----------
RULED = ("colwise", "rowwise", "packed_colwise", "packed_rowwise")


@settings(max_examples=30, deadline=None)
@given(
    style=st.sampled_from(RULED),
    ndim=st.integers(1, 3),
    tp=st.sampled_from((2, 4)),
    sizes=st.lists(st.integers(1, 3), min_size=3, max_size=3),
)
def test_a_parameter_rule_places_like_transformers(
    style: str, ndim: int, tp: int, sizes: list[int]
) -> None:
    """For a rule naming a parameter of any rank, fprep's planned placement (to torch) equals
    the placement transformers' own style gives it on a tp mesh."""
    from torch.distributed.device_mesh import init_device_mesh
    from transformers.distributed.tensor_parallel import ALL_PARALLEL_STYLES

    shape = tuple(s * 2 * tp for s in sizes[:ndim])
    planned = param_placement(STYLES[style].kind, ndim, "w", own_rule=True)
    module = nn.Module()
    module.register_parameter("w", nn.Parameter(torch.empty(shape, device="meta")))
    with fake_world(tp, 0):
        mesh = init_device_mesh("cpu", (tp,))
        ALL_PARALLEL_STYLES[style].shard_param(module, "w", mesh)
        real = getattr(module.w, "placements", None)
        expected = None if planned is None else to_torch(planned)
        assert real is not None and expected is not None
        assert _normalized(real[0], ndim) == _normalized(expected, ndim)


def _normalized(placement: Any, ndim: int) -> tuple[str, int, int]:
    dim = getattr(placement, "dim", -1)
    factor = getattr(placement, "split_factor", 1)
    return type(placement).__name__, dim % ndim if ndim else 0, factor


def test_unknown_module_style_on_a_parameter_is_refused() -> None:
    model = tiny_qwen3_moe()
    plan = {
        "model.layers.*.mlp.experts.down_proj": "moe_tp_experts",
    }
    result = tp_state(model, PrepConfig(strategy="fsdp", tp=2, tp_plan=plan))
    assert isinstance(result, Failure)
    assert "applies to modules only" in result.failure().message


@pytest.mark.parametrize("tied", [True, False])
def test_tied_qwen2_plans_its_vocabulary_once(tied: bool) -> None:
    import transformers as tf

    config = tf.Qwen2Config(
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=64,
        tie_word_embeddings=tied,
    )
    with torch.device("meta"):
        model = tf.Qwen2ForCausalLM(config)
    placed = dict(tps_of(model).placements)
    assert placed["model.embed_tokens.weight"] == Shard(0)
    assert ("lm_head.weight" in placed) is not tied
    assert Replicate() not in {placed["model.embed_tokens.weight"]}


def test_weights_with_a_packed_parameter_under_tp_is_refused_by_name(tmp_path: Any) -> None:
    from safetensors.torch import save_file

    class Packed(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.gate_up = nn.Linear(8, 16)
            self.down = nn.Linear(8, 8)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            gate, up = self.gate_up(x).chunk(2, dim=-1)
            return self.down(torch.nn.functional.silu(gate) * up)

    model = Packed()
    save_file(
        {k: v.contiguous() for k, v in model.state_dict().items()}, tmp_path / "w.safetensors"
    )
    cfg = PrepConfig(
        strategy="fsdp",
        tp=2,
        tp_plan={"gate_up": "packed_colwise", "down": "rowwise"},
        weights=tmp_path / "w.safetensors",
    )
    failure = fprep.plan(model, cfg, Topology(world_size=2)).failure()
    assert isinstance(failure, ConfigError) and failure.subject == "weights"
    assert "'gate_up.weight' is packed" in failure.message


@pytest.mark.parametrize("what", ["save", "load"])
def test_checkpoints_of_a_packed_parameter_under_tp_are_refused_before_any_io(
    what: str, tmp_path: Any
) -> None:
    """A rank's block of a packed parameter is two row ranges, which a checkpoint chunk (one
    offset and size) cannot describe: torch's DCP refuses the save deep inside and fills the
    wrong rows at load. fprep refuses both, naming the parameter, before touching a file."""
    from fprep.errors import CheckpointError

    state = tp_state(tiny_qwen3_moe()).unwrap()
    call = fprep.save if what == "save" else fprep.load
    with pytest.raises(CheckpointError) as info:
        call(tmp_path / "ckpt", state, nn.Linear(1, 1))
    assert info.value.subject == "model.layers.0.mlp.experts.gate_up_proj"
    assert "export_full" in info.value.hint
    assert list(tmp_path.iterdir()) == []


def test_a_packed_linear_cuts_its_bias_like_its_rows_and_packed_rowwise_names_parameters() -> None:
    """The bias of a fused (gate | up) Linear is packed like the weight's rows, so each rank
    holds the bias of its own output block; packed_rowwise on a module is refused."""
    model = nn.Sequential(nn.Linear(8, 16), nn.Linear(8, 8))
    cfg = PrepConfig(strategy="fsdp", tp=2, tp_plan={"0": "packed_colwise", "1": "rowwise"})
    placed = dict(tps_of(model, cfg).placements)
    assert placed["0.weight"] == placed["0.bias"] == StridedShard(0, 2)
    bad = PrepConfig(strategy="fsdp", tp=2, tp_plan={"0": "colwise", "1": "packed_rowwise"})
    failure = tp_state(model, bad).failure()
    assert isinstance(failure, ConfigError) and "lays out a fused parameter" in failure.message


class NormedEmbedding(nn.Embedding):
    """Inkling's embedding: a norm inside the embedding module."""

    def __init__(self) -> None:
        super().__init__(16, 8)
        self.norm = nn.LayerNorm(8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.norm(super().forward(x))


class FusedExperts(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.gate_up_proj = nn.Parameter(torch.empty(2, 8, 8))
        self.down_proj = nn.Parameter(torch.empty(2, 8, 4))


class Inklingish(nn.Module):
    _tp_plan: ClassVar[dict[str, str]] = {
        "embed": "embedding_rowwise",
        "experts.gate_up_proj": "colwise",
        "experts.down_proj": "rowwise",
        "experts": "moe_tp_experts",
    }

    def __init__(self) -> None:
        super().__init__()
        self.embed = NormedEmbedding()
        self.experts = FusedExperts()


def test_a_models_plan_that_would_break_is_fixed_and_noted() -> None:
    """Inkling's own plan: its normed embedding kept whole (torch's style would cut the norm
    too), its fused gate_up_proj 'colwise' planned packed (the forward splits each rank's block
    into gate and up); both said in the notes."""
    tps = tps_of(Inklingish())
    assert "embed" not in dict(tps.modules)
    assert dict(tps.param_rules)["experts.gate_up_proj"] == "packed_colwise"
    assert dict(tps.placements)["experts.gate_up_proj"] == StridedShard(1, 2)
    assert any("kept whole" in n and "embed (embed.norm.weight)" in n for n in tps.notes)
    assert any("planned 'packed_colwise'" in n for n in tps.notes)


@pytest.mark.parametrize(
    ("plan", "culprit"),
    [
        ({"embed": "embedding_rowwise"}, "besides its weight"),
        ({"experts.gate_up_proj": "colwise", "experts": "moe_tp_experts"}, "gate rows"),
    ],
)
def test_the_same_in_a_users_plan_is_refused(plan: dict[str, str], culprit: str) -> None:
    failure = tp_state(Inklingish(), PrepConfig(strategy="fsdp", tp=2, tp_plan=plan)).failure()
    assert isinstance(failure, ConfigError) and culprit in failure.message
