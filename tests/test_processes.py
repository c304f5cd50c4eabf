"""fprep.processes in one process, and its pure parts at any world size.

``num_processes`` / ``process_index`` agree with the shares a prepared data loader reads, for
planned states of any world (DDP, HSDP meshes, tensor parallelism); ``split_between_processes``
gives exactly what Accelerate's own code gives for every rank of every world size (its method
called with a stand-in for its state object); in one process ``gather`` and
``pad_across_processes`` give the single-process answer and refuse what they cannot handle,
``main_process_first`` runs the block and lets its error through, and ``fprep.autocast`` is the
prepared forward's autocast. The 2-rank behaviour is in tests/test_processes_distributed.py.
"""

from __future__ import annotations

import functools
from collections import namedtuple
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from torch import nn
from torch.utils.data import DataLoader

import fprep
from fprep import ConfigError


def model() -> nn.Module:
    return nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))


@functools.cache
def planned(world: int, rank: int, kind: str = "ddp") -> fprep.PrepState:
    """The plan of rank ``rank`` of ``world`` (no process group: planning needs none)."""
    if kind == "hsdp":
        cfg = fprep.PrepConfig(strategy="hsdp", hsdp_shard_size=2)
    elif kind == "tp":
        cfg = fprep.PrepConfig(strategy="fsdp", tp=2, tp_plan={"0": "colwise", "1": "rowwise"})
    else:
        cfg = fprep.PrepConfig(strategy="ddp")
    nodes = 2 if kind == "hsdp" else 1  # hsdp: shard within a node, replicate across
    topology = fprep.Topology(world_size=world, rank=rank, local_world_size=world // nodes)
    return fprep.plan(model(), cfg, topology).unwrap()


@pytest.fixture(scope="module")
def single() -> fprep.PrepState:
    state, _ = fprep.prepare(model(), fprep.PrepConfig())
    return state


# -- which process -------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("world", "kind", "count"), [(1, "ddp", 1), (4, "ddp", 4), (8, "hsdp", 8), (8, "tp", 4)]
)
def test_index_and_count_are_the_shares_a_prepared_loader_reads(
    world: int, kind: str, count: int
) -> None:
    indices = []
    for rank in range(world):
        state = planned(world, rank, kind)
        loader = fprep.prepare_data_loader(state, DataLoader(list(range(10)), batch_size=2))
        assert fprep.num_processes(state) == loader.spec.world == count
        assert fprep.process_index(state) == loader.spec.rank
        indices.append(fprep.process_index(state))
    assert sorted(set(indices)) == list(range(count))  # tp ranks of one shard share an index


def test_a_prepared_single_process_is_process_0_of_1(single: fprep.PrepState) -> None:
    assert (fprep.process_index(single), fprep.num_processes(single)) == (0, 1)


# -- split_between_processes ---------------------------------------------------------------------
def accelerate_split(world: int, rank: int, inputs: Any, apply_padding: bool) -> Any:
    """Accelerate's own split_between_processes, with a stand-in for its state object."""
    from accelerate import PartialState

    fake = SimpleNamespace(num_processes=world, process_index=rank, device=torch.device("cpu"))
    with PartialState.split_between_processes(fake, inputs, apply_padding) as part:
        return part


@given(
    world=st.integers(1, 6),
    length=st.integers(0, 20),
    pad=st.booleans(),
    data=st.data(),
)
def test_split_is_accelerates_for_every_rank(
    world: int, length: int, pad: bool, data: st.DataObject
) -> None:
    pytest.importorskip("accelerate")
    pad = pad and length > 0  # Accelerate pads with the last item; fprep refuses empty inputs
    rank = data.draw(st.integers(0, world - 1))
    items = [f"x{i}" for i in range(length)]
    state = planned(world, rank)
    assert fprep.split_between_processes(state, items, apply_padding=pad) == accelerate_split(
        world, rank, items, pad
    )
    rows = torch.arange(3 * length).reshape(length, 3)
    if not pad or world == 1:  # (Accelerate pads a tensor with a collective)
        ours = fprep.split_between_processes(state, rows, apply_padding=pad)
        assert torch.equal(ours, accelerate_split(world, rank, rows, pad))
    both = {"a": items, "b": rows}
    ours_dict = fprep.split_between_processes(state, both, apply_padding=pad)
    assert ours_dict["a"] == fprep.split_between_processes(state, items, apply_padding=pad)
    assert both["a"] is items  # the input dict is left as it was (Accelerate's is rewritten)


@given(world=st.integers(1, 6), length=st.integers(1, 20))
def test_padded_tensor_parts_repeat_the_last_row(world: int, length: int) -> None:
    rows = torch.arange(2 * length).reshape(length, 2)
    parts = [
        fprep.split_between_processes(planned(world, r), rows, apply_padding=True)
        for r in range(world)
    ]
    plain = [fprep.split_between_processes(planned(world, r), rows) for r in range(world)]
    assert torch.equal(torch.cat(plain), rows)
    assert len({p.shape[0] for p in parts}) == 1  # every rank the same number
    for part, real in zip(parts, plain, strict=True):
        assert torch.equal(part[: len(real)], real)
        assert all(torch.equal(extra, rows[-1]) for extra in part[len(real) :])


