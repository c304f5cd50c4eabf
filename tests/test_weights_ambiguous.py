"""Ambiguous weights are never resolved silently.

A directory with both ``model.safetensors`` and an index is read as transformers'
``from_pretrained`` reads it (the single file), and the plan says so; a file holding both names
of a tied parameter with different values is refused (transformers would untie it); a tensor a
shard holds but its index does not list for it (a key in two shards, a stale shard) is refused,
as an unexpected tensor in a single file is.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from _weights_files import write_safetensors
from _weights_workers import full_state, gpt2_config, mismatches, on_meta, reference, save
from transformers import GPT2LMHeadModel

import fprep
from fprep.errors import CheckpointError
from fprep.summary import summarize


def test_a_directory_with_both_layouts_reads_the_single_file_like_from_pretrained(
    tmp_path: Path,
) -> None:
    save("llama", tmp_path)  # shards + index, seed 0
    assert (tmp_path / "model.safetensors.index.json").exists()
    torch.manual_seed(9)
    other = {k: torch.randn_like(v) for k, v in reference(tmp_path, torch.bfloat16).items()}
    write_safetensors(tmp_path / "model.safetensors", other)  # the single file: other values
    want = reference(tmp_path)  # what from_pretrained reads
    assert mismatches(want, {k: v.float() for k, v in other.items()}) == []
    state, model = fprep.prepare(on_meta("llama"), fprep.PrepConfig(weights=str(tmp_path)))
    assert mismatches(full_state(model), want) == []
    note = "holds both model.safetensors and model.safetensors.index.json"
    assert any(note in n for n in state.state_dict.weights.notes)
    assert note in summarize(state)


def _gpt2_file(path: Path, head_offset: float) -> dict[str, torch.Tensor]:
    torch.manual_seed(3)
    values = {k: v.clone() for k, v in GPT2LMHeadModel(gpt2_config()).state_dict().items()}
    values["lm_head.weight"] = values["transformer.wte.weight"] + head_offset
    write_safetensors(path, values)
    return values


def test_both_names_of_a_tied_weight_with_different_values_are_refused(tmp_path: Path) -> None:
    path = tmp_path / "model.safetensors"
    _gpt2_file(path, head_offset=1.0)
    model = on_meta("gpt2")
    with pytest.raises(CheckpointError, match="different values") as info:
        fprep.prepare(model, fprep.PrepConfig(weights=str(path)))
    message = info.value.message
    assert "lm_head.weight" in message and "transformer.wte.weight" in message
    assert "untie" in message and "tie_word_embeddings" in (info.value.hint or "")
    assert all(p.is_meta for p in model.parameters())


def test_both_names_of_a_tied_weight_with_equal_values_load_tied(tmp_path: Path) -> None:
    path = tmp_path / "model.safetensors"
    values = _gpt2_file(path, head_offset=0.0)
    _, model = fprep.prepare(on_meta("gpt2"), fprep.PrepConfig(weights=str(path)))
    assert model.lm_head.weight is model.transformer.wte.weight
    assert torch.equal(model.lm_head.weight, values["lm_head.weight"])


def _index(directory: Path, weight_map: dict[str, str]) -> None:
    (directory / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {}, "weight_map": weight_map})
    )


@pytest.mark.parametrize("b_value", [2.0, 1.0], ids=["different values", "equal values"])
def test_one_key_in_two_shards_is_refused(tmp_path: Path, b_value: float) -> None:
    write_safetensors(tmp_path / "a.safetensors", {"x": torch.ones(2)})
    write_safetensors(
        tmp_path / "b.safetensors", {"y": torch.ones(3), "x": torch.full((2,), b_value)}
    )
    _index(tmp_path, {"x": "a.safetensors", "y": "b.safetensors"})
    error = _refusal(tmp_path)
    assert "'x'" in error.message and "does not list for it" in error.message
    assert error.subject == "x" and "b.safetensors" in error.message


def test_a_shard_holding_a_tensor_its_index_does_not_list_is_refused(tmp_path: Path) -> None:
    write_safetensors(tmp_path / "a.safetensors", {"x": torch.ones(2)})
    write_safetensors(tmp_path / "b.safetensors", {"y": torch.ones(3), "stale": torch.ones(1)})
    _index(tmp_path, {"x": "a.safetensors", "y": "b.safetensors"})
    error = _refusal(tmp_path)
    assert "'stale'" in error.message and "does not list for it" in error.message
    assert error.subject == "stale" and "b.safetensors" in error.message
    # the same tensor in a single file is refused too (an unexpected key)
    one = {"x": torch.ones(2), "y": torch.ones(3), "stale": torch.ones(1)}
    write_safetensors(tmp_path / "one.safetensors", one)
    assert "stale" in _refusal(tmp_path / "one.safetensors").message


def _refusal(path: Path) -> CheckpointError:
    model = torch.nn.Module()
    model.register_parameter("x", torch.nn.Parameter(torch.zeros(2)))
    model.register_parameter("y", torch.nn.Parameter(torch.zeros(3)))
    result = fprep.plan(model, fprep.PrepConfig(weights=str(path)))
    error = result.failure()
    assert isinstance(error, CheckpointError), error
    return error
