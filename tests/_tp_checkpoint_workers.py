"""Rank functions for tests/test_tp_checkpoint.py: fprep.save / load / export_full of tensor-
parallel (TP + FSDP2) DTensors, resharded across layouts.

One spawned job of 4 gloo ranks does every case (spawning ranks costs seconds on two cores):
train and save at dp 2 x tp 2 (sync, and ``wait=False`` with the weights changed right after the
call), export the full model, load into dp 4 (no tp), tp 4 and dp 2 x tp 2, and load a
checkpoint saved by one process. Full states come back as ``torch.save`` bytes (rank 0).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from _checkpoint_workers import dump, full_state, rank
from _tp_init_workers import build_meta
from _weights_workers import full_state as full_weights
from torch import nn

import fprep
from fprep.testing.models import LlamaConfig, llama

SEED = 3
VOCAB = 64
CONFIG = LlamaConfig(dim=32, n_heads=4, n_kv_heads=4, ffn_dim=40, vocab_size=VOCAB)
LAYOUTS: dict[str, dict[str, Any]] = {
    "dp2_tp2": {"strategy": "fsdp", "tp": 2},
    "dp4": {"strategy": "fsdp"},
    "tp4": {"strategy": "auto", "tp": 4},
    "one": {},
}


def prepared(layout: str, seed: int = SEED) -> tuple[Any, nn.Module, torch.optim.Optimizer]:
    model = llama(CONFIG, "cpu", seed=seed)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    state, model, opt = fprep.prepare(model, fprep.PrepConfig(**LAYOUTS[layout]), opt)
    return state, model, opt


def train_step(state: Any, model: nn.Module, opt: torch.optim.Optimizer, k: int) -> None:
    """One step on a batch every rank feeds alike (what each rank sees does not matter here)."""
    g = torch.Generator().manual_seed(100 + k)
    tokens = torch.randint(0, VOCAB, (2, 9), generator=g)
    logits = model(tokens[:, :-1])
    loss = F.cross_entropy(logits.reshape(-1, VOCAB), tokens[:, 1:].reshape(-1))
    fprep.backward(state, model, loss)
    fprep.optimizer_step(state, opt)
    opt.zero_grad()


def loaded(path: Path, layout: str) -> dict[str, Any]:
    """A fresh model (other seed) and optimizer at ``layout``, loaded from ``path``: its full
    state (every rank gathers; rank 0 keeps it)."""
    state, model, opt = prepared(layout, seed=SEED + 1)
    fprep.load(path, state, model, optimizers=opt)
    return full_state(model, opt)


def hf_save_pretrained(directory: Path) -> dict[str, torch.Tensor]:
    """transformers' Llama from meta at dp 2 x tp 2, stepped once, written by
    ``fprep.save_pretrained``; its full weights."""
    model = build_meta("hf_llama")
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    cfg = fprep.PrepConfig(strategy="fsdp", tp=2, seed=0)
    state, model, opt = fprep.prepare(model, cfg, opt)
    ids = torch.randint(0, VOCAB, (2, 8), generator=torch.Generator().manual_seed(1))
    fprep.backward(state, model, model(input_ids=ids, labels=ids).loss)
    fprep.optimizer_step(state, opt)
    fprep.save_pretrained(directory, state, model)
    return {k: v for k, v in full_weights(model).items() if "inv_freq" not in k}


def save_at_one(root: str) -> dict[str, Any]:
    """One process (the test's): train one step, save; its full state."""
    state, model, opt = prepared("one")
    train_step(state, model, opt, 0)
    fprep.save(Path(root) / "one", state, model, optimizers=opt, step=1)
    return full_state(model, opt)


def four_ranks(root: str) -> dict[str, Any]:
    torch.set_num_threads(1)
    base = Path(root)
    state, model, opt = prepared("dp2_tp2")
    train_step(state, model, opt, 0)
    fprep.save(base / "sync", state, model, optimizers=opt, step=1)
    fprep.export_full(base / "full.safetensors", state, model)
    at_save = full_state(model, opt)
    handle = fprep.save(base / "async", state, model, optimizers=opt, step=1, wait=False)
    train_step(state, model, opt, 1)  # changes every weight while the save is in flight
    handle.wait()
    after = full_state(model, opt)
    out: dict[str, Any] = {"at_save": at_save, "after": after}
    out["async/dp2_tp2"] = loaded(base / "async", "dp2_tp2")
    for layout in ("dp4", "tp4"):
        out[f"sync/{layout}"] = loaded(base / "sync", layout)
    out["one/dp2_tp2"] = loaded(base / "one", "dp2_tp2")
    # tp alone plans the strategy "none", yet each rank holds shards: saves are collective too
    state, model, opt = prepared("tp4")
    fprep.load(base / "sync", state, model, optimizers=opt)
    train_step(state, model, opt, 2)
    fprep.save(base / "by_tp4", state, model, optimizers=opt, step=2)
    fprep.export_full(base / "by_tp4.safetensors", state, model)
    out["tp4_trained"] = full_state(model, opt)
    out["by_tp4/dp2_tp2"] = loaded(base / "by_tp4", "dp2_tp2")
    out["hf_trained"] = hf_save_pretrained(base / "hf")
    return {k: dump(v) for k, v in out.items()} if rank() == 0 else {}
