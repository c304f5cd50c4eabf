"""``fprep.plan`` never raises for bad input, and ``fprep plan`` never shows a traceback.

Hypothesis drives ``fprep.plan`` over the strategies' invalid inputs (snapshots) and over real
``torch.nn`` modules with odd shapes (empty, scalar, complex, integer buffers, lazy modules not
yet initialized, recurrent and attention layers, parametrizations, tied weights), configs and
topologies: every outcome is ``Success`` or ``Failure(PrepError)``. The command line turns what
is not a ``PrepError`` (a bug in fprep) into one line and exit status 2; ``--debug`` or
``FPREP_DEBUG=1`` keep the traceback.
"""

from __future__ import annotations

import textwrap
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from returns.result import Failure, Success
from torch import nn

import fprep
import fprep.cli
from fprep.cli import main
from fprep.testing import strategies as fst


def _complex() -> nn.Module:
    m = nn.Module()
    m.p = nn.Parameter(torch.zeros(4, 2, dtype=torch.complex64))
    return m


def _scalar() -> nn.Module:
    m = nn.Module()
    m.s = nn.Parameter(torch.tensor(1.0))
    return m


def _int_buffer() -> nn.Module:
    m = nn.Linear(2, 2)
    m.register_buffer("steps", torch.zeros(3, dtype=torch.int64))
    return m


def _tied() -> nn.Module:
    emb, head = nn.Embedding(7, 4), nn.Linear(4, 7, bias=False)
    head.weight = emb.weight
    return nn.Sequential(emb, head)


def _parametrized() -> nn.Module:
    return nn.utils.parametrizations.weight_norm(nn.Linear(3, 3))


#: Real modules a user might hand to fprep, odd ones included.
LAYERS: dict[str, Callable[[], nn.Module]] = {
    "linear": lambda: nn.Linear(3, 5),
    "empty linear": lambda: nn.Linear(0, 4),
    "lazy linear": lambda: nn.LazyLinear(4),
    "lazy batch norm": lambda: nn.LazyBatchNorm1d(),
    "lstm": lambda: nn.LSTM(4, 3),
    "attention": lambda: nn.MultiheadAttention(6, 3),
    "embedding bag": lambda: nn.EmbeddingBag(10, 4),
    "conv": lambda: nn.Conv2d(3, 4, 3),
    "batch norm": lambda: nn.BatchNorm1d(4),
    "complex": _complex,
    "scalar": _scalar,
    "int buffer": _int_buffer,
    "tied": _tied,
    "parametrized": _parametrized,
    "frozen": lambda: nn.Linear(2, 2).requires_grad_(False),
    "no parameters": nn.ReLU,
}


@st.composite
def odd_models(draw: st.DrawFn) -> nn.Module:
    names = draw(st.lists(st.sampled_from(sorted(LAYERS)), min_size=1, max_size=3))
    layers = [LAYERS[n]() for n in names]
    model = layers[0] if len(layers) == 1 else nn.Sequential(*layers)
    if draw(st.booleans()):
        model = model.to("meta")
    return model


def _assert_plans_or_fails_with_a_prep_error(result: Any) -> None:
    assert isinstance(result, Success | Failure), result
    if isinstance(result, Failure):
        error = result.failure()
        assert isinstance(error, fprep.PrepError), repr(error)
        assert error.message


@given(fst.plan_inputs(valid=False))
def test_plan_of_invalid_snapshots_never_raises(inputs: fst.PlanCase) -> None:
    _assert_plans_or_fails_with_a_prep_error(fprep.plan(*inputs))


@pytest.mark.filterwarnings("ignore:Initializing zero-element tensors")
@settings(max_examples=150, deadline=None)
@given(model=odd_models(), cfg=fst.configs(), topology=fst.topologies())
def test_plan_of_odd_real_modules_never_raises(
    model: nn.Module, cfg: fprep.PrepConfig, topology: fprep.Topology
) -> None:
    _assert_plans_or_fails_with_a_prep_error(fprep.plan(model, cfg, topology))


@pytest.mark.parametrize("topology", ["x", 3, {"world_size": 2}])
def test_a_topology_that_is_not_one_is_a_topology_error(topology: Any) -> None:
    error = fprep.plan(nn.Linear(2, 2), fprep.PrepConfig(), topology).failure()
    assert isinstance(error, fprep.TopologyError) and error.subject == "topology"


@pytest.mark.parametrize("layer", ["lazy linear", "lazy batch norm"])
def test_a_lazy_module_not_yet_run_is_a_model_error(layer: str) -> None:
    error = fprep.plan(nn.Sequential(LAYERS[layer]()), fprep.PrepConfig()).failure()
    assert isinstance(error, fprep.ModelError)
    assert error.subject == "0.weight" and "forward pass" in error.hint


BUILDERS = textwrap.dedent(
    """
    from torch import nn

    def lazy():
        return nn.Sequential(nn.LazyLinear(8), nn.ReLU())

    def fine():
        return nn.Linear(4, 4)
    """
)


@pytest.fixture()
def builders(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    (tmp_path / "odd_models.py").write_text(BUILDERS)
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("FPREP_DEBUG", raising=False)
    return tmp_path


def test_cli_plan_of_a_lazy_model_is_one_line(
    builders: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["plan", "odd_models:lazy"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("fprep: error: parameter '0.weight' of LazyLinear is not initialized")
    assert len(err.strip().splitlines()) == 1 and "Traceback" not in err


def _broken_plan(*args: Any, **kwargs: Any) -> Any:
    raise TypeError("unhashable type: 'list'\nsecond line")


def test_an_internal_error_is_one_line_and_exit_2(
    builders: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(fprep.cli, "plan", _broken_plan)
    assert main(["plan", "odd_models:fine"]) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and "Traceback" not in err
    assert err.startswith(
        "fprep: internal error in fprep: TypeError: unhashable type: 'list' second line; "
        "please report it"
    )
    assert "--debug or FPREP_DEBUG=1" in err  # says how to get the traceback


@pytest.mark.parametrize("how", ["--debug", "FPREP_DEBUG=1"])
def test_debug_keeps_the_traceback(
    how: str, builders: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(fprep.cli, "plan", _broken_plan)
    argv = ["plan", "odd_models:fine"]
    if how == "--debug":
        argv.insert(0, "--debug")
    else:
        monkeypatch.setenv("FPREP_DEBUG", "1")
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert "Traceback (most recent call last)" in err and "_broken_plan" in err
    assert err.strip().splitlines()[-1].startswith("fprep: internal error in fprep: TypeError")


def test_debug_off_when_the_variable_is_0(
    builders: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(fprep.cli, "plan", _broken_plan)
    monkeypatch.setenv("FPREP_DEBUG", "0")
    assert main(["plan", "odd_models:fine"]) == 2
    assert "Traceback" not in capsys.readouterr().err
