"""Transformers layers' KV caches in training: dropped where they only cost.

A transformers model called with ``use_cache=True`` (its config's default, also in training)
makes an empty cache and hands it to every decoder layer, which writes its keys and values
into it. Two of fprep's regions cannot live with that:

* a checkpointed region (``fprep.apply.recompute``): the recompute would write the cache a
  second time, and dynamo cannot trace the write inside the checkpoint. Such a layer
  (``_can_checkpoint_with_cache`` false) gets no cache under gradients, as under transformers'
  own gradient checkpointing (``without_cache``);
* a region compiled on its own (``compile="regional"``): dynamo guards on the cache entry of the
  layer's own index (``past_key_values.layers[i].is_initialized``), so every layer compiles a
  graph of its own, and after ``torch._dynamo.config.recompile_limit`` (8) layers the rest run
  eagerly, uncompiled — silently (seen on an H100, torch 2.11, a 16-layer transformers Llama:
  "hit config.recompile_limit (8)", reason ``past_key_values.layers[7].is_initialized``).
  ``CachelessCall`` runs the compiled call without the cache
  when the layer trains under gradients and the cache is still empty (a cache that the model
  made for this forward: nobody reads it in training). A cache that holds something (prefix
  tuning's learned prefixes, a prompt being continued) is passed on, as is any cache in
  evaluation or under ``torch.no_grad`` (generation).

A model trained this way returns an empty cache in its output in training.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

#: The keywords through which transformers' layers receive their KV cache (names differ across
#: models and versions); ``use_cache`` asks for one.
CACHE_KEYWORDS = ("cache", "layer_past", "past_key_value", "past_key_values")


def without_cache(kwargs: dict[str, Any]) -> dict[str, Any]:
    """The keyword arguments of a transformers layer without its KV cache."""
    out = dict(kwargs)
    for name in CACHE_KEYWORDS:
        if out.get(name) is not None:
            out[name] = None
    if out.get("use_cache"):
        out["use_cache"] = False
    return out


def _empty(cache: object) -> bool:
    """A transformers ``Cache`` with nothing in it (another object: not known to be empty)."""
    length = getattr(cache, "get_seq_length", None)
    if not callable(length):
        return False
    try:
        return int(length()) == 0
    except Exception:  # a cache type whose length needs arguments: keep it
        return False


def takes_cache(module: nn.Module) -> bool:
    """Whether ``module``'s forward names a KV cache keyword."""
    try:
        names = inspect.signature(type(module).forward).parameters
    except (TypeError, ValueError):
        return False
    return any(name in names for name in CACHE_KEYWORDS)


class CachelessCall:
    """``module``'s compiled call, given no KV cache while it trains under gradients and the
    cache it gets is empty (module docstring). Runs outside the compiled frame, so dynamo never
    sees the cache nor guards on it."""

    def __init__(self, module: nn.Module, compiled: Callable[..., Any]) -> None:
        self.module = module
        self.compiled = compiled

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if torch.is_grad_enabled() and self.module.training:
            caches = [kwargs[k] for k in CACHE_KEYWORDS if kwargs.get(k) is not None]
            if caches and all(_empty(c) for c in caches):
                kwargs = without_cache(kwargs)
        return self.compiled(*args, **kwargs)

    def __repr__(self) -> str:
        return f"CachelessCall({self.compiled!r})"


def compile_without_cache(module: nn.Module) -> None:
    """Put ``CachelessCall`` in front of the compiled call ``module.compile()`` installed."""
    compiled = module.__dict__.get("_compiled_call_impl")
    if compiled is not None and takes_cache(module):
        module._compiled_call_impl = CachelessCall(module, compiled)
