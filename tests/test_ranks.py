"""fprep.ranks in one process: reduce, wait_for_everyone, print_once, set_seed, end_training,
and a 0-d gather_for_metrics. Their 2-rank behaviour is in tests/test_ops_distributed.py.

In one process every helper gives the single-process answer, so a script runs unchanged at
any world size; bad arguments are ConfigErrors naming what is allowed.
"""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from torch import nn

import fprep
from fprep import ConfigError, PrepConfig


@pytest.fixture(scope="module")
def state() -> fprep.PrepState:
    prepared, _ = fprep.prepare(nn.Linear(2, 2), PrepConfig())
    return prepared


def draws() -> list[float]:
    return [random.random(), float(np.random.rand()), float(torch.rand(()))]


@pytest.mark.parametrize("op", ["sum", "mean", "max", "min"])
def test_reduce_of_a_tensor_in_one_process_is_a_copy_of_it(state: fprep.PrepState, op: str) -> None:
    value = torch.tensor([[1.5, -2.0], [3.0, 0.25]], requires_grad=True)
    got = fprep.reduce(state, value, op)
    assert isinstance(got, torch.Tensor) and not got.requires_grad
    assert got.dtype == value.dtype and torch.equal(got, value.detach())
    got.add_(1.0)  # a copy: the input is untouched
    assert value[0, 0].item() == 1.5


@given(value=st.one_of(st.integers(-(2**40), 2**40), st.floats(-1e12, 1e12)))
def test_reduce_of_a_number_in_one_process_is_the_number(
    state: fprep.PrepState, value: float
) -> None:
    for op in ("sum", "max", "min"):
        got = fprep.reduce(state, value, op)  # type: ignore[arg-type]
        assert got == value and type(got) is type(value)  # float64: no digits lost
    assert fprep.reduce(state, value, "mean") == float(value)


def test_reduce_of_ints_and_bools_matches_the_distributed_dtypes(state: fprep.PrepState) -> None:
    ints = torch.tensor([1, 2, 4])
    assert fprep.reduce(state, ints, "mean").dtype == torch.get_default_dtype()
    assert fprep.reduce(state, ints).dtype == torch.int64
    flags = torch.tensor([True, False])
    assert fprep.reduce(state, flags).tolist() == [1, 0]  # bools count as 0 / 1
    assert fprep.reduce(state, flags, "max").dtype == torch.bool
    assert fprep.reduce(state, flags, "mean").tolist() == [1.0, 0.0]


def test_reduce_refuses_unknown_ops_and_values(state: fprep.PrepState) -> None:
    with pytest.raises(ConfigError, match="'sum', 'mean', 'max', 'min'") as op:
        fprep.reduce(state, torch.ones(2), "avg")  # type: ignore[arg-type]
    assert op.value.subject == "op"
    for bad in ([1.0, 2.0], "3", {"loss": torch.ones(())}, None):
        with pytest.raises(ConfigError, match="a tensor or a real number") as err:
            fprep.reduce(state, bad)  # type: ignore[arg-type]
        assert err.value.subject == "value" and type(bad).__qualname__ in str(err.value)


def test_wait_for_everyone_and_end_training_in_one_process(state: fprep.PrepState) -> None:
    fprep.wait_for_everyone(state)  # returns at once: nothing to wait for
    assert fprep.end_training(state) is False  # no process group: nothing to end
    assert fprep.reduce(state, 2.0) == 2.0  # the state still works


def test_print_once_prints_on_the_main_process(
    state: fprep.PrepState, capsys: pytest.CaptureFixture[str]
) -> None:
    assert fprep.is_main_process(state)
    fprep.print_once(state, "epoch", 3, sep=": ")
    assert capsys.readouterr().out == "epoch: 3\n"


def test_set_seed_seeds_python_numpy_and_torch() -> None:
    assert fprep.set_seed(11) == 11
    first = draws()
    fprep.set_seed(11)
    assert draws() == first
    fprep.set_seed(12)
    assert draws() != first


def test_set_seed_per_rank_adds_the_rank(
    state: fprep.PrepState, monkeypatch: pytest.MonkeyPatch
) -> None:
    assert fprep.set_seed(5, state, per_rank=True) == 5  # rank 0 of 1
    monkeypatch.setenv("RANK", "3")
    monkeypatch.setenv("WORLD_SIZE", "4")
    assert fprep.set_seed(5, per_rank=True) == 8  # before prepare: the launcher's rank
    assert fprep.set_seed(5) == 5


@pytest.mark.parametrize("seed", [-1, True, 1.5, "1", 2**32])
def test_set_seed_refuses_bad_seeds(seed: object) -> None:
    with pytest.raises(ConfigError) as err:
        fprep.set_seed(seed)  # type: ignore[arg-type]
    assert err.value.subject == "seed"


def test_gather_of_a_0d_tensor_is_one_entry_per_rank(state: fprep.PrepState) -> None:
    loss = torch.tensor(0.75)
    gathered = fprep.gather_for_metrics(state, loss)
    assert gathered.shape == (1,) and gathered.tolist() == [0.75]