def test_split_of_a_range_gives_a_range_to_select_with() -> None:
    parts = [fprep.split_between_processes(planned(3, r), range(10)) for r in range(3)]
    assert parts == [range(0, 4), range(4, 7), range(7, 10)]  # the first rank takes the extra
    padded = fprep.split_between_processes(planned(3, 2), range(10), apply_padding=True)
    assert padded == [*parts[2], 9]  # as long as the first part, with the last item repeated


@pytest.mark.parametrize(
    ("inputs", "pad", "subject", "words"),
    [
        ("abcdef", False, "inputs", ["str", "range(len(data))"]),
        (torch.tensor(3), False, "inputs", ["Tensor"]),
        ({"a": [1, 2], "b": [1]}, False, "inputs", ["same length", "'a': 2, 'b': 1"]),
        ({}, False, "inputs", ["empty dict"]),
        ([], True, "inputs", ["no last item"]),
        ({"a": {1, 2}}, False, "inputs['a']", ["set"]),
    ],
)
def test_split_refuses_what_it_cannot_split(
    inputs: Any, pad: bool, subject: str, words: list[str]
) -> None:
    with pytest.raises(ConfigError) as info:
        fprep.split_between_processes(planned(2, 0), inputs, apply_padding=pad)
    assert info.value.subject == subject
    for word in words:
        assert word in str(info.value), (word, str(info.value))


# -- gather and pad in one process ---------------------------------------------------------------
Pair = namedtuple("Pair", "logits labels")


def test_gather_in_one_process_keeps_the_structure(single: fprep.PrepState) -> None:
    logits, labels, loss = torch.randn(3, 5), torch.arange(3), torch.tensor(0.5)
    out = fprep.gather(single, {"pair": Pair(logits, labels), "losses": [loss]})
    assert isinstance(out["pair"], Pair) and torch.equal(out["pair"].logits, logits)
    assert torch.equal(out["pair"].labels, labels)
    assert out["losses"][0].shape == (1,) and out["losses"][0].item() == 0.5  # one per process
    gathered = fprep.gather_for_metrics(single, (logits, labels))
    assert isinstance(gathered, tuple) and torch.equal(gathered[0], logits)


def test_pad_in_one_process_is_the_identity(single: fprep.PrepState) -> None:
    ids = torch.arange(6).reshape(2, 3)
    assert fprep.pad_across_processes(single, {"ids": ids}, dim=1)["ids"] is ids


@pytest.mark.parametrize(
    ("call", "subject", "words"),
    [
        (lambda s: fprep.gather(s, (torch.ones(2), "text")), "data[1]", ["str", "torch.tensor"]),
        (lambda s: fprep.gather_for_metrics(s, [1.5]), "data[0]", ["float"]),
        (lambda s: fprep.pad_across_processes(s, torch.ones(2, 3), dim=2), "dim", ["dim=2"]),
        (lambda s: fprep.pad_across_processes(s, torch.ones(()), dim=0), "dim", ["0 dimensions"]),
        (lambda s: fprep.pad_across_processes(s, torch.ones(2), dim=0.5), "dim", ["int dim"]),
        (
            lambda s: fprep.pad_across_processes(s, torch.ones(2).long(), pad_index=0.5),
            "pad_index",
            ["torch.int64"],
        ),
        (lambda s: fprep.pad_across_processes(s, torch.ones(2), pad_index="x"), "pad_index", []),
    ],
)
def test_gather_and_pad_refuse_what_they_cannot_handle(
    single: fprep.PrepState, call: Any, subject: str, words: list[str]
) -> None:
    with pytest.raises(ConfigError) as info:
        call(single)
    assert info.value.subject == subject
    for word in words:
        assert word in str(info.value), (word, str(info.value))


# -- main_process_first and autocast -------------------------------------------------------------
def test_main_process_first_in_one_process_runs_the_block_and_its_error(
    single: fprep.PrepState,
) -> None:
    ran = []
    with fprep.main_process_first(single):
        ran.append(1)
    assert ran == [1]
    with pytest.raises(KeyError, match="missing"), fprep.main_process_first(single):
        raise KeyError("missing")


@pytest.mark.parametrize(("precision", "dtype"), [("bf16", torch.bfloat16), ("no", None)])
def test_autocast_is_the_prepared_forwards(precision: str, dtype: torch.dtype | None) -> None:
    cfg = fprep.PrepConfig(precision=precision)  # type: ignore[arg-type]
    state, net = fprep.prepare(nn.Sequential(nn.Linear(4, 4)), cfg)
    seen: list[torch.dtype] = []
    net[0].register_forward_hook(lambda m, i, o: seen.append(o.dtype))
    net(torch.ones(2, 4))  # inside the prepared forward (which returns float32)
    with fprep.autocast(state):
        outside = (torch.ones(2, 4) @ torch.ones(4, 4)).dtype
    assert outside == seen[0] == (dtype or torch.float32)
    assert torch.is_autocast_enabled("cpu") is False  # left as it was
