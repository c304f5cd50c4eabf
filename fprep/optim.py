"""Optimizer rebinding: keep an optimizer pointed at the parameters that really train.

``fully_shard`` replaces every managed ``Parameter`` with a new (DTensor) one, so an optimizer
built before sharding would silently step tensors nobody uses. fprep records each optimizer
parameter's canonical FQN before any effect (``optimizer_fqns``, which also refuses parameters
that are not the model's) and afterwards points every param group at the new parameters
(``rebind_optimizer``), keeping hyperparameters and moving existing state, sharded like the
parameter it belongs to.

An optimizer built before ``prepare`` and given to neither ``prepare`` nor ``prepare_optimizer``
still holds the replaced parameters: it steps tensors the model no longer uses, and the weights
never change. ``ReplacedParams`` remembers what ``prepare`` replaced, so that the loop helpers
refuse such an optimizer (once per optimizer; the verdict is cached until its param groups
change), and so does a plain ``optimizer.step()``: ``refuse_stale_steps`` adds the replaced
parameters to one process-wide record (held weakly) checked by a global optimizer step
pre-hook, the only hook that sees an optimizer fprep was never given.
"""

from __future__ import annotations

import threading
import warnings
import weakref
from collections.abc import Mapping
from typing import Any

import torch
from torch import nn
from torch.utils.weak import WeakIdKeyDictionary

from fprep.errors import ModelError, PrepareError
from fprep.snapshot import clean_fqn

OptimizerFQNs = tuple[tuple[str, ...], ...]


def _user_module(model: nn.Module) -> nn.Module:
    """Look through DDP, whose ``module.`` prefix is not part of the user's names."""
    from torch.nn.parallel import DistributedDataParallel

    inner = model.module if isinstance(model, DistributedDataParallel) else model
    assert isinstance(inner, nn.Module)
    return inner


def canonical_names(model: nn.Module) -> dict[int, str]:
    """``id(parameter) -> canonical FQN`` (first registered name, wrapper parts removed)."""
    names: dict[int, str] = {}
    for name, p in _user_module(model).named_parameters(remove_duplicate=False):
        names.setdefault(id(p), clean_fqn(name))
    return names


def canonical_names_weak(model: nn.Module) -> WeakIdKeyDictionary:
    """``parameter -> canonical FQN``, holding the parameters weakly.

    For names recorded before ``prepare``: the parameters sharding replaces must be freed, and a
    dict keyed by ``id`` would then match any new tensor that happens to reuse a freed address.
    """
    names = WeakIdKeyDictionary()
    for name, p in _user_module(model).named_parameters(remove_duplicate=False):
        if p not in names:
            names[p] = clean_fqn(name)
    return names


def optimizer_fqns(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    index: int = 0,
    *,
    before: Mapping[Any, str] | None = None,
) -> OptimizerFQNs:
    """Each param group's parameters by canonical FQN; a foreign parameter is a PrepareError.

    ``before`` (after ``prepare``: the parameters the model had before it, by name) also
    accepts parameters that sharding or materialization replaced.
    """
    names = canonical_names(model)
    groups: list[tuple[str, ...]] = []
    for g, group in enumerate(optimizer.param_groups):
        fqns: list[str] = []
        for i, p in enumerate(group["params"]):
            name = names.get(id(p))
            if name is None and before is not None:
                name = before.get(p)
            if name is None:
                raise _foreign(p, index, g, i, after_prepare=before is not None)
            fqns.append(name)
        groups.append(tuple(fqns))
    return tuple(groups)


def _foreign(p: torch.Tensor, index: int, g: int, i: int, *, after_prepare: bool) -> PrepareError:
    if after_prepare:
        return PrepareError(
            f"optimizer param group {g}, position {i} holds a parameter of shape "
            f"{tuple(p.shape)} that is neither the prepared model's nor one it had before "
            "prepare.",
            subject=f"param_groups[{g}].params[{i}]",
            hint="Build the optimizer from the model you prepared.",
        )
    return PrepareError(
        f"optimizer {index} (param group {g}, position {i}) holds a parameter of "
        f"shape {tuple(p.shape)} that is not a parameter of the model.",
        subject=f"optimizer[{index}].param_groups[{g}].params[{i}]",
        hint="Build the optimizer from model.parameters() of the model you prepare.",
    )


