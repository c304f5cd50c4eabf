"""Misuses the plan (or the config) must refuse with a PrepError instead of accepting silently or
leaking a raw Python / torch error (issue 12 items 2, 3, 5, 6 and the planning part of 16).

Every case uses real torch / fprep model classes; snapshots are taken with ``ModuleTree.of``.
"""

from __future__ import annotations

import dataclasses
import math
import re
from typing import Any

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from returns.result import Failure
from torch import nn

import fprep
from fprep import ConfigError, ModelError, ModuleTree, PrepConfig, Topology
from fprep.testing.models import LlamaBlock, llama_tiny

WORLD2 = Topology(world_size=2, rank=0)


def failure(*args: Any, **kwargs: Any) -> fprep.PrepError:
    result = fprep.plan(*args, **kwargs)
    assert isinstance(result, Failure), f"accepted: {result}"
    error = result.failure()
    assert isinstance(error, fprep.PrepError)
    return error


# -- item 2: a wrap policy that matches nothing ------------------------------------------------
@pytest.mark.parametrize("wrap", ["NoSuchBlock", nn.GRU, ("LlamaBlock", "NoSuchBlock")])
def test_a_wrap_class_matching_no_module_is_refused_naming_the_blocks(wrap: Any) -> None:
    error = failure(llama_tiny(), PrepConfig(strategy="fsdp", wrap=wrap), WORLD2)
    assert isinstance(error, ConfigError) and error.subject == "wrap"
    missing = "NoSuchBlock" if "NoSuchBlock" in str(wrap) else "GRU"
    assert missing in error.message
    assert "fprep.testing.models.LlamaBlock" in error.hint  # the repeated block it does have


def test_a_wrap_class_matching_only_the_root_is_accepted() -> None:
    state = fprep.plan(llama_tiny(), PrepConfig(strategy="fsdp", wrap="Llama"), WORLD2).unwrap()
    assert [u.fqn for u in state.param_handles.units] == [""]


def test_the_cli_refuses_a_wrap_class_the_405b_model_does_not_have(
    capsys: pytest.CaptureFixture[str],
) -> None:
    from fprep.cli import main

    argv = ["plan", "fprep.testing.models:llama_405b", "--wrap", "NoSuchBlock"]
    assert main([*argv, "--world-size", "1024"]) == 2
    err = capsys.readouterr().err
    assert "NoSuchBlock" in err and "LlamaBlock" in err


@pytest.mark.parametrize("wrap", [nn.Linear(2, 2), (LlamaBlock, nn.Linear(2, 2))])
def test_a_module_instance_as_wrap_is_refused_by_the_config(wrap: Any) -> None:
    with pytest.raises(ConfigError, match="pass the class") as info:
        PrepConfig(wrap=wrap)
    assert info.value.subject == "wrap" and "Linear" in str(info.value)


# -- item 3: modules whose parameters their parent's forward uses ------------------------------
class WithAttention(nn.Module):
    """A real nn.MultiheadAttention (its forward reads out_proj.weight, never calls out_proj)."""

    def __init__(self, dim: int = 64) -> None:
        super().__init__()
        self.attn = nn.MultiheadAttention(dim, 4)
        self.head = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.attn(x, x, x)[0])


def encoder(dim: int = 32) -> nn.Module:
    layer = nn.TransformerEncoderLayer(dim, 4, dim_feedforward=64, dropout=0.0)
    return nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)


@pytest.mark.parametrize("build", [WithAttention, encoder])
@pytest.mark.parametrize("min_params", [1, 1000])
def test_a_size_policy_never_makes_an_attention_child_its_own_unit(
    build: Any, min_params: int
) -> None:
    model = build()
    state = fprep.plan(model, PrepConfig(strategy="fsdp", wrap=min_params), WORLD2).unwrap()
    units = [u.fqn for u in state.param_handles.units]
    names = dict(model.named_modules())
    for fqn in units:
        parent = fqn.rpartition(".")[0]
        assert not (fqn and isinstance(names[parent], nn.MultiheadAttention)), units
    # every parameter is still managed by exactly one unit
    managed = [s.fqn for u in state.param_handles.units for s in u.params]
    assert sorted(managed) == sorted(n for n, _ in model.named_parameters())


