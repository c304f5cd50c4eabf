"""Every transformers model family with a tensor-parallel plan, built at its default size on
the meta device and planned by fprep: what each outcome was (issue 25's scan, kept as a test).

A family is a ``CONFIG_MAPPING`` entry whose config (or its text config) carries a
``base_model_tp_plan``; its model is the causal-LM class where transformers has one, else the
base model. Outcomes: ``plan`` (fprep planned it), ``refused`` (a ``PrepError``, kept with its
message), ``build`` (transformers itself cannot build the family from its default config on
meta; not fprep's to plan), ``raw`` (anything else fprep raised: a defect).
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from typing import Any, Literal

import torch

import fprep
from fprep.errors import PrepError

Outcome = Literal["plan", "refused", "build", "raw"]


@dataclass(frozen=True)
class Scanned:
    family: str
    outcome: Outcome
    detail: str = ""


def families() -> list[tuple[str, Any]]:
    """``(family, config)`` for each family whose default config carries a tp plan."""
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    out = []
    for name in sorted(CONFIG_MAPPING.keys()):
        try:
            config = CONFIG_MAPPING[name]()
        except Exception:  # a config that needs arguments: no default to build
            continue
        try:
            text = config.get_text_config()
        except Exception:
            text = config
        if getattr(config, "base_model_tp_plan", None) or getattr(text, "base_model_tp_plan", None):
            out.append((name, config))
    return out


def build(name: str, config: Any) -> torch.nn.Module:
    from transformers import AutoModel, AutoModelForCausalLM
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    auto = AutoModelForCausalLM if name in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES else AutoModel
    with torch.device("meta"), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model: torch.nn.Module = auto.from_config(config)
    return model


def scan_one(name: str, config: Any, *, world: int = 4, tp: int = 2) -> Scanned:
    try:
        model = build(name, config)
    except Exception as e:
        return Scanned(name, "build", f"{type(e).__name__}: {e}")
    try:
        result = fprep.plan(
            model, fprep.PrepConfig(strategy="fsdp", tp=tp), fprep.Topology(world_size=world)
        )
    except Exception as e:  # fprep.plan never raises: anything here is a defect
        return Scanned(name, "raw", f"{type(e).__name__}: {e}")
    error = result.failure() if _failed(result) else None
    if error is None:
        return Scanned(name, "plan")
    if isinstance(error, PrepError):
        return Scanned(name, "refused", f"{type(error).__name__}: {error.message}")
    return Scanned(name, "raw", f"{type(error).__name__}: {error}")


def _failed(result: Any) -> bool:
    from returns.result import Failure

    return isinstance(result, Failure)


def scan() -> list[Scanned]:
    from transformers.utils import logging

    logging.set_verbosity_error()
    return [scan_one(name, config) for name, config in families()]
