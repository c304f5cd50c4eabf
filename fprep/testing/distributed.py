"""Run a function on N local ranks (gloo, CPU) and collect each rank's result; or pretend to be
one rank of any world size in this process (``fake_world``).

For tests: every rank is a fresh spawned process with the torchrun variables set, so
``fprep.prepare`` finds its launcher exactly as under ``torchrun``. A rank that raises makes the
whole call raise with that rank's traceback; a rank that does not finish in time kills the rest
(never a hang).

Ranks are daemon processes by default, which Python forbids to start children; pass
``daemon=False`` for rank functions that need their own processes (``DataLoader`` workers). Such
ranks are still killed when the call fails or times out, exactly like daemon ones.
"""

from __future__ import annotations

import os
import queue
import socket
import time
import traceback
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
import torch.multiprocessing as mp

_POLL_S = 1.0  # how often the parent checks for ranks that died without reporting


class RankError(RuntimeError):
    """A rank raised; the message carries its traceback."""


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def become_rank(rank: int, world_size: int, port: int) -> None:
    """Set this process up as torchrun would start rank ``rank`` (one thread: ranks share cores)."""
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK=str(rank),
        WORLD_SIZE=str(world_size),
        LOCAL_RANK=str(rank),
        LOCAL_WORLD_SIZE=str(world_size),
    )
    torch.set_num_threads(1)


def _worker(
    fn: Callable[..., Any],
    rank: int,
    world_size: int,
    port: int,
    results: Any,
    args: tuple[Any, ...],
) -> None:
    become_rank(rank, world_size, port)
    try:
        results.put((rank, True, fn(*args)))
    except BaseException:
        results.put((rank, False, traceback.format_exc()))
    finally:
        import torch.distributed as dist

        if dist.is_initialized():
            dist.destroy_process_group()


def run_ranks(
    fn: Callable[..., Any],
    world_size: int,
    *args: Any,
    timeout_s: float = 180.0,
    daemon: bool = True,
) -> list[Any]:
    """``[fn(*args) on rank 0, ..., on rank world_size - 1]``; ``fn`` must be picklable.

    Raises ``RankError`` as soon as a rank raises, or exits without a result (a crash, a
    result that cannot be pickled), and ``TimeoutError`` when ``timeout_s`` passes first. The
    other ranks are then killed after a short grace period instead of being waited for.
    ``daemon=False`` lets ranks start processes of their own (``DataLoader`` workers); they
    are killed on failure all the same (and on ``KeyboardInterrupt``).
    """
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    port = free_port()
    procs = [
        ctx.Process(target=_worker, args=(fn, r, world_size, port, results, args), daemon=daemon)
        for r in range(world_size)
    ]
    for p in procs:
        p.start()
    out: dict[int, Any] = {}
    failed = True
    try:
        deadline = time.monotonic() + timeout_s
        while len(out) < world_size:
            try:
                rank, ok, value = results.get(timeout=_POLL_S)
            except queue.Empty:
                missing = sorted(set(range(world_size)) - set(out))
                dead = [r for r in missing if procs[r].exitcode is not None]
                if dead:
                    try:  # what a rank sent just before it exited may still be in flight
                        rank, ok, value = results.get(timeout=_POLL_S)
                    except queue.Empty:
                        codes = ", ".join(f"{r} (exit code {procs[r].exitcode})" for r in dead)
                        raise RankError(
                            f"rank {codes} exited without a result (a crash, or a return "
                            "value that cannot be pickled)"
                        ) from None
                elif time.monotonic() > deadline:
                    raise TimeoutError(
                        f"ranks {missing} did not finish within {timeout_s:.0f} s"
                    ) from None
                else:
                    continue
            if not ok:
                raise RankError(f"rank {rank} raised:\n{value}")
            out[rank] = value
        failed = False
    finally:
        # After a failure the other ranks may wait forever in a collective: short grace.
        grace = 2.0 if failed else 10.0
        for p in procs:
            p.join(timeout=grace)
            if p.is_alive():
                p.kill()
                p.join(timeout=5)
    return [out[r] for r in range(world_size)]


@contextmanager
def fake_world(world: int, rank: int) -> Iterator[None]:
    """This process as rank ``rank`` of ``world`` on torch's fake process group, for the block.

    Its collectives move no data, so ``fully_shard``, DDP and ``fprep.prepare`` run in one
    process for any world size: cheap plan-versus-reality and rollback tests. The default
    process group is destroyed on exit.
    """
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world)
    try:
        yield
    finally:
        dist.destroy_process_group()
