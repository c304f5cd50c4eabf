"""``PrepConfig``: what the user wants, validated once at construction.

Every field is keyword-only and checked in ``__post_init__``; a bad value is a ``ConfigError``
that names the field, the allowed values and, for a near miss, the value that was probably meant.
The config round-trips through a plain dict (``to_dict`` / ``from_dict``): classes and functions
are written as ``"module:qualname"`` import strings.
"""

from __future__ import annotations

import dataclasses
import difflib
import importlib
import math
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Literal, TypeAlias, TypeVar, get_args

from torch import nn

from fprep.config_names import unknown_field
from fprep.errors import ConfigError
from fprep.migrate import accelerate_fields, distributed_fields, parallelism_fields
from fprep.snapshot import ModuleInfo

Strategy = Literal["auto", "none", "ddp", "fast_ddp", "fsdp", "hsdp"]
Sharding = Literal["full", "grad_op"]
Precision = Literal["no", "fp16", "bf16", "fp8"]
Offload = Literal["none", "cpu"]
CompileMode = Literal["none", "whole", "regional"]
StateDictType = Literal["sharded", "full"]
FloatDType = Literal["float32", "bfloat16", "float16"]
CommHook = Literal["none", "fp16", "bf16", "powersgd"]
PipelineSchedule = Literal[
    "GPipe",
    "1F1B",
    "Interleaved1F1B",
    "LoopedBFS",
    "InterleavedZeroBubble",
    "ZBVZeroBubble",
    "DualPipeV",
]
Fp8Recipe = Literal["tensorwise", "rowwise", "rowwise_with_gw_hp"]

#: A wrap policy: module classes (or their names), a minimum parameter count, or a predicate over
#: a module's snapshot (``ModuleInfo``), so that wrapping is decided without touching the model.
WrapPolicy: TypeAlias = (
    "int | type[nn.Module] | str | tuple[type[nn.Module] | str, ...]"
    " | Callable[[ModuleInfo], bool] | None"
)
ParamInitFn: TypeAlias = Callable[[nn.Module], None]

#: The longest ``timeout_s``: torch keeps timeouts in nanoseconds in 64 bits (about 9.2e9 s);
#: longer ones overflow (``OverflowError``, or gloo's "Invalid timeout").
MAX_TIMEOUT_S = 1e9


# -- small validators ------------------------------------------------------------------------
def _fail(owner: str, name: str, message: str, hint: str = "") -> ConfigError:
    # Nested options are named by their path from PrepConfig ("ddp.comm_hook").
    path = owner.removeprefix("PrepConfig").lstrip(".")
    return ConfigError(
        f"{owner}.{name} {message}", subject=f"{path}.{name}" if path else name, hint=hint
    )


def _check_choice(owner: str, name: str, value: object, literal: object) -> None:
    allowed = get_args(literal)
    if value in allowed and isinstance(value, str):
        return
    close = (
        difflib.get_close_matches(value, [str(a) for a in allowed], n=1)
        if isinstance(value, str)
        else []
    )
    raise _fail(
        owner,
        name,
        f"must be one of {', '.join(repr(a) for a in allowed)}; got {value!r}.",
        f"Did you mean {close[0]!r}?" if close else "",
    )


def _check_bool(owner: str, name: str, value: object) -> None:
    if not isinstance(value, bool):
        raise _fail(owner, name, f"must be True or False; got {value!r}.")


def _check_int(owner: str, name: str, value: object, *, minimum: int) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
        raise _fail(owner, name, f"must be an int >= {minimum}; got {value!r}.")


def _check_number(
    owner: str, name: str, value: object, *, positive: bool = True, maximum: float = math.inf
) -> None:
    if (
        not isinstance(value, int | float)
        or isinstance(value, bool)
        or not math.isfinite(value)
        or (positive and value <= 0)
    ):
        raise _fail(owner, name, f"must be a positive number; got {value!r}.")
    if isinstance(value, int | float) and value > maximum:
        raise _fail(
            owner,
            name,
            f"must be at most {maximum:g}; got {value!r}.",
            "Longer timeouts overflow torch's clocks (nanoseconds in 64 bits); 1e9 s is 31 years.",
        )


