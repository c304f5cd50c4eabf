"""A tiny transformers BERT and the rank function for tests/test_misuse_prepare.py (module level,
so that ``run_ranks`` can pickle it into spawned ranks)."""

from __future__ import annotations

import warnings
from typing import Any

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

import fprep

SEED = 0


def bert() -> nn.Module:
    """BertForSequenceClassification: its head computes the loss without upcasting."""
    from transformers import BertConfig, BertForSequenceClassification

    torch.manual_seed(SEED)
    config = BertConfig(
        vocab_size=100,
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        intermediate_size=64,
        max_position_embeddings=32,
        num_labels=3,
        hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0,
    )
    return BertForSequenceClassification(config)


def bert_batch() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(SEED + 1)
    return torch.randint(0, 100, (4, 16), generator=g), torch.tensor([0, 1, 2, 1])


class _LossOps(TorchDispatchMode):
    """Records the output dtype of the ops a cross-entropy loss runs."""

    def __init__(self) -> None:
        super().__init__()
        self.dtypes: dict[str, torch.dtype] = {}

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        name = func.overloadpacket.__name__
        if name == "_log_softmax" and isinstance(out, torch.Tensor):
            self.dtypes[name] = out.dtype
        return out


def bert_loss_dtypes(model: nn.Module, ids: torch.Tensor, labels: torch.Tensor) -> Any:
    """(dtype each loss op computed in, the model's output)."""
    mode = _LossOps()
    with mode:
        out = model(input_ids=ids, labels=labels)
    return mode.dtypes, out


def bert_on_ranks() -> dict[str, tuple[float, str, str]]:
    """Every rank computes the same batch under ddp and fsdp with bf16: (loss, dtypes)."""
    warnings.simplefilter("ignore")
    ids, labels = bert_batch()
    out: dict[str, tuple[float, str, str]] = {}
    for strategy in ("ddp", "fsdp"):
        _, model = fprep.prepare(bert(), fprep.PrepConfig(strategy=strategy, precision="bf16"))
        result = model(input_ids=ids, labels=labels)
        result.loss.backward()
        out[strategy] = (result.loss.item(), str(result.loss.dtype), str(result.logits.dtype))
    return out
