"""``load`` is transactional: everything it will apply is validated against the live objects
before the first byte reaches them, and all ranks agree on the outcome.

Each case crafts a consistent checkpoint (manifest re-sealed, ``latest`` re-pinned: what a
forger who knows the format writes) whose optimizer state, hyperparameters or RNG states do not
fit the live objects, and checks that ``load`` raises ``CheckpointError`` with the model, the
optimizer and every RNG unchanged. Before, such records failed with a bare ``KeyError`` /
``ValueError`` / ``RuntimeError`` after the model was overwritten, loaded and failed at
``step()``, or crashed the process at the next ``np.random`` call.
"""

from __future__ import annotations

import copy
import random
from collections.abc import Callable
from pathlib import Path
from typing import Any

import _checkpoint_workers as W
import pytest
import torch
from torch import nn

import fprep
from fprep.errors import CheckpointError


@pytest.fixture
def saved(tmp_path: Path) -> Path:
    state, model, opt, sched, loader = W.prepared("none")
    W.Trainer(state, model, opt, sched, loader).run(2)
    import numpy  # noqa: F401  - so that the checkpoint holds NumPy's RNG state too

    return fprep.save(tmp_path, state, model, optimizers=(opt,), scheduler=sched, step=2)


def rng_states() -> Any:
    import numpy

    return (torch.get_rng_state(), random.getstate(), numpy.random.get_state())


def same_rng(a: Any, b: Any) -> bool:
    import numpy

    return (
        torch.equal(a[0], b[0])
        and a[1] == b[1]
        and a[2][0] == b[2][0]
        and numpy.array_equal(a[2][1], b[2][1])
        and a[2][2:] == b[2][2:]
    )


def group0(m: dict[str, Any]) -> dict[str, Any]:
    group: dict[str, Any] = m["optimizers"][0]["state_dict"]["param_groups"][0]
    return group


def state_of(m: dict[str, Any]) -> dict[str, Any]:
    state: dict[str, Any] = m["optimizers"][0]["state_dict"]["state"]
    return state


def rng_of(m: dict[str, Any]) -> dict[str, Any]:
    rng: dict[str, Any] = m["ranks"][0]["rng"]
    return rng


CASES: dict[str, tuple[Callable[[dict[str, Any]], None], str]] = {
    "lr is a string": (lambda m: group0(m).update(lr="abc"), r"param group 0 'lr'"),
    "lr is None": (lambda m: group0(m).update(lr=None), r"param group 0 'lr'"),
    "amsgrad is a number": (lambda m: group0(m).update(amsgrad=1), r"param group 0 'amsgrad'"),
    "betas of arity 1": (
        lambda m: group0(m).update(betas={"$tuple": [0.9]}),
        r"param group 0 'betas'",
    ),
    "betas a list": (lambda m: group0(m).update(betas=[0.9, 0.99]), r"param group 0 'betas'"),
    "a param group too many": (
        lambda m: m["optimizers"][0]["state_dict"]["param_groups"].append(
            {**group0(m), "params": []}
        ),
        r"param groups",
    ),
    "a parameter missing from a group": (
        lambda m: group0(m)["params"].pop(),
        r"param groups hold different parameters",
    ),
    "state for an unknown parameter": (
        lambda m: state_of(m).update(nope={"step": 3}),
        r"optimizer 0's state",
    ),
    "an extra state entry": (
        lambda m: state_of(m)["odd"].update(extra=1.5),
        r"optimizer 0's state",
    ),
    "torch CPU state invalid": (
        lambda m: rng_of(m).update(torch="00" * (len(rng_of(m)["torch"]) // 2)),
        r"RNG state is not valid: the torch CPU state",
    ),
    "python state index out of range": (
        lambda m: rng_of(m)["python"]["state"].__setitem__(624, 10**6),
        r"RNG state is not valid: the Python state",
    ),
    "numpy pos out of range": (
        lambda m: rng_of(m)["numpy"].update(pos=2**40),
        r"RNG state is not valid: the NumPy state",
    ),
    "numpy pos negative": (
        lambda m: rng_of(m)["numpy"].update(pos=-1),
        r"RNG state is not valid: the NumPy state",
    ),
    "numpy has_gauss not 0 or 1": (
        lambda m: rng_of(m)["numpy"].update(has_gauss=7),
        r"RNG state is not valid: the NumPy state",
    ),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_a_record_that_does_not_fit_is_refused_before_anything_changes(
    saved: Path, case: str
) -> None:
    edit, message = CASES[case]
    data = W.manifest_data(saved)
    edit(data)
    W.write_manifest_data(saved, data)
    state, model, opt, sched, _ = W.prepared("none", seed=1)
    W.Trainer(state, model, opt, sched, W.prepared("none")[4]).run(1)
    before = copy.deepcopy((model.state_dict(), opt.state_dict(), sched.state_dict()))
    rng_before = rng_states()
    with pytest.raises(CheckpointError, match=message):
        fprep.load(saved.parent, state, model, optimizers=(opt,), scheduler=sched)
    after = (model.state_dict(), opt.state_dict(), sched.state_dict())
    assert all(torch.equal(after[0][k], v) for k, v in before[0].items())
    assert str(after[1]) == str(before[1]) and after[2] == before[2]
    assert same_rng(rng_before, rng_states())


def test_a_fresh_optimizer_is_checked_too(tmp_path: Path) -> None:
    """An optimizer saved before its first step: its hyperparameters are checked the same way."""
    model = nn.Linear(4, 2)
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    state, model, opt = fprep.prepare(model, fprep.PrepConfig(), opt)
    path = fprep.save(tmp_path, state, model, optimizers=(opt,))
    data = W.manifest_data(path)
    group0(data).update(weight_decay="lots")
    W.write_manifest_data(path, data)
    with pytest.raises(CheckpointError, match=r"param group 0 'weight_decay'"):
        fprep.load(tmp_path, state, model, optimizers=(opt,))
    assert opt.param_groups[0]["weight_decay"] == 0.01 and not opt.state


def test_a_missing_hyperparameter_keeps_the_live_value(saved: Path) -> None:
    """A hyperparameter the checkpoint lacks (e.g. one a newer torch added) keeps its live value
    instead of leaving the group without it (which failed at ``step()``)."""
    data = W.manifest_data(saved)
    del group0(data)["maximize"]
    group0(data)["lr"] = 0.5
    W.write_manifest_data(saved, data)
    state, model, opt, sched, loader = W.prepared("none", seed=1)
    info = fprep.load(saved.parent, state, model, optimizers=(opt,))
    assert opt.param_groups[0]["lr"] == 0.5 and opt.param_groups[0]["maximize"] is False
    assert any("'maximize'" in note for note in info.notes)
    W.Trainer(state, model, opt, sched, loader).run(1)  # steps