def _names_tuple(owner: str, name: str, value: object) -> tuple[str, ...]:
    if isinstance(value, str):
        raise _fail(
            owner,
            name,
            f"must be a sequence of FQNs, not a single string; got {value!r}.",
            f"Write {name}=({value!r},).",
        )
    try:
        items: tuple[object, ...] = tuple(value)  # type: ignore[arg-type]
    except TypeError:
        raise _fail(owner, name, f"must be a sequence of FQN strings; got {value!r}.") from None
    for item in items:
        if not isinstance(item, str):
            raise _fail(
                owner,
                name,
                f"must contain FQN strings; got {type(item).__qualname__} {item!r}.",
                "Name modules and parameters by their FQN as in model.named_modules() / "
                "model.named_parameters(), e.g. 'layers.0.attn'.",
            )
    return items  # type: ignore[return-value]  # checked element by element above


# -- import strings for classes and functions ---------------------------------------------------
def import_string(obj: object, field_name: str) -> str:
    """``"module:qualname"`` for a class or module-level function that imports back to itself."""
    module = getattr(obj, "__module__", None)
    qualname = getattr(obj, "__qualname__", None)
    if module and qualname and "<" not in qualname:
        try:
            if resolve_import_string(f"{module}:{qualname}", field_name) is obj:
                return f"{module}:{qualname}"
        except ConfigError:
            pass
    raise ConfigError(
        f"PrepConfig.{field_name} holds {obj!r}, which cannot be written to a dict.",
        subject=field_name,
        hint="Use a module-level class or function (not a lambda or a local definition).",
    )


def resolve_import_string(text: str, field_name: str) -> Any:
    module_name, _, qualname = text.partition(":")
    try:
        obj: Any = importlib.import_module(module_name)
        for part in qualname.split("."):
            obj = getattr(obj, part)
    except (ImportError, AttributeError, ValueError) as e:
        raise ConfigError(
            f"PrepConfig.{field_name}: cannot import {text!r} ({e}).",
            subject=field_name,
            hint="Write classes and functions as 'package.module:QualName'.",
        ) from None
    return obj


def _normalize_wrap(value: object) -> WrapPolicy:
    owner, name = "PrepConfig", "wrap"
    if value is None:
        return None
    if isinstance(value, str) and ":" in value:
        value = resolve_import_string(value, name)
    if isinstance(value, bool):
        raise _fail(owner, name, f"must be classes, a parameter count or a callable; got {value}.")
    _refuse_instance(value)
    if isinstance(value, int):
        _check_int(owner, name, value, minimum=1)
        return value
    if isinstance(value, type | str):
        value = (value,)
    if isinstance(value, list | tuple | set | frozenset):
        items: list[type[nn.Module] | str] = []
        for item in value:
            if isinstance(item, str) and ":" in item:
                item = resolve_import_string(item, name)
            _refuse_instance(item)
            if (isinstance(item, type) and issubclass(item, nn.Module)) or (
                isinstance(item, str) and item
            ):
                items.append(item)
            else:
                raise _fail(
                    owner,
                    name,
                    f"classes must be nn.Module subclasses or class names; got {item!r}.",
                )
        if not items:
            raise _fail(owner, name, "is an empty collection of classes.", "Use wrap=None.")
        return tuple(items)
    if callable(value):
        return value
    raise _fail(
        owner,
        name,
        f"must be a module class, a tuple of classes, a minimum parameter count, or a "
        f"callable(ModuleInfo) -> bool; got {value!r}.",
    )


def _refuse_instance(value: object) -> None:
    """A module *instance* is callable, so it would pass as a predicate and be called with a
    ``ModuleInfo``: refuse it and say which class was probably meant."""
    if isinstance(value, nn.Module):
        cls = type(value)
        raise _fail(
            "PrepConfig",
            "wrap",
            f"got a module instance ({cls.__qualname__}); pass the class, not an instance.",
            f"Write wrap={cls.__qualname__} (or the block class of your model).",
        )


def wrap_class_names(wrap: WrapPolicy) -> tuple[str, ...]:
    """The qualified (or bare) class names a class-based wrap policy matches."""
    if not isinstance(wrap, tuple):
        return ()
    return tuple(w if isinstance(w, str) else f"{w.__module__}.{w.__qualname__}" for w in wrap)


# -- the config ---------------------------------------------------------------------------------
_Options = TypeVar("_Options", bound="_KeywordsChecked")


