"""peft LoRA models prepared by fprep: a tiny transformers Llama saved with save_pretrained, built
again on the meta device, wrapped by get_peft_model and prepared with ``weights=`` under fsdp
(2 ranks), tp 2 and dp 2 x tp 2 (4 ranks), each against the same script in one process: LoRA
initialized as peft does and the same at every world size, the base bitwise the checkpoint,
losses and adapter gradients equal, ``fprep.save`` / ``fprep.load`` resuming bitwise, and
``fprep.save_pretrained`` writing adapters that peft loads and merges like its own. Then the
combinations fprep refuses, before any effect."""

from __future__ import annotations

import io
import json
import math
from pathlib import Path
from typing import Any

import _peft_workers as W
import pytest
import torch
from peft import PeftModel, get_peft_model
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

import fprep
from fprep.testing.distributed import run_ranks

STEPS = 3
LAYOUTS: dict[str, tuple[int, dict[str, Any]]] = {
    "fsdp2": (2, {"strategy": "fsdp"}),
    "tp2": (2, {"strategy": "auto", "tp": 2}),
    "dp2_tp2": (4, {"strategy": "fsdp", "tp": 2}),
}


def _load(data: bytes) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = torch.load(io.BytesIO(data), weights_only=True)
    return out


def _max_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert a.keys() == b.keys()
    return max(float((a[k] - b[k]).abs().max()) for k in a)


@pytest.fixture(scope="module")
def base(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return W.save_base(tmp_path_factory.mktemp("peft") / "base")


@pytest.fixture(scope="module")
def one(base: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """The reference: the same script in this process (fsdp resolves to no sharding)."""
    return W.train(str(base), str(tmp_path_factory.mktemp("one")), {"strategy": "fsdp"}, STEPS)


@pytest.fixture(scope="module", params=[pytest.param(k, marks=pytest.mark.slow) for k in LAYOUTS])
def ranks(
    request: pytest.FixtureRequest, base: Path, tmp_path_factory: pytest.TempPathFactory
) -> list[dict[str, Any]]:
    world, fields = LAYOUTS[request.param]
    work = str(tmp_path_factory.mktemp(request.param))
    out: list[dict[str, Any]] = run_ranks(
        W.train, world, str(base), work, fields, STEPS, timeout_s=900
    )
    return out


def test_lora_starts_as_peft_initializes_it(one: dict[str, Any], base: Path) -> None:
    """B zeros (the wrapped model computes what the base does), A Kaiming-uniform within
    nn.Linear's bound, the base bitwise what from_pretrained loads."""
    init = _load(one["init"])
    factors = [k for k in init if ".lora_A." in k]
    assert len(factors) == 2 * len(W.TARGETS)
    for name, value in init.items():
        if ".lora_B." in name:
            assert torch.count_nonzero(value) == 0, name
        else:
            bound = 1 / math.sqrt(value.shape[1])
            assert float(value.abs().max()) <= bound, name
            assert float(value.std()) > bound / 4, name  # drawn, not constant
    reference = AutoModelForCausalLM.from_pretrained(base).state_dict()
    for name, value in _load(one["base"]).items():
        key = name.removeprefix("base_model.model.").replace(".base_layer", "")
        assert torch.equal(value, reference[key]), name


def test_trains_like_one_process(one: dict[str, Any], ranks: list[dict[str, Any]]) -> None:
    for rank, out in enumerate(ranks):
        assert out["trainable"] == one["trainable"]
        assert _load(out["init"]).keys() == _load(one["init"]).keys()
        for name, value in _load(one["init"]).items():  # the same at every world size
            assert torch.equal(_load(out["init"])[name], value), (rank, name)
        for name, value in _load(one["base"]).items():
            assert torch.equal(_load(out["base"])[name], value), (rank, name)
        assert out["losses"] == pytest.approx(one["losses"], abs=1e-5)
        for step, (got, want) in enumerate(zip(out["grads"], one["grads"], strict=True)):
            got_grads, want_grads = _load(got), _load(want)
            assert sorted(want_grads) == sorted(one["trainable"])  # only adapters get one
            assert _max_diff(got_grads, want_grads) < 1e-5, (rank, step)
        assert _max_diff(_load(out["trained"]), _load(one["trained"])) < 1e-4


def test_resumes_bitwise(ranks: list[dict[str, Any]]) -> None:
    for out in ranks:
        trained, loaded = _load(out["trained"]), _load(out["loaded"])
        assert trained.keys() == loaded.keys()
        assert all(torch.equal(trained[k], loaded[k]) for k in trained)
        continued, resumed = (_load(a) for a in out["after"])
        assert all(torch.equal(continued[k], resumed[k]) for k in continued)


def _peft_reference(base: Path, one: dict[str, Any]) -> Any:
    """The one-process run's trained weights in a plain peft model, as peft builds it."""
    model = get_peft_model(AutoModelForCausalLM.from_pretrained(base), W.lora_config())
    missing, unexpected = model.load_state_dict(_load(one["trained"]), strict=True)
    assert not missing and not unexpected
    return model


def test_adapters_load_and_merge_as_peft_does(
    base: Path, one: dict[str, Any], ranks: list[dict[str, Any]], tmp_path: Path
) -> None:
    """The files are peft's own (same names and config as PeftModel.save_pretrained), hold the
    trained adapters bitwise, and merge like peft's merge_and_unload of the one-process run."""
    reference = _peft_reference(base, one)
    reference.save_pretrained(tmp_path / "peft")
    theirs = load_file(tmp_path / "peft" / "adapter_model.safetensors")
    their_config = json.loads((tmp_path / "peft" / "adapter_config.json").read_text())
    merged_reference = reference.merge_and_unload().state_dict()
    adapters = Path(ranks[0]["adapters"])
    ours = load_file(adapters / "adapter_model.safetensors")
    assert ours.keys() == theirs.keys()
    our_config = json.loads((adapters / "adapter_config.json").read_text())
    for config in (our_config, their_config):  # a set, listed in any order
        config["target_modules"] = sorted(config["target_modules"])
    assert our_config == their_config
    trained = _load(ranks[0]["trained"])
    loaded = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base), adapters)
    for name, value in loaded.named_parameters():
        if "lora_" in name:
            assert torch.equal(value, trained[name]), name
    merged = loaded.merge_and_unload().state_dict()
    assert _max_diff(merged, merged_reference) < 1e-5


