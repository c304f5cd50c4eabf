"""Training-loop helpers in one process: objects through ``prepare``, ``prepare_optimizer``,
``optimizer_step`` with schedulers and fp16 overflow, ``accumulate``, ``clip_grad_norm``,
``unwrap`` and ``gather_for_metrics``.

The multi-process behaviour (ddp, fsdp, fast_ddp, hsdp on gloo) is in
tests/test_loop_distributed.py.
"""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import fprep
from fprep import PrepConfig
from fprep.apply.fast_ddp import DEFER_SYNC_ATTR
from fprep.apply.precision import AutocastForward
from fprep.data import LoaderSpec, ShardedSampler, rank_count, rank_indices
from fprep.testing.models import GPT, GPTBlock, GPTConfig, lm_loss, synthetic_batches, tiny_gpt

SEED = 1


def batch(n: int = 8, seed: int = 3) -> tuple[torch.Tensor, torch.Tensor]:
    return next(synthetic_batches(1, batch_size=n, seed=seed))


def loader(n: int = 10, **kwargs: Any) -> DataLoader[tuple[torch.Tensor, ...]]:
    return DataLoader(TensorDataset(torch.arange(n)), batch_size=2, **kwargs)


def params_of(model: nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def scheduler(opt: torch.optim.Optimizer) -> torch.optim.lr_scheduler.LRScheduler:
    return torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)


# -- objects through prepare ---------------------------------------------------------------------
def test_objects_come_back_in_input_order() -> None:
    model = tiny_gpt(seed=SEED)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    sched = scheduler(opt)
    train, evaluation = loader(), loader(6)
    marker = object()
    out = fprep.prepare(model, PrepConfig(), train, opt, marker, sched, evaluation, 7)
    state, prepared, *objects = out
    assert isinstance(state, fprep.PrepState) and prepared is model
    assert [type(o).__name__ for o in objects] == [
        "PreparedDataLoader",
        "AdamW",
        "object",
        "StepLR",
        "PreparedDataLoader",
        "int",
    ]
    assert objects[1] is opt and objects[2] is marker and objects[3] is sched and objects[5] == 7
    assert objects[0].dataset is train.dataset and objects[4].dataset is evaluation.dataset
    assert sched.optimizer is opt  # the scheduler still drives the (rebound) optimizer


def test_device_placement_is_one_flag_per_object() -> None:
    state, _model, placed, unplaced, opt = fprep.prepare(
        nn.Linear(2, 2),
        PrepConfig(),
        loader(),
        loader(),
        None,
        device_placement=[False, True, False, True],
    )
    assert state.config.device_placement is False  # the model's flag overrides the config
    assert placed.device == torch.device("cpu") and unplaced.device is None
    assert opt is None
    # Without flags, the config decides for every loader.
    _, _, default = fprep.prepare(nn.Linear(2, 2), PrepConfig(device_placement=False), loader())
    assert default.device is None
    with pytest.raises(fprep.ConfigError) as info:
        fprep.prepare(nn.Linear(2, 2), PrepConfig(), loader(), device_placement=[True])
    assert info.value.subject == "device_placement"


def test_a_second_model_among_the_objects_is_refused() -> None:
    model = nn.Linear(2, 2)
    with pytest.raises(fprep.ConfigError) as info:
        fprep.prepare(model, PrepConfig(), loader(), nn.Linear(2, 2))
    assert info.value.subject == "objects" and "argument 4" in str(info.value)
    assert not hasattr(model, "_fprep_prepared")  # refused before any effect


def test_a_loader_whose_sampler_would_be_lost_is_refused() -> None:
    from torch.utils.data import RandomSampler, WeightedRandomSampler

    data = TensorDataset(torch.arange(6))
    state, _ = fprep.prepare(nn.Linear(2, 2), PrepConfig())
    for sampler in (
        WeightedRandomSampler([1.0] * 6, num_samples=6),
        RandomSampler(data, replacement=True),
        RandomSampler(data, num_samples=3),
    ):
        with pytest.raises(fprep.ConfigError) as info:
            fprep.prepare_data_loader(state, DataLoader(data, batch_size=2, sampler=sampler))
        assert info.value.subject == "data_loader.sampler"
        assert type(sampler).__name__ in str(info.value)
    for shuffle in (False, True):  # what fprep reproduces per rank
        ld = fprep.prepare_data_loader(state, DataLoader(data, batch_size=2, shuffle=shuffle))
        assert sorted(int(i) for (b,) in ld for i in b) == list(range(6))


