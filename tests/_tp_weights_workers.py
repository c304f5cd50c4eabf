"""Rank functions for tests/test_tp_weights.py: ``PrepConfig.weights`` read into tensor-
parallel blocks (colwise rows, rowwise column runs, replicated and dp-sharded tensors), at
dp 2 x tp 2 and tp 4 in one spawned job, gathered back to full tensors; and biased models
(transformers' Qwen2, docs/parallelism.md's nn.Sequential: colwise biases cut on dim 0, rowwise
ones replicated) at tp 2, tp 4 and dp 2 x tp 2, compared block by block and trained."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch
from _pretrained_workers import as_bytes
from _tp_init_workers import build_meta
from _tp_workers import GLOBAL_BATCH, MAX_NORM, batches, logits_of, loss_of
from _tp_workers import VOCAB as TP_VOCAB

import fprep

LAYOUTS: dict[str, dict[str, Any]] = {
    "dp2_tp2": {"strategy": "fsdp", "tp": 2},
    "tp4": {"strategy": "auto", "tp": 4},
}
LR = 1e-2


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
        full = _full(model)
        assert state.state_dict is not None and state.state_dict.weights is not None
        reads = state.state_dict.weights.reads
        out[name] = {
            "full": as_bytes(full),
            "reads": {r.name: (r.nbytes, type(r).__name__) for r in reads},
        }
    return out


# -- biased models: transformers' Qwen2 (q/k/v biases) and the docs' nn.Sequential -------------
#: Qwen2's layouts, by world size: each spawned job runs those of its world. Sequence
#: parallelism replicates the norms over tp (SequenceParallel) and keeps biases as without it.
QWEN2_LAYOUTS: dict[int, dict[str, dict[str, Any]]] = {
    2: {
        "tp2": {"strategy": "auto", "tp": 2},
        "tp2_sp": {"strategy": "auto", "tp": 2, "sequence_parallel": True},
    },
    4: {
        "tp4": {"strategy": "auto", "tp": 4},
        "dp2_tp2": {"strategy": "fsdp", "tp": 2},
        "dp2_tp2_sp": {"strategy": "fsdp", "tp": 2, "sequence_parallel": True},
    },
}
#: docs/parallelism.md's plan for its nn.Sequential: a colwise Linear (bias Shard(0)), then a
#: rowwise one (bias replicated).
SEQUENTIAL_PLAN = {"0": "colwise", "2": "rowwise"}


def qwen2_config() -> Any:
    from transformers import Qwen2Config

    return Qwen2Config(
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=4,  # tp 4 divides the heads
        vocab_size=TP_VOCAB,
        tie_word_embeddings=False,
    )


def meta_qwen2() -> torch.nn.Module:
    from transformers import Qwen2ForCausalLM

    with torch.device("meta"):
        return Qwen2ForCausalLM(qwen2_config())


def save_qwen2(directory: Path) -> Path:
    """A seeded fp32 Qwen2, over several files. transformers initializes biases to zero, where
    any rows would look right: they are drawn at random first."""
    from transformers import Qwen2ForCausalLM

    torch.manual_seed(1)
    model = Qwen2ForCausalLM(qwen2_config())
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(".bias"):
                p.normal_()
    model.save_pretrained(directory, max_shard_size="20KB")
    return directory


def sequential(device: str = "cpu") -> torch.nn.Module:
    """docs/parallelism.md's model: two biased Linears."""
    with torch.device(device):
        return torch.nn.Sequential(
            torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 16)
        )


def save_sequential(path: Path) -> Path:
    """Its state, seeded, as one safetensors file (what fprep.export_full writes)."""
    from safetensors.torch import save_file

    torch.manual_seed(2)
    save_file(sequential().state_dict(), str(path))
    return path


