"""Tiny transformers models, built on the meta device from a config (no downloads)."""

from __future__ import annotations

import torch
import transformers as tf

VOCAB = 256


def tiny_llama(layers: int = 2, vocab: int = VOCAB) -> tf.LlamaForCausalLM:
    """A Llama of width 64 (4 query, 2 key-value heads), untied head, on the meta device."""
    cfg = tf.LlamaConfig(
        hidden_size=64,
        intermediate_size=176,
        num_hidden_layers=layers,
        vocab_size=vocab,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        tie_word_embeddings=False,
    )
    with torch.device("meta"):
        return tf.LlamaForCausalLM(cfg)