def _shard_like(value: Any, old: torch.Tensor, new: torch.Tensor) -> Any:
    """Move one optimizer-state entry to the new parameter's layout (shard it if it is one)."""
    if not isinstance(value, torch.Tensor) or value.shape != old.shape or value.dim() == 0:
        return value
    target: Any = new
    if hasattr(target, "device_mesh") and not hasattr(value, "device_mesh"):
        from torch.distributed.tensor import distribute_tensor

        local = value.detach().to(target.to_local().device)
        return distribute_tensor(local, target.device_mesh, target.placements, src_data_rank=None)
    return value.to(new.device) if value.device != new.device else value


def rebind_optimizer(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    fqns: OptimizerFQNs,
    index: int = 0,
    elsewhere: frozenset[str] = frozenset(),
) -> None:
    """Point ``optimizer`` at ``model``'s current parameters, matched by canonical FQN.

    ``elsewhere``: the names other pipeline ranks hold (``PipelineState``); an optimizer built
    over the whole model before ``prepare`` drops them here (their ranks step them).
    """
    by_name: dict[str, nn.Parameter] = {}
    for name, p in _user_module(model).named_parameters(remove_duplicate=False):
        by_name.setdefault(clean_fqn(name), p)
    if len(fqns) != len(optimizer.param_groups):
        raise PrepareError(
            f"optimizer {index} has {len(optimizer.param_groups)} param groups but "
            f"{len(fqns)} were recorded before prepare.",
            subject=f"optimizer[{index}]",
            hint="Do not add param groups while prepare runs.",
        )
    for g, (group, names) in enumerate(zip(optimizer.param_groups, fqns, strict=True)):
        new_params: list[nn.Parameter] = []
        for i, (old, name) in enumerate(zip(group["params"], names, strict=True)):
            new = by_name.get(name)
            if new is None and name in elsewhere:
                optimizer.state.pop(old, None)
                continue
            if new is None:
                raise PrepareError(
                    f"optimizer {index}'s parameter {name!r} (group {g}, position {i}) is not "
                    "in the prepared model.",
                    subject=name,
                    hint="Was the module removed or ignored by a custom step?",
                )
            if new is not old and old in optimizer.state:
                entries = optimizer.state.pop(old)
                optimizer.state[new] = {k: _shard_like(v, old, new) for k, v in entries.items()}
            new_params.append(new)
        group["params"] = new_params


class ReplacedParams:
    """The parameters ``prepare`` replaced (sharding, meta-device materialization, module swaps),
    held weakly, by canonical FQN; and the optimizers already found free of them.

    ``check`` runs once per optimizer: the verdict is cached (weakly, per optimizer) with the
    identity and length of each param group's ``params`` list, and re-checked when those change
    (a group added, a list replaced or resized, as ``prepare_optimizer`` does).
    """

    def __init__(self, names: WeakIdKeyDictionary) -> None:
        self.names = names
        # typed reads (WeakIdKeyDictionary's methods carry no annotations)
        self.lookup: Mapping[Any, str] = names
        # id(optimizer) -> (weak reference to it, each group's params list and its length).
        # Keyed by id, not a WeakKeyDictionary: the lookup runs every step, and this one makes
        # no weak reference to do it. An entry goes when its optimizer does.
        self._checked: dict[int, tuple[weakref.ref[Any], list[tuple[list[Any], int]]]] = {}

    @classmethod
    def of(cls, before: Mapping[Any, str], model: nn.Module) -> ReplacedParams | None:
        """What of ``before`` (the parameters by name before ``prepare``) ``model`` no longer
        has; ``None`` when nothing was replaced (no check is then needed)."""
        current = {id(p) for p in model.parameters()}
        names = WeakIdKeyDictionary()
        for p, name in before.items():
            if id(p) not in current:
                names[p] = name
        return cls(names) if len(names) else None

    def add(self, other: ReplacedParams) -> None:
        """Record ``other``'s parameters too; every optimizer is checked again."""
        for p, name in other.lookup.items():
            self.names[p] = name
        self._checked.clear()

    def check(self, optimizer: torch.optim.Optimizer, index: int | None, call: str) -> None:
        """A PrepareError if ``optimizer`` holds a parameter ``prepare`` replaced."""
        groups = optimizer.param_groups
        key = id(optimizer)
        entry = self._checked.get(key)
        if entry is not None and entry[0]() is optimizer:  # per step: keep this path short
            seen = entry[1]
            if len(seen) == len(groups):
                for i, group in enumerate(groups):
                    params, n = seen[i]
                    current = group["params"]
                    if current is not params or len(current) != n:
                        break
                else:
                    return
        for g, group in enumerate(groups):
            for i, p in enumerate(group["params"]):
                name = self.lookup.get(p)
                if name is not None:
                    raise _stale(name, index, g, i, call)
        checked = self._checked
        ref = weakref.ref(optimizer, lambda _: checked.pop(key, None))
        self._checked[key] = (ref, [(group["params"], len(group["params"])) for group in groups])


