"""Hypothesis strategies for fprep's inputs: module trees, topologies, configs, meshes, states.

Everything here builds plain snapshot data (``ModuleTree``, ``Topology``, ``PrepConfig``,
``MeshSpec``), never an ``nn.Module``, so thousands of examples cost milliseconds. Needs the
``test`` extra (``pip install fprep[test]``)::

    from hypothesis import given

    import fprep
    from fprep.testing import strategies as fst

    @given(fst.plan_inputs())
    def test_plan_never_raises(inputs):
        tree, cfg, topo = inputs
        fprep.plan(tree, cfg, topo)

Like hypothesis' own strategies, every keyword argument accepts either a plain value or a
``SearchStrategy`` of such values; a strategy is drawn from once per example.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple, TypeVar, Union, cast, get_args

from hypothesis import assume
from hypothesis import strategies as st
from hypothesis.errors import InvalidArgument
from hypothesis.strategies import SearchStrategy
from returns.result import Failure, Success
from torch import nn

from fprep.config import (
    CommHook,
    CompileMode,
    DDPOptions,
    FloatDType,
    Fp8Options,
    Offload,
    Precision,
    PrepConfig,
    Sharding,
    StateDictType,
    Strategy,
    wrap_class_names,
)
from fprep.planning import DEFAULT_TRANSITIONS, chain, plan
from fprep.snapshot import (
    BufferInfo,
    ModuleInfo,
    ModuleTree,
    ParamInfo,
    is_within,
    join_fqn,
    parent_fqn,
)
from fprep.state import GroupSpec, MeshSpec, PrepState
from fprep.topology import DEVICE_TYPES, Topology

__all__ = [
    "BLOCK_CLASS",
    "BUFFER_DTYPES",
    "CONTAINER_CLASSES",
    "MODULE_CLASSES",
    "PARAM_DTYPES",
    "ROOT_CLASS",
    "WRAP_CLASS_CHOICES",
    "WRAP_PREDICATES",
    "Drawable",
    "GroupLayout",
    "MeshLayout",
    "PlanCase",
    "configs",
    "group_layouts",
    "has_own_params",
    "is_block",
    "mesh_layouts",
    "module_trees",
    "noop_init",
    "plan_inputs",
    "prep_states",
    "shapes",
    "topologies",
]

T = TypeVar("T")

#: A plain value or a strategy drawing such values.
Drawable = Union[T, SearchStrategy[T]]  # noqa: UP007  (a generic alias needs Union on 3.10)

_MODULE = "torch.nn.modules.module.Module"
_OBJECT = "builtins.object"

#: The root class of generated trees (with its MRO, as ``ModuleTree.of`` spells it).
ROOT_CLASS: tuple[str, ...] = ("fprep_example.Model", _MODULE, _OBJECT)
#: The transformer-block class: ``wrap=("Block",)`` matches it and its subclass DecoderBlock.
BLOCK_CLASS = "fprep_example.Block"
#: Classes of non-root modules, each as its MRO (most derived first).
MODULE_CLASSES: tuple[tuple[str, ...], ...] = (
    ("torch.nn.modules.linear.Linear", _MODULE, _OBJECT),
    ("torch.nn.modules.normalization.LayerNorm", _MODULE, _OBJECT),
    ("torch.nn.modules.sparse.Embedding", _MODULE, _OBJECT),
    (
        "torch.nn.modules.batchnorm.BatchNorm1d",
        "torch.nn.modules.batchnorm._BatchNorm",
        "torch.nn.modules.batchnorm._NormBase",
        _MODULE,
        _OBJECT,
    ),
    ("torch.nn.modules.container.Sequential", _MODULE, _OBJECT),
    ("torch.nn.modules.container.ModuleList", _MODULE, _OBJECT),
    (BLOCK_CLASS, _MODULE, _OBJECT),
    ("fprep_example.DecoderBlock", BLOCK_CLASS, _MODULE, _OBJECT),
    ("fprep_example.Attention", _MODULE, _OBJECT),
    ("fprep_example.MLP", _MODULE, _OBJECT),
)

#: Containers: they hold modules only, never parameters or buffers of their own.
CONTAINER_CLASSES: frozenset[str] = frozenset(
    {"torch.nn.modules.container.Sequential", "torch.nn.modules.container.ModuleList"}
)

PARAM_DTYPES: tuple[str, ...] = ("float32", "bfloat16", "float16")
BUFFER_DTYPES: tuple[str, ...] = ("float32", "bfloat16", "float16", "int64", "bool")

_CHILD_NAMES = ("layers", "embed", "attn", "mlp", "norm", "head", "proj", "0", "1", "2", "3")
_PARAM_NAMES = ("weight", "bias", "scale", "w_in", "w_out")
_BUFFER_NAMES = ("running_mean", "running_var", "num_batches_tracked", "mask", "inv_freq")
#: Odd, tiny and round dim-0 sizes: smaller than, equal to and not dividing typical world sizes.
_DIM0_SIZES = (1, 2, 3, 4, 5, 7, 8, 9, 11, 12, 13, 16, 17, 24, 31, 64, 100)


def _draw(draw: st.DrawFn, value: Drawable[T]) -> T:
    """``value`` itself, or a value drawn from it when it is a strategy."""
    if isinstance(value, SearchStrategy):
        return cast(T, draw(value))
    return value


# -- wrap predicates and init functions (module level: comparable, hashable, importable) -------
def is_block(module: ModuleInfo) -> bool:
    """Wrap predicate: transformer blocks (``Block`` and its subclasses)."""
    return module.is_a("Block")


def has_own_params(module: ModuleInfo) -> bool:
    """Wrap predicate: every module that registers a parameter itself."""
    return bool(module.param_names)


def noop_init(module: nn.Module) -> None:
    """A ``param_init_fn`` that leaves the module as it is."""


#: Class-based wrap policies the generated trees can match (bare, qualified, and a real class).
WRAP_CLASS_CHOICES: tuple[tuple[type[nn.Module] | str, ...], ...] = (
    ("Block",),
    (BLOCK_CLASS,),
    ("DecoderBlock",),
    ("Linear", "Attention"),
    (nn.Linear,),
    ("torch.nn.modules.normalization.LayerNorm", "MLP"),
    ("NoSuchClass",),
)
WRAP_PREDICATES: tuple[Callable[[ModuleInfo], bool], ...] = (is_block, has_own_params)


# -- module trees -------------------------------------------------------------------------------
def shapes(
    *,
    allow_scalar: bool = False,
    allow_zero_size: bool = True,
    max_ndim: int = 3,
    max_dim: int = 4,
) -> SearchStrategy[tuple[int, ...]]:
    """Parameter shapes: dim 0 odd, tiny, round or (optionally) zero; small other dims."""
    low = 0 if allow_zero_size else 1
    dim0 = st.one_of(st.sampled_from(_DIM0_SIZES), st.integers(low, 20))
    rest = st.lists(st.integers(low, max_dim), max_size=max(0, max_ndim - 1)).map(tuple)
    nonscalar = st.builds(lambda d0, ds: (d0, *ds), dim0, rest)
    if allow_scalar:
        return st.one_of(nonscalar, st.just(()))
    return nonscalar


@dataclass
class _Node:
    fqn: str
    classes: tuple[str, ...]  # the MRO (``mro`` would clash with ``type.mro``)
    children: list[str]
    params: list[tuple[str, int]]  # (local name, parameter id)
    buffers: list[BufferInfo]
    has_reset: bool


@dataclass(frozen=True)
class _Tensor:
    shape: tuple[int, ...]
    dtype: str
    device: str
    requires_grad: bool


@dataclass(frozen=True)
class _TreeParts:
    params: SearchStrategy[list[tuple[str, tuple[tuple[int, ...], str, bool, bool]]]]
    buffers: SearchStrategy[list[tuple[str, tuple[tuple[int, ...], str, bool, bool]]]]
    children: SearchStrategy[list[str]]
    has_reset: SearchStrategy[bool]
    module_class: SearchStrategy[tuple[str, ...]]


@functools.lru_cache(maxsize=64)
def _tree_parts(
    params_limit: int,
    buffers_limit: int,
    children_limit: int,
    scalars: bool,
    zero_size: bool,
    param_dtypes: tuple[str, ...],
    buffer_dtypes: tuple[str, ...],
    some_meta: bool,
    missing_reset: bool,
) -> _TreeParts:
    """The element strategies of one kind of tree, built once (building them is not free)."""
    meta = st.booleans() if some_meta else st.just(False)
    param = st.tuples(
        shapes(allow_scalar=scalars, allow_zero_size=zero_size),
        st.sampled_from(param_dtypes),
        st.booleans(),
        meta,
    )
    buffer = st.tuples(
        st.lists(st.integers(0, 4), max_size=2).map(tuple),
        st.sampled_from(buffer_dtypes),
        st.booleans(),
        meta,
    )
    child_pool = _CHILD_NAMES + tuple(f"m{i}" for i in range(max(0, children_limit)))
    return _TreeParts(
        params=st.lists(
            st.tuples(st.sampled_from(_PARAM_NAMES), param),
            unique_by=lambda item: item[0],
            max_size=max(0, params_limit),
        ),
        buffers=st.lists(
            st.tuples(st.sampled_from(_BUFFER_NAMES), buffer),
            unique_by=lambda item: item[0],
            max_size=max(0, buffers_limit),
        ),
        children=st.lists(
            st.sampled_from(child_pool), unique=True, max_size=max(0, children_limit)
        ),
        has_reset=st.booleans() if missing_reset else st.just(True),
        module_class=st.sampled_from(MODULE_CLASSES),
    )


@st.composite
def module_trees(
    draw: st.DrawFn,
    /,
    *,
    max_depth: Drawable[int] = 3,
    max_children: Drawable[int] = 3,
    max_params: Drawable[int] = 3,
    max_buffers: Drawable[int] = 2,
    allow_scalar: Drawable[bool] = False,
    allow_zero_size: Drawable[bool] = True,
    allow_tied: Drawable[bool] = True,
    allow_meta: Drawable[bool] = False,
    allow_missing_reset: Drawable[bool] = False,
    device: Drawable[str] = "cpu",
    param_dtypes: Sequence[str] = PARAM_DTYPES,
    buffer_dtypes: Sequence[str] = BUFFER_DTYPES,
    hf_device_map: Drawable[tuple[tuple[str, str], ...] | None] = None,
    quantization: Drawable[str | None] = None,
    prepared: Drawable[bool] = False,
) -> ModuleTree:
    """Random, internally consistent ``ModuleTree`` snapshots, built as data.

    Modules are in pre-order with the root (``""``) first; every child FQN, parameter name and
    buffer name has its parent module, which lists the local name. Parameters have random shapes
    (odd dim-0 sizes, dim 0 smaller than world sizes, zero-size dimensions, optionally scalars);
    with ``allow_tied`` one parameter may be registered under several names in different modules
    (``ParamInfo.names`` in registration order, as ``ModuleTree.of`` records it). With
    ``allow_meta`` some or all parameters and buffers are on the meta device; the others are on
    ``device`` (drawn once per tree). ``allow_missing_reset`` lets modules lack
    ``reset_parameters``.
    """
    depth_limit = _draw(draw, max_depth)
    children_limit = _draw(draw, max_children)
    params_limit = _draw(draw, max_params)
    buffers_limit = _draw(draw, max_buffers)
    scalars = _draw(draw, allow_scalar)
    zero_size = _draw(draw, allow_zero_size)
    tied = _draw(draw, allow_tied)
    meta = _draw(draw, allow_meta)
    missing_reset = _draw(draw, allow_missing_reset)
    home = _draw(draw, device)
    meta_mode = draw(st.sampled_from(("none", "some", "all"))) if meta else "none"
    parts = _tree_parts(
        params_limit,
        buffers_limit,
        children_limit,
        scalars,
        zero_size,
        tuple(param_dtypes),
        tuple(buffer_dtypes),
        meta_mode == "some",
        missing_reset,
    )

    def place(on_meta: bool) -> str:
        return "meta" if meta_mode == "all" or on_meta else home

    tensors: list[_Tensor] = []
    nodes: list[_Node] = []

    def build(fqn: str, mro: tuple[str, ...], depth: int) -> None:
        params: list[tuple[str, int]] = []
        container = mro[0] in CONTAINER_CLASSES  # holds modules only, like the real ones
        for name, (shape, dtype, requires_grad, on_meta) in [] if container else draw(parts.params):
            params.append((name, len(tensors)))
            tensors.append(_Tensor(shape, dtype, place(on_meta), requires_grad))
        buffers = [
            BufferInfo(
                fqn=join_fqn(fqn, name),
                shape=shape,
                dtype=dtype,
                device=place(on_meta),
                persistent=persistent,
            )
            for name, (shape, dtype, persistent, on_meta) in (
                [] if container else draw(parts.buffers)
            )
        ]
        child_names: list[str] = []
        if depth < depth_limit:
            child_names = draw(parts.children)
        node = _Node(
            fqn=fqn,
            classes=mro,
            children=[join_fqn(fqn, c) for c in child_names],
            params=params,
            buffers=buffers,
            has_reset=draw(parts.has_reset),
        )
        nodes.append(node)  # before the children: pre-order
        for child in node.children:
            build(child, draw(parts.module_class), depth + 1)

    build("", ROOT_CLASS, 0)

    holders = [node for node in nodes if node.classes[0] not in CONTAINER_CLASSES]
    if tied and tensors and holders:
        ties = draw(
            st.lists(
                st.tuples(st.integers(0, len(tensors) - 1), st.integers(0, len(holders) - 1)),
                max_size=3,
            )
        )
        for k, (tensor_id, node_index) in enumerate(ties):
            holders[node_index].params.append((f"tied{k}", tensor_id))

    # One walk in pre-order, exactly as ModuleTree.of records names: first name is canonical.
    names: dict[int, list[str]] = {}
    for node in nodes:
        for local, tensor_id in node.params:
            names.setdefault(tensor_id, []).append(join_fqn(node.fqn, local))
    params_out = tuple(
        ParamInfo(
            names=tuple(fqns),
            shape=tensors[tensor_id].shape,
            dtype=tensors[tensor_id].dtype,
            device=tensors[tensor_id].device,
            requires_grad=tensors[tensor_id].requires_grad,
        )
        for tensor_id, fqns in names.items()
    )
    modules = tuple(
        ModuleInfo(
            fqn=node.fqn,
            cls=node.classes[0],
            mro=node.classes,
            children=tuple(node.children),
            param_names=tuple(local for local, _ in node.params),
            buffer_names=tuple(b.fqn.rpartition(".")[2] for b in node.buffers),
            has_reset_parameters=node.has_reset,
        )
        for node in nodes
    )
    quant = _draw(draw, quantization)
    if quant not in (None, "8bit", "4bit"):
        raise InvalidArgument(f"quantization must be None, '8bit' or '4bit'; got {quant!r}")
    return ModuleTree(
        modules=modules,
        params=params_out,
        buffers=tuple(b for node in nodes for b in node.buffers),
        hf_device_map=_draw(draw, hf_device_map),
        quantization=cast(Any, quant),
        prepared=_draw(draw, prepared),
    )


# -- topologies ---------------------------------------------------------------------------------
@st.composite
def topologies(
    draw: st.DrawFn,
    /,
    *,
    nodes: Drawable[int] | None = None,
    local_world_size: Drawable[int] | None = None,
    rank: Drawable[int] | None = None,
    device_type: Drawable[str] = "cpu",
    backend: Drawable[str | None] = None,
) -> Topology:
    """``nodes`` x ``local_world_size`` processes (world = their product) and one rank of them.

    Defaults: 1-3 nodes of 1-4 processes, a random rank, CPU.
    """
    n = _draw(draw, nodes if nodes is not None else st.integers(1, 3))
    local = _draw(draw, local_world_size if local_world_size is not None else st.integers(1, 4))
    if n < 1 or local < 1:
        raise InvalidArgument(f"nodes and local_world_size must be >= 1; got {n}, {local}")
    world = n * local
    r = _draw(draw, rank if rank is not None else st.integers(0, world - 1))
    return Topology(
        world_size=world,
        rank=r,
        local_world_size=local,
        device_type=_draw(draw, device_type),
        backend=_draw(draw, backend),
    )


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


# -- configs ------------------------------------------------------------------------------------
_CONFIG_FIELDS = frozenset(f.name for f in dataclasses.fields(PrepConfig))


def _choices(literal: object) -> tuple[str, ...]:
    return tuple(str(a) for a in get_args(literal))


def _placed_devices(tree: ModuleTree) -> list[str]:
    """Accelerator devices of the tree's parameters, sorted (drawing must not depend on hashing)."""
    return sorted({p.device for p in tree.params if p.device not in ("cpu", "meta")})


