"""fprep: prepare PyTorch models for distributed and mixed-precision training, functionally.

A frozen ``PrepState`` is computed by pure transitions over snapshots of the model, the topology
and the config (``fprep.plan``); effectful steps then apply it with PyTorch's own engines.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import TYPE_CHECKING, Any

from fprep.apply import Handles, Step, all_reduce_gradients, pipeline, step
from fprep.checkpoint import export_full, load, save
from fprep.config import DDPOptions, Fp8Options, PrepConfig
from fprep.data import PreparedDataLoader, prepare_data_loader
from fprep.errors import (
    CheckpointError,
    CollectiveError,
    ConfigError,
    DeviceError,
    IgnoredStateError,
    ModelError,
    PlanOrderError,
    PrepareError,
    PrepError,
    TopologyError,
)
from fprep.loop import accumulate, autocast, clip_grad_norm, gather_for_metrics, optimizer_step
from fprep.memory import MemoryEstimate, estimate_memory
from fprep.moe import RouterWatch, balance_loss, watch_routers
from fprep.parallel_loop import check_tp_inputs, loss_parallel
from fprep.pipeline_loop import pipeline_step
from fprep.planning import DEFAULT_TRANSITIONS, chain, initial_state, plan
from fprep.prepare import backward, default_steps, prepare, prepare_optimizer
from fprep.processes import (
    gather,
    main_process_first,
    num_processes,
    pad_across_processes,
    process_index,
    split_between_processes,
)
from fprep.ranks import (
    end_training,
    is_main_process,
    print_once,
    reduce,
    set_seed,
    wait_for_everyone,
)
from fprep.snapshot import BufferInfo, ModuleInfo, ModuleTree, ParamInfo
from fprep.state import (
    GroupSpec,
    MeshSpec,
    PrepState,
    ShardSpec,
    WrapUnit,
)
from fprep.topology import Topology
from fprep.transitions import (
    Transition,
    init_buffers,
    init_core,
    init_device,
    init_extension,
    init_ignored,
    init_param_handles,
    init_pipeline,
    init_prefetching,
    init_process_group,
    init_runtime,
    init_state_dict,
    transition,
)
from fprep.unwrap import unwrap

if TYPE_CHECKING:
    from torch import nn

__version__ = "0.1.0"


def save_pretrained(
    path: str | os.PathLike[str], state: PrepState, model: nn.Module, *, config: Any = None
) -> Path | str:
    """Write a directory ``from_pretrained(path)`` loads: the full model as
    ``model.safetensors`` (``export_full``) and ``config.json`` (``model.config``, or
    ``config=``), plus ``generation_config.json`` when the model has one. Call it on every rank;
    rank 0 writes. ``model.save_pretrained`` on a sharded model does not gather its shards.
    A peft model's adapters are written as ``PeftModel.save_pretrained`` writes them
    (``adapter_model.safetensors`` and ``adapter_config.json``, for
    ``PeftModel.from_pretrained``); ``config=`` does not apply to them. See docs/finetune.md.
    """
    from fprep.checkpoint.adapters import peft_model_of, save_adapters
    from fprep.checkpoint.export import save_pretrained as _save_pretrained
    from fprep.collectives import collective

    peft_model = peft_model_of(model)
    with collective("fprep.save_pretrained", state.config.timeout_s):
        if peft_model is not None:
            if config is not None:
                raise CheckpointError(
                    "config= was given for a peft model: fprep.save_pretrained writes its "
                    "adapters with their own adapter_config.json (peft's LoraConfig).",
                    subject="config",
                    hint="Leave config= out; the base model's config is the base checkpoint's.",
                )
            return save_adapters(path, state, model, peft_model)
        return _save_pretrained(path, state, model, config)


__all__ = [
    "DEFAULT_TRANSITIONS",
    "BufferInfo",
    "CheckpointError",
    "CollectiveError",
    "ConfigError",
    "DDPOptions",
    "DeviceError",
    "Fp8Options",
    "GroupSpec",
    "Handles",
    "IgnoredStateError",
    "MemoryEstimate",
    "MeshSpec",
    "ModelError",
    "ModuleInfo",
    "ModuleTree",
    "ParamInfo",
    "PlanOrderError",
    "PrepConfig",
    "PrepError",
    "PrepState",
    "PrepareError",
    "PreparedDataLoader",
    "RouterWatch",
    "ShardSpec",
    "Step",
    "Topology",
    "TopologyError",
    "Transition",
    "WrapUnit",
    "accumulate",
    "all_reduce_gradients",
    "autocast",
    "backward",
    "balance_loss",
    "chain",
    "check_tp_inputs",
    "clip_grad_norm",
    "default_steps",
    "end_training",
    "estimate_memory",
    "export_full",
    "gather",
    "gather_for_metrics",
    "init_buffers",
    "init_core",
    "init_device",
    "init_extension",
    "init_ignored",
    "init_param_handles",
    "init_pipeline",
    "init_prefetching",
    "init_process_group",
    "init_runtime",
    "init_state_dict",
    "initial_state",
    "is_main_process",
    "load",
    "loss_parallel",
    "main_process_first",
    "num_processes",
    "optimizer_step",
    "pad_across_processes",
    "pipeline",
    "pipeline_step",
    "plan",
    "prepare",
    "prepare_data_loader",
    "prepare_optimizer",
    "print_once",
    "process_index",
    "reduce",
    "save",
    "save_pretrained",
    "set_seed",
    "split_between_processes",
    "step",
    "transition",
    "unwrap",
    "wait_for_everyone",
    "watch_routers",
]