@given(
    st.integers(0, 50),
    st.integers(1, 6),
    st.integers(1, 5),
    st.booleans(),
    st.booleans(),
    st.booleans(),
)
def test_loader_length_is_what_an_epoch_yields(
    n: int, world: int, batch_size: int, shuffle: bool, even: bool, drop_last: bool
) -> None:
    """len(loader) is computed without permuting the dataset, and is still exact."""
    for rank in range(world):
        spec = LoaderSpec(
            rank=rank,
            world=world,
            batch_size=batch_size,
            shuffle=shuffle,
            even_batches=even,
            drop_last=drop_last,
        )
        assert rank_count(n, spec) == len(rank_indices(n, spec, 1))
        sampler = ShardedSampler(n, spec)
        assert len(sampler) == len(list(sampler))


# -- optimizers ----------------------------------------------------------------------------------
def _groups(model: nn.Module) -> list[dict[str, Any]]:
    matrices = [p for p in model.parameters() if p.dim() >= 2]
    vectors = [p for p in model.parameters() if p.dim() < 2]
    return [
        {"params": matrices, "weight_decay": 0.1},
        {"params": vectors, "weight_decay": 0.0, "lr": 5e-3, "name": "vectors"},
    ]


def _hyper(opt: torch.optim.Optimizer) -> list[dict[str, Any]]:
    return [{k: v for k, v in g.items() if k != "params"} for g in opt.param_groups]


def _wrapped_meta_gpt() -> nn.Module:
    """A meta-device GPT whose first block is checkpoint-wrapped and which is torch.compile-d:
    its parameter names carry ``_orig_mod.`` and ``_checkpoint_wrapped_module.``."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

    with torch.device("meta"):
        model = GPT(GPTConfig())
    model.blocks[0] = checkpoint_wrapper(model.blocks[0])
    compiled: nn.Module = torch.compile(model, backend="eager")
    return compiled


@pytest.mark.parametrize("passed", [True, False], ids=["through_prepare", "prepare_optimizer"])
def test_an_optimizer_of_a_wrapped_meta_model_is_rebound_by_canonical_name(passed: bool) -> None:
    """Materializing a meta model replaces every parameter (as sharding does); the optimizer,
    built before, is matched by name through the compile and checkpoint-wrapper prefixes."""
    model = _wrapped_meta_gpt()
    opt = torch.optim.AdamW(_groups(model), lr=1e-2, betas=(0.9, 0.95))
    hyper = _hyper(opt)
    sizes = [len(g["params"]) for g in opt.param_groups]
    if passed:
        state, prepared, returned = fprep.prepare(model, PrepConfig(seed=3), opt)
        assert returned is opt
    else:
        state, prepared = fprep.prepare(model, PrepConfig(seed=3))
        assert fprep.prepare_optimizer(state, prepared, opt) is opt
    assert _hyper(opt) == hyper and [len(g["params"]) for g in opt.param_groups] == sizes
    bound = [p for g in opt.param_groups for p in g["params"]]
    assert sorted(map(id, bound)) == sorted(map(id, prepared.parameters()))
    assert not any(p.is_meta for p in bound)
    inner = prepared._orig_mod
    assert inner.lm_head.weight is inner.wte.weight  # tied, and bound once
    x, y = batch()
    before = params_of(prepared)
    lm_loss(prepared(x), y).backward()
    opt.step()
    after = params_of(prepared)
    assert all(not torch.equal(before[n], after[n]) for n in before)  # every parameter trained


def test_an_optimizer_that_already_stepped_keeps_its_state() -> None:
    model = tiny_gpt(GPTConfig(bias=False), seed=SEED)
    opt = torch.optim.AdamW(_groups(model), lr=1e-2)
    x, y = batch()
    lm_loss(model(x), y).backward()
    opt.step()
    saved = {id(p): {k: v.clone() for k, v in s.items()} for p, s in opt.state.items()}
    _state, model, returned = fprep.prepare(model, PrepConfig(), opt)
    assert returned is opt
    for p, entries in opt.state.items():
        for key, value in entries.items():
            assert torch.equal(value, saved[id(p)][key])


def test_an_optimizer_holding_a_foreign_parameter_is_refused_before_any_effect() -> None:
    model = nn.Sequential(nn.Linear(3, 3), nn.Linear(3, 2))
    foreign = nn.Parameter(torch.zeros(4, 5))
    opt = torch.optim.SGD([{"params": list(model.parameters())}, {"params": [foreign]}], lr=0.1)
    with pytest.raises(fprep.PrepareError) as info:
        fprep.prepare(model, PrepConfig(), opt)
    assert info.value.subject == "optimizer[0].param_groups[1].params[0]"
    assert "(4, 5)" in str(info.value)
    assert not hasattr(model, "_fprep_prepared")
    assert opt.param_groups[1]["params"][0] is foreign


def test_prepare_optimizer_refuses_a_foreign_parameter() -> None:
    state, model = fprep.prepare(nn.Linear(3, 3), PrepConfig())
    opt = torch.optim.SGD([nn.Parameter(torch.zeros(2, 7))], lr=0.1)
    with pytest.raises(fprep.PrepareError) as info:
        fprep.prepare_optimizer(state, model, opt)
    assert info.value.subject == "param_groups[0].params[0]" and "(2, 7)" in str(info.value)


def test_prepare_optimizer_is_not_fooled_by_a_reused_address() -> None:
    """Parameters replaced by prepare are freed; a new tensor may get the same ``id``. It is
    still foreign, and must be refused rather than silently bound to a model parameter."""
    with torch.device("meta"):
        model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2))
    old_ids = {id(p) for p in model.parameters()}
    state, model = fprep.prepare(model, PrepConfig(seed=0))  # materializing frees the old ones
    keep = []
    reused = None
    for _ in range(2000):
        candidate = nn.Linear(4, 4)
        keep.append(candidate)
        reused = next((p for p in candidate.parameters() if id(p) in old_ids), None)
        if reused is not None:
            break
    if reused is None:
        pytest.skip("no address was reused here; nothing to check")
    with pytest.raises(fprep.PrepareError):
        fprep.prepare_optimizer(state, model, torch.optim.SGD([reused], lr=0.1))


def test_a_parameter_missing_after_prepare_is_named() -> None:
    """A custom step that removes a module: the optimizer's parameter cannot be matched."""

    @fprep.step("drop_head")
    def drop_head(state: fprep.PrepState, model: nn.Module) -> tuple[fprep.PrepState, nn.Module]:
        model[1] = nn.Identity()
        return state, model

    with torch.device("meta"):
        model = nn.Sequential(nn.Linear(3, 3), nn.Linear(3, 2))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(fprep.PrepareError) as info:
        fprep.prepare(model, PrepConfig(), opt, steps=(*fprep.default_steps(), drop_head))
    assert info.value.subject == "1.weight" and "'1.weight'" in str(info.value)