@st.composite
def configs(
    draw: st.DrawFn,
    /,
    *,
    tree: Drawable[ModuleTree | None] = None,
    topology: Drawable[Topology | None] = None,
    ignored_subset_of: Drawable[ModuleTree | None] = None,
    **fields: Any,
) -> PrepConfig:
    """Random valid ``PrepConfig`` objects.

    Any ``PrepConfig`` field may be fixed by keyword (a value, or a strategy to draw it from);
    the others are drawn. With ``tree`` (or ``ignored_subset_of``, which does only this),
    ``ignored_modules`` / ``ignored_params`` name modules or parameters of that tree (one kind at
    a time, possibly none). With ``tree`` and ``topology``, the fields that
    depend on the world are drawn so that fprep accepts the config for that tree and topology
    (``reshard_after_forward`` ints divide the shard group, ``hsdp_shard_size`` divides the
    world, no CPU offload without sharding, no fp8 on CPU, comm hooks only under DDP, no sharded
    strategy for trees with scalar parameters, ``sync_module_states`` only with real weights or
    a ``param_init_fn``, class wrap policies only naming classes the tree has). Trees fprep
    refuses whatever the config (already prepared, device maps, modules without
    ``reset_parameters`` on meta) stay refused.
    """
    unknown = set(fields) - _CONFIG_FIELDS
    if unknown:
        raise InvalidArgument(f"PrepConfig has no field(s) {sorted(unknown)}")
    tree = _draw(draw, tree)
    topology = _draw(draw, topology)
    ignored_subset_of = _draw(draw, ignored_subset_of)

    def pick(name: str, default: SearchStrategy[Any]) -> Any:
        return _draw(draw, fields[name]) if name in fields else draw(default)

    plannable = topology is not None
    world = topology.world_size if topology is not None else 1
    has_scalars = tree is not None and any(not p.shape for p in tree.params)

    strategies = _choices(Strategy)
    if plannable and has_scalars:
        strategies = tuple(s for s in strategies if s not in ("fsdp", "hsdp"))
    strategy: str = pick("strategy", st.sampled_from(strategies))
    sharding: str = pick("sharding", st.sampled_from(_choices(Sharding)))

    hsdp_choices: SearchStrategy[int | None] = st.none() | st.integers(1, 8)
    if plannable and strategy == "hsdp":
        hsdp_choices = st.none() | st.sampled_from(_divisors(world))
    hsdp_shard_size: int | None = pick("hsdp_shard_size", hsdp_choices)

    # What the plan will resolve, when we know the world.
    sharded = plannable and world > 1 and strategy in ("fsdp", "hsdp")
    if strategy == "hsdp" and topology is not None:
        shard_size = hsdp_shard_size or topology.local_world_size
    else:
        shard_size = world
    raf_ints: SearchStrategy[int] = (
        st.sampled_from(_divisors(shard_size)) if sharded else st.integers(1, 8)
    )
    # An int reshards to groups of that size: only with sharding="full".
    raf_choices: SearchStrategy[bool | int | None] = st.none() | st.just(sharding == "full")
    if sharding == "full":
        raf_choices |= raf_ints
    raf: bool | int | None = pick("reshard_after_forward", raf_choices)

    device_choices: list[str | None] = [None]
    if topology is not None:
        placed = _placed_devices(tree) if tree is not None else []
        if placed:
            device_choices += [d for d in placed if d.partition(":")[0] == topology.device_type]
        else:
            device_choices += ["cpu", topology.device_type]
    else:
        device_choices += ["cpu", *DEVICE_TYPES, "cuda:1"]
    device: str | None = pick("device", st.sampled_from(device_choices))
    if topology is not None:
        if device is not None:
            device_type = device.partition(":")[0]
        elif tree is not None and _placed_devices(tree):
            device_type = _placed_devices(tree)[0].partition(":")[0]
        else:
            device_type = topology.device_type
    else:
        device_type = "cpu"

    precisions = _choices(Precision)
    if plannable and device_type not in ("cuda", "hpu"):
        precisions = tuple(p for p in precisions if p != "fp8")
    offloads = _choices(Offload) if not plannable or sharded else ("none",)
    resolved_ddp = world > 1 and (
        strategy == "ddp" or (strategy == "auto" and device_type != "hpu")
    )
    hooks = _choices(CommHook) if not plannable or resolved_ddp else ("none",)

    ddp_default = st.builds(
        DDPOptions,
        bucket_cap_mb=st.sampled_from((1.0, 25.0, 100.5)),
        find_unused_parameters=st.booleans(),
        static_graph=st.booleans(),
        gradient_as_bucket_view=st.booleans(),
        broadcast_buffers=st.booleans(),
        comm_hook=st.sampled_from(hooks),
        powersgd_rank=st.integers(1, 4),
        powersgd_start_iter=st.integers(1, 10),
    )

    param_init_fn = pick("param_init_fn", st.sampled_from((None, noop_init)))
    sync_ok = not plannable or tree is None or not tree.is_meta or param_init_fn is not None
    sync = pick("sync_module_states", st.booleans() if sync_ok else st.just(False))

    # A plan refuses a class policy naming a class the model does not have.
    class_choices = [
        c
        for c in WRAP_CLASS_CHOICES
        if not plannable
        or tree is None
        or all(any(m.is_a(n) for m in tree.modules) for n in wrap_class_names(c))
    ]
    wrap = pick(
        "wrap",
        st.one_of(
            st.none(),
            st.integers(1, 64),
            st.sampled_from(class_choices) if class_choices else st.none(),
            st.sampled_from(WRAP_PREDICATES),
        ),
    )

    ignored_modules: tuple[str, ...] = ()
    ignored_params: tuple[str, ...] = ()
    if "ignored_modules" in fields or "ignored_params" in fields:
        ignored_modules = tuple(_draw(draw, fields.get("ignored_modules", ())))
        ignored_params = tuple(_draw(draw, fields.get("ignored_params", ())))
    elif (names_from := ignored_subset_of or tree) is not None:
        kind = draw(st.sampled_from(("none", "modules", "params")))
        # fprep refuses to ignore meta tensors (it would leave them without data): draw only
        # modules and parameters whose tensors are real.
        meta = [n for p in names_from.params if p.is_meta for n in p.names]
        meta += [b.fqn for b in names_from.buffers if b.is_meta]
        module_names = [
            m.fqn
            for m in names_from.modules
            if not any(is_within(parent_fqn(n), m.fqn) for n in meta)
        ]
        param_names = [n for p in names_from.params if not p.is_meta for n in p.names]
        if kind == "modules" and module_names:
            ignored_modules = tuple(
                draw(st.lists(st.sampled_from(module_names), unique=True, max_size=3))
            )
        elif kind == "params" and param_names:
            ignored_params = tuple(
                draw(st.lists(st.sampled_from(param_names), unique=True, max_size=3))
            )

    # fp8 with no Linear in float8 is refused: draw it only where one converts (small layers
    # converted anyway when only skip_small keeps them all).
    fp8_options = Fp8Options(skip_small=draw(st.booleans()))
    checked = plannable and tree is not None and "precision" not in fields
    if checked and "fp8" in precisions:
        assert tree is not None
        if not _converts_any(tree, fp8_options, ignored_modules, device_type):
            fp8_options = Fp8Options(skip_small=False)
        if not _converts_any(tree, fp8_options, ignored_modules, device_type):
            precisions = tuple(p for p in precisions if p != "fp8")
    precision = pick("precision", st.sampled_from(precisions))
    fp8 = pick("fp8", st.just(fp8_options)) if precision == "fp8" else Fp8Options()

    return PrepConfig(
        strategy=cast(Any, strategy),
        sharding=cast(Any, sharding),
        reshard_after_forward=raf,
        hsdp_shard_size=hsdp_shard_size,
        precision=precision,
        fp8=fp8,
        reduce_dtype=pick("reduce_dtype", st.none() | st.sampled_from(_choices(FloatDType))),
        wrap=wrap,
        ignored_modules=ignored_modules,
        ignored_params=ignored_params,
        device=device,
        device_placement=pick("device_placement", st.booleans()),
        offload=pick("offload", st.sampled_from(offloads)),
        forward_prefetch=pick("forward_prefetch", st.integers(0, 3)),
        backward_prefetch=pick("backward_prefetch", st.integers(0, 3)),
        activation_checkpointing=pick("activation_checkpointing", st.booleans()),
        compile=pick("compile", st.sampled_from(_choices(CompileMode))),
        compile_backend=pick("compile_backend", st.sampled_from((None, "inductor", "eager"))),
        compile_mode=pick("compile_mode", st.sampled_from((None, "default", "max-autotune"))),
        ddp=pick("ddp", ddp_default),
        fast_ddp_dtype=pick("fast_ddp_dtype", st.sampled_from(_choices(FloatDType))),
        sync_module_states=sync,
        param_init_fn=param_init_fn,
        reproducible_init=pick("reproducible_init", st.booleans()),
        seed=pick("seed", st.none() | st.integers(0, 2**31)),
        state_dict_type=pick("state_dict_type", st.sampled_from(_choices(StateDictType))),
        timeout_s=pick("timeout_s", st.sampled_from((1800.0, 60.0, 0.5))),
    )


