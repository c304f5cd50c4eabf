"""LoRA factors built on the meta device, initialized as peft initializes them.

peft's ``reset_lora_parameters`` draws A like ``nn.Linear`` (Kaiming-uniform with
``a=sqrt(5)``; with ``init_lora_weights="gaussian"``, normal with std ``1/r``) and sets B (and
its bias) to zeros, so that the wrapped model starts out computing exactly what the base model
computes. A base model's own convention (transformers' ``_init_weights``: normal with std 0.02
for every ``nn.Linear``) would make B non-zero and the fresh adapter would change the model.
Each factor is initialized by itself (one module, like ``reset_parameters``), so fprep's
reproducible init seeds it from its FQN: the same values at any world size.

Other initializations (``orthogonal``, and those computed from the base weights or from data:
EVA, LoRA-GA, ...; PiSSA and OLoRA already fail inside ``get_peft_model`` on the meta device)
and adapters that are not LoRA factors of Linear layers (DoRA's magnitudes, LoRA on embeddings)
are refused before any effect.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

from torch import nn

from fprep.adapters import AdapterLayout
from fprep.errors import ModelError
from fprep.state import PrepState, need

Init = Callable[[nn.Module], None]

#: ``LoraConfig.init_lora_weights`` values fprep can compute without the base weights.
SUPPORTED = (True, False, "gaussian")


def lora_inits(state: PrepState, model: nn.Module) -> dict[str, Init]:
    """Visit FQN -> the init peft runs on it, for every LoRA factor the plan visits. Raises
    ``ModelError`` for an initialization fprep cannot reproduce (call it before any effect)."""
    plan = need(state.param_handles, "init_param_handles", "lora_inits").materialize
    if not plan.lora:
        return {}
    layout = AdapterLayout.of(state.tree)
    assert layout is not None  # the plan found LoRA factors in this tree
    configs = _peft_configs(model)
    out: dict[str, Init] = {}
    for visit in plan.lora:
        found = layout.lora_factor(visit)
        assert found is not None
        layer_fqn, factor, adapter = found
        option = _option(configs, adapter, layer_fqn)
        if factor == "lora_B":
            out[visit] = _zeros
        elif option == "gaussian":
            ranks: dict[str, int] = getattr(model.get_submodule(layer_fqn), "r")  # noqa: B009
            out[visit] = _gaussian(1 / ranks[adapter])
        else:
            out[visit] = _like_linear
        if option is False:  # peft leaves both factors as nn.Linear built them
            out[visit] = _reset
    return out


def _option(configs: dict[str, Any], adapter: str, layer: str) -> object:
    config = configs.get(adapter)
    option = getattr(config, "init_lora_weights", True)
    use_dora = bool(getattr(config, "use_dora", False))
    if option not in SUPPORTED or use_dora:
        what = "use_dora=True" if use_dora else f"init_lora_weights={option!r}"
        raise ModelError(
            f"LoRA layer {layer!r} (adapter {adapter!r}) is on the meta device with {what}: "
            "fprep initializes LoRA on the meta device as peft's init_lora_weights=True, "
            "'gaussian' or False do; the others are computed from the base weights or from "
            "data (or, for DoRA, hold magnitudes of the base weights).",
            subject=layer,
            hint="Use init_lora_weights=True (peft's default) or 'gaussian' on the meta device; "
            "for the others, load the base model first (from_pretrained), call get_peft_model "
            "and prepare it without weights=.",
        )
    return option


def _peft_configs(model: nn.Module) -> dict[str, Any]:
    """``peft_config`` of the peft model (a ``PeftModel`` or a tuner such as ``LoraModel``)."""
    for module in model.modules():
        configs = getattr(module, "peft_config", None)
        if isinstance(configs, dict):
            return configs
    return {}


def _like_linear(module: nn.Module) -> None:
    nn.init.kaiming_uniform_(module.weight, a=math.sqrt(5))  # type: ignore[arg-type]


def _gaussian(std: float) -> Init:
    def init(module: nn.Module) -> None:
        nn.init.normal_(module.weight, std=std)  # type: ignore[arg-type]

    return init


def _zeros(module: nn.Module) -> None:
    for p in module.parameters(recurse=False):
        nn.init.zeros_(p)


def _reset(module: nn.Module) -> None:
    module.reset_parameters()  # type: ignore[operator]
