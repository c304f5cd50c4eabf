"""precision: autocast for replicated / single-device models, grad scaling for fp16.

Autocast is installed as a forward pre-hook / forward hook pair (``always_call=True``, so an
exception inside forward still leaves the autocast region). The hooks are instances of
module-level classes, so ``torch.save(model)`` and ``copy.deepcopy(model)`` keep working —
unlike patching ``model.forward`` with a closure. Outputs are cast back to float32.

Sharded strategies get their dtypes from FSDP2's ``MixedPrecisionPolicy`` (see shard.py).
"""

from __future__ import annotations

import contextlib
from collections.abc import MutableMapping
from typing import Any

import torch
from torch import nn

from fprep.apply.steps import handles_of, step, with_handles
from fprep.errors import PrepareError
from fprep.state import PrepState, need

_LOW = (torch.float16, torch.bfloat16)


def outputs_to_fp32(value: Any) -> Any:
    """Cast every fp16 / bf16 tensor in a (nested) output to float32, keeping containers."""
    if isinstance(value, torch.Tensor):
        return value.float() if value.dtype in _LOW else value
    if isinstance(value, MutableMapping):
        for key in list(value.keys()):
            value[key] = outputs_to_fp32(value[key])
        return value
    if isinstance(value, tuple):
        items = [outputs_to_fp32(v) for v in value]
        return type(value)(*items) if hasattr(value, "_fields") else tuple(items)
    if isinstance(value, list):
        return [outputs_to_fp32(v) for v in value]
    return value


class AutocastEnter:
    """Forward pre-hook: enter an autocast region (a stack, so re-entrant forwards work)."""

    def __init__(self, device_type: str, dtype: str) -> None:
        self.device_type = device_type
        self.dtype = dtype
        self._active: list[contextlib.AbstractContextManager[Any]] = []

    def __call__(self, module: nn.Module, args: Any) -> None:
        ctx: Any = torch.autocast(self.device_type, dtype=getattr(torch, self.dtype))
        ctx.__enter__()
        self._active.append(ctx)

    def __getstate__(self) -> dict[str, Any]:
        return {"device_type": self.device_type, "dtype": self.dtype, "_active": []}


class AutocastExit:
    """Forward hook: leave the autocast region and return float32 outputs."""

    def __init__(self, enter: AutocastEnter) -> None:
        self.enter = enter

    def __call__(self, module: nn.Module, args: Any, output: Any) -> Any:
        if self.enter._active:
            self.enter._active.pop().__exit__(None, None, None)
        return outputs_to_fp32(output)


def install_autocast(model: nn.Module, device_type: str, dtype: str) -> None:
    enter = AutocastEnter(device_type, dtype)
    model.register_forward_pre_hook(enter)
    model.register_forward_hook(AutocastExit(enter), always_call=True)


def has_autocast(model: nn.Module) -> bool:
    return any(isinstance(h, AutocastEnter) for h in model._forward_pre_hooks.values())


@step("precision")
def precision(state: PrepState, model: nn.Module) -> tuple[PrepState, nn.Module]:
    core = need(state.core, "init_core", "precision")
    policy = core.precision
    device = handles_of(state).device
    if policy.fp8:
        from fprep.devices import convert_fp8

        model = convert_fp8(model, device)
    if policy.autocast_dtype is not None and not has_autocast(model):
        install_autocast(model, device.type, policy.autocast_dtype)
    if policy.grad_scaling:
        try:
            scaler = torch.amp.GradScaler(device.type)
        except Exception as e:  # pragma: no cover - depends on the device build
            raise PrepareError(
                f"fp16 needs a gradient scaler, which is unavailable on {device}: {e}",
                subject="precision",
                hint="Use precision='bf16' on this device.",
            ) from e
        state = with_handles(state, grad_scaler=scaler)
    return state, model
