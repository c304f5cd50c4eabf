"""Tiny transformers models, saved and loaded, for the weights tests (module level: the rank
functions are pickled into spawned ranks)."""

from __future__ import annotations

import io
import os
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from transformers import (
    AutoModelForCausalLM,
    GPT2Config,
    GPT2LMHeadModel,
    LlamaConfig,
    LlamaForCausalLM,
)

import fprep


def llama_config() -> LlamaConfig:
    return LlamaConfig(
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=67,  # odd: uneven shards at 2 ranks
        max_position_embeddings=64,
    )


def gpt2_config() -> GPT2Config:
    return GPT2Config(n_embd=32, n_layer=2, n_head=4, vocab_size=67, n_positions=32)


def save(kind: str, directory: Path, dtype: torch.dtype = torch.bfloat16) -> Path:
    """save_pretrained of a seeded model, over several files (max_shard_size)."""
    torch.manual_seed(0)
    model = LlamaForCausalLM(llama_config()) if kind == "llama" else GPT2LMHeadModel(gpt2_config())
    model.to(dtype).save_pretrained(directory, max_shard_size="20KB")
    return directory


def on_meta(kind: str) -> nn.Module:
    with torch.device("meta"):
        if kind == "llama":
            return LlamaForCausalLM(llama_config())
        return GPT2LMHeadModel(gpt2_config())


def reference(directory: Path, dtype: torch.dtype = torch.float32) -> dict[str, torch.Tensor]:
    model = AutoModelForCausalLM.from_pretrained(directory, dtype=dtype)
    return {k: v.clone() for k, v in model.state_dict().items()}


def full_state(model: nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter and buffer in full (DTensors gathered), by name, on the CPU."""
    out = {}
    for k, v in model.state_dict().items():
        v = v.full_tensor() if hasattr(v, "full_tensor") else v
        out[k.replace("module.", "")] = v.detach().cpu().clone()
    return out


def mismatches(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> list[str]:
    bad = [k for k in want if k not in got or not torch.equal(got[k], want[k])]
    return bad + [k for k in got if k not in want]


def prepared(kind: str, directory: Path, **cfg: Any) -> tuple[Any, nn.Module]:
    return fprep.prepare(on_meta(kind), fprep.PrepConfig(weights=str(directory), **cfg))


def rank_round_trip(llama: Path, gpt2: Path, out: Path) -> dict[str, Any]:
    """Load at every strategy; train one fsdp step and export it. Returns mismatches."""
    results: dict[str, Any] = {}
    want = {"llama": reference(llama), "gpt2": reference(gpt2)}
    for strategy, extra in (
        ("fsdp", {}),
        ("hsdp", {"hsdp_shard_size": 1}),
        ("ddp", {}),
        ("none", {}),
    ):
        state, model = prepared("llama", llama, strategy=strategy, **extra)
        results[strategy] = mismatches(full_state(model), want["llama"])
    state, model = prepared("gpt2", gpt2, strategy="fsdp")
    results["gpt2"] = mismatches(full_state(model), want["gpt2"])
    head, wte = model.lm_head.weight, model.transformer.wte.weight
    results["gpt2-tied"] = head is wte
    # fine-tune one step under fsdp, export, and hand back the trained weights
    state, model = prepared("llama", llama, strategy="fsdp")
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    ids = torch.randint(0, 67, (2, 8), generator=torch.Generator().manual_seed(dist.get_rank()))
    model(input_ids=ids, labels=ids).loss.backward()
    optimizer.step()
    fprep.export_full(out / "model.safetensors", state, model)
    trained = full_state(model)
    if dist.get_rank() == 0:
        llama_config().save_pretrained(out)
    buffer = io.BytesIO()  # tensors cross processes as bytes (shared memory dies with the rank)
    torch.save({k: v for k, v in trained.items() if "inv_freq" not in k}, buffer)
    results["trained"] = buffer.getvalue()
    results["changed"] = not torch.equal(trained["lm_head.weight"], want["llama"]["lm_head.weight"])
    return results


def save_seeded(directory: Path, seed: int) -> Path:
    """A llama revision: the same headers for every seed, other values."""
    torch.manual_seed(seed)
    LlamaForCausalLM(llama_config()).to(torch.bfloat16).save_pretrained(
        directory, max_shard_size="20KB"
    )
    return directory


def _message(fn: Any) -> tuple[str, str]:
    try:
        fn()
    except fprep.CheckpointError as e:
        return e.message, e.subject
    return "loaded", ""


def rank_changed_weights(root: Path) -> dict[str, Any]:
    """Ranks given different revisions; a shard replaced between ranks; a rank failing after
    the other wrote everything; then a good load (see test_weights_changed)."""
    from fprep.apply import load_weights as module

    rank = int(os.environ["RANK"])
    out: dict[str, Any] = {}
    mine = save_seeded(root / f"rev{rank}", seed=rank)
    out["revisions"], out["revisions_subject"] = _message(
        lambda: prepared("llama", mine, strategy="fsdp")
    )
    shared, other = root / "shared", root / "other"
    if rank == 0:
        save_seeded(shared, seed=0)
        save_seeded(other, seed=3)
    dist.barrier()  # the process group the first prepare connected stays for a retry
    victim = sorted(shared.glob("model-*.safetensors"))[0]

    @fprep.step("replace")
    def replace(state: Any, model: nn.Module) -> tuple[Any, nn.Module]:
        if rank == 1:
            os.replace(other / victim.name, victim)
        return state, model

    steps = list(fprep.default_steps())
    steps.insert(steps.index(module.load_weights), replace)
    model = on_meta("llama")
    out["replaced"], _ = _message(
        lambda: fprep.prepare(
            model, fprep.PrepConfig(weights=str(shared), strategy="fsdp"), steps=steps
        )
    )
    out["replaced_meta"] = all(p.is_meta for p in model.parameters())
    dist.barrier()

    torch.manual_seed(7)
    real = LlamaForCausalLM(llama_config())
    before = {k: v.clone() for k, v in real.state_dict().items()}
    if rank == 1:
        original = module._Reader.check_unchanged

        def late(self: Any) -> None:
            original(self)
            raise fprep.CheckpointError("rank 1 failed late", subject="late")

        module._Reader.check_unchanged = late  # type: ignore[method-assign]
    try:
        out["late_failure"], _ = _message(
            lambda: fprep.prepare(real, fprep.PrepConfig(weights=str(shared), strategy="ddp"))
        )
    finally:
        if rank == 1:
            module._Reader.check_unchanged = original  # type: ignore[method-assign]
    now = real.state_dict()
    out["late_identical"] = all(torch.equal(now[k], v) for k, v in before.items())
    _, model = prepared("llama", shared, strategy="fsdp")
    out["ok"] = mismatches(full_state(model), reference(shared))
    return out


def rank_own_copy(root: Path) -> dict[str, Any]:
    """This rank loads its own copy, ``root/rank<RANK>`` (node-local copies), under fsdp: the
    error's message and subject, or the loaded weights' mismatches against ``root/original``."""
    rank = int(os.environ["RANK"])
    model = on_meta_tiny_llama()
    cfg = fprep.PrepConfig(weights=str(root / f"rank{rank}"), strategy="fsdp")
    try:
        _, model = fprep.prepare(model, cfg)
    except fprep.CheckpointError as e:
        return {"error": e.message, "subject": e.subject}
    want = reference(root / "original")
    return {"mismatches": mismatches(full_state(model), want)}


def on_meta_tiny_llama() -> nn.Module:
    from _tiny_transformers import meta_llama

    return meta_llama()
