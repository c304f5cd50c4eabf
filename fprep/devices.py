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


def hpu_setup(*, distributed: bool) -> None:
    """Register the hpu device and, for distributed runs, the hccl backend."""
    HpuHandle().setup(distributed=distributed)
