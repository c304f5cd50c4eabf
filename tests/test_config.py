"""PrepConfig: validated at construction, round-trips through a plain dict."""

from __future__ import annotations

import copy
import dataclasses
import inspect
import json
import pickle
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st
from torch import nn

import fprep
from fprep import ConfigError, PrepConfig
from fprep.config_names import FOREIGN_NAMES
from fprep.snapshot import ModuleInfo
from fprep.testing import strategies as fst


class Block(nn.Module):
    pass


def is_block(module: ModuleInfo) -> bool:
    return module.class_name == "Block"


def init_fn(module: nn.Module) -> None:
    pass


@pytest.mark.parametrize(
    ("field", "value", "words"),
    [
        ("strategy", "fdsp", ["strategy", "'fsdp'"]),
        ("precision", "bf32", ["precision", "'bf16'"]),
        ("sharding", "zero3", ["sharding", "'full'"]),
        ("offload", "disk", ["offload"]),
        ("compile", True, ["compile"]),
        ("reshard_after_forward", 0, ["reshard_after_forward", ">= 1"]),
        ("reshard_after_forward", "yes", ["reshard_after_forward"]),
        ("hsdp_shard_size", 0, ["hsdp_shard_size"]),
        ("wrap", 0, ["wrap", ">= 1"]),
        ("wrap", True, ["wrap"]),
        ("wrap", (), ["wrap", "empty"]),
        ("wrap", (3,), ["wrap"]),
        ("wrap", "nomodule:Nothing", ["wrap", "cannot import"]),
        ("ignored_modules", "lm_head", ["ignored_modules", "('lm_head',)"]),
        ("ignored_params", [1], ["ignored_params", "FQN"]),
        ("device", "gpu", ["device", "cuda"]),
        ("device", "cuda:x", ["device"]),
        ("forward_prefetch", -1, ["forward_prefetch"]),
        ("backward_prefetch", 1.5, ["backward_prefetch"]),
        ("activation_checkpointing", "yes", ["activation_checkpointing", "True or False"]),
        ("compile_backend", "", ["compile_backend"]),
        ("fast_ddp_dtype", "float64", ["fast_ddp_dtype"]),
        ("param_init_fn", 3, ["param_init_fn", "callable"]),
        ("seed", -1, ["seed"]),
        ("state_dict_type", "local", ["state_dict_type"]),
        ("timeout_s", 0, ["timeout_s", "positive"]),
        ("ddp", 3, ["ddp", "DDPOptions"]),
        ("reduce_dtype", "fp32", ["reduce_dtype", "'float32'"]),
        ("timeout_s", float("nan"), ["timeout_s"]),
        ("ddp", {"bucket_cap_mb": float("inf")}, ["ddp.bucket_cap_mb"]),
    ],
)
def test_bad_field_names_field_and_allowed_values(field: str, value: Any, words: list[str]) -> None:
    with pytest.raises(ConfigError) as info:
        PrepConfig(**{field: value})
    assert info.value.subject.split(".")[0] == field
    text = str(info.value)
    for word in words:
        assert word in text, (word, text)


def test_config_is_keyword_only_and_frozen() -> None:
    with pytest.raises(ConfigError, match="keyword arguments only") as info:
        PrepConfig("fsdp")  # type: ignore[misc]
    assert info.value.subject == "PrepConfig"
    cfg = PrepConfig()
    with pytest.raises(AttributeError):
        cfg.strategy = "ddp"  # type: ignore[misc]


def test_cross_field_checks() -> None:
    with pytest.raises(ConfigError) as info:
        PrepConfig(sharding="grad_op", reshard_after_forward=True)
    assert info.value.subject == "reshard_after_forward"
    with pytest.raises(ConfigError) as info:
        PrepConfig(ignored_modules=("a",), ignored_params=("b.weight",))
    assert info.value.subject == "ignored_params"


def test_int_reshard_contradicts_grad_op() -> None:
    with pytest.raises(ConfigError) as info:
        PrepConfig(sharding="grad_op", reshard_after_forward=4)
    assert info.value.subject == "reshard_after_forward" and "grad_op" in str(info.value)


