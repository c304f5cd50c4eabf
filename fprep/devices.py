"""Device handles: one small interface over cpu, cuda, hpu, xpu and mps.

``device_handle(kind)`` returns a fresh handle (no registry, no global state). Everything
device-specific that the prepare steps and loop helpers need goes through it: whether the
device exists, how many, the current one, synchronization, Gaudi's step marks, the default
process-group backend and the ``torch.compile`` backend.

Intel Gaudi: ``habana_frameworks`` ships with the Gaudi software stack (not on PyPI) and is
imported lazily, only by the hpu handle. ``habana_frameworks.torch.core`` registers the ``hpu``
device; ``habana_frameworks.torch.distributed.hccl`` registers the ``hccl`` backend and must be
imported before the process group exists. In lazy mode (``is_lazy()``; ``PT_HPU_LAZY_MODE``)
operations accumulate until ``mark_step()``, which fprep calls after backward and after the
optimizer step; ``torch.compile`` (``hpu_backend``) is for eager mode only. Each Gaudi process
sees one device, ``hpu:0``: the Gaudi stack selects the card from ``HLS_MODULE_ID`` /
``HABANA_VISIBLE_MODULES``, which the launcher sets (fprep writes no environment variables).
"""

from __future__ import annotations

import importlib
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch

from fprep.errors import PrepareError
from fprep.topology import DEFAULT_BACKEND


def import_or_fail(name: str, why: str) -> Any:
    try:
        return importlib.import_module(name)
    except ImportError as e:
        raise PrepareError(
            f"{why} needs {name}, which is not importable: {e}",
            subject=name,
            hint=(
                "On Gaudi, install Intel's Gaudi software stack (or use its container); it "
                "provides habana_frameworks for its own torch build."
                if name.startswith("habana_frameworks")
                else f"Install the package that provides {name}."
            ),
        ) from None


@dataclass(frozen=True)
class DeviceHandle:
    """Operations on one device type. Methods mirror ``torch.cuda``'s names."""

    type: str

    @property
    def module(self) -> Any:
        """``torch.cuda`` / ``torch.xpu`` / ``torch.mps`` / ``torch.hpu``; ``None`` for cpu."""
        return getattr(torch, self.type, None) if self.type != "cpu" else None

    def available(self) -> bool:
        mod = self.module
        return self.type == "cpu" or bool(mod is not None and mod.is_available())

    def count(self) -> int:
        if self.type == "cpu":
            return 1
        mod = self.module
        return int(mod.device_count()) if mod is not None and self.available() else 0

    def current_device(self) -> int:
        mod = self.module
        return int(mod.current_device()) if mod is not None and self.type != "mps" else 0

    def set_device(self, index: int) -> None:
        mod = self.module
        if mod is not None and hasattr(mod, "set_device"):
            mod.set_device(index)

    def synchronize(self) -> None:
        mod = self.module
        if mod is not None:
            mod.synchronize()

    def step_mark(self) -> None:
        """Flush accumulated work (Gaudi lazy mode only; a no-op elsewhere)."""

    @property
    def default_backend(self) -> str:
        return DEFAULT_BACKEND[self.type]

    @property
    def compile_backend(self) -> str | None:
        """The ``torch.compile`` backend to use by default (``None``: torch's default)."""
        return None

    def setup(self, *, distributed: bool) -> None:
        """Register the device (and its collective backend) before anything uses them."""

    def check_compile(self) -> None:
        """Raise a PrepareError if ``torch.compile`` cannot be used in this mode."""


