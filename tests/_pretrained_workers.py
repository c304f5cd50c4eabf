"""Rank functions for tests/test_save_pretrained.py (spawned ranks import them from here)."""

from __future__ import annotations

import io
import os
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from _weights_workers import full_state, llama_config
from transformers import AutoModelForCausalLM

import fprep


def meta_llama() -> torch.nn.Module:
    """A tiny Llama as a fine-tuning script builds it: from its config, on meta, fp32."""
    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(llama_config(), dtype=torch.float32)


def trained(strategy: str) -> tuple[fprep.PrepState, torch.nn.Module]:
    """Prepared from a seed and stepped once (different data per rank), so that the weights
    differ from any fresh initialization."""
    model = meta_llama()
    cfg = fprep.PrepConfig(strategy=strategy, seed=0)
    state, model, optimizer = fprep.prepare(model, cfg, torch.optim.SGD(model.parameters(), lr=0.1))
    rank = dist.get_rank() if dist.is_initialized() else 0
    ids = torch.randint(0, 67, (2, 8), generator=torch.Generator().manual_seed(rank))
    fprep.backward(state, model, model(input_ids=ids, labels=ids).loss)
    assert fprep.optimizer_step(state, optimizer)
    return state, model


def as_bytes(tensors: dict[str, torch.Tensor]) -> bytes:
    buffer = io.BytesIO()  # tensors cross processes as bytes (shared memory dies with the rank)
    torch.save({k: v for k, v in tensors.items() if "inv_freq" not in k}, buffer)
    return buffer.getvalue()


def rank_save_pretrained(out: Path) -> dict[str, Any]:
    """fsdp then ddp, each saved to ``out/<strategy>``; and transformers' own save_pretrained
    of the fsdp model, to ``out/plain``."""
    results: dict[str, Any] = {}
    for strategy in ("fsdp", "ddp"):
        state, model = trained(strategy)
        returned = fprep.save_pretrained(out / strategy, state, model)
        results[strategy] = {"returned": str(returned), "trained": as_bytes(full_state(model))}
        if strategy == "fsdp":
            try:
                model.save_pretrained(out / "plain")
                results["plain"] = "returned"
            except Exception as e:
                results["plain"] = f"{type(e).__name__}: {e}"
            dist.barrier()
            results["plain_files"] = sorted(os.listdir(out / "plain"))
    return results