def test_wrap_accepts_import_strings_for_callables() -> None:
    assert PrepConfig(wrap=f"{__name__}:is_block").wrap is is_block


def test_ddp_options_are_validated_and_accept_a_dict() -> None:
    with pytest.raises(ConfigError) as info:
        fprep.DDPOptions(comm_hook="bf17")  # type: ignore[arg-type]
    assert info.value.subject == "ddp.comm_hook" and "'bf16'" in str(info.value)
    cfg = PrepConfig(ddp={"bucket_cap_mb": 50, "static_graph": True})  # type: ignore[arg-type]
    assert cfg.ddp == fprep.DDPOptions(bucket_cap_mb=50, static_graph=True)
    with pytest.raises(ConfigError) as info:
        PrepConfig(ddp={"bucket_mb": 50})  # type: ignore[arg-type]
    assert "bucket_cap_mb" in str(info.value)


def test_sequences_become_tuples_and_wrap_is_normalized() -> None:
    cfg = PrepConfig(ignored_modules=["a", "b"], wrap=Block)  # type: ignore[arg-type]
    assert cfg.ignored_modules == ("a", "b")
    assert cfg.wrap == (Block,)
    assert PrepConfig(wrap="Block").wrap == ("Block",)
    assert PrepConfig(wrap=[Block, "Other"]).wrap == (Block, "Other")  # type: ignore[arg-type]
    assert PrepConfig(wrap=f"{__name__}:Block").wrap == (Block,)


def test_effective_reshard_after_forward() -> None:
    assert PrepConfig().effective_reshard_after_forward is True
    assert PrepConfig(sharding="grad_op").effective_reshard_after_forward is False
    assert PrepConfig(reshard_after_forward=4).effective_reshard_after_forward == 4


def test_from_dict_rejects_unknown_keys_with_a_suggestion() -> None:
    with pytest.raises(ConfigError) as info:
        PrepConfig.from_dict({"stratgy": "fsdp"})
    assert info.value.subject == "stratgy"
    assert "'strategy'" in str(info.value)


def test_lambda_cannot_be_written_to_a_dict() -> None:
    cfg = PrepConfig(wrap=lambda m: False)
    with pytest.raises(ConfigError) as info:
        cfg.to_dict()
    assert info.value.subject == "wrap"


def test_replace_validates() -> None:
    cfg = PrepConfig(strategy="fsdp")
    assert cfg.replace(precision="bf16").precision == "bf16"
    with pytest.raises(ConfigError):
        cfg.replace(precision="bf15")


_other_fields: dict[str, st.SearchStrategy[object]] = dict(
    strategy=st.sampled_from(["auto", "none", "ddp", "fast_ddp", "fsdp", "hsdp"]),
    hsdp_shard_size=st.one_of(st.none(), st.integers(1, 16)),
    precision=st.sampled_from(["no", "fp16", "bf16", "fp8"]),
    reduce_dtype=st.sampled_from([None, "float32", "bfloat16"]),
    wrap=st.one_of(
        st.none(),
        st.integers(1, 10**9),
        st.just((Block,)),
        st.just(("Block", Block)),
        st.just(is_block),
    ),
    ignored_modules=st.lists(st.text("abc.", min_size=1), max_size=3).map(tuple),
    device=st.sampled_from([None, "cpu", "cuda", "cuda:1", "hpu"]),
    offload=st.sampled_from(["none", "cpu"]),
    forward_prefetch=st.integers(0, 4),
    backward_prefetch=st.integers(0, 4),
    activation_checkpointing=st.booleans(),
    compile=st.sampled_from(["none", "whole", "regional"]),
    ddp=st.builds(
        fprep.DDPOptions,
        bucket_cap_mb=st.floats(0.5, 100),
        comm_hook=st.sampled_from(["none", "fp16", "bf16", "powersgd"]),
    ),
    param_init_fn=st.sampled_from([None, init_fn]),
    seed=st.one_of(st.none(), st.integers(0, 2**32)),
    state_dict_type=st.sampled_from(["sharded", "full"]),
)