@pytest.mark.parametrize("strategy", ["fsdp", "ddp", "none"])
def test_a_class_policy_naming_an_attention_child_is_refused(strategy: str) -> None:
    error = failure(WithAttention(), PrepConfig(strategy=strategy, wrap=nn.Linear), WORLD2)
    assert isinstance(error, ConfigError) and error.subject == "wrap"
    assert "'attn.out_proj'" in error.message and "MultiheadAttention" in error.message


# -- item 5: already sharded, already compiled, non-contiguous --------------------------------
def test_a_model_compiled_by_the_user_is_not_compiled_again() -> None:
    compiled = torch.compile(nn.Sequential(nn.Linear(4, 4)))
    in_place = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))
    in_place[1].compile()
    for model, fqn in ((compiled, ""), (in_place, "1")):
        for mode in ("whole", "regional"):
            error = failure(model, PrepConfig(compile=mode), Topology())
            assert isinstance(error, ConfigError) and error.subject == "compile"
            assert f"module {fqn or '<root>'!r}" in error.message
        assert fprep.plan(model, PrepConfig(compile="none"), Topology()).unwrap()


def channels_last_convs() -> nn.Module:
    net = nn.Sequential(nn.Conv2d(3, 8, 3), nn.ReLU(), nn.Conv2d(8, 8, 3))
    return net.to(memory_format=torch.channels_last)


def test_a_non_contiguous_parameter_is_refused_when_sharding() -> None:
    model = channels_last_convs()
    assert not model[0].weight.is_contiguous()
    error = failure(model, PrepConfig(strategy="fsdp"), WORLD2)
    assert isinstance(error, ModelError) and error.subject == "0.weight"
    assert "contiguous_format" in error.hint
    # replicated strategies keep whole tensors: fine
    assert fprep.plan(model, PrepConfig(strategy="ddp"), WORLD2).unwrap()
    # ... and so are ignored parameters
    assert fprep.plan(
        model, PrepConfig(strategy="fsdp", ignored_modules=("0", "2")), WORLD2
    ).unwrap()
    assert ModuleTree.of(model).param("0.bias").contiguous  # type: ignore[union-attr]


# -- item 6: an 8-bit model on another device than this rank's ----------------------------------
def quantized_tree(device: str, device_map: str | None) -> ModuleTree:
    tree = ModuleTree.of(llama_tiny(device="meta"))
    return dataclasses.replace(
        tree,
        params=tuple(dataclasses.replace(p, device=device) for p in tree.params),
        quantization="8bit",
        hf_device_map=None if device_map is None else (("", device_map),),
    )


@pytest.mark.parametrize("device_map", ["1", "cuda:1", None])
def test_an_8bit_model_on_another_rank_s_device_is_refused(device_map: str | None) -> None:
    topology = Topology(world_size=2, rank=0, local_rank=0, device_type="cuda")
    tree = quantized_tree("cuda:1", device_map)
    error = failure(tree, PrepConfig(strategy="ddp"), topology)
    assert isinstance(error, fprep.DeviceError) and "cuda:1" in error.message
    assert "cuda:0" in error.message
    # on its own rank's device it is accepted
    own = Topology(world_size=2, rank=1, local_rank=1, device_type="cuda")
    assert fprep.plan(tree, PrepConfig(strategy="ddp"), own).unwrap()


# -- item 16: raw Python errors, and a module tree with a cycle --------------------------------
def test_a_device_with_a_unicode_digit_is_a_config_error() -> None:
    for device in ("cuda:²", "cuda:١", "cuda:-1", "cuda: 1"):
        with pytest.raises(ConfigError) as info:
            PrepConfig(device=device)
        assert info.value.subject == "device"


def test_a_huge_timeout_is_a_config_error() -> None:
    for timeout in (1e15, 10**12, float("inf")):
        with pytest.raises(ConfigError) as info:
            PrepConfig(timeout_s=timeout)
        assert info.value.subject == "timeout_s"
    assert PrepConfig(timeout_s=1e9).timeout_s == 1e9


@pytest.mark.parametrize("value", [torch.tensor([True, False]), torch.tensor(True), None, 1])
def test_a_wrap_callable_that_does_not_return_a_bool_is_refused(value: Any) -> None:
    error = failure(WithAttention(), PrepConfig(strategy="fsdp", wrap=lambda m: value), WORLD2)
    assert isinstance(error, ConfigError) and error.subject == "wrap"
    assert "bool" in error.message and type(value).__name__ in error.message