class _KeywordsChecked:
    """Checks the keywords of a config dataclass before its generated ``__init__`` sees them.

    That ``__init__`` answers an unknown keyword or a positional argument with a bare
    ``TypeError``; here they are ``ConfigError``s that say what to write instead (for
    Accelerate's, transformers' and Lightning's names, the fprep field that does the same job).
    ``__new__`` rather than ``__init__``: the dataclass keeps its own ``__init__`` (signature,
    ``dataclasses.replace``), and unpickling and copying, which call ``__new__`` with no
    arguments, are untouched."""

    def __new__(cls: type[_Options], *args: Any, **kwargs: Any) -> _Options:
        owner = _OWNERS.get(cls.__name__, cls.__name__)
        names = [f.name for f in dataclasses.fields(cls)]  # type: ignore[arg-type]
        if args:
            raise ConfigError(
                f"{owner} takes keyword arguments only; got {len(args)} positional "
                f"({', '.join(repr(a) for a in args[:3])}{', ...' if len(args) > 3 else ''}).",
                subject=owner,
                hint=f"Name each value: {cls.__name__}(name=value, ...) (docs/config.md).",
            )
        for key, value in kwargs.items():
            if key not in names:
                raise unknown_field(owner, key, value, names)
        return super().__new__(cls)


#: how an options class is named in errors: by its path from PrepConfig
_OWNERS = {"DDPOptions": "PrepConfig.ddp", "Fp8Options": "PrepConfig.fp8"}


@dataclass(frozen=True, kw_only=True)
class DDPOptions(_KeywordsChecked):
    """Options for ``DistributedDataParallel`` (strategy ``"ddp"``)."""

    bucket_cap_mb: float = 25.0
    find_unused_parameters: bool = False
    static_graph: bool = False
    gradient_as_bucket_view: bool = False
    broadcast_buffers: bool = True
    comm_hook: CommHook = "none"
    powersgd_rank: int = 1
    powersgd_start_iter: int = 2

    def __post_init__(self) -> None:
        owner = "PrepConfig.ddp"
        _check_number(owner, "bucket_cap_mb", self.bucket_cap_mb)
        for name in (
            "find_unused_parameters",
            "static_graph",
            "gradient_as_bucket_view",
            "broadcast_buffers",
        ):
            _check_bool(owner, name, getattr(self, name))
        _check_choice(owner, "comm_hook", self.comm_hook, CommHook)
        _check_int(owner, "powersgd_rank", self.powersgd_rank, minimum=1)
        _check_int(owner, "powersgd_start_iter", self.powersgd_start_iter, minimum=1)


@dataclass(frozen=True, kw_only=True)
class Fp8Options(_KeywordsChecked):
    """Options for ``precision="fp8"`` (torchao float8 training on CUDA; see docs/config.md).

    Only plain ``nn.Linear`` layers whose dimensions are both multiples of 16 run in float8;
    the output projection (``skip_output``) and the modules matching ``skip`` stay in bf16, as
    torchtitan and Accelerate leave them, and so do layers too small for float8 to pay on CUDA
    (``skip_small``, torchao's thresholds). The plan lists each decision (``fprep plan``).
    """

    recipe: Fp8Recipe = "tensorwise"
    #: ``fnmatch`` patterns over module FQNs kept in bf16 (a pattern matching a module keeps
    #: every Linear below it too), e.g. ``("layers.0", "*.gate")``
    skip: tuple[str, ...] = ()
    #: keep the output projection in bf16: each Linear producing the vocabulary (its
    #: out_features is the largest nn.Embedding's num_embeddings), else the model's last Linear
    skip_output: bool = True
    #: keep in bf16 the Linears too small for float8 to pay on CUDA: below torchao's H100
    #: thresholds for the recipe (tensorwise: in_features <= 4096 and out_features <= 1024;
    #: rowwise: out_features <= 2048, or in_features <= 1024, or both <= 4096 x 2048)
    skip_small: bool = True
    #: all-gather float8 weights under fsdp / hsdp (torchao, tensorwise recipe only);
    #: ``None``: on wherever torchao supports it
    fsdp_float8_all_gather: bool | None = None

    def __post_init__(self) -> None:
        owner = "PrepConfig.fp8"
        _check_choice(owner, "recipe", self.recipe, Fp8Recipe)
        skip = _names_tuple(owner, "skip", self.skip)
        if any(not p for p in skip):
            raise _fail(owner, "skip", "contains an empty pattern.")
        object.__setattr__(self, "skip", skip)
        _check_bool(owner, "skip_output", self.skip_output)
        _check_bool(owner, "skip_small", self.skip_small)
        gather = self.fsdp_float8_all_gather
        if gather is not None:
            _check_bool(owner, "fsdp_float8_all_gather", gather)
        if gather and self.recipe != "tensorwise":
            raise _fail(
                owner,
                "fsdp_float8_all_gather",
                f"needs recipe='tensorwise'; recipe is {self.recipe!r}.",
                "torchao all-gathers float8 weights with tensorwise scales only: use "
                "recipe='tensorwise', or leave fsdp_float8_all_gather=None.",
            )


