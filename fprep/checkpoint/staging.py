"""Host copies of a rank's checkpoint tensors, in buffers reused from one save to the next.

An asynchronous save writes these copies while training goes on changing the live tensors, so
the checkpoint holds the values at the call. ``stage`` copies, before ``save`` returns, what may
change before the next optimizer step; ``guard.py`` copies the rest (``copy``) only if that step
comes before the background has read it. All together at most one more copy of this rank's
shards (model and optimizer state) in host memory; allocating it anew at every save would also
cost the page faults of fresh memory (about as long as the copy itself), so each model keeps its
buffers (``stager_for``) and a save allocates only for tensors whose shape or dtype changed.
Buffers are pinned when the tensors live on an accelerator (the copies then run asynchronously
and are waited for once). Reuse is safe because at most one save is in flight: the next one
starts only after the previous one finished reading the buffers.
"""

from __future__ import annotations

import weakref
from collections.abc import Collection, Mapping

import torch
from torch import nn
from torch.distributed.tensor import DTensor


class Stager:
    """This rank's staging buffers, by checkpoint key."""

    def __init__(self) -> None:
        self.buffers: dict[str, torch.Tensor] = {}

    @property
    def nbytes(self) -> int:
        return sum(b.numel() * b.element_size() for b in self.buffers.values())

    def stage(
        self, tensors: Mapping[str, torch.Tensor], *, skip: Collection[str] = ()
    ) -> dict[str, torch.Tensor]:
        """Copies of ``tensors`` in host memory (DTensors stay DTensors, over host shards);
        the keys in ``skip`` stay live (``guard.py`` copies them later, if at all), and keep
        their buffers from earlier saves."""
        staged: dict[str, torch.Tensor] = {}
        buffers = {k: self.buffers[k] for k in skip if k in self.buffers}
        devices: set[torch.device] = set()
        for key, value in tensors.items():
            if key in skip:
                staged[key] = value
                continue
            local = value.to_local() if isinstance(value, DTensor) else value
            buffer = buffers[key] = self._copy_into(key, local.detach())
            if local.device.type != "cpu" and buffer.is_pinned():
                devices.add(local.device)
            staged[key] = (
                DTensor(buffer, value._spec, requires_grad=False)  # type: ignore[no-untyped-call]
                if isinstance(value, DTensor)
                else buffer
            )
        for device in devices:  # the non-blocking copies: done before anyone reads the buffers
            module = getattr(torch, device.type, None)
            if module is not None and hasattr(module, "synchronize"):
                module.synchronize(device)
        self.buffers = buffers  # buffers of keys gone from the model are released
        return staged

    def copy(self, key: str, local: torch.Tensor) -> torch.Tensor:
        """A host copy of one host tensor in ``key``'s buffer (``guard.py``, before a step)."""
        buffer = self.buffers[key] = self._copy_into(key, local.detach())
        return buffer

    def _copy_into(self, key: str, local: torch.Tensor) -> torch.Tensor:
        buffer = self._buffer(key, local)
        buffer.copy_(local, non_blocking=local.device.type != "cpu" and buffer.is_pinned())
        return buffer

    def _buffer(self, key: str, like: torch.Tensor) -> torch.Tensor:
        buffer = self.buffers.get(key)
        if buffer is not None and buffer.shape == like.shape and buffer.dtype == like.dtype:
            return buffer
        pin = like.device.type != "cpu" and torch.cuda.is_available()
        return torch.empty(like.shape, dtype=like.dtype, device="cpu", pin_memory=pin)


_STAGERS: weakref.WeakKeyDictionary[nn.Module, Stager] = weakref.WeakKeyDictionary()


def stager_for(model: nn.Module) -> Stager:
    """The model's stager: its buffers live as long as the model (or until ``release``)."""
    stager = _STAGERS.get(model)
    if stager is None:
        stager = _STAGERS[model] = Stager()
    return stager


def release(model: nn.Module) -> None:
    """Free the model's staging buffers (the next asynchronous save allocates them again)."""
    _STAGERS.pop(model, None)
