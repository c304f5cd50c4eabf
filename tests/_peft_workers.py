"""Rank functions for tests/test_peft.py: a peft LoRA model of a tiny transformers Llama, built
on the meta device, its base read with ``weights=``, trained, saved and resumed, its adapters
exported; the same function runs in one process (the reference) and on every rank."""

from __future__ import annotations

import io
from pathlib import Path
from typing import Any

import torch
from _tiny_transformers import TINY_LLAMA

import fprep

#: every attention and MLP projection: colwise and rowwise layers under tensor parallelism
TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
GLOBAL_BATCH = 4
SEQ = 12


def save_base(directory: Path) -> Path:
    """The pretrained checkpoint: a seeded tiny Llama, as transformers saves it."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    LlamaForCausalLM(LlamaConfig(**TINY_LLAMA)).save_pretrained(directory)
    return directory


def lora_config(**overrides: Any) -> Any:
    from peft import LoraConfig

    fields: dict[str, Any] = dict(r=4, lora_alpha=8, target_modules=list(TARGETS))
    return LoraConfig(**{**fields, **overrides})


def build_meta(base: str, **lora: Any) -> torch.nn.Module:
    """The way the docs build it: the base on meta from its config, then get_peft_model."""
    from peft import get_peft_model
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(base)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    return get_peft_model(model, lora_config(**lora))


def batches(steps: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return [
        torch.randint(0, TINY_LLAMA["vocab_size"], (GLOBAL_BATCH, SEQ), generator=g)
        for _ in range(steps)
    ]


def full(value: torch.Tensor) -> torch.Tensor:
    return (value.full_tensor() if hasattr(value, "full_tensor") else value).detach().clone()


def as_bytes(tensors: dict[str, torch.Tensor]) -> bytes:
    buffer = io.BytesIO()
    torch.save(tensors, buffer)
    return buffer.getvalue()


def _my_rows(state: fprep.PrepState, ids: torch.Tensor) -> torch.Tensor:
    """This rank's part of the global batch: data-parallel ranks split it, the ranks of a tp
    group feed the same rows."""
    pg = state.process_group
    assert pg is not None
    tp = state.extension.tensor_parallel if state.extension is not None else None
    dp_size = pg.world_size // (tp.size if tp is not None else 1)
    dp_rank = pg.rank // (tp.size if tp is not None else 1)
    return ids.chunk(dp_size)[dp_rank]


def train(base: str, work: str, fields: dict[str, Any], steps: int) -> dict[str, Any]:
    """Prepare, record the LoRA init, train ``steps`` steps recording the global loss and the
    adapters' full gradients, save (fprep.save and save_pretrained), resume in a fresh model
    and compare one more step of both."""
    import torch.distributed as dist

    model = build_meta(base)
    cfg = fprep.PrepConfig(weights=base, seed=0, **fields)
    optimizer = torch.optim.AdamW((p for p in model.parameters() if p.requires_grad), lr=1e-2)
    state, model, optimizer = fprep.prepare(model, cfg, optimizer)
    names = [n for n, p in model.named_parameters() if p.requires_grad]
    init = {n: full(p) for n, p in model.named_parameters() if p.requires_grad}
    base_weights = {n: full(p) for n, p in model.named_parameters() if not p.requires_grad}
    losses: list[float] = []
    grads: list[dict[str, torch.Tensor]] = []
    data = batches(steps + 1)
    for ids in data[:steps]:
        mine = _my_rows(state, ids)
        loss = model(input_ids=mine, labels=mine).loss
        fprep.backward(state, model, loss)
        grads.append({n: full(p.grad) for n, p in model.named_parameters() if p.grad is not None})
        fprep.optimizer_step(state, optimizer)
        optimizer.zero_grad()
        losses.append(float(fprep.reduce(state, loss.detach(), "mean")))
    ckpt = Path(work) / "ckpt"
    fprep.save(ckpt, state, model, optimizers=optimizer, step=steps)
    adapters = fprep.save_pretrained(Path(work) / "adapters", state, model)
    trained = {n: full(p) for n, p in model.named_parameters()}

    resumed = build_meta(base)
    resumed_opt = torch.optim.AdamW((p for p in resumed.parameters() if p.requires_grad), lr=1e-2)
    cfg = fprep.PrepConfig(seed=0, **fields)  # no weights=: the checkpoint holds every weight
    state2, resumed, resumed_opt = fprep.prepare(resumed, cfg, resumed_opt)
    fprep.load(ckpt, state2, resumed, optimizers=resumed_opt)
    loaded = {n: full(p) for n, p in resumed.named_parameters()}
    after = []
    for s, m, o in ((state, model, optimizer), (state2, resumed, resumed_opt)):
        mine = _my_rows(s, data[steps])
        loss = m(input_ids=mine, labels=mine).loss
        fprep.backward(s, m, loss)
        fprep.optimizer_step(s, o)
        o.zero_grad()
        after.append({n: full(p) for n, p in m.named_parameters() if p.requires_grad})
    if dist.is_initialized():
        dist.barrier()
    return {
        "trainable": names,
        "init": as_bytes(init),
        "base": as_bytes(base_weights),
        "losses": losses,
        "grads": [as_bytes(g) for g in grads],
        "trained": as_bytes(trained),
        "loaded": as_bytes(loaded),
        "after": [as_bytes(a) for a in after],
        "adapters": str(adapters),
    }
