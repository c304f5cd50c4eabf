"""``fprep.save_pretrained``: a directory transformers' ``from_pretrained`` loads, from a model
prepared at 1 or 2 ranks (the weights gathered as ``export_full`` gathers them, the config
beside them); and what it refuses before writing anything."""

from __future__ import annotations

import io
import json
from pathlib import Path

import pytest
import torch
from _pretrained_workers import as_bytes, rank_save_pretrained, trained
from _weights_workers import full_state, mismatches
from torch import nn
from transformers import AutoModelForCausalLM, GenerationConfig

import fprep
from fprep.errors import CheckpointError
from fprep.testing.distributed import run_ranks


def loaded(directory: Path) -> dict[str, torch.Tensor]:
    """The model from_pretrained builds from the directory, with no dtype given."""
    model = AutoModelForCausalLM.from_pretrained(directory)
    return {k: v for k, v in model.state_dict().items() if "inv_freq" not in k}


def test_one_rank_round_trip_through_from_pretrained(tmp_path: Path) -> None:
    state, model = trained("none")
    before = model.config.to_dict()
    out = tmp_path / "out"
    assert fprep.save_pretrained(out, state, model) == out
    assert sorted(p.name for p in out.iterdir()) == [
        "config.json",
        "generation_config.json",
        "model.safetensors",
    ]
    want = torch.load(io.BytesIO(as_bytes(full_state(model))), weights_only=True)
    got = loaded(out)
    assert mismatches(got, want) == [] and all(v.dtype == torch.float32 for v in got.values())
    written = json.loads((out / "config.json").read_text())
    assert written["dtype"] == "float32" and written["architectures"] == ["LlamaForCausalLM"]
    assert written["model_type"] == "llama" and written["vocab_size"] == 67
    assert GenerationConfig.from_pretrained(out).to_dict() == model.generation_config.to_dict()
    assert model.config.to_dict() == before  # the caller's config is not changed
    # the directory is also a valid weights= for another prepare
    with torch.device("meta"):
        again = AutoModelForCausalLM.from_config(model.config)
    _, again = fprep.prepare(again, fprep.PrepConfig(weights=str(out)))
    assert mismatches(full_state(again), want) == []


@pytest.mark.slow
def test_two_ranks_round_trip_through_from_pretrained(tmp_path: Path) -> None:
    ranks = run_ranks(rank_save_pretrained, 2, tmp_path, timeout_s=300)
    for strategy in ("fsdp", "ddp"):
        out = tmp_path / strategy
        assert [r[strategy]["returned"] for r in ranks] == [str(out), str(out)]
        want = torch.load(io.BytesIO(ranks[0][strategy]["trained"]), weights_only=True)
        assert mismatches(loaded(out), want) == [], strategy
        config = json.loads((out / "config.json").read_text())
        assert config["architectures"] == ["LlamaForCausalLM"]  # not FSDPLlamaForCausalLM
    # docs/finetune.md: transformers' own save_pretrained does not gather fprep's shards: rank
    # 0 fails, and the directory holds the configuration without any weights.
    assert ranks[0]["plain"] != "returned" and ranks[1]["plain"] == "returned"
    assert "config.json" in ranks[0]["plain_files"]
    assert not any(name.endswith(".safetensors") for name in ranks[0]["plain_files"])


def test_a_model_without_config_is_refused_before_anything_is_written(tmp_path: Path) -> None:
    state, model = fprep.prepare(nn.Linear(4, 2), fprep.PrepConfig())
    out = tmp_path / "out"
    with pytest.raises(CheckpointError, match=r"has no \.config") as info:
        fprep.save_pretrained(out, state, model)
    assert info.value.subject == "config" and not out.exists()
    with pytest.raises(CheckpointError, match="transformers config or a dict"):
        fprep.save_pretrained(out, state, model, config="llama")
    assert not out.exists()
    # a dict is written as it is; the weights beside it load with plain safetensors
    from safetensors.torch import load_file

    fprep.save_pretrained(out, state, model, config={"model_type": "custom", "width": 4})
    assert json.loads((out / "config.json").read_text()) == {"model_type": "custom", "width": 4}
    assert torch.equal(load_file(out / "model.safetensors")["weight"], model.weight.detach())
    assert not (out / "generation_config.json").exists()


def test_an_index_left_by_a_sharded_save_is_refused(tmp_path: Path) -> None:
    """model.safetensors.index.json would be read instead of the new file by weights=."""
    state, model = trained("none")
    out = tmp_path / "out"
    out.mkdir()
    (out / "model.safetensors.index.json").write_text("{}")
    with pytest.raises(CheckpointError, match="earlier sharded save"):
        fprep.save_pretrained(out, state, model)
    assert sorted(p.name for p in out.iterdir()) == ["model.safetensors.index.json"]
