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


#: sequence lengths per step that tp 2 does not divide, changing between steps, one shorter
#: than tp (tp rank 1 then holds no token of the stream): DTensor's uneven Shard(1)
UNEVEN = (7, 1, 5)


def run(world: int, models: tuple[str, ...] = W.MODELS) -> dict[str, Any]:
    """Every model at every layout of this world size, at the tests' length and at ``UNEVEN``
    lengths (key suffix ``/uneven``)."""
    out: dict[str, Any] = {}
    for m in models:
        for name, (size, fields) in LAYOUTS.items():
            if size == world:
                out[f"{m}/{name}"] = W.train(m, fields)
                out[f"{m}/{name}/uneven"] = W.train(m, fields, UNEVEN)
    return out
