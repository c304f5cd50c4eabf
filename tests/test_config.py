"""PrepConfig: validated at construction, round-trips through a plain dict."""

from __future__ import annotations

import json
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st
from torch import nn

import fprep
from fprep import ConfigError, PrepConfig
from fprep.snapshot import ModuleInfo


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
    with pytest.raises(TypeError):
        PrepConfig("fsdp")  # type: ignore[misc]
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