@dataclass(frozen=True, kw_only=True)
class PrepConfig(_KeywordsChecked):
    """How to prepare a model. See docs/config.md for every field."""

    # what kind of parallelism
    strategy: Strategy = "auto"
    sharding: Sharding = "full"
    reshard_after_forward: bool | int | None = None
    hsdp_shard_size: int | None = None
    # tensor parallelism: tp ranks (innermost mesh dim) split each matched module; the strategy
    # shards or replicates over the world / tp data-parallel ranks (docs/parallelism.md)
    tp: int = 1
    #: ``{module pattern: style}``; kept as sorted ``(pattern, style)`` pairs (``tp_plan_pairs``)
    tp_plan: Mapping[str, str] | tuple[tuple[str, str], ...] | None = None
    #: shard the residual stream between blocks on the sequence (norms, dropouts): the plan
    #: gains torchtitan's sequence-parallel layout (docs/parallelism.md)
    sequence_parallel: bool = False
    # pipeline parallelism: pp ranks (outermost mesh dim) each run their stages of the model
    # under a torch.distributed.pipelining schedule (docs/parallelism.md)
    pp: int = 1
    pp_schedule: PipelineSchedule = "1F1B"
    #: micro-batches per step; None: one per stage (the fewest every schedule accepts)
    pp_microbatches: int | None = None
    #: stages each pp rank runs under a looped schedule (V schedules always run two)
    pp_stages_per_rank: int = 2
    #: module names per stage, outermost first; None: the model's own split (docs/parallelism.md)
    pp_split: tuple[tuple[str, ...], ...] | None = None
    # expert parallelism: ep ranks, borrowed from dp_shard x tp, each hold experts / ep of every
    # experts module and exchange the routed tokens with an all-to-all (docs/parallelism.md)
    ep: int = 1
    #: ``{module pattern: style}`` (``"ep_dispatch_experts"`` on experts modules,
    #: ``"grouped_gemm"`` on their parameters); None: the model's own (transformers'
    #: ``base_model_ep_plan``). Kept as sorted ``(pattern, style)`` pairs (``ep_plan_pairs``)
    ep_plan: Mapping[str, str] | tuple[tuple[str, str], ...] | None = None
    # precision
    precision: Precision = "no"
    reduce_dtype: FloatDType | None = None
    fp8: Fp8Options = field(default_factory=Fp8Options)
    # wrapping and what to leave alone
    wrap: WrapPolicy = None
    ignored_modules: tuple[str, ...] = ()
    ignored_params: tuple[str, ...] = ()
    # devices and memory
    device: str | None = None
    device_placement: bool = True
    offload: Offload = "none"
    # prefetching (in wrap units)
    forward_prefetch: int = 0
    backward_prefetch: int = 1
    # activation checkpointing and compilation
    activation_checkpointing: bool = False
    compile: CompileMode = "none"
    compile_backend: str | None = None
    compile_mode: str | None = None
    # replication
    ddp: DDPOptions = field(default_factory=DDPOptions)
    fast_ddp_dtype: FloatDType = "float32"
    # initialization
    sync_module_states: bool = False
    param_init_fn: ParamInitFn | None = None
    reproducible_init: bool = True
    seed: int | None = None
    # pretrained weights, read straight into each rank's shards (docs/finetune.md)
    weights: str | os.PathLike[str] | None = None  # kept as a str
    weights_extra_keys: tuple[str, ...] = ()
    weights_missing_keys: tuple[str, ...] = ()
    # data loading
    even_batches: bool = True
    split_batches: bool = False
    # checkpoints and process groups
    state_dict_type: StateDictType = "sharded"
    timeout_s: float = 600.0

    def __post_init__(self) -> None:
        o = "PrepConfig"
        _check_choice(o, "strategy", self.strategy, Strategy)
        _check_choice(o, "sharding", self.sharding, Sharding)
        raf = self.reshard_after_forward
        if raf is not None and not isinstance(raf, bool):
            _check_int(o, "reshard_after_forward", raf, minimum=1)
        if isinstance(raf, bool) and raf != (self.sharding == "full"):
            raise _fail(
                o,
                "reshard_after_forward",
                f"is {raf}, which contradicts sharding={self.sharding!r}.",
                "Set one of them: sharding='full' reshards after forward, 'grad_op' does not.",
            )
        if raf is not None and not isinstance(raf, bool) and self.sharding == "grad_op":
            raise _fail(
                o,
                "reshard_after_forward",
                f"is {raf} (reshard to groups of {raf} after forward), which contradicts "
                "sharding='grad_op' (never reshard after forward).",
                "Use an int reshard_after_forward with sharding='full' (the default).",
            )
        if self.hsdp_shard_size is not None:
            _check_int(o, "hsdp_shard_size", self.hsdp_shard_size, minimum=1)
        _check_int(o, "tp", self.tp, minimum=1)
        object.__setattr__(self, "tp_plan", _normalize_tp_plan(self.tp_plan))
        _check_bool(o, "sequence_parallel", self.sequence_parallel)
        _check_sequence_parallel(self)
        _check_pipeline(self)
        _check_expert_parallel(self)
        _check_choice(o, "precision", self.precision, Precision)
        if self.reduce_dtype is not None:
            _check_choice(o, "reduce_dtype", self.reduce_dtype, FloatDType)
        _check_fp8(self)
        object.__setattr__(self, "wrap", _normalize_wrap(self.wrap))
        for name in ("ignored_modules", "ignored_params"):
            object.__setattr__(self, name, _names_tuple(o, name, getattr(self, name)))
        if self.ignored_modules and self.ignored_params:
            raise _fail(
                o,
                "ignored_params",
                "cannot be combined with ignored_modules.",
                "Ignore whole modules or individual parameters, not both: list the modules' "
                "parameters in ignored_params instead.",
            )
        if self.device is not None:
            _check_device(self.device)
        for name in (
            "device_placement",
            "activation_checkpointing",
            "sync_module_states",
            "reproducible_init",
            "even_batches",
            "split_batches",
        ):
            _check_bool(o, name, getattr(self, name))
        _check_choice(o, "offload", self.offload, Offload)
        _check_int(o, "forward_prefetch", self.forward_prefetch, minimum=0)
        _check_int(o, "backward_prefetch", self.backward_prefetch, minimum=0)
        _check_choice(o, "compile", self.compile, CompileMode)
        for name in ("compile_backend", "compile_mode"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, str) or not value):
                raise _fail(o, name, f"must be a non-empty string or None; got {value!r}.")
        if isinstance(self.ddp, Mapping):
            object.__setattr__(self, "ddp", _build(DDPOptions, self.ddp, "PrepConfig.ddp"))
        if not isinstance(self.ddp, DDPOptions):
            raise _fail(o, "ddp", f"must be a DDPOptions or a dict; got {self.ddp!r}.")
        _check_choice(o, "fast_ddp_dtype", self.fast_ddp_dtype, FloatDType)
        if self.param_init_fn is not None and not callable(self.param_init_fn):
            raise _fail(
                o,
                "param_init_fn",
                f"must be callable (module) -> None; got {type(self.param_init_fn).__qualname__}.",
            )
        if self.seed is not None:
            _check_int(o, "seed", self.seed, minimum=0)
        _check_choice(o, "state_dict_type", self.state_dict_type, StateDictType)
        _check_number(o, "timeout_s", self.timeout_s, maximum=MAX_TIMEOUT_S)
        _check_weights(self)

    # -- conveniences ----------------------------------------------------------------------
    def replace(self, **changes: Any) -> PrepConfig:
        """A copy with some fields changed (validated like a new config)."""
        return dataclasses.replace(self, **changes)

    @property
    def tp_plan_pairs(self) -> tuple[tuple[str, str], ...] | None:
        """``tp_plan`` as the sorted ``(pattern, style)`` pairs it is stored as."""
        plan = self.tp_plan
        return None if plan is None else tuple(plan.items() if isinstance(plan, Mapping) else plan)

    @property
    def ep_plan_pairs(self) -> tuple[tuple[str, str], ...] | None:
        """``ep_plan`` as the sorted ``(pattern, style)`` pairs it is stored as."""
        plan = self.ep_plan
        return None if plan is None else tuple(plan.items() if isinstance(plan, Mapping) else plan)

    @property
    def effective_reshard_after_forward(self) -> bool | int:
        if self.reshard_after_forward is not None:
            return self.reshard_after_forward
        return self.sharding == "full"

    # -- dict round trip -------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        """Plain data (JSON-compatible): classes and functions become import strings."""
        out: dict[str, Any] = {}
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if f.name in ("ddp", "fp8"):
                value = dataclasses.asdict(value)
                value = {k: list(v) if isinstance(v, tuple) else v for k, v in value.items()}
            elif f.name == "wrap":
                value = _wrap_to_plain(value)
            elif f.name in ("tp_plan", "ep_plan") and value is not None:
                value = dict(value)
            elif f.name == "pp_split" and value is not None:
                value = [list(stage) for stage in value]
            elif f.name == "param_init_fn" and value is not None:
                value = import_string(value, "param_init_fn")
            elif isinstance(value, tuple):
                value = list(value)
            out[f.name] = value
        return out

    @classmethod
    def from_accelerate(
        cls, source: Any = None, *, parallelism: Any = None, **overrides: Any
    ) -> PrepConfig:
        """Read an Accelerate config file (YAML / JSON path, or its dict) and / or an
        Accelerate ``ParallelismConfig`` (``parallelism``); see docs/migration.md."""
        fields = {} if source is None else accelerate_fields(source)
        if parallelism is not None:
            fields.update(parallelism_fields(parallelism))
        return cls(**{**fields, **overrides})

    @classmethod
    def from_transformers(cls, distributed_config: Any, **overrides: Any) -> PrepConfig:
        """Read transformers' ``DistributedConfig`` (or its dict): ``pp_size``, ``tp_size``,
        ``fsdp_size``, ``dp_replicate_size``, ``tp_plan``, ``enable_sequence_parallel``,
        ``fsdp_cpu_offload``, ``fsdp_mixed_precision`` (bf16); see docs/migration.md."""
        return cls(**{**distributed_fields(distributed_config), **overrides})

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> PrepConfig:
        """Inverse of ``to_dict``; unknown keys are a ``ConfigError`` (with a suggestion)."""
        data = dict(data)
        init = data.get("param_init_fn")
        if isinstance(init, str):
            data["param_init_fn"] = resolve_import_string(init, "param_init_fn")
        wrap = data.get("wrap")
        if isinstance(wrap, str) and ":" in wrap:
            resolved = resolve_import_string(wrap, "wrap")
            data["wrap"] = resolved
        config: PrepConfig = _build(cls, data, "PrepConfig")
        return config