# -- optimizer_step and schedulers ---------------------------------------------------------------
def test_optimizer_step_steps_the_scheduler_once_per_step() -> None:
    state, model = fprep.prepare(nn.Linear(4, 2), PrepConfig())
    opt = torch.optim.SGD(model.parameters(), lr=1.0)
    sched = scheduler(opt)
    lrs = []
    for _ in range(3):
        model(torch.ones(3, 4)).sum().backward()
        assert fprep.optimizer_step(state, opt, sched) is True
        opt.zero_grad()
        lrs.append(opt.param_groups[0]["lr"])
    assert lrs == [0.5, 0.25, 0.125] and sched.last_epoch == 3
    before = params_of(model)
    model(torch.ones(3, 4)).sum().backward()
    assert fprep.optimizer_step(state, opt) is True  # no scheduler: just the step
    assert any(not torch.equal(before[n], p) for n, p in model.named_parameters())


@pytest.mark.parametrize("how", ["loss_times_1e30", "inf_gradient"])
def test_an_fp16_overflow_skips_the_step_and_the_scheduler(how: str) -> None:
    state, model = fprep.prepare(tiny_gpt(seed=SEED), PrepConfig(precision="fp16"))
    assert isinstance(state.handles, fprep.Handles)
    scaler = state.handles.grad_scaler
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    sched = scheduler(opt)
    x, y = batch()
    before, scale = params_of(model), scaler.get_scale()
    loss = lm_loss(model(x), y)
    if how == "loss_times_1e30":
        loss = loss * 1e30
    fprep.backward(state, model, loss)
    if how == "inf_gradient":
        model.wte.weight.grad[0, 0] = float("inf")
    assert fprep.optimizer_step(state, opt, sched) is False
    assert all(torch.equal(before[n], p) for n, p in model.named_parameters())  # not stepped
    assert sched.last_epoch == 0 and opt.param_groups[0]["lr"] == 0.1  # nor the scheduler
    assert scaler.get_scale() == scale / 2  # the scale backed off
    opt.zero_grad()
    fprep.backward(state, model, lm_loss(model(x), y))
    assert fprep.optimizer_step(state, opt, sched) is True  # the next step is a real one
    assert sched.last_epoch == 1 and opt.param_groups[0]["lr"] == 0.05
    assert any(not torch.equal(before[n], p) for n, p in model.named_parameters())


