"""rollback: if a step fails, put the model's structure back as it was before the first step.

The plan rejects everything it can before any effect. What it cannot foresee — a user's
``reset_parameters`` raising halfway through ``materialize``, a custom step failing after
``shard``, an out-of-memory error in ``place`` — happens after some steps have changed the
model in place: FSDP2 swapped classes and replaced parameters by DTensors, compile set
``_compiled_call_impl``, checkpointing and autocast replaced ``forward`` (instance attributes),
``place`` moved tensors.

``Rollback.of(model)`` records, in one walk and without copying any tensor data, what those
effects touch: every module's class and ``__dict__`` (its parameter, buffer, child and hook
dicts and its set of non-persistent buffer names copied, so that the entries, not just the
containers, are restored) and every parameter's and
buffer's tensor (``Module.to`` swaps ``param.data`` in place) with its own attributes (FSDP2
marks parameters with ``_fsdp_orig_uid``). ``restore()`` puts all of it back (an instance
``forward`` a step added goes with the rest of ``__dict__``) and forgets the composable-API
state (``fully_shard``'s) that torch keeps for the modules outside them, so that the restored
model can be prepared again.

Not rolled back: values written into the model's own storage by a collective — DDP's and
``fast_ddp``'s broadcast from rank 0 overwrite the other ranks' parameters in place (they then
hold rank 0's values) — and a process group that ``connect`` created (it stays for a retry).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn


def _copied(value: Any) -> Any:
    """Dict- and set-valued attributes (parameters, buffers, children, hooks, the names of
    non-persistent buffers) are copied one level."""
    return value.copy() if isinstance(value, dict | set) else value


@dataclass(frozen=True)
class _ModuleRecord:
    module: nn.Module
    cls: type[nn.Module]
    attrs: dict[str, Any]
    had_composable_state: bool


@dataclass(frozen=True)
class _TensorRecord:
    tensor: torch.Tensor
    data: torch.Tensor  # an alias of the original data (no copy)
    requires_grad: bool
    attrs: dict[str, Any]  # the tensor's own attributes (FSDP2 adds _fsdp_orig_uid)


def _composable_states() -> Any:
    try:
        from torch.distributed import _composable_state
    except ImportError:  # pragma: no cover - torch built without distributed
        return None
    return getattr(_composable_state, "_module_state_mapping", None)


@dataclass(frozen=True)
class Rollback:
    """The model's structure before the first step; ``restore()`` brings it back."""

    modules: tuple[_ModuleRecord, ...]
    tensors: tuple[_TensorRecord, ...]

    @classmethod
    def of(cls, model: nn.Module) -> Rollback:
        states = _composable_states()
        modules = []
        tensors: dict[int, _TensorRecord] = {}
        for module in model.modules():  # each module once, however often it is registered
            modules.append(
                _ModuleRecord(
                    module=module,
                    cls=type(module),
                    attrs={k: _copied(v) for k, v in module.__dict__.items()},
                    had_composable_state=states is not None and module in states,
                )
            )
            for t in (*module._parameters.values(), *module._buffers.values()):
                if t is not None and id(t) not in tensors:
                    tensors[id(t)] = _TensorRecord(t, t.data, t.requires_grad, dict(vars(t)))
        return cls(tuple(modules), tuple(tensors.values()))

    def restore(self) -> None:
        states = _composable_states()
        for record in self.modules:
            module = record.module
            if type(module) is not record.cls:
                module.__class__ = record.cls
            module.__dict__.clear()
            module.__dict__.update({k: _copied(v) for k, v in record.attrs.items()})
            if states is not None and not record.had_composable_state:
                states.pop(module, None)
        with torch.no_grad():
            for kept in self.tensors:
                t, data = kept.tensor, kept.data
                now = t.data
                if (
                    now.device != data.device
                    or now.dtype != data.dtype
                    or now.shape != data.shape
                    or (not data.is_meta and now.data_ptr() != data.data_ptr())
                ):
                    t.data = data
                if t.requires_grad != kept.requires_grad:
                    t.requires_grad_(kept.requires_grad)
                if vars(t) != kept.attrs:
                    vars(t).clear()
                    vars(t).update(kept.attrs)