def _stale(name: str, index: int | None, g: int, i: int, call: str) -> PrepareError:
    which = "the optimizer" if index is None else f"optimizer {index}"
    return PrepareError(
        f"{call}: {which} (param group {g}, position {i}) holds parameter {name!r} "
        "as it was before prepare, which replaced it (sharding or meta-device "
        "materialization): stepping it would never change the model's weights.",
        subject=(
            f"param_groups[{g}].params[{i}]"
            if index is None
            else f"optimizer[{index}].param_groups[{g}].params[{i}]"
        ),
        hint="Pass the optimizer to fprep.prepare(model, cfg, optimizer), or rebind it once "
        "with fprep.prepare_optimizer(state, model, optimizer) (or build it after prepare).",
    )


# The parameters every ``prepare`` of this process replaced while something still held them,
# held weakly (an entry goes with its parameter), and the optimizers found free of them. One
# record, not one per preparation: a parameter replaced by any preparation is stale for every
# optimizer, so two preparations cannot disagree, and none keeps another's model alive.
_PROCESS = ReplacedParams(WeakIdKeyDictionary())
_hook_lock = threading.Lock()
_hook: list[Any] = []  # the global hook's handle, once installed


def refuse_stale_steps(replaced: ReplacedParams) -> None:
    """Make ``optimizer.step()`` of any optimizer holding one of ``replaced`` a PrepareError.

    torch's optimizer step pre-hooks are per optimizer, and an optimizer built before
    ``prepare`` and never given to fprep is one it cannot see: so one global pre-hook
    (``torch.optim.optimizer.register_optimizer_step_pre_hook``), installed by the first
    preparation that leaves a replaced parameter alive, checks every step against the
    process-wide record. When the record is empty (the replaced parameters were freed) a step
    costs one ``len``; otherwise each optimizer is checked once, until its param groups change.
    """
    with _hook_lock:
        _PROCESS.add(replaced)
        if not _hook:
            from torch.optim.optimizer import register_optimizer_step_pre_hook

            _hook.append(register_optimizer_step_pre_hook(_before_any_step))


def _before_any_step(optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
    if len(_PROCESS.names):
        _PROCESS.check(optimizer, None, f"{type(optimizer).__name__}.step()")


def refuse_training_nothing(model: nn.Module, optimizers: list[torch.optim.Optimizer]) -> None:
    """An optimizer all of whose parameters are frozen steps nothing: a ``ModelError`` before
    any effect. A model with every parameter frozen and no optimizer gets a warning (it may be
    prepared for evaluation, but more often a freeze went too far: a peft ``target_modules``
    that names no layer of this model, an adapter made inactive)."""
    for i, opt in enumerate(optimizers):
        params = [p for g in opt.param_groups for p in g["params"]]
        if params and not any(p.requires_grad for p in params):
            raise ModelError(
                f"optimizer {i} holds {len(params)} parameters and every one of them is frozen "
                "(requires_grad=False): training would update nothing.",
                subject=f"optimizer {i}",
                hint="Unfreeze what you mean to train (for peft, check that target_modules "
                "names layers of this model and that the adapter is active), or build the "
                "optimizer from [p for p in model.parameters() if p.requires_grad].",
            )
    params = list(model.parameters())
    if params and not any(p.requires_grad for p in params):
        warnings.warn(
            f"every parameter of the {type(model).__name__} being prepared is frozen "
            "(requires_grad=False): backward will compute no gradient. Fine for evaluation; "
            "to train, unfreeze what you mean to train (for peft, check target_modules).",
            UserWarning,
            stacklevel=3,
        )