def test_fp16_with_two_optimizers_unscales_both_by_the_scale_of_the_loss() -> None:
    """One backward, two optimizers: stepped in one call, both see the true gradients even when
    the scale changes at the update; stepped one at a time, the second call is refused."""
    state, model = fprep.prepare(tiny_gpt(seed=SEED), PrepConfig(precision="fp16"))
    assert isinstance(state.handles, fprep.Handles)
    scaler = state.handles.grad_scaler
    scaler.set_growth_factor(4.0)
    scaler._growth_interval = 1  # the scale grows at every update: a stale scale would show
    params = list(model.parameters())
    opt_a = torch.optim.SGD(params[:3], lr=0.1)
    opt_b = torch.optim.SGD(params[3:], lr=0.1)
    sched_a, sched_b = scheduler(opt_a), scheduler(opt_b)
    x, y = batch()
    before = params_of(model)
    scale = scaler.get_scale()
    fprep.backward(state, model, lm_loss(model(x), y))
    grads = {n: p.grad.detach() / scale for n, p in model.named_parameters()}
    assert fprep.optimizer_step(state, [opt_a, opt_b], [sched_a, sched_b]) is True
    assert scaler.get_scale() == scale * 4  # updated once, not once per optimizer
    assert sched_a.last_epoch == sched_b.last_epoch == 1
    for name, p in model.named_parameters():
        torch.testing.assert_close(p.detach(), before[name] - 0.1 * grads[name], msg=name)

    opt_a.zero_grad()
    opt_b.zero_grad()
    fprep.backward(state, model, lm_loss(model(x), y))
    assert fprep.optimizer_step(state, opt_a) is True
    stepped_b = params_of(model)
    with pytest.raises(fprep.PrepareError) as info:
        fprep.optimizer_step(state, opt_b)
    assert info.value.subject == "optimizer_step" and "one call" in str(info.value.hint)
    assert all(torch.equal(stepped_b[n], p) for n, p in model.named_parameters())  # untouched


# -- accumulate ----------------------------------------------------------------------------------
def test_accumulate_in_one_process_equals_the_big_batch() -> None:
    micro = 4
    state, model = fprep.prepare(tiny_gpt(seed=SEED), PrepConfig())
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    reference = tiny_gpt(seed=SEED)
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.1, momentum=0.9)
    for step in range(2):
        x, y = batch(seed=10 + step)
        for j, (xm, ym) in enumerate(zip(x.chunk(micro), y.chunk(micro), strict=True)):
            with fprep.accumulate(state, model, sync=j == micro - 1):
                assert not getattr(model, DEFER_SYNC_ATTR, False)
                fprep.backward(state, model, lm_loss(model(xm), ym) / micro)
        fprep.optimizer_step(state, opt)
        opt.zero_grad()
        lm_loss(reference(x), y).backward()
        ref_opt.step()
        ref_opt.zero_grad()
    for name, p in reference.named_parameters():
        torch.testing.assert_close(dict(model.named_parameters())[name], p, atol=1e-6, rtol=1e-6)


# -- clip_grad_norm ------------------------------------------------------------------------------
@pytest.mark.parametrize("norm_type", [2.0, 1.0, math.inf])
def test_clip_grad_norm_is_torchs_in_one_process(norm_type: float) -> None:
    state, model = fprep.prepare(tiny_gpt(seed=SEED), PrepConfig())
    reference = tiny_gpt(seed=SEED)
    x, y = batch()
    fprep.backward(state, model, lm_loss(model(x), y))
    lm_loss(reference(x), y).backward()
    expected = nn.utils.clip_grad_norm_(reference.parameters(), 0.5, norm_type=norm_type)
    norm = fprep.clip_grad_norm(state, model, 0.5, norm_type=norm_type)
    torch.testing.assert_close(norm, expected, rtol=1e-6, atol=0)
    assert norm.item() > 0.5  # it clipped
    for (name, p), q in zip(model.named_parameters(), reference.parameters(), strict=True):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-6, atol=1e-9, msg=name)


def test_clip_grad_norm_leaves_small_gradients_and_handles_none() -> None:
    state, model = fprep.prepare(nn.Linear(3, 2), PrepConfig())
    assert fprep.clip_grad_norm(state, model, 1.0).item() == 0.0  # no gradients yet
    (model(torch.ones(1, 3)).sum() * 1e-3).backward()
    grads = [p.grad.clone() for p in model.parameters()]
    norm = fprep.clip_grad_norm(state, model, 1.0)
    assert 0 < norm.item() < 1.0
    assert all(torch.equal(g, p.grad) for g, p in zip(grads, model.parameters(), strict=True))


