"""Rank functions for tests/test_moe_layouts.py: mixture-of-experts models trained under every
layout, one spawned job per world size running several cases, each compared by the parent with
one process (``reference``).

A case is ``(name, model kind, PrepConfig fields, data, aux_loss_coef)``. The kinds are fprep's
``MoE`` (with a shared expert) and transformers' Qwen3-MoE, Mixtral and GPT-OSS, tiny and
seeded (the same weights in every process). The data is ``"random"`` (``synthetic_batches``),
``"starved"`` (the second half of the rows one repeated token: every token there has the same
hidden state, so those ranks send all their tokens to the same ``top_k`` experts and the other
experts receive none there) or ``"one_expert"`` (every row the same repeated token and
``top_k=1``: every token goes to one expert).

Each rank trains ``STEPS`` AdamW steps with ``fprep.pipeline_step`` (which serves every layout)
on its data-parallel share of each batch and returns, per step, its loss (where known), the
full gradient of every parameter it holds, and its routers' token counts (its own, and summed
over the data-parallel ranks), then its parameters.
"""

from __future__ import annotations

import os
from typing import Any

import numpy as np
import torch
import transformers as tf
from torch import nn
from transformers.models.qwen3_moe.modeling_qwen3_moe import load_balancing_loss_func

import fprep
from fprep.testing.models import (
    FeedForward,
    LlamaConfig,
    MoEConfig,
    MoERouter,
    lm_loss,
    moe_tiny,
    synthetic_batches,
)

STEPS = 2
BATCH = 8
SEQ = 8
VOCAB = 64
LR = 1e-3  # Adam divides by the gradients' size: a larger step magnifies their last bits
EXPERTS = 4
REPEATED = 5  # the token of the repeated rows

Case = tuple[str, str, dict[str, Any], str, float | None]


class ListedExperts(nn.Module):
    """A routed feed-forward whose experts are separate modules in a ``ModuleList`` named
    ``experts`` (transformers 4's layout; transformers 5 fuses them): an expert no token
    reaches on a rank takes no part in that rank's backward."""

    def __init__(self, config: MoEConfig) -> None:
        super().__init__()
        self.gate = MoERouter(config)
        shape = LlamaConfig(dim=config.dim, ffn_dim=config.expert_dim, n_heads=1, n_kv_heads=1)
        self.experts = nn.ModuleList(FeedForward(shape) for _ in range(config.n_experts))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        tokens = x.reshape(-1, x.shape[-1])
        _, weights, indices = self.gate(tokens)
        out = torch.zeros_like(tokens)
        for index, expert in enumerate(self.experts):
            token, slot = torch.where(indices == index)
            if token.numel():
                out = out.index_add(0, token, expert(tokens[token]) * weights[token, slot, None])
        return out.reshape(x.shape)


def build(kind: str, data: str = "random", layers: int = 2) -> nn.Module:
    """The model of ``kind`` with ``layers`` blocks (``top_k=1`` for the one-expert data),
    seeded."""
    top_k = 1 if data == "one_expert" else 2
    torch.manual_seed(0)
    if kind in ("moe", "listed"):
        model = moe_tiny(
            n_layers=layers, n_experts=EXPERTS, top_k=top_k, vocab_size=VOCAB, shared_expert=True
        )
        if kind == "listed":
            for block in model.layers:
                block.feed_forward = ListedExperts(model.config)  # type: ignore[assignment]
        return model
    common: dict[str, Any] = dict(
        hidden_size=32,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        vocab_size=VOCAB,
        tie_word_embeddings=False,
        num_experts_per_tok=top_k,
    )
    if kind == "qwen3":
        config = tf.Qwen3MoeConfig(
            **common, intermediate_size=64, moe_intermediate_size=32, num_experts=EXPERTS
        )
        return tf.Qwen3MoeForCausalLM(config)
    if kind == "mixtral":
        config = tf.MixtralConfig(**common, intermediate_size=32, num_local_experts=EXPERTS)
        return tf.MixtralForCausalLM(config)
    if kind == "gptoss":
        config = tf.GptOssConfig(
            **common,
            intermediate_size=32,
            num_local_experts=EXPERTS,
            layer_types=["sliding_attention", "full_attention"][:layers],
            sliding_window=4,
        )
        return tf.GptOssForCausalLM(config)
    raise ValueError(kind)


