"""Rank functions for tests/test_ops_distributed.py, and their single-process references.

Module level, so ``fprep.testing.distributed.run_ranks`` can pickle them into spawned ranks. One
rank function (``two_ranks``) runs every case: starting ranks costs seconds on two cores. Ranks
return plain data; the tests assert in the parent process.
"""

from __future__ import annotations

import contextlib
import io
import random
import time
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist
from _checks import timed
from _loop_workers import rank_world
from torch import nn
from torch.utils.data import DataLoader, IterableDataset

import fprep

FEATURES = 4
ROWS = 8  # the global batch: each of 2 ranks takes half


# -- the single-process references ---------------------------------------------------------------
def linear() -> nn.Linear:
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        return nn.Linear(FEATURES, 1)


def data() -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(1)
    return torch.randn(ROWS, FEATURES, generator=gen), torch.randn(ROWS, 1, generator=gen)


def half(rank: int, world: int) -> tuple[torch.Tensor, torch.Tensor]:
    x, y = data()
    n = ROWS // world
    return x[rank * n : (rank + 1) * n], y[rank * n : (rank + 1) * n]


def loss_of(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return nn.functional.mse_loss(model(x), y)


def reference_losses(world: int) -> dict[str, Any]:
    """The whole batch's loss and each rank's, computed in one process."""
    model = linear()
    with torch.no_grad():
        return {
            "full": float(loss_of(model, *data())),
            "per_rank": [float(loss_of(model, *half(r, world))) for r in range(world)],
        }


def rank_values(rank: int) -> dict[str, Any]:
    """What each rank reduces: a float tensor, an int tensor, a bool tensor, numbers."""
    base = torch.arange(6.0).reshape(2, 3)
    return {
        "float": base * (rank + 1) - rank,
        "int": torch.tensor([rank, 3 - rank, 7]),
        "bool": torch.tensor([rank == 0, True, False]),
        "number": 0.25 + rank,
        "count": 2 + rank,
    }


def plain(value: Any) -> Any:
    """A tensor as plain data (tensors through the result queue need the rank alive)."""
    if isinstance(value, torch.Tensor):
        return {"dtype": str(value.dtype).removeprefix("torch."), "values": value.tolist()}
    return value


def unplain(value: Any) -> Any:
    if isinstance(value, dict):
        return torch.tensor(value["values"], dtype=getattr(torch, value["dtype"]))
    return value


def draws() -> list[float]:
    import numpy as np

    return [random.random(), float(np.random.rand()), float(torch.rand(()))]


def seeded_draws(seed: int) -> list[float]:
    fprep.set_seed(seed)
    return draws()


# -- an iterable dataset ---------------------------------------------------------------------------
class Stream(IterableDataset[torch.Tensor]):
    """``0 .. n - 1`` as 0-d tensors, in order."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __iter__(self) -> Iterator[torch.Tensor]:
        return iter(torch.arange(self.n).unbind(0))


def batches(loader: Any, limit: int | None = None) -> list[list[int]]:
    out: list[list[int]] = []
    for batch in loader:
        out.append(batch.tolist())
        if limit is not None and len(out) == limit:
            break
    return out


def resume_case(state: fprep.PrepState, n: int, consumed: int, **loader_kw: Any) -> dict[str, Any]:
    """One uninterrupted epoch; then ``consumed`` batches, the position, and a fresh loader
    resumed from it (its rest of the epoch and the epoch after)."""
    whole = fprep.prepare_data_loader(state, DataLoader(Stream(n), batch_size=2, **loader_kw))
    epoch0, epoch1 = batches(whole), batches(whole)
    first = fprep.prepare_data_loader(state, DataLoader(Stream(n), batch_size=2, **loader_kw))
    head = batches(first, consumed)
    position = first.state_dict()
    fresh = fprep.prepare_data_loader(state, DataLoader(Stream(n), batch_size=2, **loader_kw))
    fresh.load_state_dict(position)
    return {
        "epoch0": epoch0,
        "epoch1": epoch1,
        "head": head,
        "position": position,
        "rest": batches(fresh),
        "next_epoch": batches(fresh),
        "epoch_after": fresh.epoch,
    }


def resume_cases(state: fprep.PrepState) -> dict[str, Any]:
    workers = {"num_workers": 2, "multiprocessing_context": "fork"}
    return {
        "plain": resume_case(state, 11, 2),
        "workers": resume_case(state, 11, 3, **workers),
        "persistent": resume_case(state, 11, 1, persistent_workers=True, **workers),
    }


# -- the rank function ----------------------------------------------------------------------------
def reduce_cases(state: fprep.PrepState) -> dict[str, Any]:
    rank, _ = rank_world()
    values = rank_values(rank)
    out: dict[str, Any] = {}
    for name, value in values.items():
        for op in fprep.ranks.REDUCE_OPS:
            out[f"{name}/{op}"] = plain(fprep.reduce(state, value, op))  # type: ignore[arg-type]
    out["input_unchanged"] = torch.equal(values["float"], rank_values(rank)["float"])
    return out


def barrier_case(state: fprep.PrepState) -> dict[str, float]:
    """Rank 1 arrives late: rank 0's barrier returns only after rank 1 arrived."""
    rank, _ = rank_world()
    if rank == 1:
        time.sleep(0.5)
    arrived = time.time()
    fprep.wait_for_everyone(state)
    return {"arrived": arrived, "left": time.time()}


def printed(state: fprep.PrepState) -> str:
    buffer = io.StringIO()
    with contextlib.redirect_stdout(buffer):
        fprep.print_once(state, "loss", 1.5, sep="=")
    return buffer.getvalue()


def training_loss_case(state: fprep.PrepState, model: nn.Module) -> dict[str, Any]:
    """Each rank's loss on its half: reduced to the mean, and gathered (a 0-d tensor)."""
    rank, world = rank_world()
    with torch.no_grad():
        loss = loss_of(model, *half(rank, world))
    # Over 5 samples even batches repeat one, which a per-sample gather trims (a 0-d one not).
    loader = fprep.prepare_data_loader(state, DataLoader(torch.arange(5), batch_size=2))
    samples: list[int] = []
    with_loader: list[float] = []
    for batch in loader:  # the last batch is where even batches' repeats are trimmed
        samples += fprep.gather_for_metrics(state, batch, loader).tolist()
        with_loader = fprep.gather_for_metrics(state, loss, loader).tolist()
    gathered = fprep.gather_for_metrics(state, loss)
    return {
        "mean": float(fprep.reduce(state, loss, "mean")),
        "gathered": gathered.tolist(),
        "shape": list(gathered.shape),
        "samples": samples,
        "gathered_with_loader": with_loader,
    }


def guard_case(strategy: str) -> dict[str, Any]:
    """An optimizer built before ``prepare`` and not passed to it: refused, then rebound."""
    model = linear()
    stale = torch.optim.SGD(model.parameters(), lr=0.5)
    state, model = fprep.prepare(model, fprep.PrepConfig(strategy=strategy))  # type: ignore[arg-type]
    rank, world = rank_world()
    loss_of(model, *half(rank, world)).backward()
    out: dict[str, Any] = {}
    for name, call in [
        ("optimizer_step", lambda: fprep.optimizer_step(state, stale)),
        ("clip_grad_norm", lambda: fprep.clip_grad_norm(state, model, 1.0, optimizer=stale)),
    ]:
        try:
            call()
            out[name] = None
        except fprep.PrepareError as e:
            out[name] = {"message": str(e), "subject": e.subject}
    before = {k: v.full_tensor().clone() for k, v in model.state_dict().items()}
    fprep.prepare_optimizer(state, model, stale)
    out["stepped"] = fprep.optimizer_step(state, stale)
    after = {k: v.full_tensor() for k, v in model.state_dict().items()}
    out["changed"] = {k: not torch.equal(before[k], after[k]) for k in before}
    out["after"] = {k: v.tolist() for k, v in after.items()}
    return out


def end_case(state: fprep.PrepState) -> dict[str, Any]:
    """end_training destroys the group prepare created; a second prepare makes a new one."""
    out: dict[str, Any] = {"ended": fprep.end_training(state)}
    out["initialized_after"] = dist.is_initialized()
    try:
        fprep.reduce(state, 1.0)
        out["reduce_after"] = None
    except fprep.PrepareError as e:
        out["reduce_after"] = str(e)
    out["ended_again"] = fprep.end_training(state)
    again, _model = fprep.prepare(linear(), fprep.PrepConfig(strategy="fsdp"))
    rank, _ = rank_world()
    out["second_sum"] = fprep.reduce(again, rank + 1)
    out["old_state_ends_new_group"] = fprep.end_training(state)
    out["still_initialized"] = dist.is_initialized()
    out["second_ended"] = fprep.end_training(again)
    return out


def two_ranks() -> dict[str, Any]:
    state, model = fprep.prepare(linear(), fprep.PrepConfig(strategy="ddp", seed=5))
    fsdp_state, _ = fprep.prepare(linear(), fprep.PrepConfig(strategy="fsdp", seed=5))
    return timed(
        {
            "reduce": lambda: reduce_cases(state),
            "reduce_fsdp": lambda: reduce_cases(fsdp_state),
            "barrier": lambda: barrier_case(state),
            "printed": lambda: printed(state),
            "main": lambda: fprep.is_main_process(state),
            "seeded": lambda: seeded_draws(7),
            "seeded_per_rank": lambda: (fprep.set_seed(7, state, per_rank=True), draws()),
            "loss": lambda: training_loss_case(state, model),
            "loss_fsdp": lambda: training_loss_case(fsdp_state, linear()),
            "guard_fsdp": lambda: guard_case("fsdp"),
            "resume": lambda: resume_cases(state),
            "end": lambda: end_case(state),  # last: it ends the process group
        }
    )
