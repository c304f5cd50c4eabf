"""Rank functions for tests/test_tp_composition.py: everything fprep prepares, on top of tensor
parallelism (dp 2 x tp 2, fprep's Llama), and the same configuration in one process.

One spawned job trains every case one after the other (spawning ranks costs seconds on two
cores). Each case returns its per-step losses (this rank's dp slice of the batch); the
reference is ``fprep.prepare`` of the same configuration without tp in one process, on the
whole batch, so precision, checkpointing and compilation act the same on both sides.
"""

from __future__ import annotations

from typing import Any

import _tp_workers as W
import torch
import torch.nn.functional as F
from torch import nn

import fprep
from fprep.testing.models import Llama, LlamaBlock, LlamaConfig, llama

SEED = 7
STEPS, GLOBAL_BATCH, VOCAB = W.STEPS, W.GLOBAL_BATCH, W.VOCAB  # W.batches() feeds both

#: Llama's own plan with the output head kept vocabulary-sharded (loss parallel).
LOSS_PARALLEL_PLAN = {**Llama._tp_plan, "output": "colwise_loss_parallel"}
#: Llama's plan without layer 1 (left whole, ignored and frozen) nor the output head.
PARTIAL_PLAN = {
    k.replace("layers.*", "layers.0"): v for k, v in Llama._tp_plan.items() if k != "output"
}

#: case -> (PrepConfig fields beside the layout, modules frozen on both sides, loss tolerance)
CASES: dict[str, tuple[dict[str, Any], tuple[str, ...], float]] = {
    "bf16": ({"precision": "bf16"}, (), 2e-2),
    "fp16": ({"precision": "fp16"}, (), 5e-3),
    "checkpointing": ({"activation_checkpointing": True, "wrap": LlamaBlock}, (), 1e-5),
    "compile_whole": ({"compile": "whole", "compile_backend": "aot_eager"}, (), 1e-5),
    "offload": ({"offload": "cpu", "wrap": LlamaBlock}, (), 1e-5),
    "prefetch": ({"wrap": LlamaBlock, "forward_prefetch": 1, "backward_prefetch": 2}, (), 1e-5),
    "ignored": (
        {"tp_plan": PARTIAL_PLAN, "ignored_modules": ("layers.1",), "wrap": LlamaBlock},
        ("layers.1",),
        1e-5,
    ),
    "loss_parallel": ({"tp_plan": LOSS_PARALLEL_PLAN}, (), 1e-5),
    "loss_parallel_sequence": (
        {"tp_plan": LOSS_PARALLEL_PLAN, "sequence_parallel": True, "wrap": LlamaBlock},
        (),
        1e-5,
    ),
    "bf16_compiled": (
        {"precision": "bf16", "compile": "whole", "compile_backend": "aot_eager"},
        (),
        2e-2,
    ),
}


#: compile="regional" (each LlamaBlock compiled) on tensor parallelism: layout name -> (world
#: size, PrepConfig fields), trained through tests/_tp_workers.py's loop (accumulation, clipping)
#: against its eager single-process reference.
REGIONAL: dict[str, tuple[int, dict[str, Any]]] = {
    "tp2": (2, {"strategy": "auto", "tp": 2}),
    "dp2_tp2_checkpointing": (
        4,
        {"strategy": "fsdp", "tp": 2, "activation_checkpointing": True},
    ),
    "dp2_tp2_sequence": (4, {"strategy": "fsdp", "tp": 2, "sequence_parallel": True}),
}


def regional(world: int) -> dict[str, Any]:
    """Every ``REGIONAL`` layout of this world size, fprep's Llama."""
    fields = {"compile": "regional", "compile_backend": "aot_eager", "wrap": LlamaBlock}
    out = {}
    for name, (size, layout) in REGIONAL.items():
        if size == world:
            torch._dynamo.reset()  # layouts share a process: no compiled code carries over
            out[name] = W.train("fprep_llama", {**fields, **layout})
    return out


def build(frozen: tuple[str, ...]) -> nn.Module:
    cfg = LlamaConfig(dim=32, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=64, vocab_size=VOCAB)
    model = llama(cfg, "cpu", seed=SEED)
    for fqn in frozen:
        model.get_submodule(fqn).requires_grad_(False)
    return model


def train(fields: dict[str, Any], frozen: tuple[str, ...], layout: dict[str, Any]) -> list[float]:
    """Per-step losses of this rank's data-parallel slice, prepared with ``fields`` + ``layout``."""
    torch._dynamo.reset()  # cases share a process: no compiled code (or fake mode) carries over
    model = build(frozen)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    cfg = fprep.PrepConfig(**{**fields, **layout})
    state, model, opt = fprep.prepare(model, cfg, opt)
    pg = state.process_group
    assert pg is not None
    dp, dp_rank = (pg.shard_size, pg.coordinate[-1]) if cfg.tp > 1 else (1, 0)
    per = GLOBAL_BATCH // dp
    mine = slice(dp_rank * per, (dp_rank + 1) * per)
    losses = []
    for x, y in W.batches():
        with fprep.loss_parallel(state):
            logits = model(x[mine])
            loss = F.cross_entropy(logits.flatten(0, 1).float(), y[mine].flatten())
            fprep.backward(state, model, loss)
        fprep.optimizer_step(state, opt)
        opt.zero_grad()
        value = loss.detach()
        losses.append(float(value.full_tensor() if hasattr(value, "full_tensor") else value))
    return losses


def four_ranks(cases: tuple[str, ...] = tuple(CASES)) -> dict[str, list[float]]:
    layout = {"strategy": "fsdp", "tp": 2}
    return {name: train(CASES[name][0], CASES[name][1], layout) for name in cases}


def reference(name: str) -> list[float]:
    fields, frozen, _ = CASES[name]
    # one process: no plan, nothing ignored, nothing to offload (offload needs fsdp)
    dropped = ("tp_plan", "sequence_parallel", "ignored_modules", "offload")
    one = {k: v for k, v in fields.items() if k not in dropped}
    return train(one, frozen, {"strategy": "none"})
