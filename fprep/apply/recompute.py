"""Activation checkpointing of one module: its forward run under ``torch.utils.checkpoint``.

``CheckpointForward`` is installed as the module's instance attribute ``forward`` and calls
torch's functional, non-reentrant ``checkpoint`` on the forward the module had. ``module(x)``
still goes through ``nn.Module.__call__`` (hooks, FSDP2's unshard) and every FQN is kept — unlike
``checkpoint_wrapper``, which adds ``_checkpoint_wrapped_module.`` to each name.

One mechanism for eager and compiled code. torch's composable ``checkpoint`` (hooks and
saved-tensor hooks) is not used: ``nn.Module.compile`` compiles ``_call_impl`` with the hooks in
it, the recompute then runs eagerly through the compiled code and its tensors' metadata differ
(inductor's ``assert_size_stride`` fails in the compiled backward under bf16, torch's
``CheckpointError: Recomputed values ... have different metadata`` in fp32). Dynamo traces
``torch.utils.checkpoint.checkpoint`` as a higher-order op and compiles the recompute with the
forward — what torchtitan gets from ``checkpoint_wrapper``; in eager it is the same non-reentrant
checkpoint the composable API runs. (The one exception, regions compiled under tensor
parallelism, is in ``fprep.apply.regions``.)

Without gradients (``torch.no_grad``, evaluation, generation) there is no backward to recompute
for, and the forward runs as it is. With them, a transformers layer that writes a KV cache
(a ``GradientCheckpointingLayer`` whose ``_can_checkpoint_with_cache`` is false) gets no cache,
as under transformers' own gradient checkpointing: the recompute would write it a second time,
and dynamo cannot trace a cache write inside the checkpoint (it would leave the region
uncompiled). Training never reads that cache.

An instance of a module-level class, like ``AutocastForward``, so ``copy.deepcopy`` and
``torch.save`` of the model keep working (the copy's wrapper calls the copy).
"""

from __future__ import annotations

import functools
import inspect
from typing import Any

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from fprep.apply.kv_cache import without_cache

#: ``checkpoint``'s own keyword arguments: a forward keyword of the same name is bound first,
#: so that ``checkpoint`` does not take it for its own.
_CHECKPOINT_KEYWORDS = frozenset(
    name
    for name, p in inspect.signature(checkpoint).parameters.items()
    if p.kind is inspect.Parameter.KEYWORD_ONLY
)


class CheckpointForward:
    """The module's forward, its activations recomputed in backward instead of kept.

    A forward the instance already had (someone else's patch) is checkpointed, not replaced.
    """

    def __init__(self, module: nn.Module) -> None:
        self.module = module
        self.inner: Any = module.__dict__.get("forward")

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        forward = self.inner
        if forward is None:
            # a partial: dynamo traces it on every torch from 2.11; ``function.__get__`` (2.13
            # traces it, 2.11 skips it: a graph break, the region left uncompiled) and
            # ``types.MethodType`` it does not
            forward = functools.partial(type(self.module).forward, self.module)
        if not torch.is_grad_enabled():
            return forward(*args, **kwargs)
        if getattr(type(self.module), "_can_checkpoint_with_cache", True) is False:
            kwargs = without_cache(kwargs)
        if not _CHECKPOINT_KEYWORDS.isdisjoint(kwargs):
            forward, kwargs = functools.partial(forward, **kwargs), {}
        return checkpoint(forward, *args, use_reentrant=False, **kwargs)

    def __repr__(self) -> str:
        return "CheckpointForward()"


def install_checkpoint(module: nn.Module) -> None:
    module.__dict__["forward"] = CheckpointForward(module)


def checkpoint_of(module: nn.Module) -> CheckpointForward | None:
    """fprep's checkpointing wrapper on ``module``, if it has one."""
    forward = module.__dict__.get("forward")
    return forward if isinstance(forward, CheckpointForward) else None