# -- refusals, in one process -------------------------------------------------------------


def _unchanged_on_meta(model: torch.nn.Module) -> bool:
    return all(p.is_meta for p in model.parameters())


@pytest.mark.parametrize(
    ("lora", "subject_part"),
    [
        ({"init_lora_weights": "orthogonal"}, "q_proj"),
        ({"init_lora_weights": "eva"}, "q_proj"),
        ({"use_dora": True}, "q_proj.lora_magnitude_vector"),
        ({"target_modules": ["embed_tokens"]}, "embed_tokens.lora_embedding_A"),
    ],
)
def test_inits_fprep_cannot_compute_are_refused_on_meta(
    base: Path, lora: dict[str, Any], subject_part: str
) -> None:
    model = W.build_meta(str(base), **lora)
    with pytest.raises(fprep.ModelError) as caught:
        fprep.prepare(model, fprep.PrepConfig(weights=str(base), seed=0))
    assert subject_part in caught.value.subject
    assert "from_pretrained" in caught.value.hint
    assert _unchanged_on_meta(model)


@pytest.mark.parametrize(
    ("lora", "fields", "why"),
    [
        ({"lora_dropout": 0.1}, {}, "lora_dropout"),
        ({}, {"sequence_parallel": True}, "sequence parallelism"),
    ],
)
def test_tp_over_lora_refused_where_it_cannot_work(
    base: Path, lora: dict[str, Any], fields: dict[str, Any], why: str
) -> None:
    model = W.build_meta(str(base), **lora)
    cfg = fprep.PrepConfig(strategy="auto", tp=2, weights=str(base), **fields)
    error = fprep.plan(model, cfg, fprep.Topology(world_size=2, rank=0)).failure()
    assert isinstance(error, fprep.ConfigError)
    assert error.subject.endswith("self_attn.q_proj") and why in error.message