def test_clip_grad_norm_under_fp16_unscales_through_the_optimizer() -> None:
    state, model = fprep.prepare(tiny_gpt(seed=SEED), PrepConfig(precision="fp16"))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x, y = batch()
    fprep.backward(state, model, lm_loss(model(x), y))
    with pytest.raises(fprep.PrepareError, match="optimizer="):
        fprep.clip_grad_norm(state, model, 1.0)
    norm = fprep.clip_grad_norm(state, model, 1.0, optimizer=opt)
    reference = tiny_gpt(seed=SEED)
    with torch.autocast("cpu", dtype=torch.float16):
        out = reference(x)
    lm_loss(out.float(), y).backward()
    expected = nn.utils.clip_grad_norm_(reference.parameters(), 1.0)
    assert norm.item() == pytest.approx(expected.item(), rel=1e-2)  # unscaled, not x 65536
    before = params_of(model)
    assert fprep.optimizer_step(state, opt) is True  # unscaled once, then stepped
    for (name, p), q in zip(model.named_parameters(), reference.parameters(), strict=True):
        expected_step = before[name] - 0.1 * q.grad
        torch.testing.assert_close(p.detach(), expected_step, atol=1e-3, rtol=1e-2, msg=name)


# -- unwrap --------------------------------------------------------------------------------------
def _autocast_hooks(model: nn.Module) -> int:
    return sum(isinstance(m.__dict__.get("forward"), AutocastForward) for m in model.modules())


def test_unwrap_in_one_process_returns_the_model() -> None:
    model = tiny_gpt(seed=SEED)
    state, prepared = fprep.prepare(model, PrepConfig(precision="bf16"))
    assert fprep.unwrap(state, prepared) is model  # keeps autocast: the model itself


def test_unwrap_without_autocast_is_a_plain_copy() -> None:
    state, model = fprep.prepare(tiny_gpt(seed=SEED), PrepConfig(precision="bf16"))
    plain = fprep.unwrap(state, model, keep_autocast=False)
    assert type(plain) is GPT and plain is not model
    assert list(plain.state_dict()) == list(tiny_gpt().state_dict())
    assert _autocast_hooks(plain) == 0 and _autocast_hooks(model) == 1  # the original keeps its
    assert plain.lm_head.weight is plain.wte.weight
    assert all(p is not q for p, q in zip(plain.parameters(), model.parameters(), strict=True))
    assert not hasattr(plain, "_fprep_prepared")  # a plain module: it may be prepared again
    x, _ = batch(2)
    with torch.no_grad():
        torch.testing.assert_close(plain(x), tiny_gpt(seed=SEED)(x))  # fp32, not bf16


def test_unwrap_of_a_compiled_model_does_not_run_the_prepared_one() -> None:
    """``compile="whole"`` compiles the prepared module's own call in place; the copy must not
    call into it (there: autocast; under FSDP: the sharded module and its collectives)."""
    state, model = fprep.prepare(
        tiny_gpt(seed=SEED), PrepConfig(precision="bf16", compile="whole", compile_backend="eager")
    )
    plain = fprep.unwrap(state, model, keep_autocast=False)
    ran: list[int] = []
    model.register_forward_pre_hook(lambda *_: ran.append(1))
    x, _ = batch(2)
    with torch.no_grad():
        out = plain(x)
    assert ran == []
    torch.testing.assert_close(out, tiny_gpt(seed=SEED)(x))


def test_unwrap_keeps_the_models_own_hooks() -> None:
    """``checkpoint_wrapper`` (torch.distributed code, but the user's model) registers hooks
    that strip its prefix from state-dict keys: the copy keeps them, and its keys."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

    model = tiny_gpt(seed=SEED)
    model.blocks[0] = checkpoint_wrapper(model.blocks[0])
    keys = list(model.state_dict())
    assert keys == list(tiny_gpt().state_dict())
    state, model = fprep.prepare(model, PrepConfig(precision="bf16", wrap=GPTBlock))
    plain = fprep.unwrap(state, model, keep_autocast=False)
    assert plain is not model and _autocast_hooks(plain) == 0
    assert list(plain.state_dict()) == keys
    plain.load_state_dict(tiny_gpt(seed=SEED + 1).state_dict())  # and loads them back


# -- gather_for_metrics --------------------------------------------------------------------------
def test_gather_for_metrics_in_one_process_is_the_identity() -> None:
    state, _model, ld = fprep.prepare(nn.Linear(2, 2), PrepConfig(), loader(5))
    seen = [fprep.gather_for_metrics(state, b, ld) for (b,) in ld]
    assert torch.cat(seen).tolist() == [0, 1, 2, 3, 4]
