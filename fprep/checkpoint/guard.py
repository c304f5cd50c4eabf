"""Live tensors an asynchronous save reads in the background, kept unchanged until read.

An asynchronous save must write the values at the call. Copying all of this rank's state into
host buffers before returning (what ``dcp.async_save``'s default stager does) stalls the loop for
a memory-bound copy of every shard: 0.22 s per 1.2 GB here, longer than the rest of the
foreground together. Most of those bytes cannot change before the next ``optimizer.step``:
parameters and optimizer state change only there. So an asynchronous save copies up front only
what may change sooner (buffers: BatchNorm's running statistics change in the forward, DDP
broadcasts them; parameters that no optimizer passed to ``save`` owns; tensors on an
accelerator), and the background reads the rest straight from live memory. Each optimizer passed
to ``save`` carries a step pre-hook (one per optimizer, for its lifetime, a no-op when no save is
in flight): its next ``step()`` first copies into the staging buffers whatever the background has
not read yet, waits for the tensors being read at that moment, and only then lets the step
change them. The idea is CheckFreq's (Mohan et al., FAST '21): snapshot while the next forward
and backward run, and hold back only the update.

Nothing is left to trust: torch's version counters record every in-place change, so a guarded
tensor changed by anything else (``p.mul_()`` under ``no_grad``, ``load_state_dict``) before the
background read it fails the save, naming the tensor, instead of writing a torn value.
``SaveHandle.stage()`` copies what is left on demand, for loops that change weights outside the
optimizer's step. (Writes through ``.data`` bypass version counters, as they bypass autograd's
checks: call ``stage()`` before them.)
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Iterable, Mapping
from typing import Any

import torch
from torch.distributed.checkpoint.utils import find_tensor_shard
from torch.distributed.tensor import DTensor

from fprep.checkpoint.staging import Stager
from fprep.checkpoint.states import describe
from fprep.errors import CheckpointError


def local_of(value: torch.Tensor) -> torch.Tensor:
    """This rank's tensor (a DTensor's local shard), sharing storage and version counter."""
    return value._local_tensor if isinstance(value, DTensor) else value


def _storage(t: torch.Tensor) -> int:
    return int(t.untyped_storage().data_ptr())


def optimizer_storages(optimizers: Iterable[torch.optim.Optimizer]) -> set[int]:
    """Storages the optimizers' steps change: their parameters and their state tensors."""
    out: set[int] = set()
    for opt in optimizers:
        for group in opt.param_groups:
            out.update(_storage(local_of(p)) for p in group["params"] if p.numel())
        for entry in opt.state.values():
            out.update(
                _storage(local_of(v))
                for v in entry.values()
                if isinstance(v, torch.Tensor) and v.numel()
            )
    return out


def guardable(
    tensors: Mapping[str, torch.Tensor], optimizers: Iterable[torch.optim.Optimizer]
) -> set[str]:
    """Keys the background may read live: host tensors only the optimizers' steps change."""
    owned = optimizer_storages(optimizers)
    keys = set()
    for key, value in tensors.items():
        local = local_of(value)
        if local.device.type == "cpu" and local.numel() and _storage(local) in owned:
            keys.add(key)
    return keys


