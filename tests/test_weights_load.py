"""Pretrained weights loaded by prepare (``PrepConfig(weights=...)``) equal transformers' own
``from_pretrained``, for models built on the meta device, at 1 and 2 ranks; and back again:
a fine-tuned model exported with ``fprep.export_full`` loads with ``from_pretrained``."""

from __future__ import annotations

import io
import os
from pathlib import Path

import pytest
import torch
from _weights_workers import (
    full_state,
    mismatches,
    on_meta,
    prepared,
    rank_round_trip,
    reference,
    save,
)
from transformers import AutoModelForCausalLM

import fprep
from fprep.apply.load_weights import load_weights
from fprep.apply.steps import step
from fprep.errors import CheckpointError
from fprep.testing.distributed import run_ranks


@pytest.fixture(scope="module")
def llama(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save("llama", tmp_path_factory.mktemp("llama"))


@pytest.fixture(scope="module")
def gpt2(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save("gpt2", tmp_path_factory.mktemp("gpt2"))


def test_llama_bf16_shards_into_fp32_params_equal_from_pretrained(llama: Path) -> None:
    assert len(list(llama.glob("*.safetensors"))) > 1
    state, model = prepared("llama", llama)
    assert mismatches(full_state(model), reference(llama)) == []
    assert "model.rotary_emb" not in state.param_handles.materialize.loaded  # initialized
    assert "model.layers.0.mlp.up_proj" in state.param_handles.materialize.loaded  # not


def test_fp32_file_into_bf16_params(tmp_path: Path) -> None:
    directory = save("llama", tmp_path, dtype=torch.float32)
    model = on_meta("llama").to(torch.bfloat16)
    cfg = fprep.PrepConfig(weights=str(directory))
    _, model = fprep.prepare(model, cfg)
    assert mismatches(full_state(model), reference(directory, torch.bfloat16)) == []


def test_gpt2_tied_head_is_tied_and_equal(gpt2: Path) -> None:
    _, model = prepared("gpt2", gpt2)
    assert model.lm_head.weight is model.transformer.wte.weight
    assert mismatches(full_state(model), reference(gpt2)) == []


def test_a_model_that_is_not_on_meta_is_overwritten(gpt2: Path) -> None:
    from _weights_workers import gpt2_config
    from transformers import GPT2LMHeadModel

    torch.manual_seed(5)
    model = GPT2LMHeadModel(gpt2_config())
    _, model = fprep.prepare(model, fprep.PrepConfig(weights=str(gpt2)))
    assert mismatches(full_state(model), reference(gpt2)) == []


def test_export_full_file_loads_back(tmp_path: Path, llama: Path) -> None:
    state, model = prepared("llama", llama)
    fprep.export_full(tmp_path / "model.safetensors", state, model)
    _, model2 = prepared("llama", tmp_path / "model.safetensors")
    assert mismatches(full_state(model2), full_state(model)) == []


def test_a_file_changed_after_planning_fails_and_rolls_back(tmp_path: Path) -> None:
    directory = save("gpt2", tmp_path)
    victim = sorted(directory.glob("model-*.safetensors"))[-1]

    @step("truncate")
    def truncate(state, model):  # type: ignore[no-untyped-def]
        os.truncate(victim, victim.stat().st_size - 4)
        return state, model

    steps = list(fprep.default_steps())
    steps.insert(steps.index(load_weights), truncate)  # type: ignore[attr-defined]
    model = on_meta("gpt2")
    with pytest.raises(CheckpointError, match="when prepare planned") as info:
        fprep.prepare(model, fprep.PrepConfig(weights=str(directory)), steps=steps)
    assert info.value.subject == str(victim)
    assert model.lm_head.weight.is_meta  # rolled back


@pytest.mark.slow
def test_two_ranks_every_strategy_then_fine_tune_and_back_to_from_pretrained(
    tmp_path: Path, llama: Path, gpt2: Path
) -> None:
    out = tmp_path / "finetuned"
    out.mkdir()
    ranks = run_ranks(rank_round_trip, 2, llama, gpt2, out, timeout_s=300)
    for result in ranks:
        for strategy in ("fsdp", "hsdp", "ddp", "none", "gpt2"):
            assert result[strategy] == [], (strategy, result[strategy])
        assert result["gpt2-tied"] and result["changed"]
    loaded = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
    got = {k: v for k, v in loaded.state_dict().items() if "inv_freq" not in k}
    trained = torch.load(io.BytesIO(ranks[0]["trained"]), weights_only=True)
    assert mismatches(got, trained) == []
