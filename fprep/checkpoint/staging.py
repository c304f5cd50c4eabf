"""Host copies of a rank's checkpoint tensors, in buffers reused from one save to the next.

An asynchronous save copies every tensor it will write (model parameters and buffers,
optimizer state, rank 0's gathered full state) into these buffers before ``save`` returns; the
background thread reads only the copies. The checkpoint therefore holds the values at the call
whatever changes the live tensors afterwards, and however: an optimizer's step, ``p.mul_()``, a
DTensor's in-place op, a write through ``.data``, another thread's kernel still running. The
copies are private: nothing else writes to them until the save is over (the next save starts
only after the one in flight has finished reading them), so the bytes written and the bytes
hashed are the same bytes.

A copy of everything costs a memory-bound stall (``docs/checkpoints.md`` "Cost"), kept small:
the buffers are allocated once per model (``stager_for``) and reused by every later save (fresh
memory would add the page faults of a first touch, about as long as the copy itself); a save
allocates only for tensors whose shape or dtype changed; the copies go through one
``torch._foreach_copy_`` per device (no Python work per element; torch's own copy kernels,
parallel over its intra-op threads); a DTensor's host wrapper is kept with its buffer. Buffers
are pinned when the tensors live on an accelerator, so the device-to-host copies run
asynchronously and are waited for once.
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
        # key -> (the DTensor spec it was made for, the DTensor over the key's buffer)
        self._wrapped: dict[str, tuple[object, DTensor]] = {}

    @property
    def nbytes(self) -> int:
        return sum(b.numel() * b.element_size() for b in self.buffers.values())

    def stage(self, tensors: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Copies of ``tensors`` in host memory, complete when this returns (DTensors stay
        DTensors, over host shards). Buffers of keys no longer given are released."""
        buffers: dict[str, torch.Tensor] = {}
        wrapped: dict[str, tuple[object, DTensor]] = {}
        by_device: dict[torch.device, tuple[list[torch.Tensor], list[torch.Tensor]]] = {}
        staged: dict[str, torch.Tensor] = {}
        for key, value in tensors.items():
            local = (value._local_tensor if isinstance(value, DTensor) else value).detach()
            buffer = buffers[key] = self._buffer(key, local)
            targets, sources = by_device.setdefault(local.device, ([], []))
            targets.append(buffer)
            sources.append(local)
            staged[key] = buffer
            if isinstance(value, DTensor):
                staged[key] = self._wrap(key, value, buffer, wrapped)
        for device, (targets, sources) in by_device.items():
            host = device.type == "cpu"
            torch._foreach_copy_(targets, sources, non_blocking=not host)
            if not host:  # the non-blocking copies: done before anyone reads the buffers
                module = getattr(torch, device.type, None)
                if module is not None and hasattr(module, "synchronize"):
                    module.synchronize(device)
        self.buffers, self._wrapped = buffers, wrapped
        return staged

    def _wrap(
        self,
        key: str,
        value: DTensor,
        buffer: torch.Tensor,
        out: dict[str, tuple[object, DTensor]],
    ) -> DTensor:
        """A DTensor like ``value`` over ``buffer`` (the one made last time, when the spec and
        the buffer are the same: making one costs more than copying a small shard)."""
        spec = value._spec
        kept = self._wrapped.get(key)
        if kept is not None and kept[0] is spec and kept[1]._local_tensor is buffer:
            out[key] = kept
            return kept[1]
        made = DTensor(buffer, spec, requires_grad=False)  # type: ignore[no-untyped-call]
        out[key] = (spec, made)
        return made

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