def _converts_any(
    tree: ModuleTree, options: Fp8Options, ignored_modules: tuple[str, ...], device_type: str
) -> bool:
    """Whether ``precision="fp8"`` with ``options`` runs any of ``tree``'s Linears in float8."""
    from fprep.transitions.fp8 import plan_fp8

    plan = plan_fp8(
        tree, options, ignored_modules=ignored_modules, sharded=False, device_type=device_type
    )
    return bool(plan.modules)


# -- process groups and meshes as data ----------------------------------------------------------
@dataclass(frozen=True)
class MeshLayout:
    """A device mesh over the whole world, from which each rank's ``MeshSpec`` is read.

    ``ranks`` is the root mesh in row-major order over ``root_shape``; the data-parallel mesh is
    the first ``len(dp_shape)`` dimensions (all of them unless ``sliced``), the rest (``tp``) is
    another kind of parallelism.
    """

    ranks: tuple[int, ...]
    dp_shape: tuple[int, ...]
    tp: int
    named: bool

    @property
    def sliced(self) -> bool:
        return self.tp > 1

    @property
    def root_shape(self) -> tuple[int, ...]:
        return (*self.dp_shape, self.tp) if self.sliced else self.dp_shape

    def _dp_names(self) -> tuple[str, ...]:
        return ("replicate", "shard") if len(self.dp_shape) == 2 else ("dp",)

    def spec(self, rank: int) -> MeshSpec:
        """The data-parallel mesh ``rank`` would pass (its slice, when the root has ``tp``)."""
        position = self.ranks.index(rank)
        column = position % self.tp
        members = self.ranks[column :: self.tp]
        flat = members.index(rank)
        coordinate = (flat,) if len(self.dp_shape) == 1 else divmod(flat, self.dp_shape[1])
        names = self._dp_names()
        return MeshSpec(
            shape=self.dp_shape,
            dim_names=names if self.named else None,
            coordinate=tuple(coordinate),
            ranks=members,
            root_shape=self.root_shape,
            root_dim_names=((*names, "tp") if self.sliced else names) if self.named else None,
        )


