"""Checkpoints of tensor-parallel models (TP + FSDP2 DTensors on a 2-D mesh), resharded across
layouts: saved at dp 2 x tp 2 and loaded at dp 4, tp 4 and one process; saved by one process
and loaded at dp 2 x tp 2; the asynchronous save holding the values at the call; export_full
and save_pretrained writing the full tensors (transformers' from_pretrained reads them back).
Model and optimizer state are compared bitwise, in full."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import _tp_checkpoint_workers as W
import pytest
import torch
from _checkpoint_workers import undump

from fprep.testing.distributed import run_ranks


def differences(a: Any, b: Any, where: str = "") -> list[str]:
    """Where two nested states (dicts, lists, tensors, plain values) differ (bitwise)."""
    if isinstance(a, dict):
        if not isinstance(b, dict) or a.keys() != b.keys():
            return [f"{where}: keys differ"]
        return [d for k in a for d in differences(a[k], b[k], f"{where}/{k}")]
    if isinstance(a, list):
        if not isinstance(b, list) or len(a) != len(b):
            return [f"{where}: lengths differ"]
        pairs = enumerate(zip(a, b, strict=True))
        return [d for i, (x, y) in pairs for d in differences(x, y, f"{where}[{i}]")]
    if isinstance(a, torch.Tensor):
        ok = isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
        return [] if ok else [where]
    return [] if a == b else [f"{where}: {a!r} != {b!r}"]


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    root = tmp_path_factory.mktemp("tp_ckpt")
    one = W.save_at_one(str(root))  # this process: one rank, saved before the spawned job
    out = run_ranks(W.four_ranks, 4, str(root), timeout_s=900)[0]
    yield {"root": root, "one": one, **{k: undump(v) for k, v in out.items()}}


def test_save_holds_optimizer_state_and_training_moved_on(runs: dict[str, Any]) -> None:
    at_save = runs["at_save"]
    assert at_save["optim"] and all("exp_avg" in v for v in at_save["optim"].values())
    moved = differences(at_save["model"], runs["after"]["model"])
    assert len(moved) == len(at_save["model"])  # the step after the async save changed all


@pytest.mark.parametrize("layout", ["dp4", "tp4"])
def test_dp2_tp2_loads_at_other_layouts(runs: dict[str, Any], layout: str) -> None:
    assert differences(runs["at_save"], runs[f"sync/{layout}"]) == []


def test_dp2_tp2_loads_in_one_process(runs: dict[str, Any]) -> None:
    got = W.loaded(Path(runs["root"]) / "sync", "one")
    assert differences(runs["at_save"], got) == []


def test_one_process_loads_at_dp2_tp2(runs: dict[str, Any]) -> None:
    assert differences(runs["one"], runs["one/dp2_tp2"]) == []


def test_async_save_holds_the_values_at_the_call(runs: dict[str, Any]) -> None:
    assert differences(runs["at_save"], runs["async/dp2_tp2"]) == []


def test_tp_without_data_parallelism_saves_and_exports_collectively(
    runs: dict[str, Any],
) -> None:
    """tp 4 alone (strategy "none"): every rank took part in the save (it loads at dp 2 x tp 2
    bitwise) and in the export (full tensors, not rank 0's shards)."""
    from safetensors.torch import load_file

    assert differences(runs["tp4_trained"], runs["by_tp4/dp2_tp2"]) == []
    full = load_file(str(Path(runs["root"]) / "by_tp4.safetensors"))
    assert differences(runs["tp4_trained"]["model"], full) == []
    assert differences(runs["at_save"]["model"], runs["tp4_trained"]["model"])  # it trained


def test_export_full_writes_the_full_tensors(runs: dict[str, Any]) -> None:
    from safetensors.torch import load_file

    full = load_file(str(Path(runs["root"]) / "full.safetensors"))
    assert differences(runs["at_save"]["model"], full) == []


def test_save_pretrained_round_trips_through_from_pretrained(runs: dict[str, Any]) -> None:
    from transformers import AutoModelForCausalLM

    back = AutoModelForCausalLM.from_pretrained(Path(runs["root"]) / "hf")
    got = {k: v for k, v in back.state_dict().items() if "inv_freq" not in k}
    assert differences(runs["hf_trained"], got) == []
