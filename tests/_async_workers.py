"""Rank functions for tests/test_checkpoint_async.py (module level: ``run_ranks`` pickles them).

Ranks return plain data (booleans, error strings); the tests assert in the parent process.
"""

from __future__ import annotations

import contextlib
import errno
import functools
import os
import signal
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import _checkpoint_workers as W
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

import fprep
from fprep.checkpoint.asynchronous import staging
from fprep.checkpoint.format.storage import SafeWriter


def same_full(a: dict[str, Any], b: dict[str, Any]) -> bool:
    """Model and optimizer state equal, bit for bit."""
    return (
        a["model"].keys() == b["model"].keys()
        and all(torch.equal(a["model"][k], b["model"][k]) for k in a["model"])
        and a["optim"].keys() == b["optim"].keys()
        and all(
            torch.equal(a["optim"][f][k], b["optim"][f][k])
            for f in a["optim"]
            for k in a["optim"][f]
        )
        and a["groups"] == b["groups"]
    )


def pointers(model: torch.nn.Module) -> dict[str, int]:
    return {k: b.data_ptr() for k, b in staging.stager_for(model).buffers.items()}


@contextlib.contextmanager
def held_writer() -> Iterator[threading.Event]:
    """The background thread's writes start only once the event is set: whatever the test
    does before setting it happens before the save has read a single byte."""
    gate = threading.Event()
    real = SafeWriter.write_data

    def held(self: SafeWriter, *args: Any, **kwargs: Any) -> Any:
        if threading.current_thread().name == "fprep-save":
            assert gate.wait(timeout=120), "the test never released the writer"
        return real(self, *args, **kwargs)

    SafeWriter.write_data = held  # type: ignore[method-assign]
    try:
        yield gate
    finally:
        SafeWriter.write_data = real  # type: ignore[method-assign]


# -- the in-place changes of issue 18 (each one missed by the version-counter guard under fsdp) --
def _params(model: nn.Module) -> list[torch.Tensor]:
    return [p for p in model.parameters() if p.numel()]


def _add(model: nn.Module, opt: torch.optim.Optimizer) -> None:
    _params(model)[0].add_(1.0)


def _copy(model: nn.Module, opt: torch.optim.Optimizer) -> None:
    p = _params(model)[0]
    p.copy_(torch.full_like(p, 7.0))


def _mul(model: nn.Module, opt: torch.optim.Optimizer) -> None:
    for p in _params(model):
        p.mul_(3.0)


def _detach_add(model: nn.Module, opt: torch.optim.Optimizer) -> None:
    _params(model)[-1].detach().add_(2.0)


def _foreach_add(model: nn.Module, opt: torch.optim.Optimizer) -> None:
    torch._foreach_add_(_params(model), 0.5)


def _init_zeros(model: nn.Module, opt: torch.optim.Optimizer) -> None:
    nn.init.zeros_(_params(model)[0])


def _exp_avg_by_hand(model: nn.Module, opt: torch.optim.Optimizer) -> None:
    for entry in opt.state.values():
        entry["exp_avg"].add_(1.0)


def _load_state_dict(model: nn.Module, opt: torch.optim.Optimizer) -> None:
    model.load_state_dict({k: torch.zeros_like(v) for k, v in model.state_dict().items()})


def _other_optimizer(model: nn.Module, opt: torch.optim.Optimizer) -> None:
    other = torch.optim.SGD(model.parameters(), lr=1.0)  # not passed to save
    for p in model.parameters():
        p.grad = torch.ones_like(p)
    other.step()
    other.zero_grad(set_to_none=True)


def _through_data(model: nn.Module, opt: torch.optim.Optimizer) -> None:
    _params(model)[0].data.fill_(-5.0)  # moves no version counter at all


MUTATIONS: dict[str, Callable[[nn.Module, torch.optim.Optimizer], None]] = {
    "p.add_": _add,
    "p.copy_": _copy,
    "p.mul_": _mul,
    "p.detach().add_": _detach_add,
    "torch._foreach_add_": _foreach_add,
    "nn.init.zeros_": _init_zeros,
    "exp_avg by hand": _exp_avg_by_hand,
    "model.load_state_dict": _load_state_dict,
    "another optimizer's step": _other_optimizer,
    "p.data": _through_data,
}


