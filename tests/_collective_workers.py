"""Rank functions for tests/test_collective_timeouts.py: collectives called on some ranks only,
ranks that are missing or killed, ranks that plan differently.

``spawn`` runs a rank function on N local ranks like ``fprep.testing.distributed.run_ranks``,
but a rank that dies (on purpose: ``kill -9``) or raises does not end the run: it returns what
every rank reported (or how it exited) once all are done or ``timeout_s`` has passed, so a test
can assert on the survivors. Ranks report outcomes as plain data (class name, message, seconds).
"""

from __future__ import annotations

import contextlib
import os
import queue
import signal
import time
import traceback
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
import torch.multiprocessing as mp
from torch import nn

import fprep
from fprep.testing.distributed import become_rank, free_port

TIMEOUT_S = 3.0  # PrepConfig.timeout_s in these tests: short, so that failures come fast
LONG_TIMEOUT_S = 120.0  # for calls that must succeed: no skew between the ranks reaches it


def _rank(
    fn: Any,
    rank: int,
    world_size: int,
    port: int,
    results: Any,
    args: Any,
    exit_: bool,
    started: Any,
) -> None:
    """One rank, as torchrun would start it. It exits as soon as its result is sent (tearing a
    process group down after its peer was killed can block for many seconds); with ``exit_``
    it ends as a script does instead (``atexit`` hooks run).

    The started ranks wait for each other before ``fn``: importing torch in a new process takes
    seconds on a loaded machine, and without this the ranks' skew would eat ``TIMEOUT_S``, the
    short arrival deadline these tests give ``prepare``."""
    become_rank(rank, world_size, port)
    started.wait(timeout=300)
    try:
        results.put((rank, True, fn(*args)))
    except BaseException:
        results.put((rank, False, traceback.format_exc()))
    results.close()
    results.join_thread()
    if not exit_:
        os._exit(0)


def spawn(
    fn: Any,
    world_size: int,
    *args: Any,
    ranks: Any = None,
    timeout_s: float = 90.0,
    wait_for: Any = None,
    exit_normally: bool = False,
) -> Any:
    """``{rank: result}`` for ranks that reported, ``{rank: "exit <code>"}`` for those that
    exited without a result, ``{rank: "killed by the test"}`` for those still running at
    ``timeout_s`` (or once every rank of ``wait_for`` has reported). ``ranks`` (default: all)
    are the ranks started, out of ``world_size``; ``exit_normally``: ranks end as scripts do."""
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    port = free_port()
    started = list(range(world_size)) if ranks is None else list(ranks)
    needed = set(started if wait_for is None else wait_for)
    imported = ctx.Barrier(len(started))
    procs = {
        r: ctx.Process(
            target=_rank,
            args=(fn, r, world_size, port, results, args, exit_normally, imported),
            daemon=True,
        )
        for r in started
    }
    for p in procs.values():
        p.start()
    out: dict[int, Any] = {}
    deadline = time.monotonic() + timeout_s
    try:
        while not needed <= out.keys() and time.monotonic() < deadline:
            try:
                rank, ok, value = results.get(timeout=0.5)
                out[rank] = value if ok else f"raised:\n{value}"
            except queue.Empty:
                for r, p in procs.items():
                    if r not in out and p.exitcode is not None:
                        try:  # a result sent just before exiting may still be in flight
                            rank, ok, value = results.get(timeout=1.0)
                            out[rank] = value if ok else f"raised:\n{value}"
                        except queue.Empty:
                            out[r] = f"exit {p.exitcode}"
    finally:
        for r, p in procs.items():
            if exit_normally:
                p.join(timeout=30.0)  # its exit hooks run; how it ended is part of the result
                out[r] = {"result": out.get(r), "exitcode": p.exitcode}
            p.join(timeout=1.0)
            if p.is_alive():
                p.kill()
                p.join(timeout=5)
                out.setdefault(r, "killed by the test")
    return out


class Leaf(nn.Module):
    """Parameters of its own and no ``reset_parameters``: cannot be initialized from meta."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(6, 4))


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 6)
        self.leaf = Leaf()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.lin(x) + x @ self.leaf.weight.t()
        return out


def _cfg(**kw: Any) -> fprep.PrepConfig:
    return fprep.PrepConfig(strategy="fsdp", timeout_s=TIMEOUT_S, **kw)


def _outcome(call: Any) -> dict[str, Any]:
    """What ``call()`` raised (class, message, subject, cause) and how long it took."""
    start = time.monotonic()
    try:
        call()
    except Exception as e:
        cause = e.__cause__
        return {
            "error": type(e).__name__,
            "message": str(e),
            "subject": getattr(e, "subject", None),
            "cause": None if cause is None else type(cause).__name__,
            "seconds": time.monotonic() - start,
        }
    return {"error": None, "seconds": time.monotonic() - start}


def _prepared(timeout_s: float = TIMEOUT_S) -> tuple[Any, nn.Module]:
    torch.manual_seed(0)
    state, model = fprep.prepare(Net(), fprep.PrepConfig(strategy="fsdp", timeout_s=timeout_s))
    return state, model


def save_on_rank0_only(root: str) -> dict[str, Any]:
    """Rank 0 saves, rank 1 does not (and finishes). Rank 0's outcome, and what is on disk."""
    state, model = _prepared()
    if int(os.environ["RANK"]) != 0:
        return {"error": None}
    out = _outcome(lambda: fprep.save(root, state, model, step=1))
    out["left"] = _left_behind(root)
    return out


