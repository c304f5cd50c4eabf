"""Snapshots: everything the plan needs to know about a model, as plain immutable data.

``ModuleTree.of(model)`` walks the module once (O(modules + parameters + buffers)) and never reads
tensor data, so it is as cheap on a 405B-parameter model built on the meta device as on a toy one.
Because a ``ModuleTree`` is plain data, hypothesis can generate thousands of them without building
a single ``nn.Module`` (see ``fprep.testing.strategies``).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import Literal

import torch
from torch import nn
from torch.nn.parameter import UninitializedBuffer, UninitializedParameter

from fprep.errors import ModelError

#: Module names that wrappers insert into FQNs; dropping them gives the user's original names.
WRAPPER_PARTS: frozenset[str] = frozenset(
    {
        "_orig_mod",  # torch.compile's OptimizedModule
        "_checkpoint_wrapped_module",  # activation-checkpoint wrapper
        "_fsdp_wrapped_module",  # FSDP1
    }
)

#: Containers without a forward of their own (used when ``ModuleInfo.has_forward`` is unknown).
NO_FORWARD_CONTAINERS: frozenset[str] = frozenset(
    {"torch.nn.modules.container.ModuleList", "torch.nn.modules.container.ModuleDict"}
)

#: FSDP2's ``FSDPModule`` and FSDP1's wrapper, by bare class name: torch moves them between
#: private modules (``torch.distributed.fsdp.FSDPModule`` in 2.13, ``..._fully_shard.FSDPModule``
#: before), so any class of that name under ``torch.distributed`` counts.
_SHARDED_CLASSES = ("FSDPModule", "FullyShardedDataParallel")
#: What ``torch.compile(model)`` returns (the model is its child ``_orig_mod``).
COMPILED_WRAPPER = "torch._dynamo.eval_frame.OptimizedModule"
_REPLICATED_MARKERS = ("torch.nn.parallel.distributed.DistributedDataParallel",)

#: ``nn.Module.forward`` of a class that does not define one (ModuleList, ModuleDict, ...).
_UNIMPLEMENTED_FORWARD = nn.Module.forward

#: The class of the pass-through that stands in for another pipeline stage's module
#: (``fprep.apply.pipeline_stages.StageGap``; a rank's part of the model has one per module
#: another stage holds).
STAGE_GAP_CLS = "fprep.apply.pipeline_stages.StageGap"

#: Attribute that ``prepare`` sets on a model it has prepared (so a second prepare is refused).
PREPARED_ATTR = "_fprep_prepared"

DTYPE_BYTES: Mapping[str, int] = {
    "float64": 8,
    "float32": 4,
    "float16": 2,
    "bfloat16": 2,
    "float8_e4m3fn": 1,
    "float8_e5m2": 1,
    "int64": 8,
    "int32": 4,
    "int16": 2,
    "int8": 1,
    "uint8": 1,
    "bool": 1,
    "complex64": 8,
    "complex128": 16,
}


def dtype_name(dtype: torch.dtype) -> str:
    """``torch.float32`` -> ``"float32"``: the spelling snapshots use."""
    return str(dtype).removeprefix("torch.")


def dtype_bytes(name: str) -> int:
    """Bytes per element of a dtype given by name (unknown dtypes count as 4)."""
    return DTYPE_BYTES.get(name, 4)


def clean_fqn(fqn: str) -> str:
    """The user's original name of a parameter or module, with wrapper parts removed."""
    if "_" not in fqn:
        return fqn
    return ".".join(part for part in fqn.split(".") if part not in WRAPPER_PARTS)


def join_fqn(prefix: str, name: str) -> str:
    return f"{prefix}.{name}" if prefix else name


def parent_fqn(fqn: str) -> str:
    """``"a.b.c"`` -> ``"a.b"``; the root's parent is the root (``""``)."""
    return fqn.rpartition(".")[0]


def is_within(fqn: str, ancestor: str) -> bool:
    """Whether module ``fqn`` is ``ancestor`` or lies in its subtree."""
    return ancestor == "" or fqn == ancestor or fqn.startswith(ancestor + ".")


