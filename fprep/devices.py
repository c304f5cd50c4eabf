"""Device-specific effects, imported lazily: nothing here runs unless the plan asks for it.

Intel Gaudi: ``habana_frameworks`` ships with the Gaudi software stack (not on PyPI). Importing
``habana_frameworks.torch.core`` registers the ``hpu`` device; importing
``habana_frameworks.torch.distributed.hccl`` registers the ``hccl`` backend. Both must happen
before the process group exists.
"""

from __future__ import annotations

import importlib
from typing import Any

import torch
from torch import nn

from fprep.errors import PrepareError


def _import(name: str, why: str) -> Any:
    try:
        return importlib.import_module(name)
    except ImportError as e:
        raise PrepareError(
            f"{why} needs {name}, which is not importable: {e}",
            subject=name,
            hint="On Gaudi, install Intel's Gaudi software stack (or use its container); it "
            "provides habana_frameworks for its own torch build.",
        ) from None


def hpu_setup(*, distributed: bool) -> None:
    """Register the hpu device and, for distributed runs, the hccl backend."""
    _import("habana_frameworks.torch.core", "the hpu device")
    if distributed:
        _import("habana_frameworks.torch.distributed.hccl", "the hccl backend")


def convert_fp8(model: nn.Module, device: torch.device) -> nn.Module:
    """Swap Linear layers for fp8 ones: torchao on CUDA, Habana's transformer engine on Gaudi."""
    if device.type == "cuda":
        float8 = _import("torchao.float8", "precision='fp8' on CUDA")
        converted = float8.convert_to_float8_training(model)
        return converted if isinstance(converted, nn.Module) else model
    if device.type == "hpu":
        te = _import(
            "habana_frameworks.torch.hpex.experimental.transformer_engine",
            "precision='fp8' on Gaudi",
        )
        for name, child in list(model.named_children()):
            if type(child) is nn.Linear:
                fp8 = te.Linear(child.in_features, child.out_features, bias=child.bias is not None)
                fp8.load_state_dict(child.state_dict())
                setattr(model, name, fp8)
            else:
                convert_fp8(child, device)
        return model
    raise PrepareError(
        f"precision='fp8' is not available on {device}.",
        subject="precision",
        hint="Use precision='bf16' here.",
    )
