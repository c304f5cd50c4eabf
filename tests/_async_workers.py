"""Rank functions for tests/test_checkpoint_async.py (module level: ``run_ranks`` pickles them).

Ranks return plain data (booleans, error strings); the tests assert in the parent process.
"""

from __future__ import annotations

import errno
import threading
from pathlib import Path
from typing import Any

import _checkpoint_workers as W
import torch

import fprep
from fprep.checkpoint import staging
from fprep.checkpoint.storage import SafeWriter


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


def values_at_the_call(root: str) -> dict[str, Any]:
    """Per strategy: save without waiting, keep training (the loop's collectives run on the
    default group while the save's run on its own), then load what was saved."""
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
        out[f"{strategy}_held"] = held_until_the_step(base / "held", strategy)
    return out


def held_until_the_step(base: Path, strategy: str) -> bool:
    """The background write starts only once the next step reached ``optimizer.step``: the
    forward and backward (FSDP's all-gathers, DDP's buffer broadcast) run while the live tensors
    are guarded, the step's hook copies them all, and the checkpoint still holds the values at
    the call (no version counter moved before the step)."""
    state, model, opt, sched, loader = W.prepared(strategy)
    trainer = W.Trainer(state, model, opt, sched, loader)
    trainer.run(2)
    at_call = W.full_state(model, opt)
    gate = threading.Event()
    real = SafeWriter.write_data

    def held(self: SafeWriter, *args: Any, **kwargs: Any) -> Any:
        gate.wait(timeout=60)
        return real(self, *args, **kwargs)

    SafeWriter.write_data = held  # type: ignore[method-assign]
    try:
        handle = fprep.save(base, state, model, optimizers=(opt,), step=2, wait=False)
        opt.register_step_pre_hook(lambda *_: gate.set())
        trainer.run(1)
        path = handle.wait()
    finally:
        SafeWriter.write_data = real  # type: ignore[method-assign]
    s2, m2, o2, *_ = W.prepared(strategy, seed=31)
    fprep.load(path, s2, m2, optimizers=(o2,))
    return same_full(W.full_state(m2, o2), at_call)


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