@pytest.mark.parametrize("strategy", ["fsdp", "ddp"])
def test_a_container_root_without_forward_is_refused(strategy: str) -> None:
    for root in (nn.ModuleList([nn.Linear(2, 2)]), nn.ModuleDict({"a": nn.Linear(2, 2)})):
        error = failure(root, PrepConfig(strategy=strategy), WORLD2)
        assert isinstance(error, ModelError) and error.subject == "model"
        assert type(root).__name__ in error.message


@pytest.mark.timeout(20)
@pytest.mark.parametrize("depth", [0, 2])
def test_a_module_tree_with_a_cycle_is_refused(depth: int) -> None:
    model = nn.Sequential(nn.Sequential(nn.Linear(2, 2), nn.Sequential(nn.Linear(2, 2))))
    inner = model if depth == 0 else model[0][1]
    inner.add_module("loop", model)  # registered as its own descendant
    with pytest.raises(ModelError) as info:
        ModuleTree.of(model)
    assert "cycle" in info.value.message
    assert info.value.subject == ("loop" if depth == 0 else "0.1.loop")
    assert isinstance(fprep.plan(model, PrepConfig(), Topology()), Failure)


def test_a_module_shared_by_two_paths_is_not_a_cycle() -> None:
    shared = nn.Linear(2, 2)
    model = nn.Sequential(nn.Sequential(shared), nn.Sequential(shared))
    tree = ModuleTree.of(model)
    assert tree.has_module("0.0") and tree.has_module("1.0")


# -- hypothesis: any bad value for a config field is a ConfigError naming that field ------------
_not_bool = st.one_of(st.integers(), st.text(max_size=3), st.none(), st.floats())
_not_count = st.one_of(st.integers(max_value=-1), st.floats(), st.text(max_size=3), st.booleans())
_not_positive = st.one_of(
    st.floats().filter(lambda x: not (math.isfinite(x) and 0 < x <= 1e9)),
    st.integers(max_value=0),
    st.integers(min_value=10**9 + 1),
    st.text(max_size=3),
    st.booleans(),
)


def _valid_device(text: str) -> bool:
    return re.fullmatch(r"(cpu|cuda|hpu|xpu|mps)(:[0-9]+)?", text) is not None


_not_device = st.one_of(
    st.text(max_size=8).filter(lambda s: not _valid_device(s)),
    st.sampled_from(["cuda:²", "cuda:٣", "hpu:𝟙", "cuda:"]),
    st.integers(),
)
BAD_VALUES: dict[str, st.SearchStrategy[Any]] = {
    "strategy": st.text(max_size=6).filter(
        lambda s: s not in ("auto", "none", "ddp", "fast_ddp", "fsdp", "hsdp")
    ),
    "precision": st.one_of(st.integers(), st.just("bf32"), st.none()),
    "activation_checkpointing": _not_bool,
    "sync_module_states": _not_bool,
    "forward_prefetch": _not_count,
    "backward_prefetch": _not_count,
    "seed": _not_count,
    "timeout_s": _not_positive,
    "device": _not_device,
    "wrap": st.one_of(
        st.integers(max_value=0),
        st.booleans(),
        st.floats(),
        st.just(nn.Linear(1, 1)),
        st.tuples(st.integers()),
    ),
}


@given(st.sampled_from(sorted(BAD_VALUES)).flatmap(lambda f: st.tuples(st.just(f), BAD_VALUES[f])))
def test_any_bad_value_is_a_config_error_naming_its_field(case: tuple[str, Any]) -> None:
    field, value = case
    with pytest.raises(ConfigError) as info:
        PrepConfig(**{field: value})
    assert info.value.subject == field
    assert field in info.value.message


# -- issue 18.9: dtypes FSDP2 cannot handle, 16-bit master weights, device indices -------------
class Odd(nn.Module):
    """A linear layer plus one extra parameter of any dtype (in the same wrap unit)."""

    def __init__(self, dtype: torch.dtype, requires_grad: bool = True) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.extra = nn.Parameter(torch.ones(4, dtype=dtype), requires_grad=requires_grad)


class TwoUnits(nn.Module):
    def __init__(self, dtype: torch.dtype) -> None:
        super().__init__()
        self.body = nn.Linear(4, 4)
        self.head = nn.Linear(4, 4).to(dtype)


