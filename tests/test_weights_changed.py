"""Weights that change under the loader are refused, and a failed load leaves the model's
values exactly as they were (a real model, not on the meta device).

A file replaced after planning by one of the same size (the same tensors, their bytes swapped
and the header's offsets swapped to match) or rewritten in place (its modification time put
back), a file modified while it is read, a shard truncated after planning, a read failing
halfway: each is a CheckpointError naming the file, and every parameter is bit-identical to its
value before ``prepare``. At two ranks (gloo): ranks given different revisions, a file replaced
between two ranks' planning, and one rank failing after the other has written everything.
"""

from __future__ import annotations

import itertools
import os
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from _weights_files import stamp_old, write_safetensors, write_swapped
from _weights_workers import gpt2_config, rank_changed_weights, rank_own_copy, save
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn
from transformers import GPT2LMHeadModel

import fprep
from fprep.apply.load_weights import load_weights
from fprep.apply.steps import step
from fprep.errors import CheckpointError
from fprep.testing.distributed import run_ranks
from fprep.weights import pipeline as pipeline_module
from fprep.weights.identity import BLOCK, MERGE_GAP, TENSOR_SAMPLES, sample_ranges


def _two_layers() -> nn.Module:
    torch.manual_seed(1)
    return nn.Sequential(nn.Linear(8, 8, bias=False), nn.Linear(8, 8, bias=False))


