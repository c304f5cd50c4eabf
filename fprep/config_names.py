"""What to write instead of a keyword ``PrepConfig`` does not have.

People arrive from Accelerate, transformers' ``Trainer`` and Lightning with those libraries'
names in their fingers (``mixed_precision="bf16"``, ``bf16=True``, ``gradient_accumulation_steps``).
``unknown_field`` turns such a keyword into a ``ConfigError`` that names the library it comes
from and the fprep field (or function) that does the same job; any other unknown keyword gets
the closest fprep field names (``difflib``). Plain data and string formatting: no torch here.
"""

from __future__ import annotations

import difflib
from collections.abc import Sequence

from fprep.errors import ConfigError

_ACCELERATOR = "Accelerate's Accelerator"
_FSDP_PLUGIN = "Accelerate's FullyShardedDataParallelPlugin"
_TRAINER = "transformers' TrainingArguments"
_LIGHTNING = "Lightning's Trainer / Fabric"
_TITAN = "torchtitan's job config"
_HF_DIST = "transformers' DistributedConfig"

#: keyword -> (where it comes from, what to do in fprep). ``{value!r}`` is the value given.
FOREIGN_NAMES: dict[str, tuple[str, str]] = {
    # Accelerate: Accelerator(...)
    "mixed_precision": (_ACCELERATOR, "Write precision={value!r} ('no', 'fp16', 'bf16' or 'fp8')."),
    "cpu": (_ACCELERATOR, "Write device='cpu' to run on the CPU."),
    "gradient_accumulation_steps": (
        _ACCELERATOR,
        "fprep has no such field: accumulate in your loop with "
        "fprep.accumulate(state, model, sync=(i + 1) % {value!r} == 0) and divide the loss by "
        "{value!r} (docs/training.md).",
    ),
    "gradient_accumulation_plugin": (
        _ACCELERATOR,
        "fprep has no such field: use fprep.accumulate(state, model, sync=...) in your loop.",
    ),
    "fsdp_plugin": (
        _ACCELERATOR,
        "Write strategy='fsdp' and the plugin's settings as PrepConfig fields (wrap=, "
        "sharding=, offload=, ...; docs/migration.md), or "
        "PrepConfig.from_accelerate(config_file).",
    ),
    "deepspeed_plugin": (
        _ACCELERATOR,
        "fprep does not run DeepSpeed; strategy='fsdp' (ZeRO-3) or sharding='grad_op' "
        "(ZeRO-2) shard the same state with FSDP2.",
    ),
    "deepspeed_plugins": (_ACCELERATOR, "fprep does not run DeepSpeed; use strategy='fsdp'."),
    "megatron_lm_plugin": (
        _ACCELERATOR,
        "fprep does not run Megatron-LM; tp= and strategy='fsdp' give tensor and data "
        "parallelism (docs/parallelism.md).",
    ),
    "torch_tp_plugin": (
        _ACCELERATOR,
        "Write tp=N (the tensor-parallel ranks) and tp_plan= if needed.",
    ),
    "parallelism_config": (
        _ACCELERATOR,
        "Build the config with PrepConfig.from_accelerate(parallelism={value!r}), or set "
        "strategy=, hsdp_shard_size= and tp= (docs/migration.md).",
    ),
    "dataloader_config": (
        _ACCELERATOR,
        "Write its settings as PrepConfig fields: even_batches= and split_batches=.",
    ),
    "kwargs_handlers": (
        _ACCELERATOR,
        "DistributedDataParallelKwargs become ddp=fprep.DDPOptions(...), "
        "InitProcessGroupKwargs(timeout=) becomes timeout_s=.",
    ),
    "dynamo_backend": (_ACCELERATOR, "Write compile='whole' and compile_backend={value!r}."),
    "dynamo_plugin": (
        _ACCELERATOR,
        "Write compile='whole' (or 'regional'), compile_backend= and compile_mode=.",
    ),
    "rng_types": (
        _ACCELERATOR,
        "fprep has no such field: seed= seeds initialization, fprep.set_seed seeds the "
        "generators, and fprep.save keeps their states.",
    ),
    "log_with": (
        _ACCELERATOR,
        "fprep has no trackers: call yours on the main process (fprep.is_main_process(state)); "
        "see docs/migration.md.",
    ),
    "project_dir": (_ACCELERATOR, "fprep has no such field: pass the path to fprep.save."),
    "project_config": (_ACCELERATOR, "fprep has no such field: pass the path to fprep.save."),
    "step_scheduler_with_optimizer": (
        _ACCELERATOR,
        "fprep has no such field: fprep.optimizer_step(state, opt, scheduler) steps the "
        "scheduler once per real optimizer step.",
    ),
    "dispatch_batches": (
        _ACCELERATOR,
        "fprep has no such field: every rank reads its own share (fprep.prepare_data_loader).",
    ),
    "fp8_recipe_handler": (
        _ACCELERATOR,
        "Write precision='fp8' and fp8=fprep.Fp8Options(recipe=...).",
    ),
    # Accelerate: FullyShardedDataParallelPlugin / fsdp_config
    "sharding_strategy": (
        _FSDP_PLUGIN,
        "Write strategy='fsdp' (FULL_SHARD), strategy='fsdp', sharding='grad_op' "
        "(SHARD_GRAD_OP) or strategy='hsdp' (HYBRID_SHARD).",
    ),
    "auto_wrap_policy": (
        _FSDP_PLUGIN,
        "Write wrap=: block classes or their names (TRANSFORMER_BASED_WRAP) or a parameter "
        "count (SIZE_BASED_WRAP).",
    ),
    "transformer_cls_names_to_wrap": (_FSDP_PLUGIN, "Write wrap={value!r} (class names)."),
    "transformer_layer_cls_to_wrap": (_FSDP_PLUGIN, "Write wrap={value!r} (class names)."),
    "min_num_params": (_FSDP_PLUGIN, "Write wrap={value!r} (a minimum parameter count)."),
    "cpu_offload": (_FSDP_PLUGIN, "Write offload='cpu'."),
    "mixed_precision_policy": (_FSDP_PLUGIN, "Write precision='bf16' (and reduce_dtype=)."),
    "cpu_ram_efficient_loading": (
        _FSDP_PLUGIN,
        "Build the model on the meta device and pass weights= (or sync_module_states=True).",
    ),
    "fsdp_version": (_FSDP_PLUGIN, "fprep always uses FSDP2 (fully_shard): drop it."),
    "use_orig_params": (_FSDP_PLUGIN, "FSDP2 always keeps the original parameters: drop it."),
    # transformers: TrainingArguments(...)
    "bf16": (_TRAINER, "Write precision='bf16'."),
    "fp16": (_TRAINER, "Write precision='fp16'."),
    "half_precision_backend": (_TRAINER, "Write precision='bf16' or 'fp16'."),
    "use_cpu": (_TRAINER, "Write device='cpu' to run on the CPU."),
    "no_cuda": (_TRAINER, "Write device='cpu' to run on the CPU."),
    "gradient_checkpointing": (_TRAINER, "Write activation_checkpointing={value!r}."),
    "torch_compile": (_TRAINER, "Write compile='whole'."),
    "torch_compile_backend": (_TRAINER, "Write compile='whole' and compile_backend={value!r}."),
    "torch_compile_mode": (_TRAINER, "Write compile='whole' and compile_mode={value!r}."),
    "fsdp": (
        _TRAINER,
        "Write strategy='fsdp' (and sharding=, offload=, wrap= for its options).",
    ),
    "fsdp_config": (
        _TRAINER,
        "Write its settings as PrepConfig fields (wrap=, sharding=, ...), or use "
        "PrepConfig.from_accelerate({{'distributed_type': 'FSDP', 'fsdp_config': ...}}).",
    ),
    "deepspeed": (_TRAINER, "fprep does not run DeepSpeed; use strategy='fsdp'."),
    "ddp_find_unused_parameters": (
        _TRAINER,
        "Write ddp=fprep.DDPOptions(find_unused_parameters={value!r}).",
    ),
    "ddp_bucket_cap_mb": (_TRAINER, "Write ddp=fprep.DDPOptions(bucket_cap_mb={value!r})."),
    "ddp_broadcast_buffers": (
        _TRAINER,
        "Write ddp=fprep.DDPOptions(broadcast_buffers={value!r}).",
    ),
    "ddp_static_graph": (_TRAINER, "Write ddp=fprep.DDPOptions(static_graph={value!r})."),
    "ddp_timeout": (_TRAINER, "Write timeout_s={value!r} (seconds)."),
    "ddp_backend": (
        _TRAINER,
        "fprep picks the backend from the device (nccl on CUDA, gloo on the CPU); to choose, "
        "create the process group yourself before prepare.",
    ),
    "data_seed": (_TRAINER, "Write seed={value!r} (the data loader's shuffling uses it too)."),
    "dataloader_drop_last": (
        _TRAINER,
        "Give your DataLoader drop_last={value!r}; fprep.prepare_data_loader keeps it.",
    ),
    "per_device_train_batch_size": (
        _TRAINER,
        "Give your DataLoader batch_size={value!r}; each rank reads batches of it.",
    ),
    "local_rank": (
        _TRAINER,
        "fprep reads the rank from the launcher (torchrun's variables); see fprep.Topology.",
    ),
    # torchtitan: [parallelism] section of its job config
    "pipeline_parallel_degree": (_TITAN, "Write pp={value!r}."),
    "pipeline_parallel_schedule": (_TITAN, "Write pp_schedule={value!r}."),
    "pipeline_parallel_microbatch_size": (
        _TITAN,
        "fprep counts micro-batches, not their rows: write pp_microbatches=(local batch size "
        "// {value!r}).",
    ),
    "pipeline_parallel_split_points": (
        _TITAN,
        "Write pp_split=[[module names of stage 0], [stage 1], ...] (whole stages, not cut "
        "points).",
    ),
    "pipeline_parallel_layers_per_stage": (
        _TITAN,
        "fprep spreads the layers by torchtitan's default rule; to choose, write "
        "pp_split=[[...], ...].",
    ),
    "tensor_parallel_degree": (_TITAN, "Write tp={value!r}."),
    "data_parallel_shard_degree": (
        _TITAN,
        "Write strategy='fsdp' (fprep shards over the ranks left after pp and tp).",
    ),
    "data_parallel_replicate_degree": (
        _TITAN,
        "Write strategy='hsdp' and hsdp_shard_size= (the shard degree).",
    ),
    # transformers: DistributedConfig(...) (PrepConfig.from_transformers reads one)
    "pp_size": (_HF_DIST, "Write pp={value!r}, or PrepConfig.from_transformers(config)."),
    "tp_size": (_HF_DIST, "Write tp={value!r}, or PrepConfig.from_transformers(config)."),
    "fsdp_size": (
        _HF_DIST,
        "Write strategy='fsdp', or PrepConfig.from_transformers(config).",
    ),
    # Lightning: Trainer(...) / Fabric(...)
    "accelerator": (_LIGHTNING, "Write device={value!r} (e.g. 'cuda', 'cpu', 'hpu')."),
    "devices": (
        _LIGHTNING,
        "Launch as many processes as devices: torchrun --nproc-per-node N script.py.",
    ),
    "num_nodes": (_LIGHTNING, "Launch with torchrun --nnodes N (docs/multinode.md)."),
    "accumulate_grad_batches": (
        _LIGHTNING,
        "fprep has no such field: use fprep.accumulate(state, model, sync=...) in your loop.",
    ),
    "gradient_clip_val": (
        _LIGHTNING,
        "fprep has no such field: call fprep.clip_grad_norm(state, model, {value!r}) before "
        "the optimizer step.",
    ),
    "sync_batchnorm": (
        _LIGHTNING,
        "Convert the model before prepare: torch.nn.SyncBatchNorm.convert_sync_batchnorm(model).",
    ),
}