def mutated_before_the_write(
    base: Path, strategy: str, state: Any, model: nn.Module, opt: Any
) -> dict[str, Any]:
    """Each mutation right after ``save(wait=False)`` returns, before the background has read
    anything: every checkpoint must load to exactly the values at the call."""
    out: dict[str, Any] = {}
    s2, m2, o2, *_ = W.prepared(strategy, seed=31)
    for step, (name, mutate) in enumerate(MUTATIONS.items(), start=1):
        at_call = W.full_state(model, opt)
        with held_writer() as gate:
            handle = fprep.save(base, state, model, optimizers=(opt,), step=step, wait=False)
            with torch.no_grad():
                mutate(model, opt)
            gate.set()
            path = handle.wait()  # a failure here fails the test (raised in the rank)
        changed = not same_full(W.full_state(model, opt), at_call)
        fprep.load(path, s2, m2, optimizers=(o2,))
        out[name] = {
            "changed": changed,
            "equal": same_full(W.full_state(m2, o2), at_call),
        }
    return out


def mul_while_saving(model: nn.Module, until: Callable[[], bool], started: threading.Event) -> int:
    """A thread's loop: ``p.mul_(1.0001)`` on every parameter until ``until()``; ``started``
    is set after the second round. Returns the rounds run."""
    rounds = 0
    params = _params(model)
    with torch.no_grad():
        while not until():
            for p in params:
                p.mul_(1.0001)
            rounds += 1
            if rounds == 2:
                started.set()
    started.set()
    return rounds


def _same_replicas(model: nn.Module) -> None:
    """Replicated (ddp) parameters as rank 0 has them: each rank's thread ran its own number of
    rounds, and a checkpoint holds one replica (rank 0's). Shards (fsdp) are each rank's own."""
    if not dist.is_initialized():
        return
    with torch.no_grad():
        for p in model.parameters():
            if not isinstance(p, DTensor):
                dist.broadcast(p.detach(), src=0)


def overlapping_kernels(
    base: Path,
    fresh: Callable[[], tuple[Any, ...]],
    state: Any,
    model: nn.Module,
    opt: Any,
    saves: int,
) -> dict[str, Any]:
    """``saves`` asynchronous saves, each while another thread multiplies every parameter in
    place until the save is done (the background writes only after that thread's second round,
    so reads and kernels overlap for sure): each published step must load to exactly the
    values at its call, and ``latest`` must name the last one. ``fresh()``: a prepared
    ``(state, model, optimizer)`` like the saved one, to load into."""
    s2, m2, o2, *_ = fresh()
    equal, rounds = [], []
    for i in range(saves):
        step = 100 + i
        at_call = W.full_state(model, opt)
        with held_writer() as gate:
            handle = fprep.save(base, state, model, optimizers=(opt,), step=step, wait=False)
            thread = threading.Thread(
                target=lambda h=handle, g=gate: rounds.append(mul_while_saving(model, h.done, g))
            )
            thread.start()
            path = handle.wait()
            thread.join()
        _same_replicas(model)
        fprep.load(path, s2, m2, optimizers=(o2,))
        equal.append(same_full(W.full_state(m2, o2), at_call))
    latest = fprep.load(base, s2, m2).step
    return {"equal": equal, "rounds": rounds, "latest": latest}