class Guard:
    """The guarded keys of one asynchronous save: read live by the writer until
    ``protect()``, which copies the unread ones into the stager's buffers.

    Writer side (any thread): ``expect`` the keys and chunk counts of this rank's plan,
    ``begin(item)`` before reading a chunk (returns the staged copy to read instead, if any),
    ``end(key)`` once the chunk's bytes are written and hashed. ``failure()`` says whether a
    guarded tensor changed before it was read.
    """

    def __init__(
        self,
        values: Mapping[str, torch.Tensor],
        stager: Stager,
        optimizers: Iterable[torch.optim.Optimizer],
    ) -> None:
        self._values = dict(values)  # key -> the value as collected (a DTensor or a tensor)
        self._versions = {k: local_of(v)._version for k, v in self._values.items()}
        self._left: dict[str, int | None] = dict.fromkeys(self._values)  # None: not yet planned
        self._reading = dict.fromkeys(self._values, 0)
        self._staged: dict[str, torch.Tensor] = {}
        self._stager = stager
        self._cond = threading.Condition()
        self._failure: CheckpointError | None = None
        self._open = bool(self._values)
        self.optimizers = tuple(optimizers)
        self.copied_bytes = 0  # bytes protect() had to copy (the background had not read them)
        if self._open:
            _watch(self)

    def expect(self, chunks: Mapping[str, int]) -> None:
        """This rank's plan: ``chunks[key]`` chunks of each key to read (absent: none)."""
        with self._cond:
            for key in self._left:
                if key not in self._staged:
                    self._left[key] = chunks.get(key, 0)
            self._cond.notify_all()

    def begin(self, item: Any) -> torch.Tensor | None:
        """The writer is about to read ``item``'s chunk: the staged copy to read, or None
        (read the live tensor; ``protect`` waits until ``end``)."""
        key = item.index.fqn
        with self._cond:
            if key in self._staged:
                return find_tensor_shard(self._staged[key], item.index)
            if key in self._reading and self._open:
                self._reading[key] += 1
        return None

    def end(self, key: str) -> None:
        """A chunk of ``key`` read from live memory has been written and hashed."""
        with self._cond:
            if not self._reading.get(key):
                return
            self._reading[key] -= 1
            left = self._left[key]
            self._left[key] = None if left is None else max(left - 1, 0)
            if self._left[key] == 0 and not self._reading[key]:
                self._check(key)  # read completely: was it the value at the call all along?
            self._cond.notify_all()

    def protect(self) -> None:
        """Make the live tensors free to change: copy every unread guarded tensor into the
        staging buffers, wait for those being read. Called by the optimizers' step pre-hook
        (training thread) and ``SaveHandle.stage()``; returns at once after the first time."""
        with self._cond:
            while self._open:
                for key, left in self._left.items():
                    if left != 0 and not self._reading[key] and key not in self._staged:
                        self._stage(key)
                if not any(self._reading.values()):
                    self._open = False
                    break
                self._cond.wait()
        _unwatch(self)

    def close(self) -> None:
        """The background is done with the live tensors (written, or failed)."""
        with self._cond:
            self._open = False
            self._reading = dict.fromkeys(self._reading, 0)
            self._values, self._staged = {}, {}  # a kept handle keeps no tensors alive
            self._cond.notify_all()
        _unwatch(self)

    def failure(self) -> CheckpointError | None:
        with self._cond:
            return self._failure

    def _stage(self, key: str) -> None:
        if not self._check(key):
            return  # already changed: the save fails; copying it would not help
        value = self._values[key]
        buffer = self._stager.copy(key, local_of(value))
        self.copied_bytes += buffer.numel() * buffer.element_size()
        self._staged[key] = (
            DTensor(buffer, value._spec, requires_grad=False)  # type: ignore[no-untyped-call]
            if isinstance(value, DTensor)
            else buffer
        )

    def _check(self, key: str) -> bool:
        if local_of(self._values[key])._version == self._versions[key]:
            return True
        if self._failure is None:
            self._failure = CheckpointError(
                f"{describe(key)} was changed in place while the asynchronous save was "
                "reading it, by something other than a step of the optimizers passed to save; "
                "the checkpoint would not hold the values at the call, so it is not published.",
                subject=key,
                hint="Call handle.stage() before changing tensors outside optimizer.step() "
                "(it copies what the save has not read yet), or pass that optimizer in "
                "optimizers=.",
            )
        return False


# One step pre-hook per optimizer, for the optimizer's lifetime (removing a hook from inside
# ``step``'s iteration over its hooks would break that iteration): it protects the guard in
# flight that names the optimizer, and costs a dictionary lookup otherwise.
_HOOKED: weakref.WeakKeyDictionary[torch.optim.Optimizer, Any] = weakref.WeakKeyDictionary()
_WATCHING: weakref.WeakKeyDictionary[torch.optim.Optimizer, Guard] = weakref.WeakKeyDictionary()
_hooks_lock = threading.Lock()


def _before_step(optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
    guard = _WATCHING.get(optimizer)
    if guard is not None:
        guard.protect()


def _watch(guard: Guard) -> None:
    with _hooks_lock:
        for opt in guard.optimizers:
            if opt not in _HOOKED:
                _HOOKED[opt] = opt.register_step_pre_hook(_before_step)
            _WATCHING[opt] = guard


def _unwatch(guard: Guard) -> None:
    with _hooks_lock:
        for opt in guard.optimizers:
            if _WATCHING.get(opt) is guard:
                del _WATCHING[opt]