sharding_choices = st.one_of(
    st.tuples(st.just("full"), st.one_of(st.none(), st.just(True), st.integers(1, 64))),
    st.tuples(st.just("grad_op"), st.one_of(st.none(), st.just(False))),
)
configs = sharding_choices.flatmap(
    lambda sharding: st.builds(
        PrepConfig,
        sharding=st.just(sharding[0]),
        reshard_after_forward=st.just(sharding[1]),
        **_other_fields,
    )
)


@given(configs)
def test_dict_round_trip(cfg: PrepConfig) -> None:
    data = cfg.to_dict()
    assert json.loads(json.dumps(data)) == data  # plain, JSON-compatible data
    again = PrepConfig.from_dict(json.loads(json.dumps(data)))
    assert again == cfg
    assert hash(again) == hash(cfg)


# -- keywords PrepConfig does not have -------------------------------------------------------------
FIELDS = [f.name for f in dataclasses.fields(PrepConfig)]


@pytest.mark.parametrize("name", sorted(FOREIGN_NAMES))
def test_a_foreign_keyword_names_its_library_and_what_to_write(name: str) -> None:
    assert name not in FIELDS  # a foreign name that is also a field would never be reached
    with pytest.raises(ConfigError) as info:
        PrepConfig(**{name: 4})
    origin, _ = FOREIGN_NAMES[name]
    assert info.value.subject == name
    assert f"has no field {name!r}" in info.value.message and origin in info.value.message
    assert info.value.hint and "{value" not in info.value.hint  # formatted, not a template


@pytest.mark.parametrize(
    ("name", "value", "instead"),
    [
        ("mixed_precision", "bf16", {"precision": "bf16"}),
        ("mixed_precision", "FP16", {"precision": "fp16"}),
        ("cpu", True, {"device": "cpu"}),
        ("bf16", True, {"precision": "bf16"}),
        ("fp16", True, {"precision": "fp16"}),
        ("use_cpu", True, {"device": "cpu"}),
        ("gradient_checkpointing", True, {"activation_checkpointing": True}),
        ("cpu_offload", True, {"offload": "cpu"}),
        ("min_num_params", 1000, {"wrap": 1000}),
        ("transformer_cls_names_to_wrap", ["LlamaDecoderLayer"], {"wrap": ["LlamaDecoderLayer"]}),
        ("torch_compile_backend", "inductor", {"compile": "whole", "compile_backend": "inductor"}),
        ("ddp_timeout", 1800, {"timeout_s": 1800}),
        ("data_seed", 7, {"seed": 7}),
        ("accelerator", "cpu", {"device": "cpu"}),
    ],
)
def test_the_advice_for_a_foreign_keyword_is_a_config_that_works(
    name: str, value: object, instead: dict[str, Any]
) -> None:
    with pytest.raises(ConfigError) as info:
        PrepConfig(**{name: value})
    for field, wanted in instead.items():
        assert f"{field}={wanted!r}" in info.value.hint, info.value.hint
    PrepConfig(**instead)  # what the hint says to write is valid


def test_the_ddp_advice_names_the_ddp_options_field() -> None:
    with pytest.raises(ConfigError) as info:
        PrepConfig(ddp_find_unused_parameters=True)
    assert "ddp=fprep.DDPOptions(find_unused_parameters=True)" in info.value.hint
    PrepConfig(ddp=fprep.DDPOptions(find_unused_parameters=True))


def test_gradient_accumulation_steps_points_to_accumulate_with_the_count() -> None:
    with pytest.raises(ConfigError) as info:
        PrepConfig(gradient_accumulation_steps=8)
    assert "fprep.accumulate(state, model, sync=(i + 1) % 8 == 0)" in info.value.hint


def test_every_accelerator_argument_is_a_field_or_has_advice() -> None:
    accelerate = pytest.importorskip("accelerate")
    params = list(inspect.signature(accelerate.Accelerator.__init__).parameters)[1:]
    assert params  # the real signature was read
    missing = [p for p in params if p not in FIELDS and p not in FOREIGN_NAMES]
    assert not missing, f"Accelerator arguments with no advice: {missing}"


