"""Rank functions for the sequence-parallel tests (tests/test_tp_composition.py): fprep's
Llama and transformers' Llama and Qwen2 trained with ``sequence_parallel=True``, through the
same loop and single-process reference as tests/_tp_workers.py."""

from __future__ import annotations

from typing import Any

import _tp_workers as W

#: layout name -> (world size, PrepConfig fields)
LAYOUTS: dict[str, tuple[int, dict[str, Any]]] = {
    "tp2": (2, {"strategy": "auto", "tp": 2, "sequence_parallel": True}),
    "dp2_tp2": (4, {"strategy": "fsdp", "tp": 2, "sequence_parallel": True}),
}


def run(world: int, models: tuple[str, ...] = W.MODELS) -> dict[str, Any]:
    """Every model at every layout of this world size."""
    return {
        f"{m}/{name}": W.train(m, fields)
        for m in models
        for name, (size, fields) in LAYOUTS.items()
        if size == world
    }
