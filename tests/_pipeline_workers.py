"""Rank functions for tests/test_pipeline.py: training under pipeline parallelism, one spawned
job per world size running several cases, each compared by the parent with one process.

A case is ``(name, model kind, PrepConfig fields, source)``: the source of the initial weights
is ``None`` (built with the same seed in every process), ``"meta"`` (built on the meta device and
initialized by fprep with ``seed=0``, as one process initializes it) or a ``weights=``
directory. Each rank trains
``STEPS`` SGD steps with ``fprep.pipeline_step`` and ``fprep.clip_grad_norm`` on the batches of
``batches()`` (its data-parallel share of each), and returns per step the loss (where it is
known), the norm, and the full gradient of every parameter it holds, then its parameters after
the last step. Gradients under FSDP / tp are DTensors: ``full_tensor`` gathers them over the
rank's stage (every rank of a stage holds the same parameters, in the same order).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import numpy as np
import torch
import transformers as tf
from torch import nn

import fprep
from fprep.testing.models import LlamaConfig, llama, lm_loss, synthetic_batches

STEPS = 2
BATCH = 8
SEQ = 8
VOCAB = 64
LR = 0.1
MAX_NORM = 1.0

Case = tuple[str, str, dict[str, Any], str | None]


def build(kind: str, device: str = "cpu") -> nn.Module:
    """The model of ``kind``, with the same weights in every process (seeded)."""
    torch.manual_seed(0)
    with torch.device(device):
        if kind == "llama":
            return llama(
                LlamaConfig(
                    dim=32, n_layers=4, n_heads=4, n_kv_heads=2, ffn_dim=64, vocab_size=VOCAB
                ),
                device=device,
                seed=None if device == "meta" else 0,
            )
        common: dict[str, Any] = dict(
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=4,
            vocab_size=VOCAB,
            num_attention_heads=4,
            num_key_value_heads=2,
            tie_word_embeddings=False,
        )
        if kind == "hf_llama":
            return tf.LlamaForCausalLM(tf.LlamaConfig(**common))
        if kind == "hf_qwen2":
            return tf.Qwen2ForCausalLM(tf.Qwen2Config(**common))
    raise ValueError(kind)


def logits_of(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    out = model(x)
    return out if isinstance(out, torch.Tensor) else out.logits


def batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    return list(synthetic_batches(STEPS, batch_size=BATCH, seq_len=SEQ, vocab_size=VOCAB, seed=1))


def save(kind: str, directory: Path) -> str:
    """The seeded model's weights as transformers saves them (several files)."""
    build(kind).save_pretrained(directory, max_shard_size="20KB")  # type: ignore[operator]
    return str(directory)


def _full(t: torch.Tensor) -> np.ndarray:
    whole = t.full_tensor() if hasattr(t, "full_tensor") else t
    return whole.detach().to(torch.float32).numpy().copy()


def reference(kind: str, source: str | None = None) -> dict[str, Any]:
    """One process: the whole batch, the mean loss, torch's clipping, SGD. ``source="meta"``:
    from fprep's initialization of the meta model in one process."""
    if source == "meta":
        model = fprep.prepare(build(kind, "meta"), fprep.PrepConfig(seed=0))[1]
    else:
        model = build(kind)
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    steps = []
    for x, y in batches():
        loss = lm_loss(logits_of(model, x), y)
        loss.backward()
        grads = {n: _full(p.grad) for n, p in model.named_parameters() if p.grad is not None}
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM)
        opt.step()
        opt.zero_grad()
        steps.append({"loss": loss.item(), "norm": norm.item(), "grads": grads})
    return {"steps": steps, "params": {n: _full(p) for n, p in model.named_parameters()}}