def test_common_training_arguments_have_advice() -> None:
    transformers = pytest.importorskip("transformers")
    params = set(inspect.signature(transformers.TrainingArguments.__init__).parameters)
    # what chooses how a model is prepared (the rest configures the Trainer's loop)
    preparing = {
        "bf16", "fp16", "use_cpu", "gradient_checkpointing", "torch_compile",
        "torch_compile_backend", "torch_compile_mode", "fsdp", "fsdp_config", "deepspeed",
        "ddp_find_unused_parameters", "ddp_bucket_cap_mb", "ddp_broadcast_buffers",
        "ddp_static_graph", "ddp_timeout", "ddp_backend", "gradient_accumulation_steps",
        "parallelism_config", "data_seed", "local_rank",
    }  # fmt: skip
    assert preparing <= params  # still transformers' names
    assert all(p in FIELDS or p in FOREIGN_NAMES for p in preparing)


@pytest.mark.parametrize("cls", [PrepConfig, fprep.DDPOptions, fprep.Fp8Options])
def test_a_misspelt_field_lists_it_among_close_matches(cls: type) -> None:
    names = [f.name for f in dataclasses.fields(cls)]
    for name in names:
        for i in range(len(name)):  # every one-letter slip
            typo = name[:i] + name[i + 1 :]
            if typo in names or typo in FOREIGN_NAMES:
                continue
            with pytest.raises(ConfigError) as info:
                cls(**{typo: None})
            assert info.value.subject == typo
            assert info.value.hint.startswith("Did you mean") and repr(name) in info.value.hint


def test_an_unknown_keyword_with_no_close_match_lists_the_fields() -> None:
    with pytest.raises(ConfigError) as info:
        PrepConfig(zzz=1)
    assert info.value.hint == f"Fields: {', '.join(FIELDS)}."


def test_from_dict_and_replace_give_the_same_advice() -> None:
    with pytest.raises(ConfigError) as direct:
        PrepConfig(mixed_precision="bf16")
    with pytest.raises(ConfigError) as loaded:
        PrepConfig.from_dict({"mixed_precision": "bf16"})
    with pytest.raises(ConfigError) as replaced:
        PrepConfig().replace(mixed_precision="bf16")
    assert str(direct.value) == str(loaded.value) == str(replaced.value)


def test_nested_options_refuse_unknown_keywords_under_their_path() -> None:
    with pytest.raises(ConfigError, match=r"^PrepConfig\.ddp has no field 'find_unused'"):
        fprep.DDPOptions(find_unused=True)  # type: ignore[call-arg]
    with pytest.raises(ConfigError, match=r"^PrepConfig\.fp8 has no field 'recipes'"):
        PrepConfig(precision="fp8", fp8={"recipes": "rowwise"})  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="keyword arguments only"):
        fprep.DDPOptions(25.0)  # type: ignore[misc]


@given(fst.configs())
def test_a_config_stays_a_frozen_dataclass_that_pickles_and_copies(cfg: PrepConfig) -> None:
    assert dataclasses.is_dataclass(cfg)
    for again in (pickle.loads(pickle.dumps(cfg)), copy.copy(cfg), copy.deepcopy(cfg)):
        assert again == cfg and hash(again) == hash(cfg)
    assert dataclasses.replace(cfg) == cfg
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.seed = 1  # type: ignore[misc]


@pytest.mark.parametrize("spelling", ["cp", "cp_size", "context_parallel", "context_parallel_size"])
def test_context_parallelism_is_refused_with_its_reason(spelling: str) -> None:
    with pytest.raises(ConfigError) as info:
        PrepConfig(**{spelling: 2})
    assert info.value.subject == spelling
    assert "ring attention" in str(info.value) and "CUDA" in str(info.value)
    assert "sequence_parallel=True" in (info.value.hint or "")


def test_accelerate_cp_size_gets_the_same_reason() -> None:
    from fprep.migrate import parallelism_fields

    with pytest.raises(ConfigError, match="ring attention") as info:
        parallelism_fields({"parallelism_config_cp_size": 2, "parallelism_config_tp_size": 1})
    assert info.value.subject == "parallelism_config_cp_size"
