"""Issue 12.1: an optimizer that still holds the parameters ``prepare`` replaced is refused.

Meta-device materialization replaces every parameter (as sharding does; the fsdp case at 2
ranks is in tests/test_ops_distributed.py). An optimizer built before ``prepare`` and given to
neither ``prepare`` nor ``prepare_optimizer`` would step the old tensors: no error, and the
weights never change. ``optimizer_step`` and ``clip_grad_norm(optimizer=...)`` refuse it, naming
the fix; the check runs once per optimizer and again when its param groups change.
"""

from __future__ import annotations

import _stale_workers as SW
import pytest
import torch
import torch.distributed as dist
from torch import nn

import fprep
from fprep import PrepareError
from fprep.apply.steps import handles_of
from fprep.testing.distributed import run_ranks


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


# -- a plain optimizer.step() (issue 18.4) -------------------------------------------------------
def test_a_plain_step_of_replaced_parameters_is_refused_before_it_changes_anything() -> None:
    """The loop helpers are optional: ``opt.step()`` as plain torch writes it is refused too,
    with the fix; once rebound, plain steps train."""
    model = meta_model()
    stale = torch.optim.Adam(model.parameters(), lr=0.1)
    state, model = fprep.prepare(model, fprep.PrepConfig(seed=0))
    loss(model).backward()
    before = weights(model)
    with pytest.raises(PrepareError, match=r"Adam\.step\(\).*'0\.weight'") as step:
        stale.step()
    assert step.value.subject == "param_groups[0].params[0]"
    assert "prepare_optimizer" in (step.value.hint or "")
    assert not stale.state  # refused before the step: no state made for the old tensors
    fprep.prepare_optimizer(state, model, stale)
    stale.step()
    assert changed(before, model)


def test_a_plain_step_is_checked_again_when_a_group_is_added() -> None:
    model = meta_model()
    old = list(model.parameters())
    _, model = fprep.prepare(model, fprep.PrepConfig(seed=0))
    opt = torch.optim.SGD(model[0].parameters(), lr=0.1)
    loss(model).backward()
    opt.step()  # checked and cached
    opt.add_param_group({"params": [old[2]]})
    with pytest.raises(PrepareError, match=r"group 1, position 0\) holds parameter '2\.weight'"):
        opt.step()


def test_two_preparations_do_not_interfere_and_freed_parameters_are_forgotten() -> None:
    from fprep import optim

    a, b = meta_model(), meta_model()
    stale_a = torch.optim.SGD(a.parameters(), lr=0.1)
    _, a = fprep.prepare(a, fprep.PrepConfig(seed=0))
    _, b = fprep.prepare(b, fprep.PrepConfig(seed=1))
    fresh_b = torch.optim.SGD(b.parameters(), lr=0.1)
    loss(b).backward()
    before = weights(b)
    fresh_b.step()  # b's own optimizer is not affected by a's record
    assert changed(before, b)
    with pytest.raises(PrepareError, match=r"SGD\.step"):
        stale_a.step()
    del stale_a  # the only holder of a's old parameters: the record lets them go
    assert len(optim._PROCESS.names) == 0
    plain = torch.optim.SGD(nn.Linear(2, 2).parameters(), lr=0.1)
    plain.step()  # an optimizer fprep never saw steps as ever


def test_a_real_model_in_one_process_keeps_its_parameters_and_a_plain_step_trains() -> None:
    model = nn.Sequential(nn.Linear(4, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)  # built before prepare, not passed
    _, model = fprep.prepare(model, fprep.PrepConfig(seed=0))
    loss(model).backward()
    before = weights(model)
    opt.step()
    assert changed(before, model)


@pytest.mark.slow
@pytest.mark.skipif(not (dist.is_available() and dist.is_gloo_available()), reason="needs gloo")
def test_at_two_ranks_a_plain_step_is_refused_exactly_where_parameters_were_replaced() -> None:
    """fsdp replaces every parameter (meta or real model), as materialization does under ddp:
    refused, naming the fix, nothing changed; ddp and none keep a real model's parameters, so an
    optimizer built before prepare steps them and trains."""
    results = run_ranks(SW.stale_steps, 2, timeout_s=240.0)
    for rank in results:
        for case, out in rank.items():
            replaced = case.startswith("fsdp") or case.endswith("meta")
            if replaced:
                refused = out["refused"]
                assert refused is not None, f"{case}: a stale optimizer stepped silently"
                assert "prepare_optimizer" in refused["hint"], case
                assert refused["subject"].startswith("param_groups[0].params["), case
                assert out["changed"] == 0, case  # refused before any change
                assert out["changed_after_fix"] == out["total"], case  # then it trains
            else:
                assert out["refused"] is None, case
                assert out["changed"] == out["total"], case