@st.composite
def mesh_layouts(
    draw: st.DrawFn,
    /,
    world_size: int,
    *,
    hybrid: Drawable[bool] = False,
    sliced: Drawable[bool] = st.booleans(),  # noqa: B008  (strategies are immutable)
    permuted: Drawable[bool] = st.booleans(),  # noqa: B008
) -> MeshLayout:
    """A mesh over ``world_size`` ranks: 1-D (or 2-D ``(replicate, shard)`` when ``hybrid``),
    optionally a slice of a larger mesh with a ``tp`` dimension, optionally over permuted ranks.
    """
    tp = draw(st.sampled_from(_divisors(world_size))) if _draw(draw, sliced) else 1
    dp = world_size // tp
    if _draw(draw, hybrid):
        shard = draw(st.sampled_from(_divisors(dp)))
        dp_shape: tuple[int, ...] = (dp // shard, shard)
    else:
        dp_shape = (dp,)
    ranks = tuple(range(world_size))
    if _draw(draw, permuted):
        ranks = tuple(draw(st.permutations(ranks)))
    return MeshLayout(ranks=ranks, dp_shape=dp_shape, tp=tp, named=draw(st.booleans()))


@dataclass(frozen=True)
class GroupLayout:
    """The world split into equal process groups; ``spec(rank)`` is the group ``rank`` passes."""

    groups: tuple[tuple[int, ...], ...]

    def spec(self, rank: int) -> GroupSpec:
        group = next(g for g in self.groups if rank in g)
        return GroupSpec(size=len(group), rank=group.index(rank), ranks=group)


@st.composite
def group_layouts(draw: st.DrawFn, /, world_size: int) -> GroupLayout:
    """Equal-size process groups partitioning ``world_size`` ranks (members shuffled)."""
    size = draw(st.sampled_from(_divisors(world_size)))
    ranks = draw(st.permutations(range(world_size)))
    return GroupLayout(groups=tuple(tuple(ranks[i : i + size]) for i in range(0, world_size, size)))


# -- whole planning inputs -----------------------------------------------------------------------
class PlanCase(NamedTuple):
    """``(tree, cfg, topology)``: unpacks like a tuple, reads like a record."""

    tree: ModuleTree
    cfg: PrepConfig
    topology: Topology


@st.composite
def plan_inputs(
    draw: st.DrawFn,
    /,
    *,
    trees: Drawable[ModuleTree] | None = None,
    topos: Drawable[Topology] | None = None,
    valid: bool = True,
    **config_fields: Any,
) -> PlanCase:
    """A tree, a config and a topology that go together (ignored names come from the tree).

    With ``valid=True`` (the default) the three are drawn so that fprep accepts them (trees
    without scalar parameters or modules missing ``reset_parameters``, no tied parameter split
    across sibling units by the wrap policy; see ``configs``). With
    ``valid=False`` anything goes, and planning may fail. ``config_fields`` fix config fields.
    """
    topology = _draw(draw, topos if topos is not None else topologies())
    if trees is None:
        # Half the valid trees keep one parameter dtype: under fsdp / hsdp the trainable
        # parameters of a wrap unit must share theirs (redrawn below otherwise), and mixed
        # trees would mostly be redrawn there.
        one_dtype = valid and draw(st.booleans())
        dtypes = (draw(st.sampled_from(PARAM_DTYPES)),) if one_dtype else PARAM_DTYPES
        trees = (
            module_trees(allow_meta=st.booleans(), param_dtypes=dtypes)
            if valid
            else module_trees(
                allow_scalar=st.booleans(),
                allow_meta=st.booleans(),
                allow_missing_reset=st.booleans(),
            )
        )
    tree = _draw(draw, trees)
    cfg = draw(configs(tree=tree, topology=topology if valid else None, **config_fields))
    mixed = len({p.dtype for p in tree.params if p.requires_grad}) > 1
    if valid and mixed:
        # Trainable parameters of two dtypes in one unit are refused under fsdp / hsdp; a tree
        # given by the caller (trees=) would mostly be redrawn for it, so make it one dtype
        # instead whenever the plan refuses it for that (a repair, not a filter).
        result = plan(tree, cfg, topology)
        if isinstance(result, Failure) and "trainable parameters of two dtypes" in str(
            result.failure()
        ):
            first = next(p.dtype for p in tree.params if p.requires_grad)
            params = tuple(
                dataclasses.replace(p, dtype=first) if p.requires_grad else p for p in tree.params
            )
            tree = dataclasses.replace(tree, params=params)
    if valid and any(len(p.names) > 1 for p in tree.params):
        # Whether the wrap policy leaves a tied parameter to no unit of its own (or puts
        # trainable parameters of two dtypes in one unit) depends on the whole unit layout;
        # rather than predict it, redraw the cases fprep refuses for it.
        result = plan(tree, cfg, topology)
        assume(isinstance(result, Success) or "is tied across units" not in str(result.failure()))
    return PlanCase(tree, cfg, topology)


def _transition_name(t: object) -> str:
    return str(getattr(t, "__name__", t))


@st.composite
def prep_states(
    draw: st.DrawFn,
    /,
    *,
    before: str | None = None,
    inputs: Drawable[PlanCase] | None = None,
) -> PrepState:
    """States ready for a transition: the default transitions up to (not including) ``before``
    applied to drawn ``plan_inputs``; ``before=None`` gives complete plans.

    Inputs that fail to plan are rejected (``assume``): pass inputs fprep accepts.
    """
    names = [_transition_name(t) for t in DEFAULT_TRANSITIONS]
    if before is not None and before not in names:
        raise InvalidArgument(f"before must be one of {names}; got {before!r}")
    count = names.index(before) if before is not None else len(names)
    tree, cfg, topology = _draw(draw, inputs if inputs is not None else plan_inputs())
    state = PrepState.initial(tree, cfg, topology)
    result = chain(*DEFAULT_TRANSITIONS[:count])(state)
    assume(isinstance(result, Success))
    return result.unwrap()