def test_a_complex_parameter_under_fsdp_mixed_precision_is_refused_by_name() -> None:
    error = failure(Odd(torch.complex64), PrepConfig(strategy="fsdp", precision="bf16"), WORLD2)
    assert isinstance(error, ModelError) and error.subject == "extra"
    assert "complex64" in str(error) and "precision='no'" in str(error)
    # alone in its unit and without mixed precision FSDP handles it; under ddp nothing is cast
    wrapped = PrepConfig(strategy="fsdp", wrap=nn.Linear, precision="bf16")
    assert failure(TwoUnits(torch.complex64), wrapped, WORLD2).subject == "head.weight"
    assert fprep.plan(
        TwoUnits(torch.complex64), PrepConfig(strategy="fsdp", wrap=nn.Linear), WORLD2
    ).unwrap()
    assert fprep.plan(Odd(torch.complex64), PrepConfig(strategy="ddp", precision="bf16"), WORLD2)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float16, torch.bfloat16, torch.complex64])
@pytest.mark.parametrize("precision", ["no", "bf16"])
def test_trainable_parameters_of_two_dtypes_in_one_fsdp_unit_are_refused(
    dtype: torch.dtype, precision: str
) -> None:
    cfg = PrepConfig(strategy="fsdp", precision=precision)  # type: ignore[arg-type]
    error = failure(Odd(dtype), cfg, WORLD2)
    assert isinstance(error, ModelError) and error.subject == "extra"
    if dtype.is_floating_point or precision == "no":
        assert "two dtypes" in str(error) and "wrap unit" in str(error.hint)
    # frozen, or in a unit of its own (floating point), it is what FSDP2 handles
    assert fprep.plan(Odd(dtype, requires_grad=False), cfg, WORLD2).unwrap()
    if dtype.is_floating_point:
        assert fprep.plan(TwoUnits(dtype), cfg.replace(wrap=nn.Linear), WORLD2).unwrap()


@pytest.mark.parametrize("dtype", [torch.int64, torch.bool, torch.uint8])
def test_frozen_integer_parameters_are_accepted_under_fsdp_mixed_precision(
    dtype: torch.dtype,
) -> None:
    cfg = PrepConfig(strategy="fsdp", precision="bf16")
    assert fprep.plan(Odd(dtype, requires_grad=False), cfg, WORLD2).unwrap()


@pytest.mark.parametrize("strategy", ["none", "ddp", "fsdp"])
def test_16_bit_trainable_parameters_with_mixed_precision_get_a_note(strategy: str) -> None:
    """transformers builds bf16 parameters from a bf16 config.json: the optimizer would keep
    bf16 master weights and state, which the plan now says (fprep plan prints its notes)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
        num_attention_heads=2, num_key_value_heads=2, dtype="bfloat16",
    )  # fmt: skip
    with torch.device("meta"):
        model = LlamaForCausalLM._from_config(config)
    assert next(model.parameters()).dtype == torch.bfloat16  # what the recipe silently got
    cfg = PrepConfig(strategy=strategy, precision="bf16")  # type: ignore[arg-type]
    state = fprep.plan(model, cfg, WORLD2).unwrap()
    notes = [n for n in state.core.notes if "master weights" in n]
    assert len(notes) == 1 and "bfloat16" in notes[0] and "dtype=torch.float32" in notes[0]
    assert notes[0] in state.summary()
    with torch.device("meta"):
        fp32 = LlamaForCausalLM._from_config(config, dtype=torch.float32)  # the fix it names
    assert not any("master weights" in n for n in fprep.plan(fp32, cfg, WORLD2).unwrap().core.notes)
    no_mixed = fprep.plan(model, cfg.replace(precision="no"), WORLD2).unwrap()
    assert not any("master weights" in n for n in no_mixed.core.notes)


@pytest.mark.parametrize(
    ("device", "says"),
    [
        ("cpu:99999999999999999999999", "one cpu device"),
        ("cpu:1", "one cpu device"),
        ("mps:2", "one mps device"),
        ("cuda:128", "out of range"),  # torch.device would wrap it to cuda:-128
        ("cuda:" + "9" * 5000, "out of range"),  # more digits than int() converts
    ],
)
def test_device_indices_that_cannot_exist_are_refused(device: str, says: str) -> None:
    with pytest.raises(ConfigError, match=says) as refused:
        PrepConfig(device=device)
    assert refused.value.subject == "device"


@pytest.mark.parametrize("device", ["cpu", "cpu:0", "cuda:127", "cuda:007", "hpu:3", "mps:0"])
def test_device_indices_torch_keeps_are_accepted(device: str) -> None:
    assert PrepConfig(device=device).device == device