def unwrap_on_rank0_only() -> dict[str, Any]:
    state, model = _prepared()
    if int(os.environ["RANK"]) != 0:
        return {"error": None}
    return _outcome(lambda: fprep.unwrap(state, model))


def prepare_without_peer() -> dict[str, Any]:
    """This rank alone, under a launcher that promised more."""
    return _outcome(lambda: fprep.prepare(Net(), _cfg()))


def plans_differ() -> dict[str, Any]:
    """Rank 0 has real weights, rank 1 builds on meta a module without reset_parameters: only
    rank 1's plan fails."""
    torch.manual_seed(0)
    if int(os.environ["RANK"]) == 0:
        model = Net()
    else:
        with torch.device("meta"):
            model = Net()
    before = {k: v.clone() for k, v in model.state_dict().items() if not v.is_meta}
    out = _outcome(lambda: fprep.prepare(model, _cfg(sync_module_states=True)))
    after = {k: v for k, v in model.state_dict().items() if not v.is_meta}
    out["unchanged"] = before.keys() == after.keys() and all(
        torch.equal(before[k], after[k]) for k in before
    )
    out["group_created"] = torch.distributed.is_initialized()
    return out


def plans_fail_alike() -> dict[str, Any]:
    """Every rank's plan fails the same way: each keeps the plan's own error."""
    return _outcome(lambda: fprep.prepare(Net(), _cfg(ignored_modules=("nope",))))


@contextlib.contextmanager
def slow_paths() -> Iterator[dict[str, int]]:
    """Counts, for the block, of the guards' store waits (``waits``), of those that ran out
    (``ran_out``: a rank was late, and the guard waited for its deadline) and of probes for
    lost ranks (``probes``: entered only after a collective failed). Evidence that the guards
    let the normal path through without waiting for a timeout, whatever the machine's speed."""
    import fprep.collectives as C

    seen = {"waits": 0, "ran_out": 0, "probes": 0}
    wait, probe, probe_world = C._await, C.probe, C.probe_world

    def counted_wait(*args: Any, **kwargs: Any) -> bool:
        arrived = wait(*args, **kwargs)
        seen["waits"] += 1
        seen["ran_out"] += not arrived
        return arrived

    def counted(fn: Any) -> Any:
        def call(*args: Any, **kwargs: Any) -> Any:
            seen["probes"] += 1
            return fn(*args, **kwargs)

        return call

    C._await, C.probe, C.probe_world = counted_wait, counted(probe), counted(probe_world)  # type: ignore[assignment]
    try:
        yield seen
    finally:
        C._await, C.probe, C.probe_world = wait, probe, probe_world  # type: ignore[assignment]


def plans_differ_then_alike_then_succeed(root: str) -> dict[str, Any]:
    """Three prepares in one launch (the failed ones leave it able to try again), then save,
    load and unwrap on every rank: the guards let the normal path through. The last prepare
    and the calls after it get a long ``timeout_s``, so that a loaded machine's skew between
    the ranks never reaches a deadline; ``slow_paths`` shows that none was waited for."""
    out: dict[str, Any] = {"differ": plans_differ(), "alike": plans_fail_alike()}
    with slow_paths() as seen:

        def normal_path() -> None:
            state, model = _prepared(timeout_s=LONG_TIMEOUT_S)
            fprep.save(root, state, model, step=1)
            fprep.load(root, state, model)
            fprep.unwrap(state, model)

        out["ok"] = _outcome(normal_path)
    out["ok"]["slow_paths"] = dict(seen)
    out["group_created"] = torch.distributed.is_initialized()
    return out


def killed_mid_save(root: str, victim: int) -> dict[str, Any]:
    """Rank ``victim`` is killed (SIGKILL) while writing its shards; the other must not wait
    for it (rank 0 hosts the store: the survivor then cannot even reach it)."""
    from fprep.checkpoint.format import storage

    state, model = _prepared()
    if int(os.environ["RANK"]) == victim:

        def die(*args: Any, **kwargs: Any) -> Any:
            os.kill(os.getpid(), signal.SIGKILL)

        storage.SafeWriter.write_data = die  # type: ignore[method-assign]
    out = _outcome(lambda: fprep.save(root, state, model, step=1))
    out["left"] = _left_behind(root)
    return out


