"""PrepConfig.from_accelerate: Accelerate config files (YAML / JSON) to PrepConfig."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from fprep import ConfigError, PrepConfig

FSDP_YAML = """\
compute_environment: LOCAL_MACHINE
distributed_type: FSDP
mixed_precision: bf16
num_machines: 1
num_processes: 8
fsdp_config:
  fsdp_auto_wrap_policy: TRANSFORMER_BASED_WRAP
  fsdp_transformer_layer_cls_to_wrap: LlamaDecoderLayer, MistralDecoderLayer
  fsdp_sharding_strategy: SHARD_GRAD_OP
  fsdp_offload_params: true
  fsdp_state_dict_type: FULL_STATE_DICT
  fsdp_backward_prefetch: NO_PREFETCH
  fsdp_forward_prefetch: true
  fsdp_sync_module_states: true
  fsdp_activation_checkpointing: true
dynamo_config:
  dynamo_backend: INDUCTOR
  dynamo_mode: max-autotune
"""


def test_fsdp_yaml(tmp_path: Path) -> None:
    path = tmp_path / "default_config.yaml"
    path.write_text(FSDP_YAML)
    cfg = PrepConfig.from_accelerate(path)
    assert cfg == PrepConfig(
        strategy="fsdp",
        sharding="grad_op",
        precision="bf16",
        wrap=("LlamaDecoderLayer", "MistralDecoderLayer"),
        offload="cpu",
        state_dict_type="full",
        backward_prefetch=0,
        forward_prefetch=1,
        sync_module_states=True,
        activation_checkpointing=True,
        compile="whole",
        compile_backend="inductor",
        compile_mode="max-autotune",
    )


@pytest.mark.parametrize(
    ("data", "expected"),
    [
        ({"distributed_type": "NO"}, PrepConfig(strategy="none")),
        (
            {"distributed_type": "MULTI_GPU", "mixed_precision": "fp16"},
            PrepConfig(strategy="ddp", precision="fp16"),
        ),
        ({"distributed_type": "MULTI_HPU"}, PrepConfig(strategy="auto")),
        (
            {"distributed_type": "MULTI_CPU", "use_cpu": True},
            PrepConfig(strategy="ddp", device="cpu"),
        ),
        (
            {
                "distributed_type": "FSDP",
                "fsdp_config": {
                    "fsdp_sharding_strategy": 4,
                    "fsdp_auto_wrap_policy": "SIZE_BASED_WRAP",
                    "fsdp_min_num_params": 1000,
                },
            },
            PrepConfig(strategy="hsdp", wrap=1000),
        ),
        (
            {
                "distributed_type": "FSDP",
                "fsdp_config": {"fsdp_version": 2, "fsdp_reshard_after_forward": False},
            },
            PrepConfig(strategy="fsdp", sharding="grad_op"),
        ),
    ],
)
def test_json_and_dicts(tmp_path: Path, data: dict[str, object], expected: PrepConfig) -> None:
    path = tmp_path / "config.json"
    path.write_text(json.dumps(data))
    assert PrepConfig.from_accelerate(path) == expected
    assert PrepConfig.from_accelerate(data) == expected


@pytest.mark.parametrize(
    ("data", "subject"),
    [
        ({"distributed_type": "DEEPSPEED"}, "distributed_type"),
        ({"distributed_type": "TPU_POD"}, "distributed_type"),
        ({"mixed_precision": "fp4"}, "mixed_precision"),
        (
            {"distributed_type": "FSDP", "fsdp_config": {"fsdp_sharding_strategy": "ZERO3"}},
            "fsdp_sharding_strategy",
        ),
        (
            {
                "distributed_type": "FSDP",
                "fsdp_config": {"fsdp_auto_wrap_policy": "TRANSFORMER_BASED_WRAP"},
            },
            "fsdp_transformer_layer_cls_to_wrap",
        ),
    ],
)
def test_unsupported_values_name_the_accelerate_field(
    data: dict[str, object], subject: str
) -> None:
    with pytest.raises(ConfigError) as info:
        PrepConfig.from_accelerate(data)
    assert info.value.subject == subject


def test_overrides_and_missing_files(tmp_path: Path) -> None:
    assert PrepConfig.from_accelerate({"distributed_type": "FSDP"}, seed=3).seed == 3
    with pytest.raises(ConfigError):
        PrepConfig.from_accelerate(tmp_path / "nope.yaml")
    bad = tmp_path / "evil.yaml"
    bad.write_text("!!python/object/apply:os.system ['touch pwned']\n")
    with pytest.raises(ConfigError) as info:  # safe_load refuses tags that would run code
        PrepConfig.from_accelerate(bad)
    assert not (tmp_path / "pwned").exists() and "python/object" in str(info.value)
    broken = tmp_path / "broken.json"
    broken.write_text("{not json")
    with pytest.raises(ConfigError) as info:
        PrepConfig.from_accelerate(broken)
    assert info.value.subject == str(broken)
    with pytest.raises(ConfigError) as info:
        PrepConfig.from_accelerate(
            {
                "distributed_type": "FSDP",
                "fsdp_config": {
                    "fsdp_auto_wrap_policy": "SIZE_BASED_WRAP",
                    "fsdp_min_num_params": "lots",
                },
            }
        )
    assert info.value.subject == "fsdp_min_num_params"


# -- Accelerate's ParallelismConfig -----------------------------------------------------------
PARALLEL_YAML = """\
distributed_type: FSDP
mixed_precision: bf16
num_processes: 8
fsdp_config:
  fsdp_version: 2
  fsdp_reshard_after_forward: true