#: Keywords whose values are case-sensitive names (torch's schedule names: '1F1B').
_CASE_KEPT = frozenset({"pipeline_parallel_schedule"})


def _shown(value: object) -> object:
    """An enum member by its value (Accelerate's ``PrecisionType.BF16`` is ``'bf16'``)."""
    inner = getattr(value, "value", value)
    return inner.lower() if isinstance(inner, str) and inner.isupper() else inner


#: The keywords that ask fprep for context parallelism, which it does not do yet.
CONTEXT_PARALLEL_NAMES = frozenset({"cp", "cp_size", "context_parallel", "context_parallel_size"})


def context_parallel_refused(subject: str, given: str) -> ConfigError:
    """The one refusal of context parallelism, however it was asked for (``given``)."""
    return ConfigError(
        f"{given}: fprep does not do context parallelism yet: torch's ring attention "
        "(torch.distributed.tensor.experimental.context_parallel) runs only on CUDA's SDPA "
        "kernels (flash, memory-efficient, cuDNN), so it cannot be checked across ranks against "
        "one process the way every layout fprep applies is.",
        subject=subject,
        hint="Leave it out: shard the sequence's activations with tp= and "
        "sequence_parallel=True, or checkpoint activations (activation_checkpointing=) to fit "
        "long sequences.",
    )


