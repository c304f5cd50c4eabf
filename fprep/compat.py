"""compat: every behaviour that depends on the installed torch (or torchao) release, decided here.

fprep supports torch ``MIN_TORCH`` to ``NEWEST_TESTED`` (docs/versions.md says which releases were
tested where). Other modules never compare versions or probe torch's attributes themselves: they
ask this module, which decides from feature probes (``inspect.signature``, an attribute's
presence) where one exists and from ``torch.__version__`` only for what a probe cannot see (the
support range). Supporting a new release means changing this file and tests/test_compat.py.

A feature that needs a newer torch or torchao than the one installed is refused with a
``ConfigError`` naming the feature and the minimum release, never a ``TypeError`` or
``AttributeError`` from deep inside torch.
"""

from __future__ import annotations

import functools
import importlib
import importlib.metadata
import inspect
import re
from dataclasses import dataclass
from typing import Any

import torch

from fprep.errors import ConfigError

#: The oldest torch fprep runs on (FSDP2, DTensor and DCP as fprep uses them are all in 2.11).
MIN_TORCH = (2, 11)
#: The newest torch release fprep was tested with (pyproject's upper bound is the next minor).
NEWEST_TESTED = (2, 15)
#: The oldest torchao whose float8 training API fprep uses (recipes by name, a module filter,
#: float8 all-gather under FSDP2); 0.18 is the release tested.
MIN_TORCHAO = (0, 10)

_VERSION = re.compile(
    r"^(?P<major>\d+)\.(?P<minor>\d+)(?:\.(?P<patch>\d+))?"
    r"(?P<pre>(?:a|b|rc|alpha|beta)\d*)?(?:\.?(?P<dev>(?:dev|post)\d*))?"
    r"(?:\+(?P<local>[0-9A-Za-z.]+))?$"
)


@dataclass(frozen=True, order=True)
class Version:
    """A release number as torch and torchao write it (PEP 440 subset).

    ``2.11.0+cu130`` is 2.11.0 built for CUDA 13.0; ``2.15.0a0+git1a2b3c`` is a build from the
    2.15 development branch, which has 2.15's features for everything fprep probes.
    """

    major: int
    minor: int
    patch: int = 0
    pre: str = ""  # "a0", "rc1": a pre-release of major.minor.patch
    local: str = ""  # "cu130", "cpu", "git1a2b3c": the build, not the release

    @property
    def release(self) -> tuple[int, int, int]:
        return (self.major, self.minor, self.patch)

    def at_least(self, minimum: tuple[int, ...]) -> bool:
        """Whether this is ``minimum`` or newer (pre-releases count as their release)."""
        return self.release >= tuple(minimum) + (0,) * (3 - len(minimum))

    def __str__(self) -> str:
        text = f"{self.major}.{self.minor}.{self.patch}{self.pre}"
        return f"{text}+{self.local}" if self.local else text


def parse_version(text: str, *, what: str = "torch") -> Version:
    """``Version`` of ``text``; a string that is no release number is a ``ConfigError``."""
    match = _VERSION.match(text.strip()) if isinstance(text, str) else None
    if match is None:
        raise ConfigError(
            f"cannot read {what}'s version {text!r}.",
            subject=f"{what}.__version__",
            hint="fprep expects versions like '2.13.0', '2.11.0+cu130' or '2.15.0a0+git1234'.",
        )
    return Version(
        major=int(match["major"]),
        minor=int(match["minor"]),
        patch=int(match["patch"] or 0),
        pre=match["pre"] or "",
        local=match["local"] or "",
    )


def _dotted(version: tuple[int, ...]) -> str:
    return ".".join(str(v) for v in version)


@dataclass(frozen=True)
class TorchFeatures:
    """What the installed torch offers, as fprep needs to know it."""

    version: Version
    #: ``DistributedDataParallel(forward_sync_buffers=)`` (torch 2.13): before it, the same
    #: switch is ``broadcast_buffers=`` (which 2.13 deprecates).
    ddp_forward_sync_buffers: bool

    @property
    def supported(self) -> bool:
        """Within the range fprep declares (``MIN_TORCH`` to ``NEWEST_TESTED``, any patch)."""
        minor = (self.version.major, self.version.minor)
        return MIN_TORCH <= minor <= NEWEST_TESTED

    def support_note(self) -> str:
        """A sentence when this torch is outside the tested range; empty inside it."""
        if self.supported:
            return ""
        lo, hi = _dotted(MIN_TORCH), _dotted(NEWEST_TESTED)
        side = "older" if self.version.release < (*MIN_TORCH, 0) else "newer"
        return (
            f"torch {self.version} is {side} than the releases fprep is tested with "
            f"({lo} to {hi}.x); see docs/versions.md."
        )


def probe_torch(version: str | None = None) -> TorchFeatures:
    """Probe the installed torch (``version`` overrides only the reported version string)."""
    from torch.nn.parallel import DistributedDataParallel

    ddp_params = inspect.signature(DistributedDataParallel.__init__).parameters
    return TorchFeatures(
        version=parse_version(torch.__version__ if version is None else version),
        ddp_forward_sync_buffers="forward_sync_buffers" in ddp_params,
    )


