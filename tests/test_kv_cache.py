"""KV caches of transformers layers in compiled regions (``fprep.apply.kv_cache``).

With ``compile="regional"`` each decoder layer is compiled on its own. A transformers model
hands every layer the cache it made for the forward (``use_cache`` is the config's, true by
default, also in training); dynamo guards on the entry of the layer's own index, so each layer
compiled a graph of its own and, past dynamo's recompile limit (8), the remaining layers ran
uncompiled (seen on an H100 with a 16-layer Llama). The layers now train without that
write-only cache: one graph for all, the losses those of eager. A cache that holds something,
evaluation and ``torch.no_grad`` keep theirs.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import transformers as tf
from _tiny_transformers import VOCAB, tiny_llama
from transformers.models.llama.modeling_llama import LlamaDecoderLayer

import fprep
from fprep.apply.kv_cache import CachelessCall, takes_cache

LAYERS = 3  # more than one: one graph per layer was the defect


def _llama() -> tf.LlamaForCausalLM:
    return tiny_llama(LAYERS)


def _prepared(compile: str) -> tuple[Any, Any]:
    cfg = fprep.PrepConfig(seed=0, device="cpu", wrap=LlamaDecoderLayer, compile=compile)
    return fprep.prepare(_llama(), cfg)


def _train(compile: str, steps: int = 3) -> list[float]:
    state, model = _prepared(compile)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    x = torch.randint(0, VOCAB, (2, 16), generator=torch.Generator().manual_seed(1))
    out = []
    for _ in range(steps):
        loss = model(input_ids=x, labels=x).loss  # use_cache: the config's (True)
        fprep.backward(state, model, loss)
        fprep.optimizer_step(state, opt)
        opt.zero_grad(set_to_none=True)
        out.append(loss.item())
    return out


def test_regionally_compiled_layers_share_one_graph_and_train_like_eager(dynamo: Any) -> None:
    eager = _train("none")
    assert not dynamo["frames"]
    compiled = _train("regional")
    torch.testing.assert_close(compiled, eager, rtol=1e-5, atol=0)
    assert dynamo["stats"]["unique_graphs"] == 1, dict(dynamo["stats"])
    assert not any(dynamo["graph_break"].values()), dict(dynamo["graph_break"])


def test_every_region_of_a_transformers_model_gets_the_cacheless_call() -> None:
    _, model = _prepared("regional")
    layers = list(model.model.layers)
    assert len(layers) == LAYERS
    assert all(isinstance(layer._compiled_call_impl, CachelessCall) for layer in layers)
    assert takes_cache(layers[0])


class _Recorder(torch.nn.Module):
    """A layer that records the cache it was given (a transformers-like signature)."""

    def __init__(self) -> None:
        super().__init__()
        self.seen: list[tuple[object, object]] = []

    def forward(
        self, x: torch.Tensor, past_key_values: object = None, use_cache: bool = False
    ) -> torch.Tensor:
        self.seen.append((past_key_values, use_cache))
        return x


def _call(module: _Recorder, cache: object) -> tuple[object, object]:
    CachelessCall(module, module._call_impl)(torch.ones(1), past_key_values=cache, use_cache=True)
    return module.seen[-1]


def test_only_an_empty_cache_in_training_under_gradients_is_dropped() -> None:
    from transformers import DynamicCache

    layer = _Recorder()
    empty = DynamicCache()
    assert _call(layer, empty) == (None, False)  # training, gradients, empty: dropped

    prefix = DynamicCache()  # prefix tuning: learned keys / values the layer must read
    prefix.update(torch.zeros(1, 2, 3, 4), torch.zeros(1, 2, 3, 4), layer_idx=0)
    assert _call(layer, prefix) == (prefix, True)

    with torch.no_grad():  # generation
        assert _call(layer, empty) == (empty, True)
    layer.eval()  # evaluation with gradients (scoring): kept
    assert _call(layer, empty) == (empty, True)
    layer.train()
    assert _call(layer, object()) == (layer.seen[-1][0], True)  # unknown type: kept


def test_generation_after_regional_compile_still_fills_the_cache() -> None:
    _, model = _prepared("regional")
    x = torch.randint(0, VOCAB, (1, 5))
    training = model(input_ids=x, use_cache=True)
    assert training.past_key_values is not None
    assert training.past_key_values.get_seq_length() == 0  # dropped: nobody reads it in training
    with torch.no_grad():
        generating = model(input_ids=x, use_cache=True)
    assert generating.past_key_values.get_seq_length() == 5
    torch.testing.assert_close(training.logits.detach(), generating.logits, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("compile", ["none", "whole"])
def test_other_compile_modes_leave_layers_alone(compile: str) -> None:
    _, model = _prepared(compile)
    assert not isinstance(model.__dict__.get("_compiled_call_impl"), CachelessCall)
    assert all(layer.__dict__.get("_compiled_call_impl") is None for layer in model.model.layers)