def _values(model: nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def _bit_identical(model: nn.Module, before: dict[str, torch.Tensor]) -> bool:
    now = model.state_dict()
    return now.keys() == before.keys() and all(
        torch.equal(now[k].view(torch.uint8), v.view(torch.uint8)) for k, v in before.items()
    )


def _before_load(action: Callable[[], None]) -> list[Any]:
    """The default steps with ``action`` run just before load_weights."""

    @step("meddle")
    def meddle(state, model):  # type: ignore[no-untyped-def]
        action()
        return state, model

    steps = list(fprep.default_steps())
    steps.insert(steps.index(load_weights), meddle)  # type: ignore[attr-defined]
    return steps


@pytest.fixture
def pair(tmp_path: Path) -> tuple[Path, dict[str, torch.Tensor]]:
    torch.manual_seed(2)
    tensors = {"0.weight": torch.randn(8, 8), "1.weight": torch.randn(8, 8)}
    return stamp_old(write_safetensors(tmp_path / "model.safetensors", tensors)), tensors


@pytest.mark.parametrize("how", ["replaced", "rewritten in place"])
def test_a_same_size_file_with_swapped_tensors_after_planning_is_refused(
    tmp_path: Path, pair: tuple[Path, dict[str, torch.Tensor]], how: str
) -> None:
    path, tensors = pair
    swapped = write_swapped(tmp_path / "swapped", tensors)
    assert swapped.stat().st_size == path.stat().st_size

    def swap() -> None:
        if how == "replaced":
            os.replace(swapped, path)
        else:  # same inode, and the modification time put back: only the header tells
            with open(path, "r+b") as f:
                f.write(swapped.read_bytes())
            stamp_old(path)

    model = _two_layers()
    before = _values(model)
    with pytest.raises(CheckpointError) as info:
        fprep.prepare(model, fprep.PrepConfig(weights=str(path)), steps=_before_load(swap))
    assert info.value.subject == str(path)
    assert str(path) in info.value.message
    assert _bit_identical(model, before)
    # the swapped file itself is fine: planned afresh, it loads the right values
    _, loaded = fprep.prepare(_two_layers(), fprep.PrepConfig(weights=str(path)))
    assert torch.equal(loaded[0].weight, tensors["0.weight"])
    assert torch.equal(loaded[1].weight, tensors["1.weight"])


def test_a_file_modified_while_it_is_read_is_refused_and_values_restored(
    pair: tuple[Path, dict[str, torch.Tensor]], monkeypatch: pytest.MonkeyPatch
) -> None:
    path, _ = pair
    real_read = pipeline_module.read_exact
    calls = []

    def read_then_modify(*args: Any) -> None:
        real_read(*args)
        calls.append(1)
        if len(calls) == 1:  # after the first tensor landed: rewrite the file in place
            with open(path, "r+b") as f:
                f.seek(-4, os.SEEK_END)
                f.write(b"\x00\x00\x80\x7f")

    monkeypatch.setattr(pipeline_module, "read_exact", read_then_modify)
    model = _two_layers()
    before = _values(model)
    with pytest.raises(CheckpointError, match="modified") as info:
        fprep.prepare(model, fprep.PrepConfig(weights=str(path)))
    assert info.value.subject == str(path)
    assert calls  # the failure came after writes into the model
    assert _bit_identical(model, before)


def test_a_shard_truncated_after_planning_leaves_a_real_model_bit_identical(
    tmp_path: Path,
) -> None:
    directory = save("gpt2", tmp_path)
    victim = sorted(directory.glob("model-*.safetensors"))[-1]
    torch.manual_seed(5)
    model = GPT2LMHeadModel(gpt2_config())
    before = _values(model)
    steps = _before_load(lambda: os.truncate(victim, victim.stat().st_size - 4))
    with pytest.raises(CheckpointError) as info:
        fprep.prepare(model, fprep.PrepConfig(weights=str(directory)), steps=steps)
    assert info.value.subject == str(victim)
    assert _bit_identical(model, before)


def test_a_read_failing_halfway_restores_every_written_value(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    directory = save("gpt2", tmp_path)
    torch.manual_seed(5)
    model = GPT2LMHeadModel(gpt2_config())
    before = _values(model)
    real_read = pipeline_module.read_exact
    calls = []

    def fail_on_the_tenth(*args: Any) -> None:
        calls.append(1)
        if len(calls) == 10:
            raise OSError(5, "Input/output error", str(args[3]))
        real_read(*args)

    monkeypatch.setattr(pipeline_module, "read_exact", fail_on_the_tenth)
    with pytest.raises(CheckpointError, match="Input/output error"):
        fprep.prepare(model, fprep.PrepConfig(weights=str(directory)))
    # the reads other reader threads had in flight finish (nothing writes after the error)
    assert 10 <= len(calls) <= 10 + pipeline_module.MAX_READERS
    assert _bit_identical(model, before)
    monkeypatch.undo()  # and the same model then loads
    _, loaded = fprep.prepare(model, fprep.PrepConfig(weights=str(directory)))
    assert not _bit_identical(loaded, before)


def test_two_ranks_refuse_different_revisions_and_a_file_replaced_between_them(
    tmp_path: Path,
) -> None:
    results = run_ranks(rank_changed_weights, 2, tmp_path, timeout_s=300)
    for rank, result in enumerate(results):
        assert "different revisions" in result["revisions"], (rank, result)
        assert result["revisions_subject"].endswith(".safetensors")
        assert "replaced" in result["replaced"] or "another" in result["replaced"], result
        assert result["replaced_meta"]  # rolled back to the meta device
        assert result["late_failure"] == "rank 1 failed late", result
        assert result["late_identical"], rank  # rank 0 had written everything: put back
        assert result["ok"] == []  # and the same checkpoint then loads on both


# -- revisions that differ in one tensor ------------------------------------------------------
def _per_file_samples(header_bytes: int, size: int) -> list[tuple[int, int]]:
    """What a per-file sampler reads (the oracle of "it would not see it"): 16 evenly spaced
    4 KiB blocks over the data section, the last at its end."""
    last = max(0, size - header_bytes - 4096)
    starts = {header_bytes + last * i // 15 for i in range(16)}
    return [(s, min(4096, size - s)) for s in sorted(starts)]


def _unsampled_tensor(path: Path) -> tuple[str, int, int]:
    """The largest tensor of ``path`` that no per-file sample touches: (key, offset, nbytes)."""
    from fprep.weights.header import read_header

    tensors, record = read_header(str(path))
    samples = _per_file_samples(record.header_bytes, record.size)
    free = [
        t
        for t in tensors
        if t.nbytes and all(t.offset + t.nbytes <= s or s + n <= t.offset for s, n in samples)
    ]
    assert free, "every tensor is sampled per file: the test needs a larger file"
    t = max(free, key=lambda t: t.nbytes)
    return t.key, t.offset, t.nbytes


def _copies(root: Path, world: int, differing: int | None) -> str | None:
    """``root/original`` (a tiny Llama's save_pretrained, one file) and one copy per rank;
    rank ``differing``'s copy has one tensor changed in place (every value of it, as a
    fine-tune changes a layer it trains), where a per-file sampler would not look. Returns
    that tensor's key."""
    from _tiny_transformers import TINY_LLAMA
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(3)
    LlamaForCausalLM(LlamaConfig(**TINY_LLAMA)).save_pretrained(root / "original")
    for rank in range(world):
        shutil.copytree(root / "original", root / f"rank{rank}")
    if differing is None:
        return None
    path = root / f"rank{differing}" / "model.safetensors"
    key, offset, nbytes = _unsampled_tensor(path)
    with open(path, "r+b") as f:
        f.seek(offset)
        values = torch.frombuffer(bytearray(f.read(nbytes)), dtype=torch.float32)
        f.seek(offset)
        f.write((values + 1e-3).numpy().tobytes())
    return key


@pytest.mark.parametrize(("world", "differing"), [(2, 1), (4, 2)])
def test_ranks_whose_copies_differ_in_one_tensor_are_refused(
    tmp_path: Path, world: int, differing: int
) -> None:
    """One rank's copy differs from the others' in one whole tensor that lies between the
    blocks a per-file sampler reads: a CheckpointError on every rank, naming that rank, the
    file and the tensor (and no other), before anything is loaded."""
    key = _copies(tmp_path, world, differing)
    assert key is not None
    results = run_ranks(rank_own_copy, world, tmp_path, timeout_s=300)
    for rank, result in enumerate(results):
        assert "error" in result, (rank, result)
        assert "different revisions" in result["error"], (rank, result)
        assert f"rank {differing}'s" in result["error"] and "model.safetensors" in result["error"]
        assert f"differ in {key!r} (1 of the tensors sampled)" in result["error"], result
        assert result["subject"] == "model.safetensors"


def test_ranks_with_identical_copies_load(tmp_path: Path) -> None:
    """Node-local copies that are byte for byte the same load, equal to from_pretrained."""
    _copies(tmp_path, 2, None)
    results = run_ranks(rank_own_copy, 2, tmp_path, timeout_s=300)
    assert [r.get("mismatches") for r in results] == [[], []], results


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(0, 200_000), min_size=1, max_size=30), st.integers(0, 9000))
def test_every_tensor_is_sampled_at_both_ends(sizes: list[int], pad: int) -> None:
    """The digest's ranges (any tensor sizes, laid out back to back after a header of ``pad``
    bytes): sorted and disjoint, each tensor's first and last bytes in them, and no tensor read
    beyond its samples and the gaps merged between them."""
    offsets = [pad + sum(sizes[:i]) for i in range(len(sizes))]
    ranges = sample_ranges(zip(offsets, sizes, strict=True))
    assert all(a + n < b for (a, n), (b, _) in itertools.pairwise(ranges))  # merged if touching

    def covered(byte: int) -> bool:
        return any(a <= byte < a + n for a, n in ranges)

    for offset, n in zip(offsets, sizes, strict=True):
        if n:
            assert covered(offset) and covered(offset + n - 1)
        inside = sum(max(0, min(a + m, offset + n) - max(a, offset)) for a, m in ranges)
        bound = n if n <= TENSOR_SAMPLES * BLOCK else TENSOR_SAMPLES * BLOCK + 3 * MERGE_GAP
        assert inside <= bound
