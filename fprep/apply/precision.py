"""precision: autocast for every strategy, grad scaling for fp16.

Autocast wraps the model's forward (``AutocastForward``, an instance attribute of a module-level
class, not hooks: nn.Module's hook dispatch costs microseconds a call) and casts outputs back to
float32. ``torch.save(model)`` and ``copy.deepcopy(model)`` keep working — unlike patching
``model.forward`` with a closure.

Sharded strategies also get their parameter, reduction and output dtypes from FSDP2's
``MixedPrecisionPolicy`` (see shard.py); autocast runs there too, so that the ops autocast keeps
in float32 (softmax, norms, a loss computed inside forward) do so under every strategy: one
precision setting, the same numerics and output dtypes everywhere.

fp8: the ``fp8`` step (fprep.apply.fp8, before sharding) swaps the Linear layers the plan lists
for float8 ones; this step adds bf16 autocast around the whole forward, as for bf16.
"""

from __future__ import annotations

from collections.abc import MutableMapping
from typing import Any

import torch
from torch import nn

from fprep.apply.steps import ScalerUse, handles_of, skipped, step, with_handles
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


class AutocastForward:
    """The module's forward under autocast, with float32 outputs.

    Installed as the module's instance attribute ``forward``, so ``module(x)`` keeps nn.Module's
    hook-free fast path (two forward hooks cost ~7 µs a call more than this on CPU). An instance
    of a module-level class rather than a closure, so ``torch.save(model)`` and
    ``copy.deepcopy(model)`` keep working: the copy's wrapper calls the copy. A forward the
    instance already had (someone else's patch) is wrapped, not replaced.
    """

    def __init__(self, module: nn.Module, device_type: str, dtype: str) -> None:
        self.module = module
        self.device_type = device_type
        self.dtype = dtype
        self.inner: Any = module.__dict__.get("forward")
        self._dtype = getattr(torch, dtype)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        with torch.autocast(self.device_type, dtype=self._dtype):
            if self.inner is not None:
                out = self.inner(*args, **kwargs)
            else:
                out = type(self.module).forward(self.module, *args, **kwargs)
        return outputs_to_fp32(out)

    def rebound(self, module: nn.Module, inner: Any) -> AutocastForward:
        """The same wrapper over ``module`` (a copy of the one this wraps) and its ``inner``
        forward (the caller's copy of this one's)."""
        copy = AutocastForward.__new__(AutocastForward)
        copy.__dict__.update(self.__dict__, module=module, inner=inner)
        return copy

    def __repr__(self) -> str:
        return f"AutocastForward({self.device_type!r}, {self.dtype!r})"


def install_autocast(model: nn.Module, device_type: str, dtype: str) -> None:
    model.__dict__["forward"] = AutocastForward(model, device_type, dtype)


def autocast_of(model: nn.Module) -> AutocastForward | None:
    """fprep's autocast wrapper on ``model``, if it has one."""
    forward = model.__dict__.get("forward")
    return forward if isinstance(forward, AutocastForward) else None


def has_autocast(model: nn.Module) -> bool:
    return autocast_of(model) is not None


def remove_autocast(model: nn.Module) -> None:
    """Undo ``install_autocast`` (restoring a forward the instance had before, if any)."""
    wrapper = autocast_of(model)
    if wrapper is None:
        return
    if wrapper.inner is None:
        del model.__dict__["forward"]
    else:
        model.__dict__["forward"] = wrapper.inner


@step("precision")
def precision(state: PrepState, model: nn.Module) -> tuple[PrepState, nn.Module]:
    core = need(state.core, "init_core", "precision")
    policy = core.precision
    device = handles_of(state).device
    if not (policy.autocast_dtype or policy.grad_scaling):
        return skipped(state, model)
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
        state = with_handles(state, grad_scaler=scaler, scaler_use=ScalerUse())
    return state, model
