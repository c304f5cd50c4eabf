"""Rank functions for tests/test_tp_init.py: meta-device models materialized under tensor
parallelism, gathered back to full tensors, for comparison with one process.

One spawned job runs every (model, layout) pair (spawning ranks costs seconds on two cores).
Models: fprep's Llama (``reset_parameters``), transformers' Llama (``_init_weights``) and an MLP
whose ``param_init_fn`` is not row-local (``orthogonal_``: computed in full, then cut into the
rank's block, shared out over the shard group).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

import fprep
from fprep.testing.models import LlamaConfig, llama

SEED = 7
VOCAB = 64

#: Layouts run by ``four_ranks`` (world 4).
LAYOUTS: dict[str, dict[str, Any]] = {
    "dp2_tp2": {"strategy": "fsdp", "tp": 2},
    "tp4": {"strategy": "auto", "tp": 4},
}
MODELS = ("fprep_llama", "hf_llama", "mlp_orthogonal")
MLP_PLAN = {"0": "colwise", "2": "rowwise"}


def _orthogonal(module: nn.Module) -> None:
    if isinstance(module, nn.Linear):
        nn.init.orthogonal_(module.weight)
        if module.bias is not None:
            nn.init.uniform_(module.bias, -0.1, 0.1)


def build_meta(name: str) -> nn.Module:
    """The model on the meta device."""
    if name == "fprep_llama":  # four heads and kv heads: tp 4 divides them
        cfg = LlamaConfig(dim=32, n_heads=4, n_kv_heads=4, ffn_dim=40, vocab_size=VOCAB)
        return llama(cfg, "meta")
    if name == "mlp_orthogonal":
        with torch.device("meta"):
            return nn.Sequential(nn.Linear(12, 24), nn.ReLU(), nn.Linear(24, 10))
    from transformers import LlamaConfig as HFLlamaConfig
    from transformers import LlamaForCausalLM

    shape = HFLlamaConfig(
        hidden_size=32,
        intermediate_size=40,
        num_hidden_layers=1,
        num_attention_heads=4,
        num_key_value_heads=4,
        vocab_size=VOCAB,
        tie_word_embeddings=False,
    )
    with torch.device("meta"):
        return LlamaForCausalLM(shape)


def config(name: str, **fields: Any) -> fprep.PrepConfig:
    extra: dict[str, Any] = {}
    if name == "mlp_orthogonal":
        extra["param_init_fn"] = _orthogonal
        if fields.get("tp", 1) > 1:
            extra["tp_plan"] = MLP_PLAN
    return fprep.PrepConfig(seed=SEED, **fields, **extra)


def full_weights(model: nn.Module) -> dict[str, Any]:
    """Every parameter and buffer in full (DTensors gathered), as numpy arrays (a tensor sent
    back from a rank would live in shared memory that dies with it)."""
    out: dict[str, Any] = {}
    for n, t in (*model.named_parameters(), *model.named_buffers()):
        full = t.full_tensor() if hasattr(t, "full_tensor") else t
        out[n] = full.detach().numpy().copy()
    return out


def one_process(name: str) -> dict[str, Any]:
    _, model = fprep.prepare(build_meta(name), config(name))
    return full_weights(model)


def four_ranks(models: tuple[str, ...] = MODELS) -> dict[str, dict[str, Any]]:
    out = {}
    for m in models:
        for lay, fields in LAYOUTS.items():
            _, model = fprep.prepare(build_meta(m), config(m, **fields))
            out[f"{m}/{lay}"] = full_weights(model)
    return out