@functools.cache
def torch_features() -> TorchFeatures:
    """``probe_torch()`` of this process's torch (probed once: the installed torch cannot
    change under a running process)."""
    return probe_torch()


# -- pipeline parallelism ------------------------------------------------------------------------
#: torch's class for each schedule fprep offers (``PrepConfig.pp_schedule``).
PIPELINE_SCHEDULE_CLASSES = {
    "GPipe": "ScheduleGPipe",
    "1F1B": "Schedule1F1B",
    "Interleaved1F1B": "ScheduleInterleaved1F1B",
    "LoopedBFS": "ScheduleLoopedBFS",
    "InterleavedZeroBubble": "ScheduleInterleavedZeroBubble",
    "ZBVZeroBubble": "ScheduleZBVZeroBubble",
    "DualPipeV": "ScheduleDualPipeV",
}


def pipeline_schedule_class(name: str) -> Any:
    """torch's schedule class for ``pp_schedule=name``; a ``ConfigError`` naming the field when
    this torch does not have it (probed: the class's presence in
    ``torch.distributed.pipelining.schedules``)."""
    try:
        schedules = importlib.import_module("torch.distributed.pipelining.schedules")
    except ImportError:
        schedules = None
    cls = getattr(schedules, PIPELINE_SCHEDULE_CLASSES.get(name, ""), None)
    if cls is None:
        raise ConfigError(
            f"pp_schedule={name!r}: torch {torch.__version__} has no such pipeline schedule "
            "(torch.distributed.pipelining).",
            subject="pp_schedule",
            hint="Use one this torch has (1F1B, GPipe, Interleaved1F1B are in every release "
            "fprep supports), or a newer torch.",
        )
    return cls


def pipeline_stage_meshes() -> bool:
    """Whether ``PipelineStage`` takes ``get_mesh=`` (DTensor activations between stages:
    sequence parallelism under pp), probed on its signature."""
    from torch.distributed.pipelining import PipelineStage

    return "get_mesh" in inspect.signature(PipelineStage.__init__).parameters


# -- DistributedDataParallel --------------------------------------------------------------------
def ddp_buffer_kwargs(sync_buffers: bool) -> dict[str, bool]:
    """DDP's keyword for "broadcast buffers from rank 0 before each forward"."""
    name = (
        "forward_sync_buffers" if torch_features().ddp_forward_sync_buffers else "broadcast_buffers"
    )
    return {name: sync_buffers}


def ddp_syncs_buffers(ddp: Any) -> bool:
    """Whether a ``DistributedDataParallel`` broadcasts buffers before each forward."""
    name = (
        "forward_sync_buffers" if torch_features().ddp_forward_sync_buffers else "broadcast_buffers"
    )
    return bool(getattr(ddp, name))


# -- DTensor loss parallelism ----------------------------------------------------------------
def loss_parallel_active() -> bool:
    """Whether torch's ``loss_parallel()`` is entered (its cross-entropy handlers sit in
    DTensor's op dispatcher). True where this torch keeps them elsewhere: a check built on this
    then never refuses for want of knowing."""
    try:
        from torch.distributed.tensor import DTensor

        handlers = DTensor._op_dispatcher._custom_op_handlers
    except (ImportError, AttributeError):  # pragma: no cover - another torch's layout
        return True
    return torch.ops.aten.nll_loss_forward.default in handlers


# -- torchao float8 -----------------------------------------------------------------------------
@dataclass(frozen=True)
class Float8Api:
    """torchao's float8 training entry points, checked to be the ones fprep calls."""

    version: Version
    convert: Any  # convert_to_float8_training(module, *, module_filter_fn, config)
    config_for_recipe: Any  # Float8LinearConfig.from_recipe_name(name)
    recipes: tuple[str, ...]  # the recipe names this torchao knows
    fsdp_float8_all_gather: bool  # Float8LinearConfig(enable_fsdp_float8_all_gather=)
    #: precompute_float8_dynamic_scale_for_fsdp(module): one all-reduce for every float8
    #: weight's scale, after each optimizer step (None when this torchao lacks it)
    precompute_fsdp_scales: Any = None
    #: torchao.float8.float8_tensor_parallel's (Float8ColwiseParallel, Float8RowwiseParallel):
    #: tensor parallelism over Float8Linear with tensorwise scales (None when absent)
    tp_styles: tuple[Any, Any] | None = None


def _torchao_missing(why: str, feature: str) -> ConfigError:
    return ConfigError(
        f"{feature} needs torchao >= {_dotted(MIN_TORCHAO)}: {why}",
        subject="precision",
        hint=f"pip install 'torchao>={_dotted(MIN_TORCHAO)}' (0.18 is tested), or use "
        "precision='bf16'.",
    )


