"""Rank functions for tests/test_expert_parallel.py: training under expert parallelism, one
spawned job per world size running several cases, each compared by the parent with one process.

A case is ``(name, model kind, PrepConfig fields, router)``; a kind may name its expert count
(``"qwen3_moe:2"``). ``router`` is ``"learned"`` (the
seeded model's own router) or ``"one"``: the router's weights set to zero and frozen, with one
expert per token, so every token goes to the same expert (``torch.topk`` breaks the tie the same
way everywhere) and the other experts receive none. Each rank trains ``STEPS`` AdamW steps on its
data-parallel share of each batch and returns its losses, the experts it holds, and every
parameter after the last step as one process would hold it: dense parameters gathered over the
data-parallel ranks, expert parameters gathered over efsdp (this rank's experts only).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import torch
from _tiny_transformers import mixtral, qwen3_moe
from torch import nn

import fprep

STEPS = 3
BATCH = 4  # rows per data-parallel rank
SEQ = 8
#: AdamW moves an entry by about lr x (its gradient's rounding noise / the gradient): where a
#: gradient nearly cancels, the ranks' other summation order (the gradients agree within 2e-8)
#: moved parameters by 2e-5 at lr 1e-2 (the 2-expert case). At 1e-3 that stays within 1e-5.
LR = 1e-3
MAX_NORM = 0.5  # below the first steps' norms: clipping changes every update

Case = tuple[str, str, dict[str, Any], str]


def build(kind: str, router: str) -> nn.Module:
    """The model of ``kind`` with the same weights in every process (seeded)."""
    top_k = 1 if router == "one" else 2
    family, _, count = kind.partition(":")
    sizes: dict[str, Any] = {"num_experts_per_tok": top_k}
    if count:
        sizes["num_experts" if family == "qwen3_moe" else "num_local_experts"] = int(count)
    model = (qwen3_moe if family == "qwen3_moe" else mixtral)(**sizes)
    if router == "one":
        for layer in model.model.layers:  # type: ignore[union-attr]
            layer.mlp.gate.weight.data.zero_()
            layer.mlp.gate.weight.requires_grad_(False)
    return model


def batch(step: int, rows: int) -> torch.Tensor:
    """Step ``step``'s token ids, ``rows`` x ``SEQ`` (the same in every process)."""
    gen = torch.Generator().manual_seed(100 + step)
    return torch.randint(0, 256, (rows, SEQ), generator=gen)


def optimizer(model: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=LR)


def train(
    model: nn.Module, rows: slice, dp: int, clip: Callable[[], torch.Tensor]
) -> tuple[list[float], list[float]]:
    """``STEPS`` steps on rows ``rows`` of each batch (of ``BATCH x dp`` rows), gradients
    clipped by ``clip``: the losses and the norms before clipping."""
    opt = optimizer(model)
    losses, norms = [], []
    for step in range(STEPS):
        ids = batch(step, BATCH * dp)[rows]
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        norms.append(float(clip()))
        opt.step()
        opt.zero_grad()
        losses.append(float(loss.detach()))
    return losses, norms


def reference(kind: str, router: str, dp: int) -> dict[str, Any]:
    """One process on the whole batch: the losses, the parameters, the experts tokens chose."""
    model = build(kind, router)
    chosen: set[int] = set()

    def record(module: nn.Module, args: tuple[Any, ...]) -> None:
        chosen.update(args[1].reshape(-1).tolist())

    for layer in model.model.layers:  # type: ignore[union-attr]
        layer.mlp.experts.register_forward_pre_hook(record)
    trained = [p for p in model.parameters() if p.requires_grad]
    losses, norms = train(
        model, slice(None), dp, lambda: nn.utils.clip_grad_norm_(trained, MAX_NORM)
    )
    params = {n: p.detach().numpy().copy() for n, p in model.named_parameters()}
    return {"losses": losses, "norms": norms, "params": params, "chosen": sorted(chosen)}


def _whole(p: torch.Tensor) -> np.ndarray:
    full = p.full_tensor() if hasattr(p, "full_tensor") else p
    return full.detach().numpy().copy()


def run(cases: list[Case]) -> list[dict[str, Any]]:
    out = []
    for name, kind, fields, router in cases:
        model = build(kind, router)
        state, model = fprep.prepare(model, fprep.PrepConfig(**fields))
        plan = state.expert_parallel
        assert plan is not None
        dp = state.process_group.mesh.dp_size  # type: ignore[union-attr]
        rank = state.process_group.mesh.dp_rank  # type: ignore[union-attr]
        losses, norms = train(
            model,
            slice(rank * BATCH, (rank + 1) * BATCH),
            dp,
            lambda: fprep.clip_grad_norm(state, model, MAX_NORM),  # noqa: B023
        )
        placements = {
            n: str(p.placements) for n, p in model.named_parameters() if n in plan.param_fqns
        }
        params = {n: _whole(p) for n, p in model.named_parameters()}
        experts = {
            m.fqn: (plan.local_experts(m.fqn).start, plan.local_experts(m.fqn).stop)
            for m in plan.modules
        }
        out.append(
            {
                "name": name,
                "losses": losses,
                "norms": norms,
                "params": params,
                "experts": experts,
                "placements": placements,
                "dp": dp,
            }
        )
    return out
