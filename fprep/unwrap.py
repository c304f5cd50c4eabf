"""unwrap: the user's model back — original classes, original FQNs — for saving or evaluation.

* DDP: the wrapped module itself (it shares the trained parameters).
* FSDP2: ``fully_shard`` swaps each unit's class for a generated ``FSDP<Class>`` and replaces
  parameters with shards. ``unwrap`` returns a *new* module tree of the original classes whose
  parameters are the full (gathered) tensors, with FSDP's hooks and bookkeeping removed; tied
  parameters stay tied. Gathering is a collective: call it on every rank.
* Otherwise the model is returned as it is.

fprep's autocast hooks are kept by default (``keep_autocast=True``), so evaluation computes in
the same precision as training; pass ``False`` for a plain float32 model.
"""

from __future__ import annotations

import collections
from typing import Any

import torch
from torch import nn

from fprep.apply.precision import AutocastEnter, AutocastExit
from fprep.snapshot import PREPARED_ATTR
from fprep.state import PrepState

_HOOK_DICTS = (
    "_forward_pre_hooks",
    "_forward_hooks",
    "_backward_pre_hooks",
    "_backward_hooks",
    "_forward_hooks_with_kwargs",
    "_forward_pre_hooks_with_kwargs",
    "_state_dict_pre_hooks",
    "_state_dict_hooks",
    "_load_state_dict_pre_hooks",
    "_load_state_dict_post_hooks",
)


def _original_class(module: nn.Module) -> type[nn.Module]:
    from torch.distributed.fsdp import FSDPModule

    kind = type(module)
    if isinstance(module, FSDPModule):
        for base in kind.__mro__[1:]:
            if not issubclass(base, FSDPModule) and issubclass(base, nn.Module):
                return base
    return kind


def _is_fprep_or_fsdp_hook(hook: Any, keep_autocast: bool) -> bool:
    if isinstance(hook, AutocastEnter | AutocastExit):
        return not keep_autocast
    owner = getattr(hook, "__module__", "") or ""
    func = getattr(hook, "__func__", None) or getattr(hook, "func", None)
    owner = owner or getattr(func, "__module__", "") or ""
    return owner.startswith("torch.distributed")


def _plain_copy(module: nn.Module, full: dict[int, nn.Parameter], keep_autocast: bool) -> nn.Module:
    cls = _original_class(module)
    copy = cls.__new__(cls)
    attrs = {
        k: v
        for k, v in module.__dict__.items()
        if not k.startswith("_fsdp") and k not in ("__composable_api_registry", PREPARED_ATTR)
    }
    copy.__dict__.update(attrs)
    copy._parameters = {
        name: (full[id(p)] if p is not None else None) for name, p in module._parameters.items()
    }
    copy._buffers = dict(module._buffers)
    copy._modules = {
        name: (_plain_copy(child, full, keep_autocast) if child is not None else None)
        for name, child in module._modules.items()
    }
    for name in _HOOK_DICTS:
        hooks = getattr(module, name, None)
        if isinstance(hooks, dict):
            kept = [
                (k, h) for k, h in hooks.items() if not _is_fprep_or_fsdp_hook(h, keep_autocast)
            ]
            setattr(copy, name, collections.OrderedDict(kept))
    # ids of forward hooks that run even when forward raises: keep those still registered
    always = getattr(module, "_forward_hooks_always_called", {})
    copy._forward_hooks_always_called = collections.OrderedDict(
        (k, v) for k, v in always.items() if k in copy._forward_hooks
    )
    return copy


def unwrap(state: PrepState, model: nn.Module, *, keep_autocast: bool = True) -> nn.Module:
    """The model with its original class and FQNs (see the module docs)."""
    from torch.nn.parallel import DistributedDataParallel

    inner = model.module if isinstance(model, DistributedDataParallel) else model
    assert isinstance(inner, nn.Module)
    params = dict(inner.named_parameters(remove_duplicate=False))
    if not any(hasattr(p, "full_tensor") for p in params.values()) and keep_autocast:
        return inner
    full: dict[int, nn.Parameter] = {}
    with torch.no_grad():
        for p in params.values():
            if id(p) in full:
                continue
            data = p.full_tensor() if hasattr(p, "full_tensor") else p.detach()
            full[id(p)] = nn.Parameter(data.clone(), requires_grad=p.requires_grad)
    return _plain_copy(inner, full, keep_autocast)
