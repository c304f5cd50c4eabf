"""Read an Accelerate config file (``accelerate config`` / ``default_config.yaml``) into a
``PrepConfig``. See docs/migration.md for the full field table.

Only fields with a fprep meaning are read; the launcher's own fields (``num_processes``,
``machine_rank``, ``main_process_ip`` ...) belong to ``torchrun`` and are ignored. A value fprep
cannot honour is a ``ConfigError`` naming the Accelerate field.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from fprep.config_names import context_parallel_refused
from fprep.errors import ConfigError

_STRATEGY = {
    "NO": "none",
    "MULTI_CPU": "ddp",
    "MULTI_GPU": "ddp",
    "MULTI_XPU": "ddp",
    "MULTI_MLU": "ddp",
    "MULTI_NPU": "ddp",
    "MULTI_HPU": "ddp",
    "FSDP": "fsdp",
}
_SHARDING = {  # fsdp_sharding_strategy: name or FSDP1's enum number
    "FULL_SHARD": ("fsdp", "full"),
    "1": ("fsdp", "full"),
    "SHARD_GRAD_OP": ("fsdp", "grad_op"),
    "2": ("fsdp", "grad_op"),
    "NO_SHARD": ("ddp", "full"),
    "3": ("ddp", "full"),
    "HYBRID_SHARD": ("hsdp", "full"),
    "4": ("hsdp", "full"),
    "HYBRID_SHARD_ZERO2": ("hsdp", "grad_op"),
    "5": ("hsdp", "grad_op"),
}
_HOOKS = {"NO": "none", "FP16": "fp16", "BF16": "bf16", "POWER_SGD": "powersgd"}


def _load(source: str | Path | Mapping[str, Any]) -> dict[str, Any]:
    if isinstance(source, Mapping):
        return dict(source)
    path = Path(source)
    try:
        text = path.read_text()
    except OSError as e:
        raise ConfigError(
            f"cannot read the Accelerate config {str(path)!r}: {e.strerror}.", subject=str(path)
        ) from None
    if path.suffix == ".json":
        try:
            data = json.loads(text)
        except json.JSONDecodeError as e:
            raise ConfigError(
                f"the Accelerate config {str(path)!r} is not valid JSON: {e}.", subject=str(path)
            ) from None
    else:
        try:
            import yaml
        except ImportError:
            raise ConfigError(
                "reading a YAML Accelerate config needs PyYAML.",
                subject=str(path),
                hint="pip install pyyaml, or pass the config as JSON or a dict.",
            ) from None
        try:
            data = yaml.safe_load(text)  # safe_load: a config file never runs code
        except yaml.YAMLError as e:
            raise ConfigError(
                f"the Accelerate config {str(path)!r} is not valid YAML (or uses tags that "
                f"would run code): {e}",
                subject=str(path),
            ) from None
    if not isinstance(data, dict):
        raise ConfigError(
            f"the Accelerate config {str(path)!r} is not a mapping.", subject=str(path)
        )
    return data


def _flag(value: Any) -> bool:
    return str(value).strip().lower() in ("true", "1", "yes")


def accelerate_fields(source: str | Path | Mapping[str, Any]) -> dict[str, Any]:
    """``PrepConfig`` fields from an Accelerate config file (YAML or JSON) or its dict
    (``PrepConfig.from_accelerate`` builds the config; this module never imports it)."""
    data = _load(source)
    fields: dict[str, Any] = {}
    dist = str(data.get("distributed_type", "NO")).upper()
    if dist == "DEEPSPEED" or dist == "MEGATRON_LM":
        raise ConfigError(
            f"distributed_type {dist} has no fprep equivalent.",
            subject="distributed_type",
            hint="Use FSDP (sharded) or MULTI_GPU (replicated) instead.",
        )
    if dist not in _STRATEGY:
        raise ConfigError(
            f"unknown distributed_type {dist!r}.",
            subject="distributed_type",
            hint=f"Known: {', '.join(sorted(_STRATEGY))}.",
        )
    fields["strategy"] = "auto" if dist == "MULTI_HPU" else _STRATEGY[dist]
    precision = str(data.get("mixed_precision", "no")).lower()
    if precision not in ("no", "fp16", "bf16", "fp8"):
        raise ConfigError(
            f"unknown mixed_precision {precision!r}.",
            subject="mixed_precision",
            hint="Accelerate's values are no, fp16, bf16 and fp8.",
        )
    fields["precision"] = precision
    if _flag(data.get("use_cpu", False)):
        fields["device"] = "cpu"
    dynamo = data.get("dynamo_config") or {}
    backend = str(dynamo.get("dynamo_backend", "NO")).lower()
    if backend not in ("no", "none"):
        fields["compile"] = (
            "regional" if _flag(dynamo.get("dynamo_use_regional_compilation")) else "whole"
        )
        fields["compile_backend"] = backend
        if dynamo.get("dynamo_mode") not in (None, "default"):
            fields["compile_mode"] = str(dynamo["dynamo_mode"])
    if dist == "FSDP":
        fields.update(_fsdp_fields(data.get("fsdp_config") or {}))
    section = data.get("parallelism_config")
    if section:
        fields.update(parallelism_fields(section, data.get("num_processes")))
    return fields


#: Accelerate's ParallelismConfig sizes (the config file prefixes them with
#: ``parallelism_config_``); cp and sp have no fprep equivalent yet.
_SIZES = ("dp_replicate_size", "dp_shard_size", "tp_size", "cp_size", "sp_size")


def _size(section: Any, name: str) -> int:
    """One size from an Accelerate ``ParallelismConfig`` object or its config-file section."""
    if isinstance(section, Mapping):
        raw = section.get(f"parallelism_config_{name}", section.get(name, 1))
    else:
        raw = getattr(section, name, 1)
    field = f"parallelism_config_{name}"
    try:
        value = int(1 if raw is None else raw)
    except (TypeError, ValueError):
        raise ConfigError(f"{field} must be an integer; got {raw!r}.", subject=field) from None
    if value < 1:
        raise ConfigError(f"{field} must be at least 1; got {value}.", subject=field)
    return value


def parallelism_fields(section: Any, num_processes: Any = None) -> dict[str, Any]:
    """``PrepConfig`` fields (``strategy``, ``hsdp_shard_size``, ``tp``) from Accelerate's
    ``ParallelismConfig(dp_replicate_size, dp_shard_size, tp_size, cp_size)`` or the
    ``parallelism_config`` section of its config file. The mesh is the same: replicate x shard
    x tp, tp innermost."""
    rep, shard, tp, cp, sp = (_size(section, n) for n in _SIZES)
    if cp > 1:
        raise context_parallel_refused(
            "parallelism_config_cp_size", f"parallelism_config_cp_size={cp}"
        )
    if sp > 1:
        raise ConfigError(
            f"parallelism_config_sp_size={sp}: fprep does not support sequence (Ulysses) "
            "parallelism yet.",
            subject="parallelism_config_sp_size",
            hint="Set sp_size to 1 (use tp_size and the dp sizes), or stay on Accelerate for "
            "this run.",
        )
    total = rep * shard * tp
    if num_processes is not None and str(num_processes).isdigit() and int(num_processes) != total:
        raise ConfigError(
            f"parallelism_config: dp_replicate_size {rep} x dp_shard_size {shard} x tp_size "
            f"{tp} = {total}, but num_processes is {num_processes}.",
            subject="parallelism_config",
            hint="The product of the sizes must be the number of processes.",
        )
    out: dict[str, Any] = {"tp": tp}
    if rep > 1 and (shard > 1 or tp > 1):  # HSDP; shard size 1 under tp replicates over rep
        out.update(strategy="hsdp", hsdp_shard_size=shard)
    elif rep > 1:
        out["strategy"] = "ddp"
    elif shard > 1:
        out["strategy"] = "fsdp"
    elif tp > 1:
        out["strategy"] = "auto"  # tp is the whole world: no data-parallel ranks
    return out


def _fsdp_fields(fsdp: Mapping[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    sharding = str(fsdp.get("fsdp_sharding_strategy", "FULL_SHARD")).upper()
    if sharding not in _SHARDING:
        raise ConfigError(
            f"unknown fsdp_sharding_strategy {sharding!r}.",
            subject="fsdp_sharding_strategy",
            hint=f"Known: {', '.join(k for k in _SHARDING if not k.isdigit())}.",
        )
    out["strategy"], out["sharding"] = _SHARDING[sharding]
    if "fsdp_reshard_after_forward" in fsdp:  # FSDP2-style configs state it directly
        raf = fsdp["fsdp_reshard_after_forward"]
        if isinstance(raf, str) and raf.upper() in _SHARDING:
            out["strategy"], out["sharding"] = _SHARDING[raf.upper()]
        else:
            out["sharding"] = "full" if _flag(raf) else "grad_op"
    policy = str(fsdp.get("fsdp_auto_wrap_policy", "NO_WRAP")).upper()
    if policy == "TRANSFORMER_BASED_WRAP":
        classes = str(fsdp.get("fsdp_transformer_layer_cls_to_wrap", "")).split(",")
        names = tuple(c.strip() for c in classes if c.strip())
        if not names:
            raise ConfigError(
                "fsdp_auto_wrap_policy is TRANSFORMER_BASED_WRAP but "
                "fsdp_transformer_layer_cls_to_wrap names no class.",
                subject="fsdp_transformer_layer_cls_to_wrap",
                hint="List the block classes, e.g. LlamaDecoderLayer.",
            )
        out["wrap"] = names
    elif policy == "SIZE_BASED_WRAP":
        raw = fsdp.get("fsdp_min_num_params", 100_000_000)
        try:
            out["wrap"] = int(raw)
        except (TypeError, ValueError):
            raise ConfigError(
                f"fsdp_min_num_params must be an integer; got {raw!r}.",
                subject="fsdp_min_num_params",
            ) from None
    if _flag(fsdp.get("fsdp_offload_params", False)):
        out["offload"] = "cpu"
    if "STATE_DICT" in str(fsdp.get("fsdp_state_dict_type", "")).upper():
        full = str(fsdp["fsdp_state_dict_type"]).upper().startswith("FULL")
        out["state_dict_type"] = "full" if full else "sharded"
    prefetch = str(fsdp.get("fsdp_backward_prefetch", "BACKWARD_PRE")).upper()
    out["backward_prefetch"] = 0 if prefetch in ("NO_PREFETCH", "NONE", "FALSE") else 1
    out["forward_prefetch"] = 1 if _flag(fsdp.get("fsdp_forward_prefetch", False)) else 0
    out["sync_module_states"] = _flag(fsdp.get("fsdp_sync_module_states", False))
    out["activation_checkpointing"] = _flag(fsdp.get("fsdp_activation_checkpointing", False))
    return out


#: transformers' DistributedConfig fields fprep reads; the others have no fprep equivalent.
_HF_SIZES = ("tp_size", "fsdp_size", "dp_replicate_size", "pp_size", "ep_size")


def _hf_size(config: Any, name: str) -> int:
    raw = config.get(name) if isinstance(config, Mapping) else getattr(config, name, None)
    field = f"DistributedConfig.{name}"
    if raw is None:
        return 1
    if isinstance(raw, bool) or not isinstance(raw, int) or raw < 1:
        raise ConfigError(
            f"{field} must be a whole number of at least 1; got {raw!r}.", subject=name
        )
    return raw


def _hf_value(config: Any, name: str, default: Any) -> Any:
    if isinstance(config, Mapping):
        return config.get(name, default)
    return getattr(config, name, default)


def distributed_fields(config: Any) -> dict[str, Any]:
    """``PrepConfig`` fields from transformers' ``DistributedConfig`` (or its dict): the mesh
    is the same, pp outermost and tp innermost: ``pp x dp_replicate x fsdp x tp``, and
    ``ep_size`` ranks borrowed from ``fsdp x tp`` (its ``efsdp = fsdp x tp / ep``)."""
    tp, fsdp, rep, pp, ep = (_hf_size(config, n) for n in _HF_SIZES)
    if ep == 1 and _hf_value(config, "enable_expert_parallel", False):
        raise ConfigError(
            "DistributedConfig.enable_expert_parallel is set without ep_size: transformers "
            "removed that flag (it meant ep_size = tp_size with an empty tp_plan).",
            subject="enable_expert_parallel",
            hint="Give ep_size, the expert-parallel ranks, instead.",
        )
    out: dict[str, Any] = {"tp": tp, "pp": pp}
    if ep > 1:
        out["ep"] = ep
    ep_plan = _hf_value(config, "ep_plan", None)
    if isinstance(ep_plan, Mapping) and ep_plan:
        out["ep_plan"] = dict(ep_plan)
    plan = _hf_value(config, "tp_plan", None)
    if isinstance(plan, Mapping):
        out["tp_plan"] = dict(plan)
    if _hf_value(config, "enable_sequence_parallel", False):
        out["sequence_parallel"] = True
    if rep > 1:
        out.update(strategy="hsdp", hsdp_shard_size=fsdp)
    elif fsdp > 1:
        out["strategy"] = "fsdp"
    if _hf_value(config, "fsdp_cpu_offload", False):
        out["offload"] = "cpu"
    if _hf_value(config, "fsdp_mixed_precision", False):
        out["precision"] = "bf16"
    return out