def _wrap_to_plain(value: WrapPolicy) -> Any:
    if value is None or isinstance(value, int):
        return value
    if isinstance(value, tuple):
        return [w if isinstance(w, str) else import_string(w, "wrap") for w in value]
    return import_string(value, "wrap")


def _build(cls: Any, data: Mapping[str, Any], owner: str) -> Any:
    names = [f.name for f in dataclasses.fields(cls)]
    for key, value in data.items():
        if not isinstance(key, str) or key not in names:  # (cls(**data) needs str keys)
            raise unknown_field(owner, key, value, names)
    return cls(**data)


def _check_fp8(cfg: PrepConfig) -> None:
    """``fp8`` is an ``Fp8Options`` (or its dict), set only with ``precision="fp8"``."""
    if isinstance(cfg.fp8, Mapping):
        object.__setattr__(cfg, "fp8", _build(Fp8Options, cfg.fp8, "PrepConfig.fp8"))
    if not isinstance(cfg.fp8, Fp8Options):
        raise _fail("PrepConfig", "fp8", f"must be an Fp8Options or a dict; got {cfg.fp8!r}.")
    if cfg.fp8 != Fp8Options() and cfg.precision != "fp8":
        raise _fail(
            "PrepConfig",
            "fp8",
            f"is set but precision is {cfg.precision!r}.",
            "Set precision='fp8', or drop fp8.",
        )


