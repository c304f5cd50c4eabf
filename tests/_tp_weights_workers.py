"""Rank functions for tests/test_tp_weights.py: ``PrepConfig.weights`` read into tensor-
parallel blocks (colwise rows, rowwise column runs, replicated and dp-sharded tensors), at
dp 2 x tp 2 and tp 4 in one spawned job, gathered back to full tensors."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from _pretrained_workers import as_bytes
from _tp_init_workers import build_meta

import fprep

LAYOUTS: dict[str, dict[str, Any]] = {
    "dp2_tp2": {"strategy": "fsdp", "tp": 2},
    "tp4": {"strategy": "auto", "tp": 4},
}


def save(directory: Path, dtype: torch.dtype) -> Path:
    """transformers' Llama (tp-divisible shapes), seeded, over several files."""
    from transformers import LlamaForCausalLM

    torch.manual_seed(0)
    model = LlamaForCausalLM(build_meta("hf_llama").config)
    model.to(dtype).save_pretrained(directory, max_shard_size="20KB")
    return directory


def loaded(directory: str) -> dict[str, Any]:
    """Every layout's full weights after loading ``directory`` (fp32 parameters), and the
    largest number of bytes a rank planned to read for one tensor."""
    out: dict[str, Any] = {}
    for name, fields in LAYOUTS.items():
        cfg = fprep.PrepConfig(weights=directory, **fields)
        state, model = fprep.prepare(build_meta("hf_llama"), cfg)
        full = {}
        for k, v in model.state_dict().items():
            full[k] = (v.full_tensor() if hasattr(v, "full_tensor") else v).detach().clone()
        assert state.state_dict is not None and state.state_dict.weights is not None
        reads = state.state_dict.weights.reads
        out[name] = {
            "full": as_bytes(full),
            "reads": {r.name: (r.nbytes, type(r).__name__) for r in reads},
        }
    return out
