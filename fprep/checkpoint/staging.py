"""Host copies of a rank's checkpoint tensors, in buffers reused from one save to the next.

An asynchronous save writes these copies while training goes on changing the live tensors, so
the checkpoint holds the values at the call. The copies cost one more copy of this rank's shards
(model and optimizer state) in host memory; allocating them anew at every save would also cost
the page faults of fresh memory (about as long as the copy itself), so each model keeps its
buffers (``stager_for``) and a save allocates only for tensors whose shape or dtype changed.
Buffers are pinned when the tensors live on an accelerator (the copies then run asynchronously
and are waited for once). Reuse is safe because at most one save is in flight: the next one
starts only after the previous one finished reading the buffers.
"""

from __future__ import annotations

import weakref
from collections.abc import Mapping

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

    def stage(self, tensors: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Copies of ``tensors`` in host memory (DTensors stay DTensors, over host shards)."""
        staged: dict[str, torch.Tensor] = {}
        buffers: dict[str, torch.Tensor] = {}
        devices: set[torch.device] = set()
        for key, value in tensors.items():
            local = value.to_local() if isinstance(value, DTensor) else value
            local = local.detach()
            buffer = self._buffer(key, local)
            pinned = local.device.type != "cpu" and buffer.is_pinned()
            buffer.copy_(local, non_blocking=pinned)
            if pinned:
                devices.add(local.device)
            buffers[key] = buffer
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
