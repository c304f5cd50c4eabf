"""Run a function on N local ranks (gloo, CPU) and collect each rank's result.

For tests: every rank is a fresh spawned process with the torchrun variables set, so
``fprep.prepare`` finds its launcher exactly as under ``torchrun``. A rank that raises makes the
whole call raise with that rank's traceback; a rank that does not finish in time kills the rest
(never a hang).
"""

from __future__ import annotations

import os
import queue
import socket
import traceback
from collections.abc import Callable
from typing import Any

import torch
import torch.multiprocessing as mp


class RankError(RuntimeError):
    """A rank raised; the message carries its traceback."""


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def _worker(
    fn: Callable[..., Any],
    rank: int,
    world_size: int,
    port: int,
    results: Any,
    args: tuple[Any, ...],
) -> None:
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK=str(rank),
        WORLD_SIZE=str(world_size),
        LOCAL_RANK=str(rank),
        LOCAL_WORLD_SIZE=str(world_size),
    )
    torch.set_num_threads(1)
    try:
        results.put((rank, True, fn(*args)))
    except BaseException:
        results.put((rank, False, traceback.format_exc()))
    finally:
        import torch.distributed as dist

        if dist.is_initialized():
            dist.destroy_process_group()


def run_ranks(
    fn: Callable[..., Any], world_size: int, *args: Any, timeout_s: float = 180.0
) -> list[Any]:
    """``[fn(*args) on rank 0, ..., on rank world_size - 1]``; ``fn`` must be picklable."""
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    port = free_port()
    procs = [
        ctx.Process(target=_worker, args=(fn, r, world_size, port, results, args), daemon=True)
        for r in range(world_size)
    ]
    for p in procs:
        p.start()
    out: dict[int, Any] = {}
    try:
        while len(out) < world_size:
            try:
                rank, ok, value = results.get(timeout=timeout_s)
            except queue.Empty:
                missing = sorted(set(range(world_size)) - set(out))
                raise TimeoutError(
                    f"ranks {missing} did not finish within {timeout_s:.0f} s"
                ) from None
            if not ok:
                raise RankError(f"rank {rank} raised:\n{value}")
            out[rank] = value
    finally:
        for p in procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
    return [out[r] for r in range(world_size)]
