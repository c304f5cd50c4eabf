"""Tiny transformers models, built on the meta device from a config (no downloads)."""

from __future__ import annotations

from typing import Any

import torch
import transformers as tf

VOCAB = 256

#: A Llama of width 64 (4 query, 2 key-value heads), untied head.
TINY_LLAMA: dict[str, Any] = dict(
    hidden_size=64,
    intermediate_size=176,
    num_hidden_layers=2,
    vocab_size=VOCAB,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=512,
    tie_word_embeddings=False,
)


def meta_llama(**config: Any) -> tf.LlamaForCausalLM:
    """A Llama on the meta device: ``TINY_LLAMA`` with ``config`` over it."""
    with torch.device("meta"):
        return tf.LlamaForCausalLM(tf.LlamaConfig(**{**TINY_LLAMA, **config}))


def tiny_llama(layers: int = 2, vocab: int = VOCAB) -> tf.LlamaForCausalLM:
    """``TINY_LLAMA`` with ``layers`` decoder layers and a ``vocab`` vocabulary."""
    return meta_llama(num_hidden_layers=layers, vocab_size=vocab)
