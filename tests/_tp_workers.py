"""Rank functions for tests/test_tensor_parallel.py, and their single-process references.

One rank function prepares several layouts in one process group (spawning ranks costs seconds
on two cores): fprep's Llama and transformers' Llama and Qwen2 at dp 2 x tp 2 (FSDP2 over the
dp sub-mesh), tp 4, and hsdp (replicate 2 x shard 1) x tp 2. Each returns per-step losses,
gradient norms (clipped), and the plan-versus-DTensor mismatches, as plain data.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

import fprep
from fprep.apply.placements import to_torch
from fprep.testing.models import LlamaConfig, llama

SEED = 5
STEPS = 3
GLOBAL_BATCH = 4
SEQ = 8
VOCAB = 128
MAX_NORM = 0.5  # below the gradient norm: clipping acts at every step

#: Layouts (name, world, PrepConfig fields) run by ``four_ranks``.
LAYOUTS: dict[str, dict[str, Any]] = {
    "dp2_tp2": {"strategy": "fsdp", "tp": 2},
    "tp4": {"strategy": "auto", "tp": 4},
    "hsdp2x1_tp2": {"strategy": "hsdp", "tp": 2, "hsdp_shard_size": 1},
}
MODELS = ("fprep_llama", "hf_llama", "hf_qwen2", "hf_qwen2_tied")


def build(name: str, seed: int = SEED) -> nn.Module:
    torch.manual_seed(seed)
    if name == "fprep_llama":  # four kv heads: tp 4 divides them
        cfg = LlamaConfig(dim=64, n_heads=4, n_kv_heads=4, ffn_dim=96, vocab_size=VOCAB)
        return llama(cfg, "cpu", seed=seed)
    from transformers import (
        LlamaConfig as HFLlamaConfig,
    )
    from transformers import (
        LlamaForCausalLM,
        Qwen2Config,
        Qwen2ForCausalLM,
    )

    shape = dict(
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=4,
        vocab_size=VOCAB,
        tie_word_embeddings=False,
    )
    if name == "hf_llama":
        return LlamaForCausalLM(HFLlamaConfig(**shape))
    if name == "hf_qwen2_tied":  # Qwen2.5 0.5B-3B tie their embeddings
        return Qwen2ForCausalLM(Qwen2Config(**{**shape, "tie_word_embeddings": True}))
    return Qwen2ForCausalLM(Qwen2Config(**shape))


def logits_of(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    out = model(x)
    return out if isinstance(out, torch.Tensor) else out.logits


def batches(lengths: tuple[int, ...] = (SEQ,) * STEPS) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """One (inputs, targets) batch per step, of ``lengths[step]`` tokens."""
    g = torch.Generator().manual_seed(11)
    out = []
    for seq in lengths:
        tokens = torch.randint(0, VOCAB, (GLOBAL_BATCH, seq + 1), generator=g)
        out.append((tokens[:, :-1], tokens[:, 1:]))
    return out


def loss_of(logits: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), y.reshape(-1))


def reference(name: str, lengths: tuple[int, ...] = (SEQ,) * STEPS) -> dict[str, list[float]]:
    """One process, full batch, two half-batch micro-steps (accumulation), clipping."""
    model = build(name)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    losses, norms = [], []
    for x, y in batches(lengths):
        total = 0.0
        for half in (slice(0, GLOBAL_BATCH // 2), slice(GLOBAL_BATCH // 2, GLOBAL_BATCH)):
            loss = loss_of(logits_of(model, x[half]), y[half]) / 2
            loss.backward()
            total += loss.item()
        norms.append(float(nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM)))
        losses.append(total)
        opt.step()
        opt.zero_grad()
    return {"losses": losses, "norms": norms}


def _mismatches(state: fprep.PrepState, model: nn.Module) -> list[str]:
    """Planned (local shape, mesh dims, placements) versus the real parameters."""
    assert state.param_handles is not None
    params = dict(model.named_parameters())
    out: list[str] = []
    for spec in state.param_handles.specs:
        p = params[spec.fqn]
        if hasattr(p, "to_local"):
            real = (
                tuple(p.to_local().shape),
                tuple(p.device_mesh.mesh_dim_names or ()),
                tuple(repr(pl) for pl in p.placements),
            )
        else:
            real = (tuple(p.shape), (), ())
        # the plan's typed placements as torch builds them from the plan
        typed = tuple(repr(to_torch(pl)) for pl in spec.placements)
        planned = (spec.local_shape, spec.mesh_dims, typed)
        if real != planned:
            out.append(f"{spec.fqn}: planned {planned}, real {real}")
    return out


def train(
    name: str, fields: dict[str, Any], lengths: tuple[int, ...] = (SEQ,) * STEPS
) -> dict[str, Any]:
    """This rank's losses (its dp slice of each batch of ``lengths[step]`` tokens), clipped
    norms, and plan mismatches."""
    model = build(name)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    state, model, opt = fprep.prepare(model, fprep.PrepConfig(**fields), opt)
    pg = state.process_group
    assert pg is not None and state.core is not None
    dp = pg.replicate_size * pg.shard_size if state.core.is_distributed else 1
    dp_rank = 0
    if state.core.is_distributed:
        for coord, size in zip(pg.coordinate, pg.mesh_shape, strict=True):
            dp_rank = dp_rank * size + coord
    per = GLOBAL_BATCH // dp
    mine = slice(dp_rank * per, (dp_rank + 1) * per)
    losses, norms = [], []
    for x, y in batches(lengths):
        xs, ys = x[mine], y[mine]
        total = 0.0
        micro = per // 2 if per >= 2 else per
        chunks = [slice(i, i + micro) for i in range(0, per, micro)]
        for i, c in enumerate(chunks):
            with fprep.accumulate(state, model, sync=i == len(chunks) - 1):
                # a micro-batch's share of the global mean over GLOBAL_BATCH rows
                loss = loss_of(logits_of(model, xs[c]), ys[c]) * (c.stop - c.start) / per
                fprep.backward(state, model, loss)  # FSDP2 averages gradients over dp
            total += loss.item()
        norms.append(float(fprep.clip_grad_norm(state, model, MAX_NORM, optimizer=opt)))
        losses.append(total)
        fprep.optimizer_step(state, opt)
        opt.zero_grad()
    return {
        "losses": losses,
        "norms": norms,
        "dp_rank": dp_rank,
        "mismatches": _mismatches(state, model),
        "notes": list(state.tensor_parallel.notes) if state.tensor_parallel else [],
    }


def four_ranks(
    models: tuple[str, ...] = MODELS, layouts: tuple[str, ...] = tuple(LAYOUTS)
) -> dict[str, Any]:
    return {f"{m}/{lay}": train(m, LAYOUTS[lay]) for m in models for lay in layouts}


def reference_block(
    shape: tuple[int, int], tp: int, tp_dim: int | None, t: int, dp: int, d: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """The global rows and columns of tp rank ``t``'s, dp rank ``d``'s block of a 2-D tensor,
    by torch.chunk arithmetic (the test oracle): the tp chunk along ``tp_dim``, then FSDP2's
    even chunk of its rows."""
    rows, cols = torch.arange(shape[0]), torch.arange(shape[1])
    if tp_dim == 0:
        rows = rows.chunk(tp)[t]
    elif tp_dim == 1:
        cols = cols.chunk(tp)[t]
    c = -(-len(rows) // dp)
    return rows[c * d : c * (d + 1)], cols
