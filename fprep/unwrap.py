"""unwrap: the user's model back — original classes, original FQNs — for saving or evaluation.

* DDP: the wrapped module itself (it shares the trained parameters).
* FSDP2: ``fully_shard`` swaps each unit's class for a generated ``FSDP<Class>`` and replaces
  parameters with shards. ``unwrap`` returns a *new* module tree of the original classes whose
  parameters are the full (gathered) tensors, with FSDP's hooks and bookkeeping removed; tied
  parameters stay tied. Gathering is a collective: call it on every rank (one that is not, or
  is lost, is named in a ``CollectiveError`` within ``timeout_s``); the copy itself runs no
  collective, so evaluating it on one rank is fine. Modules compiled in place
  (``compile="regional"`` / ``"whole"``) come back uncompiled (their compiled code belongs to
  the prepared module); a ``torch.compile``-d ``OptimizedModule`` stays one, over the copy.
* Otherwise the model is returned as it is.

A copy has no activation checkpointing (it only trades compute for memory in training); a model
returned as it is keeps its own (``fprep.apply.recompute``).

fprep's autocast wrapper is kept by default (``keep_autocast=True``), so evaluation computes in
the same precision as training; pass ``False`` for a plain float32 model.
"""

from __future__ import annotations

import collections
import types
from typing import Any

import torch
from torch import nn

from fprep.apply.precision import AutocastForward
from fprep.apply.recompute import CheckpointForward
from fprep.collectives import collective
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


#: Where FSDP2's hooks and those of the composable APIs (whose per-module state the copy does not
#: keep) are defined. Other hooks, torch's included (e.g. ``checkpoint_wrapper``'s state-dict
#: hooks, which strip its prefix from the keys), are the model's own and stay.
_DROPPED_HOOK_OWNERS = ("torch.distributed.fsdp", "torch.distributed._composable")
#: ``__dict__`` entries that are preparation bookkeeping, not the user's.
_DROPPED_ATTRS = frozenset({PREPARED_ATTR, "_fprep_compiled", "_is_fsdp_managed_module"})
_DROPPED_PREFIXES = ("_fsdp", "__composable_api_state_key")  # FSDP, fully_shard's state


def _hook_owner(hook: Any) -> str:
    inner = getattr(hook, "hook", hook)  # nn.Module's _WrappedHook
    func = getattr(inner, "__func__", None) or getattr(inner, "func", None)
    owner = getattr(inner, "__module__", "") or getattr(func, "__module__", "") or ""
    return str(owner)


def _copy_hooks(
    hooks: Any, original: nn.Module, copy: nn.Module
) -> collections.OrderedDict[int, Any]:
    kept: collections.OrderedDict[int, Any] = collections.OrderedDict()
    for key, hook in hooks.items():
        if _hook_owner(hook).startswith(_DROPPED_HOOK_OWNERS):
            continue
        if getattr(hook, "with_module", False) and getattr(hook, "module", lambda: None)() is (
            original
        ):
            kept[key] = type(hook)(hook.hook, copy)  # a _WrappedHook bound to the copy
        else:
            kept[key] = hook
    return kept


def _forward_of_copy(
    forward: Any, original: nn.Module, copy: nn.Module, keep_autocast: bool
) -> Any:
    """The instance ``forward`` of the copy (None: its class's): fprep's wrappers call the
    original, so autocast wraps the copy instead (or is dropped) and checkpointing is dropped."""
    if isinstance(forward, CheckpointForward):
        return _forward_of_copy(forward.inner, original, copy, keep_autocast)
    if isinstance(forward, AutocastForward):
        inner = _forward_of_copy(forward.inner, original, copy, keep_autocast)
        return forward.rebound(copy, inner) if keep_autocast else inner
    if isinstance(forward, types.MethodType) and forward.__self__ is original:
        return types.MethodType(forward.__func__, copy)
    return forward


def _plain_copy(
    module: nn.Module,
    full: dict[int, nn.Parameter],
    keep_autocast: bool,
    memo: dict[int, nn.Module],
) -> nn.Module:
    if id(module) in memo:  # a submodule registered twice stays one module
        return memo[id(module)]
    cls = _original_class(module)
    copy = cls.__new__(cls)
    memo[id(module)] = copy
    attrs = {
        k: v
        for k, v in module.__dict__.items()
        if k not in _DROPPED_ATTRS and not k.startswith(_DROPPED_PREFIXES)
    }
    attrs["_parameters"] = {
        name: (full[id(p)] if p is not None else None) for name, p in module._parameters.items()
    }
    attrs["_buffers"] = dict(module._buffers)
    attrs["_modules"] = {
        name: (_plain_copy(child, full, keep_autocast, memo) if child is not None else None)
        for name, child in module._modules.items()
    }
    if attrs.get("_compiled_call_impl") is not None:
        # ``Module.compile`` compiled the *original* module's ``_call_impl``: calling it would
        # run the prepared module (FSDP hooks, collectives). The copy runs eagerly.
        attrs["_compiled_call_impl"] = None
    for name in _HOOK_DICTS:
        hooks = getattr(module, name, None)
        if isinstance(hooks, dict):
            attrs[name] = _copy_hooks(hooks, module, copy)
    # ids of forward hooks that run even when forward raises: keep those still registered
    always = getattr(module, "_forward_hooks_always_called", {})
    forward_hooks = attrs.get("_forward_hooks", {})
    attrs["_forward_hooks_always_called"] = collections.OrderedDict(
        (k, v) for k, v in always.items() if k in forward_hooks
    )
    forward = _forward_of_copy(attrs.pop("forward", None), module, copy, keep_autocast)
    if forward is not None:
        attrs["forward"] = forward
    # Straight into __dict__: a class may redirect attribute writes (torch.compile's
    # OptimizedModule forwards them to the module it wraps, which is the original here).
    copy.__dict__.update(attrs)
    from torch._dynamo.eval_frame import OptimizedModule

    if isinstance(copy, OptimizedModule):
        copy._initialize()  # its forward was bound to the original module: bind it to the copy
    return copy


def unwrap(state: PrepState, model: nn.Module, *, keep_autocast: bool = True) -> nn.Module:
    """The model with its original class and FQNs (see the module docs)."""
    from torch.distributed.fsdp import FSDPModule
    from torch.nn.parallel import DistributedDataParallel

    inner = model.module if isinstance(model, DistributedDataParallel) else model
    assert isinstance(inner, nn.Module)
    # Decided by FSDP itself, not by DTensor parameters: between a forward that keeps them
    # unsharded (sharding="grad_op") and the next backward they are plain tensors.
    sharded = any(isinstance(m, FSDPModule) for m in inner.modules())
    if not sharded and keep_autocast:
        return inner
    params = dict(inner.named_parameters(remove_duplicate=False))
    full: dict[int, nn.Parameter] = {}
    group = getattr(state.handles, "process_group", None)  # the group FSDP gathers over
    with collective("fprep.unwrap", state.config.timeout_s, group), torch.no_grad():
        for p in params.values():
            if id(p) in full:
                continue
            data = p.full_tensor() if hasattr(p, "full_tensor") else p.detach()
            full[id(p)] = nn.Parameter(data.clone(), requires_grad=p.requires_grad)
    return _plain_copy(inner, full, keep_autocast, {})
