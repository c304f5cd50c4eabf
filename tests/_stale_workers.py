"""Rank functions for tests/test_optimizer_guard.py: a plain ``optimizer.step()`` of an optimizer
built before ``prepare`` (issue 18.4), under each strategy, on a meta and on a real model."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import nn

import fprep

CASES = (("fsdp", True), ("fsdp", False), ("ddp", True), ("ddp", False), ("none", False))


def model(meta: bool) -> nn.Module:
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        with torch.device("meta" if meta else "cpu"):
            return nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))


def full(model: nn.Module) -> dict[str, torch.Tensor]:
    return {
        k: (v.full_tensor() if hasattr(v, "full_tensor") else v).detach().clone()
        for k, v in model.state_dict().items()
    }


def one_case(strategy: str, meta: bool) -> dict[str, Any]:
    """Build the optimizer first, prepare, backward, ``opt.step()`` as plain torch does."""
    m = model(meta)
    opt = torch.optim.SGD(m.parameters(), lr=0.5)
    cfg = fprep.PrepConfig(strategy=strategy, seed=0)  # type: ignore[arg-type]
    state, m = fprep.prepare(m, cfg)
    x = torch.randn(4, 4, generator=torch.Generator().manual_seed(dist.get_rank()))
    m(x).square().mean().backward()
    before = full(m)
    out: dict[str, Any] = {"refused": None}
    try:
        opt.step()
    except fprep.PrepareError as e:
        out["refused"] = {"message": str(e), "subject": e.subject, "hint": e.hint}
    after = full(m)
    out["changed"] = sum(not torch.equal(before[k], after[k]) for k in before)
    out["total"] = len(before)
    if out["refused"] is not None:  # the fix the error names: then plain steps train
        fprep.prepare_optimizer(state, m, opt)
        opt.zero_grad()
        m(x).square().mean().backward()
        opt.step()
        fixed = full(m)
        out["changed_after_fix"] = sum(not torch.equal(after[k], fixed[k]) for k in after)
    return out


def stale_steps() -> dict[str, Any]:
    return {
        f"{strategy}-{'meta' if meta else 'real'}": one_case(strategy, meta)
        for strategy, meta in CASES
    }
