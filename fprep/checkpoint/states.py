"""Model and optimizer state as flat ``key -> tensor`` dicts plus JSON skeletons.

Keys: ``model/<FQN>`` for parameters and persistent buffers (canonical FQNs, as
``torch.distributed.checkpoint.state_dict`` names them), ``optimizer/<i>/state/<FQN>/<name>`` for
optimizer state tensors. Everything else of an optimizer's state dict (param groups with their
hyperparameters and parameter FQNs, non-tensor state) stays in its skeleton, which goes to the
manifest. Buffers are saved in their original dtype (``state.buffers``).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
)

from fprep.checkpoint.format.encoding import encode
from fprep.checkpoint.format.manifest import OptimizerRecord
from fprep.errors import CheckpointError
from fprep.optim import canonical_names
from fprep.state import PrepState

MODEL = "model"


def model_key(fqn: str) -> str:
    return f"{MODEL}/{fqn}"


def optimizer_prefix(index: int) -> str:
    return f"optimizer/{index}"


def describe(key: str) -> str:
    """A readable name for a flat key, e.g. ``model 'fc.weight'``."""
    head, _, rest = key.partition("/")
    if head == MODEL:
        return f"model {rest!r}"
    index, _, rest = rest.partition("/")
    kind, _, rest = rest.partition("/")
    if kind == "state" and "/" in rest:
        fqn, _, name = rest.rpartition("/")
        return f"optimizer {index} state {name!r} of {fqn!r}"
    return f"optimizer {index} {kind} {rest!r}"


def buffer_dtypes(state: PrepState) -> dict[str, torch.dtype]:
    buffers = state.buffers
    if buffers is None:
        return {}
    return {name: getattr(torch, dtype) for name, dtype in buffers.dtypes}


def options(state: PrepState, *, for_save: bool) -> StateDictOptions:
    """Full state dicts (gathered to rank 0, on the CPU) when the plan says so, for saving.

    Loading always targets this rank's shards: DCP reads each rank's part of any layout, so a
    full checkpoint never has to be materialized whole on one rank to be loaded. Under pipeline
    parallelism torch would keep global rank 0's stage only: the sharded state dict is taken
    and ``pipeline.keep_full`` gathers it onto one rank per stage.
    """
    sd = state.state_dict
    staged = state.pipeline is not None and state.pipeline.size > 1
    full = for_save and sd is not None and sd.type == "full" and not staged
    return StateDictOptions(full_state_dict=full, cpu_offload=full)


def model_tensors(state: PrepState, model: nn.Module, *, for_save: bool) -> dict[str, torch.Tensor]:
    """``model/<FQN> -> tensor`` (DTensor shards when sharded); buffers in original dtype."""
    sd = get_model_state_dict(model, options=options(state, for_save=for_save))
    original = buffer_dtypes(state)
    out: dict[str, torch.Tensor] = {}
    for fqn, value in sd.items():
        if not isinstance(value, torch.Tensor):
            if not for_save:
                continue  # cannot be in a checkpoint: save refuses it
            raise CheckpointError(
                f"the model's state dict holds a {type(value).__qualname__} under {fqn!r}; "
                "fprep checkpoints hold tensors only in model state.",
                subject=fqn,
                hint="Module extra state (get_extra_state) must be tensors to be saved; keep "
                "other values in extras.",
            )
        dtype = original.get(fqn)
        if dtype is not None and value.dtype != dtype:
            value = value.to(dtype)
        out[model_key(fqn)] = value
    return out


def fresh_skeleton(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """The state dict of an optimizer that has not stepped, without initializing its state.

    (``get_optimizer_state_dict`` would run a zero-learning-rate step to create state, which
    changes what the next real step does, e.g. Adam's bias correction.)
    """
    names = canonical_names(model)
    groups = []
    for group in optimizer.param_groups:
        entry = {k: v for k, v in group.items() if k != "params"}
        entry["params"] = [
            names.get(id(p), f"<unnamed {i}>") for i, p in enumerate(group["params"])
        ]
        groups.append(entry)
    return {"state": {}, "param_groups": groups}


def is_fresh(optimizer: torch.optim.Optimizer) -> bool:
    return not optimizer.state


def optimizer_state(
    state: PrepState, model: nn.Module, optimizer: torch.optim.Optimizer, *, for_save: bool
) -> dict[str, Any]:
    if is_fresh(optimizer):
        return fresh_skeleton(model, optimizer)
    osd: dict[str, Any] = get_optimizer_state_dict(
        model, optimizer, options=options(state, for_save=for_save)
    )
    return osd


def class_name(obj: object) -> str:
    return f"{type(obj).__module__}.{type(obj).__qualname__}"


def split_optimizers(
    state: PrepState,
    model: nn.Module,
    optimizers: Sequence[torch.optim.Optimizer],
    tensors: dict[str, torch.Tensor],
    *,
    for_save: bool,
) -> list[OptimizerRecord]:
    """Each optimizer's class and encoded skeleton; its tensors are added to ``tensors``."""
    records = []
    for i, opt in enumerate(optimizers):
        osd = optimizer_state(state, model, opt, for_save=for_save)
        records.append(
            OptimizerRecord(cls=class_name(opt), state=encode(osd, optimizer_prefix(i), tensors))
        )
    return records


def group_params(osd: Mapping[str, Any]) -> list[list[str]]:
    groups = osd.get("param_groups", [])
    return [list(g.get("params", [])) for g in groups] if isinstance(groups, list) else []