def block_mismatches(model: torch.nn.Module, want: dict[str, torch.Tensor]) -> list[str]:
    """Parameters whose local tensor is not bitwise torch's own block of ``want`` (the full
    tensor cut by ``distribute_tensor`` to the parameter's mesh and placements)."""
    from torch.distributed.tensor import DTensor, distribute_tensor

    bad = []
    for name, p in model.named_parameters():
        full = want[name]
        if isinstance(p, DTensor):
            expected = distribute_tensor(full, p.device_mesh, p.placements).to_local()
            got = p.to_local()
        else:
            expected, got = full, p
        if got.dtype != expected.dtype or not torch.equal(got.detach(), expected):
            bad.append(name)
    return bad


def _dp_rank(state: fprep.PrepState) -> tuple[int, int]:
    """``(data-parallel ranks, this rank's index among them)``."""
    pg = state.process_group
    assert pg is not None and state.core is not None
    dp, dp_rank = 1, 0
    if state.core.is_distributed:
        for coord, size in zip(pg.coordinate, pg.mesh_shape, strict=True):
            dp, dp_rank = dp * size, dp_rank * size + coord
    return dp, dp_rank


def train_steps(
    state: fprep.PrepState, model: torch.nn.Module, optimizer: torch.optim.Optimizer
) -> dict[str, Any]:
    """``STEPS`` AdamW steps on this rank's share of ``_tp_workers.batches`` (one process: all
    of it), clipped: the losses (this rank's rows), the clipped gradient norms and the rank's
    data-parallel index."""
    dp, dp_rank = _dp_rank(state)
    per = GLOBAL_BATCH // dp
    mine = slice(dp_rank * per, (dp_rank + 1) * per)
    losses, norms = [], []
    for x, y in batches():
        loss = loss_of(logits_of(model, x[mine]), y[mine])
        fprep.backward(state, model, loss)  # FSDP2 averages gradients over dp
        norms.append(float(fprep.clip_grad_norm(state, model, MAX_NORM, optimizer=optimizer)))
        losses.append(loss.item())
        fprep.optimizer_step(state, optimizer)
        optimizer.zero_grad()
    return {"losses": losses, "norms": norms, "dp_rank": dp_rank}


def qwen2_reference(directory: str) -> dict[str, Any]:
    """The same steps in one process, from transformers' from_pretrained."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32)
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR)
    state, model, optimizer = fprep.prepare(model, fprep.PrepConfig(strategy="none"), optimizer)
    return train_steps(state, model, optimizer)


def biased_loaded(qwen2: str, seq: str) -> dict[str, Any]:
    """Per layout of this world: Qwen2 loaded with ``weights=`` (its blocks against torch's
    blocks of from_pretrained's tensors, its full tensors, then training steps), and the docs'
    nn.Sequential loaded from ``seq`` at the same tp (blocks against the file's tensors)."""
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    want = dict(AutoModelForCausalLM.from_pretrained(qwen2, dtype=torch.float32).named_parameters())
    out: dict[str, Any] = {}
    for name, fields in QWEN2_LAYOUTS[int(os.environ["WORLD_SIZE"])].items():
        model = meta_qwen2()
        optimizer = torch.optim.AdamW(model.parameters(), lr=LR)
        cfg = fprep.PrepConfig(weights=qwen2, **fields)
        state, model, optimizer = fprep.prepare(model, cfg, optimizer)
        result: dict[str, Any] = {"blocks": block_mismatches(model, want)}
        result["full"] = as_bytes(_full(model))
        result.update(train_steps(state, model, optimizer))
        if not fields.get("sequence_parallel"):  # the docs' example runs without it
            cfg = fprep.PrepConfig(weights=seq, tp_plan=SEQUENTIAL_PLAN, **fields)
            _, small = fprep.prepare(sequential("meta"), cfg)
            result["sequential"] = block_mismatches(small, load_file(seq))
            result["sequential_full"] = as_bytes(_full(small))
        out[name] = result
    return out


def _full(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {
        k: (v.full_tensor() if hasattr(v, "full_tensor") else v).detach().clone()
        for k, v in model.state_dict().items()
    }