def calls_differ(root: str) -> dict[str, Any]:
    """Rank 0 saves while rank 1 unwraps: both learn it at once. A long timeout_s, so that the
    ranks' acknowledgements (at most min(timeout_s, PROBE_S)) do not race a loaded machine."""
    state, model = _prepared(timeout_s=60)
    if int(os.environ["RANK"]) == 0:
        return _outcome(lambda: fprep.save(root, state, model, step=1))
    return _outcome(lambda: fprep.unwrap(state, model))


def killed_before_gather() -> dict[str, Any]:
    """Rank 1 is killed after prepare; rank 0's per-batch gather (no arrival check) names it."""
    state, _ = _prepared()
    if int(os.environ["RANK"]) == 1:
        os.kill(os.getpid(), signal.SIGKILL)
    return _outcome(lambda: fprep.gather_for_metrics(state, torch.ones(2, 1)))


def _left_behind(root: str) -> list[str]:
    """What a failed save left in ``root``: everything but the root's lock file (``.lock``, kept
    for the next saver)."""
    path = Path(root)
    return sorted(p.name for p in path.iterdir() if p.name != ".lock") if path.exists() else []


# -- peers that are gone, ended or frozen ---------------------------------------------------------
def save_after_peer_exits(root: str) -> dict[str, Any]:
    """Rank 1 returns (its process then exits as a script does); rank 0 saves meanwhile, with a
    long ``timeout_s``: it must hear at once that rank 1 has exited."""
    torch.manual_seed(0)
    state, model = fprep.prepare(Net(), fprep.PrepConfig(strategy="fsdp", timeout_s=120))
    if int(os.environ["RANK"]) != 0:
        return {"error": None}
    return _outcome(lambda: fprep.save(root, state, model, step=1))


def save_after_peer_ended(root: str) -> dict[str, Any]:
    """A process group of the user's own: rank 1 calls end_training (which leaves the group
    alone) and stays alive, rank 0 saves: it hears at once that rank 1 has ended."""
    import datetime

    import torch.distributed as dist

    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=120))
    torch.manual_seed(0)
    state, model = fprep.prepare(Net(), fprep.PrepConfig(strategy="fsdp", timeout_s=120))
    if int(os.environ["RANK"]) != 0:
        return {"ended": fprep.end_training(state)}  # False: the group is the user's
    return _outcome(lambda: fprep.save(root, state, model, step=1))


def store_host_frozen(root: str, where: str) -> dict[str, Any]:
    """Rank 0 (the store's host) stops itself (SIGSTOP) in ``prepare``'s plan agreement or
    while writing its shards in ``save``; rank 1 must not wait for it without end."""
    from fprep.checkpoint.format import storage

    def freeze(*args: Any, **kwargs: Any) -> Any:
        os.kill(os.getpid(), signal.SIGSTOP)

    rank0 = int(os.environ["RANK"]) == 0
    if where == "prepare":
        from fprep import agreement

        if rank0:
            agreement.exchange = freeze  # type: ignore[assignment]
        return _outcome(_prepared)
    state, model = _prepared()
    if rank0:
        storage.SafeWriter.write_data = freeze  # type: ignore[method-assign]
    return _outcome(lambda: fprep.save(root, state, model, step=1))


def prepare_and_end(repeats: int) -> dict[str, Any]:
    """The flow of a finished job (meta GPT, fsdp, bf16, end_training), then the process ends
    as a script does. Also: after each barrier, fprep holds the last reference to its token."""
    import fprep.ranks
    from fprep.testing import models

    leftover = []
    real = fprep.ranks.released

    def watch(tensor: torch.Tensor, limit_s: float = 2.0) -> None:
        real(tensor, limit_s)
        leftover.append(tensor._use_count() - 1)  # type: ignore[attr-defined]

    fprep.ranks.released = watch  # type: ignore[assignment]
    state, _ = fprep.prepare(
        models.tiny_gpt(device="meta"), fprep.PrepConfig(strategy="fsdp", precision="bf16")
    )
    for _ in range(repeats):
        fprep.wait_for_everyone(state)
    ended = fprep.end_training(state)
    return {"ended": ended, "leftover": leftover}


def lost_under_a_mesh(victim: int) -> dict[str, Any]:
    """dp 2 x tp 2 (FSDP2 over dp, tensor parallel over tp): rank ``victim`` is killed (SIGKILL)
    after the forward, the others run the backward. Each survivor's outcome (its message must
    name the victim, and no rank alive)."""
    from fprep.testing.models import LlamaConfig, llama

    torch.manual_seed(0)
    cfg = LlamaConfig(dim=32, n_heads=2, n_kv_heads=2, ffn_dim=48, vocab_size=64)
    model = llama(cfg, "cpu", seed=0)
    # timeout_s: gloo gives up on a blocked rank after it (rank 0 is not: its peers exit)
    state, model = fprep.prepare(model, fprep.PrepConfig(strategy="fsdp", tp=2, timeout_s=60))
    x = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(1))
    loss = model(x).float().pow(2).mean()
    if int(os.environ["RANK"]) == victim:
        os.kill(os.getpid(), signal.SIGKILL)
    return _outcome(lambda: fprep.backward(state, model, loss))
