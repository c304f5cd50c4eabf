"""Rank functions for tests/test_pipeline_checkpoint.py: checkpoints across pipeline layouts,
one spawned job per world size running several cases, each rank returning full tensors (numpy)
that the parent compares bitwise with each other and with one process.

``layouts`` (4 ranks): AdamW after one step saved at pp 2 x dp 2 (sharded, and full), then the
values loaded at dp 4, at pp 2 x tp 2 and at pp 2 x dp 2, one more step after each; the
reverse (saved at dp 4, loaded at pp 2 x dp 2); the refusals. ``exports`` (2 ranks):
``export_full`` and ``save_pretrained`` of transformers' Llama at pp 2, and AdamW saved with
two stages per rank. Every value is taken whole (``full_tensor``: every rank of a stage holds
the same parameters, in the same order).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import _pipeline_workers as W
import numpy as np
import torch
from torch import nn

import fprep
from fprep.testing.models import lm_loss

LR = 1e-2
FRESH_LR = 0.5
PP_DP: dict[str, Any] = {"pp": 2, "wrap": ("LlamaBlock",)}  # at 4 ranks: pp 2 x dp 2 (FSDP)
DP: dict[str, Any] = {"strategy": "fsdp", "wrap": ("LlamaBlock",)}
PP_TP: dict[str, Any] = {"pp": 2, "tp": 2}

Values = dict[str, np.ndarray]


def prepared(fields: dict[str, Any], kind: str = "llama") -> tuple[Any, nn.Module, Any]:
    state, model = fprep.prepare(W.build(kind), fprep.PrepConfig(**fields))
    return state, model, torch.optim.AdamW(model.parameters(), lr=LR)


def train_step(state: Any, model: nn.Module, opt: torch.optim.Optimizer, index: int) -> None:
    """One AdamW step on batch ``index`` (this rank's data-parallel share of it)."""
    x, y = W.batches()[index]
    share, shares = fprep.process_index(state), fprep.num_processes(state)
    rows = W.BATCH // shares
    xs, ys = x[share * rows : (share + 1) * rows], y[share * rows : (share + 1) * rows]
    if state.pipeline is not None:
        fprep.pipeline_step(state, model, xs, ys, lm_loss)
    else:
        lm_loss(model(xs), ys).backward()
    opt.step()
    opt.zero_grad()


def values(model: nn.Module, opt: torch.optim.Optimizer) -> Values:
    """Every parameter this rank holds and its optimizer state, whole: ``name`` and
    ``name/exp_avg`` (``step``, ``exp_avg_sq``)."""
    out: Values = {}
    for name, p in model.named_parameters():
        out[name] = W._full(p)
        for key, value in sorted(opt.state.get(p, {}).items()):
            out[f"{name}/{key}"] = W._full(value)
    return out


def loaded(path: str, fields: dict[str, Any]) -> tuple[Values, Values]:
    """Load ``path`` into a fresh model and optimizer of layout ``fields``: the values loaded,
    and those after one more step (batch 1)."""
    state, model, opt = prepared(fields)
    fprep.load(path, state, model, optimizers=opt)
    got = values(model, opt)
    train_step(state, model, opt, 1)
    return got, values(model, opt)


def refused(fn: Any) -> str:
    """The CheckpointError ``fn()`` raises, as ``subject: message``."""
    try:
        fn()
    except fprep.CheckpointError as e:
        return f"{e.subject}: {e}"
    return "nothing raised"


def attempt(fn: Any, *args: Any) -> Any:
    """``fn(*args)``, or the error every rank raised (fprep's errors are raised on every rank, so
    the job goes on to its next case and the parent reports each case on its own)."""
    try:
        return fn(*args)
    except fprep.PrepError as e:
        return f"{type(e).__name__}: {e}"


def saved_at_pp(root: str, kind: str) -> dict[str, Values]:
    """One AdamW step at pp 2 x dp 2, saved (``kind`` state dicts); for the sharded one also
    exported, and the run continued one step."""
    extra = {"state_dict_type": "full"} if kind == "full" else {}
    state, model, opt = prepared({**PP_DP, **extra})
    train_step(state, model, opt, 0)
    fprep.save(f"{root}/pp_{kind}", state, model, optimizers=opt, step=1)
    out = {"saved": values(model, opt)}
    if kind == "sharded":
        fprep.export_full(f"{root}/pp_dp.safetensors", state, model)
        train_step(state, model, opt, 1)
        out["continued"] = values(model, opt)
    return out


def saved_at_dp(root: str) -> Values:
    state, model, opt = prepared(DP)
    train_step(state, model, opt, 0)
    fprep.save(f"{root}/dp", state, model, optimizers=opt, step=1)
    return values(model, opt)


def fresh(root: str) -> tuple[float, int]:
    """An optimizer saved before its first step at pp 2 x dp 2, loaded at dp 4: its learning
    rate and how many state entries the loaded one holds."""
    state, model = fprep.prepare(W.build("llama"), fprep.PrepConfig(**PP_DP))
    opt = torch.optim.AdamW(model.parameters(), lr=FRESH_LR)
    fprep.save(f"{root}/fresh", state, model, optimizers=opt)
    state, model, opt = prepared(DP)
    fprep.load(f"{root}/fresh", state, model, optimizers=opt)
    return opt.param_groups[0]["lr"], len(opt.state)


def layouts(root: str) -> dict[str, Any]:
    """The 4-rank job (see the module docs); directories under ``root``."""
    out: dict[str, Any] = {}
    for kind in ("sharded", "full"):
        out[f"pp_{kind}"] = attempt(saved_at_pp, root, kind)
    for name, fields in (("dp", DP), ("pp_tp", PP_TP), ("pp_dp", PP_DP)):
        out[f"load_{name}"] = attempt(loaded, f"{root}/pp_sharded", fields)
    out["load_full_dp"] = attempt(loaded, f"{root}/pp_full", DP)
    out["saved_dp"] = attempt(saved_at_dp, root)  # the reverse: saved without pp
    out["reverse"] = attempt(loaded, f"{root}/dp", PP_DP)
    out["fresh"] = attempt(fresh, root)

    state, model, opt = prepared({"pp": 2}, kind="hf_llama")  # another model's checkpoint
    out["other_model"] = refused(lambda: fprep.load(f"{root}/pp_sharded", state, model))
    state, model, _ = prepared(PP_DP)
    assert state.pipeline is not None
    lr = LR * (1 + state.pipeline.rank)  # the stages disagree on a hyperparameter
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    out["stages_disagree"] = refused(
        lambda: fprep.save(f"{root}/disagree", state, model, optimizers=opt)
    )
    out["disagree_left"] = sorted(os.listdir(root))
    return out


def interleaved(root: str) -> Values:
    """Two stages per rank (Interleaved1F1B at pp 2): one AdamW step, saved."""
    state, model, opt = prepared({"pp": 2, "pp_schedule": "Interleaved1F1B"})
    assert state.pipeline is not None and len(state.pipeline.stages) == 2
    train_step(state, model, opt, 0)
    fprep.save(f"{root}/interleaved", state, model, optimizers=opt, step=1)
    return values(model, opt)


def exports(root: str) -> dict[str, Any]:
    """The 2-rank job: transformers' Llama at pp 2, written whole (see the module docs), and a
    checkpoint of two stages per rank."""
    state, model = fprep.prepare(W.build("hf_llama"), fprep.PrepConfig(pp=2))
    fprep.export_full(f"{root}/pp.safetensors", state, model)
    fprep.save_pretrained(f"{root}/pp_pretrained", state, model)
    held = sorted(n for n, _ in model.named_parameters())
    return {"held": held, "interleaved": attempt(interleaved, root)}


def run(job: str, root: str) -> Any:
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    return layouts(root) if job == "layouts" else exports(root)


def one_process(kind: str, directory: Path) -> None:
    """What one process writes: ``export_full`` and ``save_pretrained`` of the same model."""
    state, model = fprep.prepare(W.build(kind), fprep.PrepConfig())
    fprep.export_full(directory / "one.safetensors", state, model)
    fprep.save_pretrained(directory / "one_pretrained", state, model)