def test_modules_to_save_copies_load_from_the_base(base: Path) -> None:
    """A module peft copies for training (modules_to_save) reads the base's weight into both
    the original and the trainable copy."""
    model = W.build_meta(str(base), modules_to_save=["lm_head"])
    _, model = fprep.prepare(model, fprep.PrepConfig(weights=str(base), seed=0))
    want = AutoModelForCausalLM.from_pretrained(base).lm_head.weight
    head = model.base_model.model.lm_head
    assert torch.equal(head.original_module.weight, want)
    assert torch.equal(head.modules_to_save["default"].weight, want)
    assert head.modules_to_save["default"].weight.requires_grad


def test_optimizer_of_frozen_parameters_is_refused(base: Path) -> None:
    model = W.build_meta(str(base))
    frozen = [p for p in model.parameters() if not p.requires_grad]
    optimizer = torch.optim.AdamW(frozen, lr=1e-3)
    with pytest.raises(fprep.ModelError, match="training would update nothing") as caught:
        fprep.prepare(model, fprep.PrepConfig(weights=str(base)), optimizer)
    assert caught.value.subject == "optimizer 0"
    assert _unchanged_on_meta(model)


def test_frozen_model_warns(base: Path) -> None:
    model = W.build_meta(str(base)).requires_grad_(False)
    with pytest.warns(UserWarning, match="every parameter of the PeftModel"):
        fprep.prepare(model, fprep.PrepConfig(weights=str(base), seed=0))


def test_save_pretrained_refuses_a_config_for_adapters(base: Path, tmp_path: Path) -> None:
    model = W.build_meta(str(base))
    state, model = fprep.prepare(model, fprep.PrepConfig(weights=str(base), seed=0))
    with pytest.raises(fprep.CheckpointError) as caught:
        fprep.save_pretrained(tmp_path / "out", state, model, config={"x": 1})
    assert caught.value.subject == "config"
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("option", ["gaussian", False])
def test_other_lora_inits_peft_computes_without_the_base(base: Path, option: object) -> None:
    """'gaussian': A normal with std 1/r, B zeros; False: both as nn.Linear builds them."""
    model = W.build_meta(str(base), init_lora_weights=option)
    _, model = fprep.prepare(model, fprep.PrepConfig(weights=str(base), seed=0))
    layer = model.base_model.model.model.layers[0].self_attn.q_proj
    a, b = layer.lora_A["default"].weight, layer.lora_B["default"].weight
    if option == "gaussian":
        assert torch.count_nonzero(b) == 0
        assert 0.8 / layer.r["default"] < float(a.std()) < 1.2 / layer.r["default"]
    else:
        assert float(b.abs().max()) <= 1 / math.sqrt(b.shape[1])
        assert torch.count_nonzero(b) == b.numel()


def test_missing_keys_are_named_and_allowed_as_the_checkpoint_names_them(
    base: Path, tmp_path: Path
) -> None:
    """A checkpoint without the head: the error names the key the checkpoint lacks (not peft's
    name), and weights_missing_keys allows it under that name (the head is then initialized)."""
    from safetensors.torch import save_file

    state_dict = load_file(base / "model.safetensors")
    del state_dict["lm_head.weight"]
    headless = tmp_path / "headless"
    headless.mkdir()
    save_file(state_dict, headless / "model.safetensors", metadata={"format": "pt"})
    model = W.build_meta(str(base), modules_to_save=["lm_head"])
    error = fprep.plan(model, fprep.PrepConfig(weights=str(headless)), fprep.Topology()).failure()
    assert isinstance(error, fprep.CheckpointError)
    assert "'lm_head.weight' (2 missing)" in error.message  # the original and the copy
    cfg = fprep.PrepConfig(weights=str(headless), weights_missing_keys=("lm_head.*",), seed=0)
    _, model = fprep.prepare(model, cfg)
    head = model.base_model.model.lm_head
    assert not head.original_module.weight.is_meta
    assert torch.count_nonzero(head.modules_to_save["default"].weight) > 0
