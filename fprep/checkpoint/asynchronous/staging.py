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
parallel over its intra-op threads); a DTensor's host wrapper is kept with its buffer.

Tensors on an accelerator are copied into pinned buffers on a side stream (``fprep.devices.
Lane``) and ``stage`` returns once the copies are enqueued; the stall is the time to enqueue,
not to copy. The same guarantee holds (values at the call), by three orderings:

* the side stream first waits for the current stream: every kernel enqueued before ``save``
  (the last optimizer step) has written before the copy reads;
* the current stream then waits for the event recorded after the copies: a kernel enqueued after
  ``save`` returns (the next step's in-place update) runs after the copy has read. Without this
  the next step's kernels, on the current stream, would not wait for the side stream and could
  overwrite a parameter before it was copied. The host does not wait: only the device orders;
* the sources stay referenced (``_sources``) until the copies are done, so the caching allocator
  cannot hand their memory to another tensor (what ``record_stream`` would do, on any backend).

The background thread calls ``wait`` (host waits for the event) before hashing or writing a
byte. Writes to the live tensors from another stream of the user's are not ordered by this (as
with any stream): such code must order itself after the current stream.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Mapping

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from fprep.devices import Lane


class Stager:
    """This rank's staging buffers, by checkpoint key."""

    def __init__(self, lane_for: Callable[[torch.device], Lane | None] | None = None) -> None:
        self.buffers: dict[str, torch.Tensor] = {}
        # key -> (the DTensor spec it was made for, the DTensor over the key's buffer)
        self._wrapped: dict[str, tuple[object, DTensor]] = {}
        self._lane_for = lane_for or self._side_lane
        self._lanes: dict[torch.device, Lane] = {}
        self._pending: list[tuple[Lane, torch.Event | None]] = []
        self._sources: list[torch.Tensor] = []  # referenced until their copies are done

    def _side_lane(self, device: torch.device) -> Lane | None:
        """A side stream per accelerator, made once; ``None``: copy on the host."""
        if device.type == "cpu":
            return None
        lane = self._lanes.get(device)
        if lane is None:
            lane = self._lanes[device] = Lane(device)
        return lane

    def wait(self) -> None:
        """Block until every copy of the last ``stage`` is done (the background thread calls
        this before reading a buffer); then release the sources."""
        for lane, mark in self._pending:
            lane.wait(mark)
        self._pending, self._sources = [], []

    @property
    def nbytes(self) -> int:
        return sum(b.numel() * b.element_size() for b in self.buffers.values())

    def stage(self, tensors: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Copies of ``tensors`` in host memory (DTensors stay DTensors, over host shards):
        complete when this returns for host tensors, enqueued for accelerator tensors (complete
        after ``wait``). Buffers of keys no longer given are released."""
        self.wait()  # copies of a save that never started writing: done before buffers are reused
        buffers: dict[str, torch.Tensor] = {}
        wrapped: dict[str, tuple[object, DTensor]] = {}
        by_device: dict[torch.device, tuple[list[torch.Tensor], list[torch.Tensor]]] = {}
        staged: dict[str, torch.Tensor] = {}
        for key, value in tensors.items():
            local = (value._local_tensor if isinstance(value, DTensor) else value).detach()
            buffer = buffers[key] = self._buffer(key, local, self._lane_for(local.device))
            targets, sources = by_device.setdefault(local.device, ([], []))
            targets.append(buffer)
            sources.append(local)
            staged[key] = buffer
            if isinstance(value, DTensor):
                staged[key] = self._wrap(key, value, buffer, wrapped)
        for device, (targets, sources) in by_device.items():
            lane = self._lane_for(device)
            if lane is None:
                torch._foreach_copy_(targets, sources)
                continue
            lane.after_current()  # after every kernel enqueued before the call
            lane.copy(targets, sources)
            mark = lane.mark()
            lane.current_waits(mark)  # every kernel enqueued after the call: after the copy
            self._pending.append((lane, mark))
            self._sources.extend(sources)
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

    def _buffer(self, key: str, like: torch.Tensor, lane: Lane | None) -> torch.Tensor:
        buffer = self.buffers.get(key)
        if buffer is not None and buffer.shape == like.shape and buffer.dtype == like.dtype:
            return buffer
        if lane is None:
            return torch.empty(like.shape, dtype=like.dtype, device="cpu")
        return lane.host_buffer(like.numel(), like.dtype).view(like.shape)  # pinned


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