@dataclass(frozen=True)
class HpuHandle(DeviceHandle):
    """Intel Gaudi through ``habana_frameworks`` (imported on first use)."""

    type: str = "hpu"

    def _core(self) -> Any:
        return import_or_fail("habana_frameworks.torch.core", "the hpu device")

    def setup(self, *, distributed: bool) -> None:
        self._core()
        if distributed:
            import_or_fail("habana_frameworks.torch.distributed.hccl", "the hccl backend")

    def is_lazy(self) -> bool:
        internal = import_or_fail(
            "habana_frameworks.torch.utils.internal", "Gaudi's execution mode"
        )
        return bool(internal.is_lazy())

    def step_mark(self) -> None:
        if self.is_lazy():
            self._core().mark_step()

    @property
    def module(self) -> Any:
        return import_or_fail("habana_frameworks.torch.hpu", "the hpu device")

    def current_device(self) -> int:
        return 0  # each Gaudi process sees exactly one card

    @property
    def compile_backend(self) -> str | None:
        return "hpu_backend"

    def check_compile(self) -> None:
        if self.is_lazy():
            raise PrepareError(
                "torch.compile on Gaudi needs eager mode, but this process runs in lazy mode.",
                subject="compile",
                hint="Set PT_HPU_LAZY_MODE=0 before starting Python, or use compile='none'.",
            )


def device_handle(device_type: str) -> DeviceHandle:
    """A handle for ``device_type`` ("cpu", "cuda", "hpu", "xpu", "mps")."""
    return HpuHandle() if device_type == "hpu" else DeviceHandle(device_type)


class Lane:
    """Copies between host and one device, ordered on a side stream so that they overlap the
    host's work (reading the next chunk) and the device's (the training loop).

    On an accelerator every ``copy`` is enqueued on a stream of its own (``torch.Stream``, so
    cuda, xpu and hpu alike), non-blocking, between pinned host memory and the device; ``mark``
    records an event after the copies enqueued so far, which the host (``wait``) or the current
    stream (``current_waits``) waits on. On the cpu (or a device without streams) every copy is
    done when ``copy`` returns and the marks are ``None``: the same code runs, synchronously.
    """

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.stream: torch.Stream | None = None
        accel = torch.accelerator.current_accelerator() if device.type != "cpu" else None
        self.pin = accel is not None and accel.type == device.type
        if self.pin:
            try:
                self.stream = torch.Stream(device)
            except (RuntimeError, TypeError):  # pragma: no cover - a backend without streams
                self.stream = None

    def _current(self) -> torch.Stream:
        return torch.accelerator.current_stream(self.device)

    def host_buffer(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        """Host memory the device copies from or to asynchronously (pinned on an accelerator)."""
        return torch.empty(numel, dtype=dtype, pin_memory=self.pin)

    def device_buffer(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        return torch.empty(numel, dtype=dtype, device=self.device)

    @contextmanager
    def _on_side(self) -> Iterator[None]:
        """The side stream current (``torch.Stream``'s own context manager: it also selects
        the stream's device and restores both, whatever the current device was)."""
        if self.stream is None:
            yield
            return
        with self.stream:
            yield

    def after_current(self) -> None:
        """Order the side stream after everything enqueued on the current stream so far."""
        if self.stream is not None:
            self.stream.wait_stream(self._current())

    def copy(self, dst: Sequence[torch.Tensor], src: Sequence[torch.Tensor]) -> None:
        """``dst[i].copy_(src[i])`` for every ``i``, on the side stream (a cast included)."""
        non_blocking = self.stream is not None
        with self._on_side():
            if len(dst) == 1:
                dst[0].copy_(src[0], non_blocking=non_blocking)
            else:
                torch._foreach_copy_(list(dst), list(src), non_blocking=non_blocking)

    def mark(self) -> torch.Event | None:
        """An event after every copy enqueued so far (``None``: they are already done)."""
        return None if self.stream is None else self.stream.record_event()

    def wait(self, mark: torch.Event | None) -> None:
        """Block the host until the copies before ``mark`` are done."""
        if mark is not None:
            mark.synchronize()

    def current_waits(self, mark: torch.Event | None) -> None:
        """Order later work on the current stream after the copies before ``mark``; the host
        does not wait."""
        if mark is not None:
            self._current().wait_event(mark)


def hpu_setup(*, distributed: bool) -> None:
    """Register the hpu device and, for distributed runs, the hccl backend."""
    HpuHandle().setup(distributed=distributed)