def float8_api(feature: str = "precision='fp8' on CUDA") -> Float8Api:
    """torchao's float8 training API, or a ``ConfigError`` naming ``feature`` and the minimum
    torchao when it is absent, too old, or lacks what fprep calls."""
    try:
        float8 = importlib.import_module("torchao.float8")
    except ImportError as e:
        raise _torchao_missing(f"it is not importable ({e}).", feature) from None
    try:
        found = importlib.metadata.version("torchao")
    except importlib.metadata.PackageNotFoundError:
        found = str(getattr(importlib.import_module("torchao"), "__version__", "0.0"))
    version = parse_version(found, what="torchao")
    if not version.at_least(MIN_TORCHAO):
        raise _torchao_missing(f"torchao {version} is installed.", feature)
    convert = getattr(float8, "convert_to_float8_training", None)
    config_cls = getattr(float8, "Float8LinearConfig", None)
    recipe_enum = getattr(float8, "Float8LinearRecipeName", None)
    if (
        convert is None
        or config_cls is None
        or recipe_enum is None
        or not hasattr(config_cls, "from_recipe_name")
        or "module_filter_fn" not in inspect.signature(convert).parameters
    ):
        raise _torchao_missing(
            f"torchao {version} lacks convert_to_float8_training(module_filter_fn=) or "
            "Float8LinearConfig.from_recipe_name.",
            feature,
        )
    fields = getattr(config_cls, "__dataclass_fields__", {})
    try:
        tp = importlib.import_module("torchao.float8.float8_tensor_parallel")
        tp_styles = (tp.Float8ColwiseParallel, tp.Float8RowwiseParallel)
    except (ImportError, AttributeError):
        tp_styles = None
    return Float8Api(
        version=version,
        convert=convert,
        config_for_recipe=config_cls.from_recipe_name,
        recipes=tuple(str(r.value) for r in recipe_enum),
        fsdp_float8_all_gather="enable_fsdp_float8_all_gather" in fields,
        precompute_fsdp_scales=getattr(float8, "precompute_float8_dynamic_scale_for_fsdp", None),
        tp_styles=tp_styles,
    )


def float8_tp_styles(api: Float8Api) -> tuple[Any, Any]:
    """torchao's ``(Float8ColwiseParallel, Float8RowwiseParallel)``, or the ``ConfigError``."""
    if api.tp_styles is None:
        raise _torchao_missing(
            f"torchao {api.version} has no torchao.float8.float8_tensor_parallel.",
            "precision='fp8' with tp > 1",
        )
    return api.tp_styles


def float8_config(api: Float8Api, recipe: str, *, fsdp_all_gather: bool, emulate: bool) -> Any:
    """A ``Float8LinearConfig`` for ``recipe`` (a ``ConfigError`` if this torchao lacks it).

    ``emulate`` runs the float8 matmuls in high precision (torchao's switch for devices without
    float8 kernels, e.g. the CPU in tests)."""
    import dataclasses

    if recipe not in api.recipes:
        raise ConfigError(
            f"fp8.recipe={recipe!r} is not a recipe of torchao {api.version}.",
            subject="fp8.recipe",
            hint=f"Recipes there: {', '.join(api.recipes)}.",
        )
    config = api.config_for_recipe(recipe)
    changes: dict[str, bool] = {}
    if fsdp_all_gather:
        if not api.fsdp_float8_all_gather:
            raise _torchao_missing(
                f"torchao {api.version} has no enable_fsdp_float8_all_gather.",
                "fp8.fsdp_float8_all_gather",
            )
        if api.precompute_fsdp_scales is None:
            raise _torchao_missing(
                f"torchao {api.version} has no precompute_float8_dynamic_scale_for_fsdp.",
                "fp8.fsdp_float8_all_gather",
            )
        changes["enable_fsdp_float8_all_gather"] = True
    if emulate:
        changes["emulate"] = True
    return dataclasses.replace(config, **changes) if changes else config


# -- expert parallelism --------------------------------------------------------------------------
@functools.cache
def grouped_mm(device_type: str, dtype: torch.dtype) -> bool:
    """Whether ``torch._grouped_mm`` runs forward and backward on ``device_type`` in ``dtype``
    in this torch (the experts of expert parallelism then run as one grouped GEMM per
    projection; otherwise a loop over the local experts). Decided once per process by running
    it on a few rows: which devices, dtypes and architectures it supports has changed from one
    release to the next (CUDA needed sm90 at first; the CPU runs it since 2.8)."""
    if not hasattr(torch, "_grouped_mm"):
        return False
    try:
        rows = torch.ones(3, 8, device=device_type, dtype=dtype, requires_grad=True)
        weights = torch.ones(2, 8, 8, device=device_type, dtype=dtype, requires_grad=True)
        ends = torch.tensor([1, 3], device=device_type, dtype=torch.int32)
        out = torch._grouped_mm(rows, weights.transpose(-2, -1), offs=ends)
        torch.autograd.backward(out, torch.ones_like(out))
        return bool(weights.grad is not None and float(weights.grad.sum()) == 3 * 8 * 8)
    except (RuntimeError, NotImplementedError, TypeError, ValueError):
        return False