def values_at_the_call(root: str) -> dict[str, Any]:
    """Per strategy: save without waiting, keep training (the loop's collectives run on the
    default group while the save's run on its own), then load what was saved; then every
    in-place change of issue 18, and overlapping kernels."""
    torch.set_num_threads(1)
    out: dict[str, Any] = {}
    for strategy in ("fsdp", "ddp"):
        base = Path(root) / strategy
        state, model, opt, sched, loader = W.prepared(strategy)
        trainer = W.Trainer(state, model, opt, sched, loader)
        trainer.run(W.N_STEPS)
        at_call = W.full_state(model, opt)
        lr_at_call = sched.get_last_lr()
        handle = fprep.save(
            base,
            state,
            model,
            optimizers=(opt,),
            scheduler=sched,
            loader=loader,
            step=W.N_STEPS,
            wait=False,
        )
        trainer.run(2)  # the optimizer changes the parameters right away
        changed = not same_full(W.full_state(model, opt), at_call)
        path = handle.wait()
        first = pointers(model)
        second = fprep.save(base, state, model, optimizers=(opt,), step=99, wait=False)
        out[f"{strategy}_reused"] = first == pointers(model) and len(first) > 0
        second.wait()
        s2, m2, o2, sc2, l2 = W.prepared(strategy, seed=31)
        info = fprep.load(path, s2, m2, optimizers=(o2,), scheduler=sc2, loader=l2)
        out[f"{strategy}_changed_after_call"] = changed
        out[f"{strategy}_equal"] = same_full(W.full_state(m2, o2), at_call)
        out[f"{strategy}_lr"] = sc2.get_last_lr() == lr_at_call
        out[f"{strategy}_loader"] = l2.state_dict() == {"epoch": 0, "batches": W.N_STEPS}
        out[f"{strategy}_step"] = info.step
        out[f"{strategy}_published"] = path.name
        out[f"{strategy}_mutations"] = mutated_before_the_write(
            base / "mutations", strategy, state, model, opt
        )
        out[f"{strategy}_overlap"] = overlapping_kernels(
            base / "overlap",
            functools.partial(W.prepared, strategy, seed=31),
            state,
            model,
            opt,
            saves=3,
        )
    return out


def one_rank_fails(root: str) -> dict[str, Any]:
    """Rank 1's background write fails (a full disk): every rank's ``wait`` raises it, the
    previous checkpoint stays the one to load, and the next save works."""
    torch.set_num_threads(1)
    state, model, opt, *_ = W.prepared("fsdp")
    fprep.save(root, state, model, optimizers=(opt,), step=1)
    real = SafeWriter._write

    def full_disk(self: SafeWriter, *args: Any) -> Any:
        if W.rank() == 1:
            raise OSError(errno.ENOSPC, "No space left on device")
        return real(self, *args)

    SafeWriter._write = full_disk  # type: ignore[method-assign]
    try:
        handle = fprep.save(root, state, model, optimizers=(opt,), step=2, wait=False)
        error = W.expect_error(handle.wait)
    finally:
        SafeWriter._write = real  # type: ignore[method-assign]
    s2, m2, o2, *_ = W.prepared("fsdp", seed=4)
    step_after_failure = fprep.load(root, s2, m2, optimizers=(o2,)).step
    fprep.save(root, state, model, optimizers=(opt,), step=3, wait=False).wait()
    return {
        "error": error,
        "step_after_failure": step_after_failure,
        "step_after_retry": fprep.load(root, s2, m2, optimizers=(o2,)).step,
        "leftovers": sorted(p.name for p in Path(root).iterdir() if p.name.startswith(".tmp")),
    }


def two_ranks(root: str) -> dict[str, Any]:
    """Both of the above in one spawned group (spawning costs seconds on two cores)."""
    return {
        "values": values_at_the_call(str(Path(root) / "values")),
        "failure": one_rank_fails(str(Path(root) / "failure")),
    }


def killed_in_the_background(root: str, victim: int) -> dict[str, Any]:
    """Rank ``victim`` is killed (SIGKILL) while its background thread writes its shards; the
    survivor's ``wait`` must raise a ``CollectiveError`` naming it (not gloo's raw message),
    and the previous checkpoint stays the latest."""
    import _collective_workers as C

    state, model = C._prepared()
    fprep.save(root, state, model, step=1)
    if int(os.environ["RANK"]) == victim:

        def die(*args: Any, **kwargs: Any) -> Any:
            os.kill(os.getpid(), signal.SIGKILL)

        SafeWriter.write_data = die  # type: ignore[method-assign]
    handle = fprep.save(root, state, model, step=2, wait=False)
    out = C._outcome(handle.wait)
    latest = Path(root) / "latest"
    out["latest"] = latest.read_text().split()[0] if latest.exists() else None
    return out