@dataclass(frozen=True, slots=True)
class ParamInfo:
    """One parameter object; tied parameters appear once with every name they are reachable by."""

    names: tuple[str, ...]
    shape: tuple[int, ...]
    dtype: str = "float32"
    device: str = "cpu"
    requires_grad: bool = True
    #: False for a strided layout FSDP cannot shard (e.g. channels_last convolution weights)
    contiguous: bool = True

    @property
    def fqn(self) -> str:
        """Canonical name: the first name in registration (state-dict) order."""
        return self.names[0]

    @property
    def numel(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n

    @property
    def is_meta(self) -> bool:
        return self.device == "meta"

    @property
    def is_tied(self) -> bool:
        return len(self.names) > 1

    @property
    def owners(self) -> tuple[str, ...]:
        """FQNs of the modules that register this parameter (more than one when tied)."""
        return tuple(dict.fromkeys(parent_fqn(n) for n in self.names))


@dataclass(frozen=True, slots=True)
class BufferInfo:
    """One buffer: its FQN, shape, dtype and whether it is saved in the state dict."""

    fqn: str
    shape: tuple[int, ...]
    dtype: str = "float32"
    device: str = "cpu"
    persistent: bool = True

    @property
    def is_meta(self) -> bool:
        return self.device == "meta"


@dataclass(frozen=True, slots=True)
class ModuleInfo:
    """One module position in the tree (a module reachable by two paths appears twice)."""

    fqn: str
    cls: str
    mro: tuple[str, ...] = ()
    children: tuple[str, ...] = ()
    param_names: tuple[str, ...] = ()  # local names of directly registered parameters
    buffer_names: tuple[str, ...] = ()  # local names of directly registered buffers
    has_reset_parameters: bool = True
    #: The class defines ``init_weights`` (torchtitan's convention: a root that initializes
    #: everything below it)
    has_init_weights: bool = False
    #: False for a ModuleList / ModuleDict (or subclass) that defines no forward — what
    #: ``fully_shard`` refuses; ``None``: judge by class name (hand-built trees)
    has_forward: bool | None = None
    #: ``module.compile()`` was called (it sets ``_compiled_call_impl``)
    compiled: bool = False

    @property
    def class_name(self) -> str:
        """Bare class name (``"Linear"``), as Accelerate's ``transformer_layer_cls_to_wrap``."""
        return self.cls.rpartition(".")[2]

    def is_a(self, qualified_or_bare: str) -> bool:
        """Whether the module's class or one of its bases has this name (bare or qualified)."""
        names = self.mro or (self.cls,)
        if "." in qualified_or_bare:
            return qualified_or_bare in names
        return any(n.rpartition(".")[2] == qualified_or_bare for n in names)

    @property
    def is_stage_gap(self) -> bool:
        """A pass-through standing in for another pipeline stage's module (see STAGE_GAP_CLS)."""
        return self.cls == STAGE_GAP_CLS

    @property
    def can_run_forward(self) -> bool:
        """False for containers such as ModuleList / ModuleDict, which cannot be wrap units."""
        if self.has_forward is not None:
            return self.has_forward
        return self.cls not in NO_FORWARD_CONTAINERS

    @property
    def is_sharded(self) -> bool:
        """Already managed by FSDP (FSDP2 ``fully_shard`` or the FSDP1 wrapper)."""
        return any(
            m.startswith("torch.distributed.") and m.rpartition(".")[2] in _SHARDED_CLASSES
            for m in self.mro
        )

    @property
    def is_compiled(self) -> bool:
        """Already compiled by the user: ``torch.compile(module)`` or ``module.compile()``."""
        return self.compiled or COMPILED_WRAPPER in self.mro

    @property
    def is_replicated(self) -> bool:
        return any(m in self.mro for m in _REPLICATED_MARKERS)


def _refuse_uninitialized(module: nn.Module, fqn: str, kind: str) -> None:
    raise ModelError(
        f"{kind} {fqn!r} of {type(module).__qualname__} is not initialized yet (a lazy module: "
        "its shape is known only after a first forward pass), so there is nothing to plan.",
        subject=fqn,
        hint="Run one forward pass on a sample batch (or use the non-lazy module with its "
        "sizes) before fprep.plan / fprep.prepare.",
    )


def _refuse_cycle(module: nn.Module, fqn: str) -> None:
    raise ModelError(
        f"the module tree has a cycle: {fqn!r} is a {type(module).__qualname__} that is also "
        "one of its own ancestors, so the tree has no end (state_dict() would recurse forever).",
        subject=fqn,
        hint="Register each module below itself at most once: keep a reference to a parent in "
        "a plain attribute (object.__setattr__) or a weakref, not as a submodule.",
    )


@dataclass(frozen=True)
class ModuleTree:
    """A model's structure: modules in pre-order (root first), unique parameters, buffers.

    ``hf_device_map`` and ``quantization`` carry the Hugging Face loading facts that the seeds
    check (a model dispatched with ``device_map`` or loaded in 8/4 bit), so those checks are
    decidable from the snapshot too.
    """

    modules: tuple[ModuleInfo, ...]
    params: tuple[ParamInfo, ...] = ()
    buffers: tuple[BufferInfo, ...] = ()
    hf_device_map: tuple[tuple[str, str], ...] | None = None
    quantization: Literal["8bit", "4bit"] | None = None
    prepared: bool = False
    #: The model's own tensor-parallel plan (a transformers model's, as transformers resolves
    #: it: its ``base_model_tp_plan``, its sub-models' and its class's ``_tp_plan``, each under
    #: its module; any other model's ``_tp_plan``), as ``(module or parameter pattern, style)``
    #: pairs from the root; None when it has none.
    tp_plan: tuple[tuple[str, str], ...] | None = None
    #: Head counts tensor parallelism must divide (``num_attention_heads``,
    #: ``num_key_value_heads``, ``n_heads``, ``n_kv_heads`` of ``model.config`` or its text
    #: config); a field that varies by layer appears once per distinct value.
    head_counts: tuple[tuple[str, int], ...] = ()
    #: Other sizes of ``model.config`` a tp style needs (``qk_rope_head_dim``: the rope part
    #: ``mla_kv_a_proj`` splits off).
    model_dims: tuple[tuple[str, int], ...] = ()
    #: The model's own pipeline plan: the modules its forward runs one after another, in that
    #: order, from the root (transformers' ``base_model_pp_plan`` under ``base_model_prefix``
    #: plus the class's ``_pp_plan``; any model's ``_pp_plan``). A model that has one declares
    #: that its forward passes activations through each of them, so a pipeline stage can stand
    #: a pass-through in for the ones another stage holds. None when it has none.
    pp_plan: tuple[str, ...] | None = None
    _module_index: dict[str, ModuleInfo] = field(init=False, repr=False, compare=False, hash=False)
    _param_index: dict[str, ParamInfo] = field(init=False, repr=False, compare=False, hash=False)

    def __post_init__(self) -> None:
        if not self.modules or self.modules[0].fqn != "":
            raise ModelError(
                "A ModuleTree needs its root module first, with FQN ''.", subject="modules"
            )
        module_index = {m.fqn: m for m in self.modules}
        param_index: dict[str, ParamInfo] = {}
        for p in self.params:
            for name in p.names:
                param_index[name] = p
        object.__setattr__(self, "_module_index", module_index)
        object.__setattr__(self, "_param_index", param_index)

    # -- lookups ---------------------------------------------------------------------------
    @property
    def root(self) -> ModuleInfo:
        return self.modules[0]

    def module(self, fqn: str) -> ModuleInfo | None:
        return self._module_index.get(fqn)

    def param(self, name: str) -> ParamInfo | None:
        """The parameter reachable by ``name`` (any of a tied parameter's names)."""
        return self._param_index.get(name)

    def has_module(self, fqn: str) -> bool:
        return fqn in self._module_index

    def subtree(self, fqn: str) -> Iterator[ModuleInfo]:
        """``fqn`` and every module below it, in pre-order."""
        for m in self.modules:
            if is_within(m.fqn, fqn):
                yield m

    @property
    def numel(self) -> int:
        return sum(p.numel for p in self.params)

    @property
    def is_meta(self) -> bool:
        return any(p.is_meta for p in self.params) or any(b.is_meta for b in self.buffers)

    # -- construction ----------------------------------------------------------------------
    @classmethod
    def of(cls, model: nn.Module) -> ModuleTree:
        """Snapshot ``model`` in one walk. Reads metadata only (shape, dtype, device)."""
        if not isinstance(model, nn.Module):
            raise ModelError(
                f"fprep prepares torch.nn.Module objects; got {type(model).__qualname__}.",
                subject="model",
                hint="Pass the model itself (an nn.Module) as the first argument.",
            )
        modules: list[ModuleInfo] = []
        params: dict[int, tuple[list[str], torch.Tensor]] = {}
        buffers: list[BufferInfo] = []
        # Per class: its MRO names and whether it has reset_parameters (looked up once).
        class_cache: dict[type, tuple[tuple[str, ...], bool, bool, bool]] = {}

        # A module registered below itself (a cycle) would make the walk endless. Each entry
        # carries its parent's position; only a module met again (shared, or a cycle) has its
        # ancestors searched, so the common case costs one set lookup.
        ids: list[int] = []  # id of the module at each position
        parents: list[int] = []  # position of each position's parent (-1: the root)
        met: set[int] = set()
        stack: list[tuple[str, nn.Module, int]] = [("", model, -1)]
        while stack:
            prefix, mod, parent = stack.pop()
            key = id(mod)
            if key in met:
                at = parent
                while at >= 0:
                    if ids[at] == key:
                        _refuse_cycle(mod, prefix)
                    at = parents[at]
            met.add(key)
            position = len(ids)
            ids.append(key)
            parents.append(parent)
            kind = type(mod)
            known = class_cache.get(kind)
            if known is None:
                known = (
                    tuple(f"{k.__module__}.{k.__qualname__}" for k in kind.__mro__),
                    callable(getattr(kind, "reset_parameters", None)),
                    callable(getattr(kind, "init_weights", None)),
                    # fully_shard's rule: ModuleList / ModuleDict without a forward of their own
                    not (
                        issubclass(kind, nn.ModuleList | nn.ModuleDict)
                        and getattr(kind, "forward", None) is _UNIMPLEMENTED_FORWARD
                    ),
                )
                class_cache[kind] = known
            mro, has_reset, has_init_weights, has_forward = known
            dot = prefix + "." if prefix else ""  # join_fqn(prefix, name) == dot + name
            param_names: list[str] = []
            for name, p in mod._parameters.items():
                if p is None:
                    continue
                if isinstance(p, UninitializedParameter):
                    _refuse_uninitialized(mod, dot + name, "parameter")
                param_names.append(name)
                seen = params.get(id(p))
                if seen is None:
                    params[id(p)] = ([dot + name], p)
                else:
                    seen[0].append(dot + name)
            buffer_names: list[str] = []
            if mod._buffers:
                non_persistent = mod._non_persistent_buffers_set
                for name, b in mod._buffers.items():
                    if b is None:
                        continue
                    if isinstance(b, UninitializedBuffer):
                        _refuse_uninitialized(mod, dot + name, "buffer")
                    buffer_names.append(name)
                    buffers.append(
                        BufferInfo(
                            fqn=dot + name,
                            shape=tuple(b.shape),
                            dtype=dtype_name(b.dtype),
                            device=str(b.device),
                            persistent=name not in non_persistent,
                        )
                    )
            children = [(dot + n, c) for n, c in mod._modules.items() if c is not None]
            modules.append(
                ModuleInfo(
                    fqn=prefix,
                    cls=mro[0],
                    mro=mro,
                    children=tuple([fqn for fqn, _ in children]),
                    param_names=tuple(param_names),
                    buffer_names=tuple(buffer_names),
                    has_reset_parameters=has_reset,
                    has_init_weights=has_init_weights,
                    has_forward=has_forward,
                    compiled=mod.__dict__.get("_compiled_call_impl") is not None,
                )
            )
            stack.extend([(fqn, c, position) for fqn, c in reversed(children)])

        param_infos = tuple(
            ParamInfo(
                names=tuple(names),
                shape=tuple(p.shape),
                dtype=dtype_name(p.dtype),
                device=str(p.device),
                requires_grad=p.requires_grad,
                contiguous=p.is_contiguous(),
            )
            for names, p in params.values()
        )
        device_map = getattr(model, "hf_device_map", None)
        quant: Literal["8bit", "4bit"] | None = None
        if getattr(model, "is_loaded_in_8bit", False):
            quant = "8bit"
        elif getattr(model, "is_loaded_in_4bit", False):
            quant = "4bit"
        return cls(
            modules=tuple(modules),
            params=param_infos,
            buffers=tuple(buffers),
            hf_device_map=(
                tuple((str(k), str(v)) for k, v in device_map.items())
                if isinstance(device_map, Mapping)
                else None
            ),
            quantization=quant,
            prepared=bool(getattr(model, PREPARED_ATTR, False)),
            tp_plan=own_tp_plan(model),
            head_counts=head_counts(model),
            model_dims=_config_ints(model, _DIM_FIELDS),
            pp_plan=own_pp_plan(model),
        )


_HEAD_FIELDS = ("num_attention_heads", "num_key_value_heads", "n_heads", "n_kv_heads")


def own_tp_plan(model: nn.Module) -> tuple[tuple[str, str], ...] | None:
    """The plan a model carries (transformers' convention), with patterns from the root. A peft
    model carries its base model's, under the base model's FQN (``fprep.adapters`` maps the
    patterns that reach wrapped layers onto their base layers and adapters)."""
    inner = _peft_base(model)
    if inner is not None:
        at, base_model = inner
        own = own_tp_plan(base_model)
        return tuple((f"{at}.{k}", v) for k, v in own) if own is not None else None
    resolved = vars(model).get("_tp_plan")
    if callable(getattr(model, "init_parallel_plans", None)) and isinstance(resolved, Mapping):
        # transformers merged its plans at post_init (sub-models' under their modules, and
        # 'embed_tokens': 'embedding_rowwise' beside a plan that names no embedding)
        return tuple(sorted((str(k), str(v)) for k, v in resolved.items())) or None
    plan: dict[str, str] = {}
    config = getattr(model, "config", None)
    base = getattr(config, "base_model_tp_plan", None)
    prefix = getattr(model, "base_model_prefix", "")
    if isinstance(base, Mapping):
        # a task model holds the base model under ``base_model_prefix`` ("model"); the base
        # model itself (LlamaModel) holds the layers directly
        under = prefix if prefix and isinstance(getattr(model, prefix, None), nn.Module) else ""
        plan.update({(f"{under}.{k}" if under else str(k)): str(v) for k, v in base.items()})
    own = getattr(type(model), "_tp_plan", None)
    if isinstance(own, Mapping):
        plan.update({str(k): str(v) for k, v in own.items()})
    return tuple(sorted(plan.items())) if plan else None


def own_pp_plan(model: nn.Module) -> tuple[str, ...] | None:
    """The modules a model's forward runs in sequence, from the root, as the model declares
    them (see ``ModuleTree.pp_plan``); None when it declares none."""
    order: list[str] = []
    config = getattr(model, "config", None)
    base = getattr(config, "base_model_pp_plan", None)
    prefix = getattr(model, "base_model_prefix", "")
    if isinstance(base, Mapping) and base:
        under = prefix if prefix and isinstance(getattr(model, prefix, None), nn.Module) else ""
        order.extend(f"{under}.{k}" if under else str(k) for k in base)
    own = getattr(type(model), "_pp_plan", None)
    if isinstance(own, Mapping):
        order.extend(str(k) for k in own if str(k) not in order)
    return tuple(order) if order else None


def _peft_base(model: nn.Module) -> tuple[str, nn.Module] | None:
    """``(FQN, module)`` of the model a peft model wraps (``PeftModel``: ``base_model.model``;
    a tuner such as ``LoraModel``: ``model``), by class name (fprep never imports peft)."""
    names = {f"{k.__module__}.{k.__qualname__}" for k in type(model).__mro__}
    for cls, at in (
        ("peft.peft_model.PeftModel", "base_model.model"),
        ("peft.tuners.tuners_utils.BaseTuner", "model"),
    ):
        if cls in names:
            try:
                inner = model.get_submodule(at)
            except AttributeError:
                return None
            return at, inner
    return None


_DIM_FIELDS = ("qk_rope_head_dim",)


def head_counts(model: nn.Module) -> tuple[tuple[str, int], ...]:
    return _config_ints(model, _HEAD_FIELDS)


def _config_ints(model: nn.Module, fields: tuple[str, ...]) -> tuple[tuple[str, int], ...]:
    """``(field, value)`` for each integer field of the model's (text) config; a field that
    varies by layer (transformers' per-layer configs refuse the global read) once per distinct
    value of its layers."""
    config = getattr(model, "config", None)
    text = getattr(config, "get_text_config", None)
    if callable(text):
        with contextlib.suppress(Exception):  # several text configs: read the top level
            config = text()
    out: list[tuple[str, int]] = []
    for name in fields:
        try:
            values = [getattr(config, name, None)]
        except Exception:  # AmbiguousGlobalPerLayerAttributeError: read each layer's
            layers = getattr(config, "per_layer_config", None) or ()
            values = [getattr(layer, name, None) for layer in layers]
        for value in dict.fromkeys(values):
            if isinstance(value, int) and not isinstance(value, bool):
                out.append((name, value))
    return tuple(out)
