"""A stand-in for an accelerator's side stream, on the CPU, for the pipelines' structure.

``DeferredLane`` behaves as a stream would where it matters: a copy is only enqueued (it runs
later, in order), a mark runs nothing, and the copies run when the host waits on a mark after
them or when the current stream is made to wait on one (``on_current`` runs the "training
loop's" work after everything the current stream waits on). Code that reused a buffer before its
copy was waited for, or let the current stream run ahead of a copy, would read or write the
wrong bytes here, as on a GPU, and its tests would see wrong values.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from fprep.devices import Lane


class DeferredLane(Lane):
    def __init__(self) -> None:  # no super().__init__: no accelerator here
        self.device = torch.device("cpu")
        self.stream = "side"  # type: ignore[assignment]  # not None: the accelerator paths
        self.pin = False
        self.queue: list[tuple[int, Callable[[], None]]] = []  # (mark it precedes, copy)
        self.marks = 0
        self.log: list[str] = []
        self.host_buffers = 0
        self.device_buffers = 0
        self.most_queued = 0
        self.current_after = 0  # marks the current stream waits on

    def host_buffer(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        self.host_buffers += 1
        return torch.full((numel * dtype.itemsize,), 0xAB, dtype=torch.uint8).view(dtype)

    def device_buffer(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        self.device_buffers += 1
        return torch.full((numel * dtype.itemsize,), 0xCD, dtype=torch.uint8).view(dtype)

    def after_current(self) -> None:
        self.log.append("after_current")

    def copy(self, dst: Sequence[torch.Tensor], src: Sequence[torch.Tensor]) -> None:
        self.log.append("copy")

        def run() -> None:
            for d, s in zip(dst, src, strict=True):
                d.copy_(s)

        self.queue.append((self.marks, run))
        self.most_queued = max(self.most_queued, len(self.queue))

    def mark(self) -> int:  # type: ignore[override]
        self.marks += 1
        self.log.append("mark")
        return self.marks

    def _run_until(self, mark: int) -> None:
        while self.queue and self.queue[0][0] < mark:
            self.queue.pop(0)[1]()

    def wait(self, mark: object) -> None:
        if mark is not None:
            assert isinstance(mark, int)
            self.log.append("wait")
            self._run_until(mark)

    def current_waits(self, mark: object) -> None:
        if mark is not None:
            assert isinstance(mark, int)
            self.log.append("current_waits")
            self.current_after = max(self.current_after, mark)

    def on_current(self, work: Callable[[], None]) -> None:
        """The training loop's next kernel: after what the current stream waits on."""
        self._run_until(self.current_after)
        work()

    def drain(self) -> None:
        """The stream running on by itself, later."""
        self._run_until(self.marks + 1)