def batches(data: str) -> list[tuple[torch.Tensor, torch.Tensor]]:
    out = []
    for x, y in synthetic_batches(STEPS, batch_size=BATCH, seq_len=SEQ, vocab_size=VOCAB, seed=1):
        rows = BATCH // 2 if data == "starved" else 0 if data == "one_expert" else BATCH
        x, y = x.clone(), y.clone()
        x[rows:] = REPEATED
        y[rows:] = REPEATED
        out.append((x, y))
    return out


def logits_of(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    out = model(x)
    return out if isinstance(out, torch.Tensor) else out.logits


def _full(t: torch.Tensor) -> np.ndarray:
    whole = t.full_tensor() if hasattr(t, "full_tensor") else t
    return whole.detach().to(torch.float32).numpy().copy()


def _named(model: nn.Module) -> dict[str, torch.Tensor]:
    """Parameters under the model's own names (DDP prefixes them with ``module.``)."""
    return {n.removeprefix("module."): p for n, p in model.named_parameters()}


def _routers(model: nn.Module) -> dict[str, nn.Module]:
    return {n: m for n, m in model.named_modules() if type(m).__name__.endswith("Router")}


def reference(kind: str, data: str, chunks: int, coef: float | None) -> dict[str, Any]:
    """One process: each batch as ``chunks`` equal row blocks (each data-parallel rank's share,
    cut into its micro-batches), the mean of their losses, each block's load-balancing loss
    computed by transformers' ``load_balancing_loss_func`` for each layer and summed, AdamW.
    Token counts from the routers' own outputs."""
    model = build(kind, data)
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    calls: list[tuple[str, torch.Tensor, torch.Tensor]] = []
    for name, router in _routers(model).items():
        router.register_forward_hook(
            lambda m, a, out, name=name: calls.append((name, out[0], out[2]))
        )
    top_k = 1 if data == "one_expert" else 2
    steps = []
    for x, y in batches(data):
        counts = {name: np.zeros(EXPERTS, dtype=np.int64) for name in _routers(model)}
        total = torch.zeros(())
        losses = []
        rows = BATCH // chunks
        for k in range(chunks):
            part = slice(k * rows, (k + 1) * rows)
            calls.clear()
            loss = lm_loss(logits_of(model, x[part]), y[part])
            losses.append(loss.item())
            aux = sum(load_balancing_loss_func((logits,), EXPERTS, top_k) for _, logits, _ in calls)
            total = total + (loss + (coef or 0.0) * aux) / chunks
            for name, _, indices in calls:
                counts[name] += np.bincount(indices.flatten().numpy(), minlength=EXPERTS)
        total.backward()
        grads = {n: _full(p.grad) for n, p in model.named_parameters() if p.grad is not None}
        opt.step()
        opt.zero_grad()
        steps.append({"loss": float(np.mean(losses)), "grads": grads, "counts": counts})
    return {"steps": steps, "params": {n: _full(p) for n, p in model.named_parameters()}}


def train(case: Case) -> dict[str, Any]:
    name, kind, fields, data, coef = case
    state, model = fprep.prepare(build(kind, data), fprep.PrepConfig(**fields))
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    watch = fprep.watch_routers(state, model)
    share, shares = fprep.process_index(state), fprep.num_processes(state)
    steps = []
    for x, y in batches(data):
        rows = BATCH // shares
        xs, ys = x[share * rows : (share + 1) * rows], y[share * rows : (share + 1) * rows]
        loss = fprep.pipeline_step(state, model, xs, ys, lm_loss, aux_loss_coef=coef)
        grads = {n: _full(p.grad) for n, p in _named(model).items() if p.grad is not None}
        mine = watch.token_counts(reset=False)
        summed = watch.token_counts(reduce=True)
        assert fprep.optimizer_step(state, opt)
        opt.zero_grad()
        steps.append(
            {
                "loss": None if loss is None else loss.item(),
                "grads": grads,
                "counts": {n: c.numpy().copy() for n, c in summed.items()},
                "mine": {n: c.numpy().copy() for n, c in mine.items()},
            }
        )
    pipeline = state.pipeline
    return {
        "name": name,
        "shares": shares,
        "microbatches": 1 if pipeline is None else pipeline.microbatches,
        "steps": steps,
        "params": {n: _full(p) for n, p in _named(model).items()},
    }


def run(cases: list[Case]) -> list[dict[str, Any]]:
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    return [train(case) for case in cases]