def _check_weights(cfg: PrepConfig) -> None:
    """``weights`` is a path (kept as a string, so the config stays plain data); the key
    patterns (``fnmatch``, e.g. ``"lm_head.*"``) only make sense with it. Whether the path
    exists is found while planning, where the files are read."""
    o = "PrepConfig"
    if cfg.weights is not None:
        path = cfg.weights
        if isinstance(path, os.PathLike):
            path = os.fspath(path)
        if not isinstance(path, str) or not path:
            raise _fail(
                o,
                "weights",
                f"must be a path (str or os.PathLike) or None; got {cfg.weights!r}.",
                "Pass a save_pretrained directory or a .safetensors file.",
            )
        object.__setattr__(cfg, "weights", path)
    for name in ("weights_extra_keys", "weights_missing_keys"):
        patterns = _names_tuple(o, name, getattr(cfg, name))
        object.__setattr__(cfg, name, patterns)
        if any(not p for p in patterns):
            raise _fail(o, name, "contains an empty pattern.")
        if patterns and cfg.weights is None:
            raise _fail(
                o,
                name,
                "is set but weights is not.",
                f"Set weights=PATH, or drop {name}.",
            )


def _normalize_tp_plan(value: object) -> Any:
    """``{pattern: style}`` as sorted ``(pattern, style)`` pairs (hashable); each style checked
    against the vocabulary here, the patterns against the model while planning."""
    from fprep.layout.styles import check_style

    if value is None:
        return None
    if isinstance(value, tuple) and all(isinstance(i, tuple) and len(i) == 2 for i in value):
        value = dict(value)
    if not isinstance(value, Mapping):
        raise _fail(
            "PrepConfig",
            "tp_plan",
            f"must be a dict {{module pattern: style}}; got {type(value).__qualname__}.",
            'e.g. tp_plan={"layers.*.attention.wq": "colwise", "layers.*.attention.wo": "rowwise"}',
        )
    pairs: list[tuple[str, str]] = []
    for pattern, style in value.items():
        if not isinstance(pattern, str) or not pattern:
            raise _fail("PrepConfig", "tp_plan", f"has a pattern {pattern!r}; patterns are FQNs.")
        check_style(pattern, style)
        pairs.append((pattern, style))
    return tuple(sorted(pairs))


