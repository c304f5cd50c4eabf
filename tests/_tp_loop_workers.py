"""Rank functions for tests/test_tp_loop.py: the loop helpers under tensor parallelism
(transformers' Qwen2 at tp 2 on 2 ranks, dp 2 x tp 2 on 4), one spawned job per world size.

``clip`` returns the norm ``fprep.clip_grad_norm`` found, the collectives it issued, the number
of distinct gradient meshes (counted here, by equality) and the clipped gradients made whole;
``inputs`` what the tp input check said to equal, different and permuted inputs;
``labels`` what a transformers forward given ``labels=`` did outside and inside
``fprep.loss_parallel``. Every case returns plain data; failures are returned as messages.
"""

from __future__ import annotations

import logging
from typing import Any

import _tp_workers as W
import torch
import torch.distributed as dist
from torch import nn

import fprep

MODEL = "hf_qwen2"
LAYOUT = {"strategy": "fsdp"}  # FSDP2 over the dp ranks (none at tp 2 alone: dp 1)
REDISTRIBUTE_LOGGER = "torch.distributed.tensor._redistribute"


def prepared(**fields: Any) -> tuple[fprep.PrepState, nn.Module]:
    cfg = fprep.PrepConfig(**{**LAYOUT, "tp": 2, **fields})
    return fprep.prepare(W.build(MODEL), cfg)


class Captured(logging.Handler):
    """The messages of one logger while installed."""

    def __init__(self) -> None:
        super().__init__()
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


def _distinct(meshes: list[Any]) -> list[Any]:
    out: list[Any] = []
    for mesh in meshes:
        if not any(mesh == known for known in out):
            out.append(mesh)
    return out


def clip() -> dict[str, Any]:
    from torch.distributed.tensor.debug import CommDebugMode

    state, model = prepared()
    x, y = W.batches()[0]  # the whole batch on every rank: gradients are the whole batch's
    fprep.backward(state, model, W.loss_of(W.logits_of(model, x), y))
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    meshes = [g.device_mesh for g in grads if hasattr(g, "device_mesh")]
    logger = logging.getLogger(REDISTRIBUTE_LOGGER)
    captured = Captured()
    logger.addHandler(captured)
    try:
        with CommDebugMode() as comm:
            norm = fprep.clip_grad_norm(state, model, W.MAX_NORM)
        clip_warnings = list(captured.messages)
        # the control: DTensor's own reduction of the (dp, tp) gradients' norm warns
        two_d = [
            g
            for g in grads
            if getattr(g, "device_mesh", None) is not None and g.device_mesh.ndim == 2
        ]
        if two_d:
            nn.utils.get_total_norm(two_d).full_tensor()  # type: ignore[attr-defined]
        control_warnings = captured.messages[len(clip_warnings) :]
    finally:
        logger.removeHandler(captured)
    whole = {  # numpy: a tensor would cross to the parent as shared memory the rank frees
        name: (p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad).numpy()
        for name, p in model.named_parameters()
        if p.grad is not None
    }
    return {
        "norm": float(norm),
        "collectives": comm.get_total_counts(),
        "mesh_objects": len({id(m) for m in meshes}),
        "meshes": len(_distinct(meshes)),
        "dtensor_grads": len(meshes),
        "grads": whole,
        "clip_warnings": clip_warnings,
        "control_warnings": control_warnings,
        "two_d": bool(two_d),
    }


def _refusal(fn: Any) -> str | None:
    try:
        fn()
    except fprep.PrepError as e:
        return str(e)
    return None


def inputs() -> dict[str, Any]:
    rank = dist.get_rank()
    tp_rank, dp_rank = rank % 2, rank // 2  # tp innermost
    x, _ = W.batches()[0]
    g = torch.Generator().manual_seed(100 + rank)
    other = torch.randint(0, W.VOCAB, x.shape, generator=g)  # a per-rank seed
    permuted = x[[1, 0, 2, 3]] if tp_rank == 1 else x  # the same rows, another order
    per_dp = x + dp_rank  # dp ranks may differ; the ranks of a tp group do not
    out: dict[str, Any] = {}

    def first_forward(batch: torch.Tensor) -> Any:
        _, model = prepared()
        return lambda: W.logits_of(model, batch)

    out["hook_equal"] = _refusal(first_forward(per_dp))
    out["hook_different"] = _refusal(first_forward(other))
    out["hook_permuted"] = _refusal(first_forward(permuted))
    state, model = prepared()
    out["helper_equal"] = _refusal(lambda: fprep.check_tp_inputs(state, per_dp, mask=per_dp > 3))
    out["helper_different"] = _refusal(lambda: fprep.check_tp_inputs(state, other))
    out["helper_permuted"] = _refusal(lambda: fprep.check_tp_inputs(state, input_ids=permuted))
    out["helper_mask_differs"] = _refusal(lambda: fprep.check_tp_inputs(state, x, mask=x > tp_rank))
    # the first forward checks, then the hook goes: later forwards cost nothing
    W.logits_of(model, per_dp)
    out["later_forward"] = _refusal(lambda: W.logits_of(model, other))
    return out


def labels() -> dict[str, Any]:
    own = fprep.ModuleTree.of(W.build(MODEL)).tp_plan
    assert own is not None
    plan = {**dict(own), "lm_head": "colwise_loss_parallel"}
    x, y = W.batches()[0]
    _, model = prepared(tp_plan=plan)
    outside = _refusal(lambda: model(input_ids=x, labels=y))
    state, model = prepared(tp_plan=plan)
    with fprep.loss_parallel(state):
        loss = model(input_ids=x, labels=y).loss
        fprep.backward(state, model, loss)
    value = loss.detach()
    return {
        "outside": outside,
        "inside": float(value.full_tensor() if hasattr(value, "full_tensor") else value),
    }


def reference_labels() -> float:
    x, y = W.batches()[0]
    return float(W.build(MODEL)(input_ids=x, labels=y).loss.detach())


def run(cases: tuple[str, ...]) -> dict[str, Any]:
    fns = {"clip": clip, "inputs": inputs, "labels": labels}
    return {case: fns[case]() for case in cases}


def reference_clip() -> dict[str, Any]:
    """One process: torch's clip_grad_norm_ of the same model and batch."""
    model = W.build(MODEL)
    x, y = W.batches()[0]
    W.loss_of(W.logits_of(model, x), y).backward()
    norm = nn.utils.clip_grad_norm_(model.parameters(), W.MAX_NORM)
    grads = {name: p.grad for name, p in model.named_parameters() if p.grad is not None}
    return {"norm": float(norm), "grads": grads}
