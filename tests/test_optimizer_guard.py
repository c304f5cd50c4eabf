"""Issue 12.1: an optimizer that still holds the parameters ``prepare`` replaced is refused.

Meta-device materialization replaces every parameter (as sharding does; the fsdp case at 2
ranks is in tests/test_ops_distributed.py). An optimizer built before ``prepare`` and given to
neither ``prepare`` nor ``prepare_optimizer`` would step the old tensors: no error, and the
weights never change. ``optimizer_step`` and ``clip_grad_norm(optimizer=...)`` refuse it, naming
the fix; the check runs once per optimizer and again when its param groups change.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

import fprep
from fprep import PrepareError
from fprep.apply.steps import handles_of


def meta_model() -> nn.Module:
    with torch.device("meta"):
        return nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 1))


def loss(model: nn.Module) -> torch.Tensor:
    x = torch.randn(6, 4, generator=torch.Generator().manual_seed(0))
    out: torch.Tensor = model(x).square().mean()
    return out


def weights(model: nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def changed(before: dict[str, torch.Tensor], model: nn.Module) -> bool:
    return all(not torch.equal(before[k], v) for k, v in model.state_dict().items())


def test_an_optimizer_of_replaced_parameters_is_refused_until_rebound() -> None:
    model = meta_model()
    stale = torch.optim.SGD(model.parameters(), lr=0.1)
    state, model = fprep.prepare(model, fprep.PrepConfig(seed=0))
    fprep.backward(state, model, loss(model))
    before = weights(model)
    with pytest.raises(PrepareError, match="prepare_optimizer") as step:
        fprep.optimizer_step(state, stale)
    assert step.value.subject == "optimizer[0].param_groups[0].params[0]"
    assert "'0.weight'" in str(step.value)  # names the parameter
    with pytest.raises(PrepareError, match="clip_grad_norm"):
        fprep.clip_grad_norm(state, model, 1.0, optimizer=stale)
    with pytest.raises(PrepareError, match=r"optimizer 1 \(param group 0"):  # in a list
        fprep.optimizer_step(state, [torch.optim.SGD(model.parameters()), stale])
    assert weights(model).keys() == before.keys() and not changed(before, model)
    fprep.prepare_optimizer(state, model, stale)  # the fix the error names
    assert fprep.optimizer_step(state, stale)
    assert changed(before, model)


@pytest.mark.parametrize("how", ["passed", "after"])
def test_optimizers_of_the_prepared_parameters_step(how: str) -> None:
    model = meta_model()
    if how == "passed":
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        state, model, opt = fprep.prepare(model, fprep.PrepConfig(seed=0), opt)
    else:
        state, model = fprep.prepare(model, fprep.PrepConfig(seed=0))
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
    before = weights(model)
    fprep.backward(state, model, loss(model))
    fprep.clip_grad_norm(state, model, 1.0, optimizer=opt)
    assert fprep.optimizer_step(state, opt) and changed(before, model)


def test_a_param_group_added_later_is_checked_again() -> None:
    model = meta_model()
    old = list(model.parameters())
    state, model = fprep.prepare(model, fprep.PrepConfig(seed=0))
    opt = torch.optim.SGD(model[0].parameters(), lr=0.1)
    fprep.backward(state, model, loss(model))
    fprep.optimizer_step(state, opt)  # checked, and the verdict cached
    opt.add_param_group({"params": [old[2]]})  # the old '2.weight'
    with pytest.raises(PrepareError, match=r"group 1, position 0\) holds parameter '2\.weight'"):
        fprep.optimizer_step(state, opt)
    opt.param_groups.pop()
    fprep.optimizer_step(state, opt)
    opt.param_groups[0]["params"].append(old[3])  # the same list, one longer
    with pytest.raises(PrepareError, match=r"'2\.bias'"):
        fprep.optimizer_step(state, opt)


@pytest.mark.parametrize("meta", [False, True])
def test_nothing_is_checked_when_no_replaced_parameter_is_left(meta: bool) -> None:
    """A real model in one process keeps its parameters; a meta model's optimizer passed to
    prepare is rebound, and the old parameters are freed: no check, no per-step cost."""
    model = meta_model() if meta else nn.Sequential(nn.Linear(4, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    state, model, opt = fprep.prepare(model, fprep.PrepConfig(seed=0), opt)
    assert handles_of(state).replaced_params is None
    fprep.backward(state, model, loss(model))
    assert fprep.optimizer_step(state, opt)