def _check_sequence_parallel(cfg: PrepConfig) -> None:
    from fprep.layout.styles import SEQUENCE_ONLY

    if cfg.sequence_parallel and cfg.tp == 1:
        raise _fail(
            "PrepConfig",
            "sequence_parallel",
            "is True but tp=1: sequence parallelism shards activations over the tp ranks.",
            "Set tp > 1, or leave sequence_parallel False.",
        )
    named = sorted({s for _, s in cfg.tp_plan_pairs or () if s in SEQUENCE_ONLY})
    if named and not cfg.sequence_parallel:
        raise _fail(
            "PrepConfig",
            "tp_plan",
            f"uses {', '.join(repr(s) for s in named)}, which only fit a sequence-parallel "
            "layout (every norm, dropout and block boundary sharded on the sequence).",
            "Set sequence_parallel=True (fprep then plans the whole layout), or use 'replicate'.",
        )


def _check_pipeline(cfg: PrepConfig) -> None:
    o = "PrepConfig"
    _check_int(o, "pp", cfg.pp, minimum=1)
    _check_choice(o, "pp_schedule", cfg.pp_schedule, PipelineSchedule)
    if cfg.pp_microbatches is not None:
        _check_int(o, "pp_microbatches", cfg.pp_microbatches, minimum=1)
    _check_int(o, "pp_stages_per_rank", cfg.pp_stages_per_rank, minimum=1)
    split: Any = cfg.pp_split  # whatever the caller passed, checked here
    if split is not None:
        if isinstance(split, str | bytes) or not isinstance(split, tuple | list):
            raise _fail(
                o,
                "pp_split",
                f"must be a list of stages, each a list of module names; got {split!r}.",
                "e.g. pp_split=[['tok_embeddings', 'layers.0'], ['layers.1', 'norm', 'output']]",
            )
        stages = []
        stage: Any
        for index, stage in enumerate(split):
            if isinstance(stage, str | bytes) or not isinstance(stage, tuple | list) or not stage:
                raise _fail(
                    o,
                    "pp_split",
                    f"stage {index} is {stage!r}, not a non-empty list of module names.",
                    "Give each stage a list of module names, e.g. ['layers.0', 'layers.1'].",
                )
            if not all(isinstance(n, str) and n for n in stage):
                raise _fail(o, "pp_split", f"stage {index} names {stage!r}; names are FQNs.")
            stages.append(tuple(stage))
        object.__setattr__(cfg, "pp_split", tuple(stages))
    if cfg.pp == 1 and (split is not None or cfg.pp_microbatches is not None):
        field_name = "pp_split" if split is not None else "pp_microbatches"
        raise _fail(
            o,
            field_name,
            "is set but pp=1: there is no pipeline to split or feed.",
            "Set pp > 1 (the pipeline ranks), or leave it unset.",
        )