parallelism_config:
  parallelism_config_dp_replicate_size: 2
  parallelism_config_dp_shard_size: 2
  parallelism_config_tp_size: 2
  parallelism_config_cp_size: 1
"""


def test_parallelism_section_of_a_config_file(tmp_path: Path) -> None:
    path = tmp_path / "tp.yaml"
    path.write_text(PARALLEL_YAML)
    cfg = PrepConfig.from_accelerate(path)
    assert (cfg.strategy, cfg.hsdp_shard_size, cfg.tp, cfg.precision) == ("hsdp", 2, 2, "bf16")


class ParallelismConfig:  # the attributes of accelerate.ParallelismConfig (not installed here)
    def __init__(self, **sizes: int) -> None:
        self.dp_replicate_size = sizes.get("dp_replicate_size", 1)
        self.dp_shard_size = sizes.get("dp_shard_size", 1)
        self.tp_size = sizes.get("tp_size", 1)
        self.cp_size = sizes.get("cp_size", 1)


@pytest.mark.parametrize(
    ("sizes", "expected"),
    [
        ({"dp_shard_size": 4, "tp_size": 2}, {"strategy": "fsdp", "tp": 2}),
        (
            {"dp_replicate_size": 2, "dp_shard_size": 4, "tp_size": 2},
            {"strategy": "hsdp", "hsdp_shard_size": 4, "tp": 2},
        ),
        (
            {"dp_replicate_size": 2, "tp_size": 2},
            {"strategy": "hsdp", "hsdp_shard_size": 1, "tp": 2},
        ),
        ({"dp_replicate_size": 4}, {"strategy": "ddp"}),
        ({"tp_size": 4}, {"strategy": "auto", "tp": 4}),
        ({"dp_shard_size": 8}, {"strategy": "fsdp"}),
    ],
)
def test_parallelism_config_object(sizes: dict[str, int], expected: dict[str, object]) -> None:
    cfg = PrepConfig.from_accelerate(parallelism=ParallelismConfig(**sizes))
    assert cfg == PrepConfig(**expected)  # type: ignore[arg-type]
    # the plan lays it out as Accelerate does: (replicate, shard, tp), tp innermost
    world = 1
    for v in sizes.values():
        world *= v
    if cfg.tp > 1 and world > cfg.tp:
        import fprep
        from fprep.testing.models import llama_tiny

        topo = fprep.Topology(world_size=world, rank=0, local_world_size=min(8, world))
        state = fprep.plan(llama_tiny("meta"), cfg, topo).unwrap()
        tps = state.extension.tensor_parallel  # type: ignore[union-attr]
        assert tps is not None and tps.mesh_shape[-1] == sizes["tp_size"]
        rep, shard = sizes.get("dp_replicate_size", 1), sizes.get("dp_shard_size", 1)
        assert tps.mesh_shape == ((rep, shard, cfg.tp) if rep > 1 else (shard, cfg.tp))


@pytest.mark.parametrize(
    ("section", "subject"),
    [
        ({"parallelism_config_cp_size": 2}, "parallelism_config_cp_size"),
        ({"parallelism_config_sp_size": 2}, "parallelism_config_sp_size"),
        ({"parallelism_config_tp_size": 0}, "parallelism_config_tp_size"),
        ({"parallelism_config_tp_size": "two"}, "parallelism_config_tp_size"),
        (
            {"parallelism_config_tp_size": 2, "parallelism_config_dp_shard_size": 2},
            "parallelism_config",
        ),
    ],
)
def test_parallelism_refusals_name_the_field(section: dict[str, object], subject: str) -> None:
    with pytest.raises(ConfigError) as info:
        PrepConfig.from_accelerate(
            {"distributed_type": "FSDP", "num_processes": 8, "parallelism_config": section}
        )
    assert info.value.subject == subject
    if "cp_size" in subject:
        assert "context parallelism yet" in info.value.message


# -- transformers' DistributedConfig ---------------------------------------------------------------
def test_transformers_distributed_config(monkeypatch: pytest.MonkeyPatch) -> None:
    from transformers.distributed.configuration_utils import DistributedConfig

    monkeypatch.setenv("WORLD_SIZE", "4")
    cfg = PrepConfig.from_transformers(
        DistributedConfig(tp_size=2, pp_size=2, enable_sequence_parallel=True)
    )
    assert (cfg.pp, cfg.tp, cfg.sequence_parallel, cfg.strategy) == (2, 2, True, "auto")
    # transformers refuses FSDP with pp ("not supported yet"); fprep plans it: from its dict
    both = PrepConfig.from_transformers(
        {"pp_size": 2, "fsdp_size": 2, "dp_replicate_size": 2, "fsdp_cpu_offload": True},
        pp_schedule="Interleaved1F1B",
    )
    assert (both.pp, both.strategy, both.hsdp_shard_size, both.offload) == (2, "hsdp", 2, "cpu")
    assert both.pp_schedule == "Interleaved1F1B"


def test_transformers_expert_parallelism_is_read() -> None:
    cfg = PrepConfig.from_transformers(
        {"fsdp_size": 4, "ep_size": 2, "ep_plan": {"layers.*.mlp.experts": "ep_dispatch_experts"}}
    )
    assert (cfg.ep, cfg.strategy) == (2, "fsdp")
    assert cfg.ep_plan_pairs == (("layers.*.mlp.experts", "ep_dispatch_experts"),)
    with pytest.raises(ConfigError) as caught:  # the flag transformers removed, without a size
        PrepConfig.from_transformers({"tp_size": 2, "enable_expert_parallel": True})
    assert caught.value.subject == "enable_expert_parallel" and "ep_size" in (
        caught.value.hint or ""
    )


@pytest.mark.parametrize(
    ("name", "value", "words"),
    [
        ("pipeline_parallel_degree", 4, "Write pp=4."),
        ("pipeline_parallel_schedule", "1F1B", "pp_schedule='1F1B'"),
        ("pipeline_parallel_microbatch_size", 2, "pp_microbatches=(local batch size // 2)"),
        ("pp_size", 2, "from_transformers"),
    ],
)
def test_torchtitan_and_transformers_pipeline_names_say_what_to_write(
    name: str, value: object, words: str
) -> None:
    with pytest.raises(ConfigError) as caught:
        PrepConfig(**{name: value})  # type: ignore[arg-type]
    assert words in caught.value.message + caught.value.hint
