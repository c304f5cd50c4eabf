"""Rank function for tests/test_fp8_parallel.py's checkpoint test: fprep.save / load /
export_full of a model whose float8 weights FSDP2 all-gathers in float8 (torchao wraps each
weight in a tensor subclass inside the DTensor; fprep precomputes its scale after each step and
after a load). Emulated float8 matmuls on the CPU, 2 gloo ranks, one spawned job.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import _fp8_workers as F
import _tp_workers as W
import torch
from _checkpoint_workers import dump, full_state, rank
from torch import nn

import fprep
from fprep.state import PrepState

RUN = "fsdp2_gather"


def _step(state: PrepState, model: nn.Module, opt: torch.optim.Optimizer, k: int) -> float:
    """Step ``k`` on this rank's dp slice of W.batches()[k]; its loss."""
    x, y = W.batches()[k]
    per = W.GLOBAL_BATCH // 2
    mine = slice(rank() * per, (rank() + 1) * per)
    loss = W.loss_of(W.logits_of(model, x[mine]), y[mine])
    fprep.backward(state, model, loss)
    fprep.optimizer_step(state, opt)
    opt.zero_grad()
    return loss.item()


def _loaded(path: Path) -> dict[str, Any]:
    """A fresh prepared model (other seed) loaded from ``path``: its scales before and after
    the load, its full state, and the loss of the step after it (step 1, as in the run)."""
    state, model, opt = F.prepared(RUN, seed=W.SEED + 1)
    before = F._scales(model)
    fprep.load(path, state, model, optimizers=opt)
    after = F._scales(model)
    return {
        "scales_before": before,
        "scales": after,
        "state": dump(full_state(model, opt)),
        "loss": _step(state, model, opt, 1),
    }


def round_trip(root: str) -> dict[str, Any]:
    """Train one step, save (sync and ``wait=False``) and export, train a second step while
    the async save is in flight; load each checkpoint into a fresh model."""
    torch.set_num_threads(1)
    base = Path(root)
    state, model, opt = F.prepared(RUN)
    _step(state, model, opt, 0)
    fprep.save(base / "sync", state, model, optimizers=opt, step=1)
    fprep.export_full(base / "full.safetensors", state, model)
    at_save = full_state(model, opt)
    kinds = sorted({type(getattr(p, "_local_tensor", p)).__name__ for p in model.parameters()})
    handle = fprep.save(base / "async", state, model, optimizers=opt, step=1, wait=False)
    loss = _step(state, model, opt, 1)  # changes every weight while the save is in flight
    handle.wait()
    # weights= from the export, read into the float8 weights' wrappers by prepare's load step
    state, model, opt = F.prepared(RUN, seed=W.SEED + 2, weights=str(base / "full.safetensors"))
    loaded = full_state(model, opt)["model"]
    return {
        "weights": dump(loaded) if rank() == 0 else b"",
        "at_save": dump(at_save) if rank() == 0 else b"",
        "kinds": kinds,
        "loss": loss,
        "sync": _loaded(base / "sync"),
        "async": _loaded(base / "async"),
    }