def unknown_field(owner: str, key: object, value: object, fields: Sequence[str]) -> ConfigError:
    """The ``ConfigError`` for ``owner(key=value)`` when ``owner`` (``"PrepConfig"``,
    ``"PrepConfig.ddp"``, ...) has only ``fields``."""
    name = str(key)
    if owner == "PrepConfig" and name in CONTEXT_PARALLEL_NAMES:
        return context_parallel_refused(name, f"{owner}({name}={_shown(value)})")
    foreign = FOREIGN_NAMES.get(name) if owner == "PrepConfig" else None
    if foreign is not None:
        origin, advice = foreign
        return ConfigError(
            f"{owner} has no field {name!r}; {name} is a keyword of {origin}.",
            subject=name,
            hint=advice.format(value=value if name in _CASE_KEPT else _shown(value)),
        )
    close = difflib.get_close_matches(name, fields, n=3)
    return ConfigError(
        f"{owner} has no field {name!r}.",
        subject=name,
        hint=f"Did you mean {' or '.join(map(repr, close))}?"
        if close
        else f"Fields: {', '.join(fields)}.",
    )


__all__ = [
    "CONTEXT_PARALLEL_NAMES",
    "FOREIGN_NAMES",
    "context_parallel_refused",
    "unknown_field",
]
