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


#: A Qwen3-MoE of width 32: 4 experts of width 16, two per token, a dense-free decoder.
TINY_QWEN3_MOE: dict[str, Any] = dict(
    hidden_size=32,
    intermediate_size=64,
    moe_intermediate_size=16,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=8,
    num_experts=4,
    num_experts_per_tok=2,
    vocab_size=VOCAB,
    max_position_embeddings=128,
    tie_word_embeddings=False,
)

#: A Mixtral of width 32: 4 experts of width 16, two per token.
TINY_MIXTRAL: dict[str, Any] = dict(
    hidden_size=32,
    intermediate_size=16,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=8,
    num_local_experts=4,
    num_experts_per_tok=2,
    vocab_size=VOCAB,
    max_position_embeddings=128,
    tie_word_embeddings=False,
)


def meta_qwen3_moe(**config: Any) -> tf.Qwen3MoeForCausalLM:
    """A Qwen3-MoE on the meta device: ``TINY_QWEN3_MOE`` with ``config`` over it."""
    with torch.device("meta"):
        return tf.Qwen3MoeForCausalLM(tf.Qwen3MoeConfig(**{**TINY_QWEN3_MOE, **config}))


def meta_mixtral(**config: Any) -> tf.MixtralForCausalLM:
    """A Mixtral on the meta device: ``TINY_MIXTRAL`` with ``config`` over it."""
    with torch.device("meta"):
        return tf.MixtralForCausalLM(tf.MixtralConfig(**{**TINY_MIXTRAL, **config}))


def qwen3_moe(seed: int = 0, **config: Any) -> tf.Qwen3MoeForCausalLM:
    """``TINY_QWEN3_MOE`` with real weights on the CPU, drawn from ``seed``."""
    torch.manual_seed(seed)
    return tf.Qwen3MoeForCausalLM(tf.Qwen3MoeConfig(**{**TINY_QWEN3_MOE, **config}))


def mixtral(seed: int = 0, **config: Any) -> tf.MixtralForCausalLM:
    """``TINY_MIXTRAL`` with real weights on the CPU, drawn from ``seed``."""
    torch.manual_seed(seed)
    return tf.MixtralForCausalLM(tf.MixtralConfig(**{**TINY_MIXTRAL, **config}))