def train(case: Case) -> dict[str, Any]:
    name, kind, fields, source = case
    model = build(kind, "meta" if source else "cpu")
    extra: dict[str, Any] = {}
    if source == "meta":
        extra = {"seed": 0}
    elif source is not None:
        extra = {"weights": source}
    cfg = fprep.PrepConfig(**fields, **extra)
    if name.endswith("optimizer_first"):  # built over the whole model, before prepare
        opt = torch.optim.SGD(model.parameters(), lr=LR)
        state, prepared, opt = fprep.prepare(model, cfg, opt)
        # this rank's parameters only: the other stages' were dropped
        assert len(opt.param_groups[0]["params"]) == len(list(prepared.parameters()))
    else:
        state, prepared = fprep.prepare(model, cfg)
        opt = torch.optim.SGD(prepared.parameters(), lr=LR)
    scheduler = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 1.0)  # the lr stays LR
    share, shares = fprep.process_index(state), fprep.num_processes(state)
    steps = []
    for x, y in batches():
        rows = BATCH // shares
        xs, ys = x[share * rows : (share + 1) * rows], y[share * rows : (share + 1) * rows]
        if name.endswith("accumulate"):  # two half batches, gradients accumulated
            half = len(xs) // 2
            losses = []
            for k, sync in ((0, False), (1, True)):
                part = slice(k * half, (k + 1) * half)
                with fprep.accumulate(state, prepared, sync=sync):
                    step_loss = fprep.pipeline_step(state, prepared, xs[part], ys[part], _halved)
                losses.append(step_loss)
            loss = None if losses[0] is None else sum(losses)  # type: ignore[arg-type]
        else:
            loss = fprep.pipeline_step(state, prepared, xs, ys, lm_loss)
        grads = {n: _full(p.grad) for n, p in prepared.named_parameters() if p.grad is not None}
        norm = fprep.clip_grad_norm(state, prepared, MAX_NORM)
        assert fprep.optimizer_step(state, opt, scheduler)  # fprep's step, scheduler and all
        opt.zero_grad()
        steps.append(
            {"loss": None if loss is None else loss.item(), "norm": norm.item(), "grads": grads}
        )
    assert scheduler.last_epoch == STEPS  # stepped once per real optimizer step
    plan = state.pipeline
    assert plan is not None
    return {
        "name": name,
        "stages": plan.stages,
        "shares": shares,
        "steps": steps,
        "params": {n: _full(p) for n, p in prepared.named_parameters()},
        "calling": _call_refused(prepared),
    }


def _halved(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """The loss of one of two accumulated half batches."""
    return lm_loss(logits, targets) / 2


def _call_refused(model: nn.Module) -> str:
    try:
        model(torch.zeros(1, 1, dtype=torch.long))
    except fprep.PrepError as e:
        return type(e).__name__ + ": " + e.hint
    return "ran"


def misuse() -> dict[str, Any]:
    """What ``pipeline_step`` says on every rank to batches it cannot run (nothing has run)."""
    state, prepared = fprep.prepare(build("llama"), fprep.PrepConfig(pp=2, pp_microbatches=4))
    x, y = batches()[0]
    said: dict[str, Any] = {}
    for name, args in {
        "rows": (x[:6], y[:6]),  # 6 rows into 4 micro-batches
        "targets": (x, y[:4]),
        "zero_d": (x[0, 0], y),
    }.items():
        try:
            fprep.pipeline_step(state, prepared, *args, lm_loss)
            said[name] = "ran"
        except fprep.PrepError as e:
            said[name] = (type(e).__name__, e.subject)
    fprep.pipeline_step(state, prepared, x, y, lm_loss)  # the first step fixes the shapes
    try:
        fprep.pipeline_step(state, prepared, x[:, :4], y[:, :4], lm_loss)
        said["shape"] = "ran"
    except fprep.PrepError as e:
        said["shape"] = (type(e).__name__, e.subject)
    return {"name": "misuse", "said": said}


def run(cases: list[Case]) -> list[dict[str, Any]]:
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    return [misuse() if case[0] == "misuse" else train(case) for case in cases]