#: The styles of an expert-parallel plan (transformers' names): the experts module dispatches
#: its tokens to the ranks holding their experts; its parameters run as one grouped GEMM.
EP_STYLES = ("ep_dispatch_experts", "grouped_gemm")


def _check_expert_parallel(cfg: PrepConfig) -> None:
    o = "PrepConfig"
    _check_int(o, "ep", cfg.ep, minimum=1)
    plan: Any = cfg.ep_plan
    if plan is None:
        return
    if isinstance(plan, tuple) and all(isinstance(i, tuple) and len(i) == 2 for i in plan):
        plan = dict(plan)
    if not isinstance(plan, Mapping):
        raise _fail(
            o,
            "ep_plan",
            f"must be a dict {{module pattern: style}}; got {type(plan).__qualname__}.",
            'e.g. ep_plan={"layers.*.mlp.experts": "ep_dispatch_experts"}',
        )
    for pattern, style in plan.items():
        if not isinstance(pattern, str) or not pattern:
            raise _fail(o, "ep_plan", f"has a pattern {pattern!r}; patterns are FQNs.")
        if style not in EP_STYLES:
            raise _fail(
                o,
                "ep_plan",
                f"gives {pattern!r} the style {style!r}, which is not an expert-parallel style.",
                f"Use one of {', '.join(map(repr, EP_STYLES))}.",
            )
    if cfg.ep == 1:
        raise _fail(
            o,
            "ep_plan",
            "is set but ep=1: there are no expert-parallel ranks to spread experts over.",
            "Set ep > 1 (the expert-parallel ranks), or leave ep_plan unset.",
        )
    object.__setattr__(cfg, "ep_plan", tuple(sorted(plan.items())))


def _check_device(device: object) -> None:
    from fprep.topology import DEVICE_TYPES

    ok = isinstance(device, str)
    if ok:
        kind, colon, index = str(device).partition(":")
        # ASCII digits only: str.isdigit() also accepts '²' or '١', which int() then refuses
        ok = kind in DEVICE_TYPES and (not colon or (index.isascii() and index.isdigit()))
    if not ok:
        raise ConfigError(
            f"PrepConfig.device must be a device string like 'cpu', 'cuda', 'cuda:1', 'hpu'; "
            f"got {device!r}.",
            subject="device",
            hint=f"Device types: {', '.join(DEVICE_TYPES)}.",
        )
    kind, colon, digits = str(device).partition(":")
    # (no int() of the digits as given: Python refuses to convert more than 4300 of them)
    number = int(digits.lstrip("0")[:4] or "0")
    if colon and kind in _ONE_DEVICE and number != 0:
        raise ConfigError(
            f"PrepConfig.device {device!r}: a process has one {kind} device, {kind}:0.",
            subject="device",
            hint=f"Use device={kind!r}.",
        )
    # torch keeps a device index in 8 bits: torch.device('cuda:128') silently becomes cuda:-128
    if colon and number > _MAX_DEVICE_INDEX:
        raise ConfigError(
            f"PrepConfig.device {device!r}: the index is out of range (torch's device indices "
            f"go up to {_MAX_DEVICE_INDEX}).",
            subject="device",
            hint=f"Use {kind!r} (this rank's own device) or the index of a device this "
            "machine has.",
        )


#: device types with a single device per process (no index but 0)
_ONE_DEVICE = ("cpu", "mps")
#: the largest index torch.device keeps (c10::DeviceIndex is int8)
_MAX_DEVICE_INDEX = 127
