"""init_param_handles: the wrap units, which parameters each manages, and this rank's shards.

Units are chosen by the wrap policy (classes, a minimum parameter count, or a predicate over
``ModuleInfo``); the root is always the last unit. A parameter belongs to the nearest unit above
the module that registers it; a tied parameter registered under two units belongs to their
nearest common unit (so FSDP2 sees it once). Ignored modules are never units and their
parameters are kept whole on every rank.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from typing import cast

from fprep.adapters import AdapterLayout
from fprep.config import WrapPolicy, wrap_class_names
from fprep.errors import ConfigError, ModelError, PrepError
from fprep.layout.placements import Placement
from fprep.policies import repeated_block_classes, used_by_parent_forward
from fprep.sharding import TPLayout, shard_shape
from fprep.snapshot import (
    ModuleInfo,
    ModuleTree,
    ParamInfo,
    is_within,
    parent_fqn,
)
from fprep.state import (
    IgnoredState,
    MaterializePlan,
    ParamHandleState,
    PrepState,
    ShardSpec,
    Unavailable,
    WrapUnit,
    need,
)
from fprep.transitions._base import transition
from fprep.transitions.dtypes import check_unit_dtypes


def _owned_numel(tree: ModuleTree, ignored: IgnoredState) -> dict[str, int]:
    """Elements of the managed parameters each module registers directly (tied: counted once)."""
    owned: dict[str, int] = {}
    for p in tree.params:
        if p.fqn in ignored.params:
            continue
        owner = _common_ancestor(p.owners)  # a tied parameter counts where all owners meet
        owned[owner] = owned.get(owner, 0) + p.numel
    return owned


def _tie_splitting_modules(tree: ModuleTree, ignored: IgnoredState) -> set[str]:
    """Modules holding some but not all modules of a tied parameter: wrapping one would split
    the tie across units, which FSDP2 silently breaks, so the size policy never does."""
    splitting: set[str] = set()
    for p in tree.params:
        owners = p.owners
        if len(owners) < 2 or p.fqn in ignored.params:
            continue
        for owner in owners:
            module = owner
            while module and not all(is_within(o, module) for o in owners):
                splitting.add(module)
                module = parent_fqn(module)
    return splitting


def _common_ancestor(fqns: tuple[str, ...]) -> str:
    common = fqns[0]
    for fqn in fqns[1:]:
        while not is_within(fqn, common):
            common = parent_fqn(common)
    return common


def _by_size(tree: ModuleTree, ignored: IgnoredState, min_params: int) -> set[str]:
    """FSDP's size policy: wrap a module once what is not yet wrapped below it reaches the size.

    ``ModuleList`` / ``ModuleDict`` without a forward are never wrapped, nor is a module that
    would split a tied parameter from its other modules, nor a module whose parameters its
    parent's forward uses (``nn.MultiheadAttention``'s ``out_proj``): their count carries on to
    the parent.
    """
    owned = _owned_numel(tree, ignored)
    splitting = _tie_splitting_modules(tree, ignored) | used_by_parent_forward(tree).keys()
    remaining: dict[str, int] = {}
    units: set[str] = set()
    for m in reversed(tree.modules):  # children before parents
        if m.fqn in ignored.modules:
            remaining[m.fqn] = 0
            continue
        total = owned.get(m.fqn, 0) + sum(remaining.get(c, 0) for c in m.children)
        if m.fqn and total >= min_params and m.can_run_forward and m.fqn not in splitting:
            units.add(m.fqn)
            total = 0
        remaining[m.fqn] = total
    return units


def _by_predicate(
    tree: ModuleTree, ignored: IgnoredState, predicate: Callable[[ModuleInfo], bool]
) -> set[str]:
    units: set[str] = set()
    for m in tree.modules[1:]:
        if m.fqn in ignored.modules:
            continue
        try:
            chosen = predicate(m)
        except PrepError:
            raise
        except Exception as e:
            raise ConfigError(
                f"the wrap policy raised {type(e).__name__}: {e} on module {m.fqn!r}.",
                subject="wrap",
                hint="A wrap callable receives a fprep.ModuleInfo and returns a bool.",
            ) from None
        if not isinstance(chosen, bool):  # a tensor's truth value may raise, or mislead
            raise ConfigError(
                f"the wrap policy returned a {type(chosen).__qualname__} for module {m.fqn!r}, "
                "not a bool.",
                subject="wrap",
                hint="A wrap callable receives a fprep.ModuleInfo and returns True or False.",
            )
        if chosen:
            units.add(m.fqn)
    return units


def select_units(tree: ModuleTree, wrap: WrapPolicy, ignored: IgnoredState) -> tuple[str, ...]:
    """Unit FQNs in pre-order (the root, ``""``, first)."""
    if wrap is None:
        chosen: set[str] = set()
    elif isinstance(wrap, int):
        chosen = _by_size(tree, ignored, wrap)
    elif isinstance(wrap, tuple):
        names = wrap_class_names(wrap)
        _check_classes_exist(tree, names)
        chosen = {
            m.fqn
            for m in tree.modules[1:]
            if m.fqn not in ignored.modules and any(m.is_a(n) for n in names)
        }
    else:
        chosen = _by_predicate(tree, ignored, cast(Callable[[ModuleInfo], bool], wrap))
    inside = used_by_parent_forward(tree) if chosen else {}
    for m in tree.modules[1:]:
        if m.fqn in chosen and not m.can_run_forward:
            raise ConfigError(
                f"the wrap policy selects {m.fqn!r}, a {m.class_name}: a container without a "
                "forward cannot be a wrap unit (units are sharded, checkpointed and compiled "
                "through their forward).",
                subject="wrap",
                hint=f"Wrap the modules inside {m.fqn!r} (e.g. their block class) instead.",
            )
        if m.fqn in chosen and m.fqn in inside:
            parent = tree.module(inside[m.fqn]) or tree.root
            raise ConfigError(
                f"the wrap policy selects {m.fqn!r}, a {m.class_name} inside "
                f"{parent.fqn or '<root>'!r}, a {parent.class_name} whose forward uses its "
                "parameters without calling it: as its own unit they would never be gathered.",
                subject="wrap",
                hint=f"Wrap {parent.fqn or 'the model'!r} (or a module around it) instead, or "
                "narrow the policy so that it skips modules inside it.",
            )
    return ("", *(m.fqn for m in tree.modules[1:] if m.fqn in chosen))


def _check_classes_exist(tree: ModuleTree, names: tuple[str, ...]) -> None:
    """A class policy naming no class of the model would silently make it one unit."""
    for name in names:
        if any(m.is_a(name) for m in tree.modules):
            continue
        blocks = repeated_block_classes(tree)
        raise ConfigError(
            f"the wrap policy names {name!r}, which matches no module of the model "
            f"({tree.root.class_name}): the whole model would be one unit.",
            subject="wrap",
            hint=(
                f"The model's repeated blocks are {', '.join(map(repr, blocks))}."
                if blocks
                else "Name the class of a submodule (see model.named_modules())."
            ),
        )


def _unit_of(module: str, units: frozenset[str]) -> str:
    while module not in units:
        module = parent_fqn(module)
    return module


def _assign(p: ParamInfo, units: frozenset[str], sharded: bool) -> str:
    """The unit managing ``p``: the nearest unit above all modules that register it.

    FSDP2 finds a unit's parameters through the modules it owns directly (not through nested
    units), so a tied parameter whose owners all sit in *other* units below that common unit
    would reach no unit at all: that is refused when sharding (other strategies use units
    only as checkpoint / compile regions).
    """
    owners = {_unit_of(parent_fqn(n), units) for n in p.names}
    if len(owners) == 1:
        return owners.pop()
    unit = next(iter(owners))
    while not all(is_within(o, unit) for o in owners):
        unit = _unit_of(parent_fqn(unit), units) if unit else ""
    if sharded and unit not in owners:
        raise ModelError(
            f"parameter {p.fqn!r} is tied across units {', '.join(sorted(map(repr, owners)))}, "
            f"and none of its modules belongs to their common unit {unit or '<root>'!r}.",
            subject=p.fqn,
            hint="Do not wrap those modules as separate units (or wrap a module containing "
            "both), or untie the parameter.",
        )
    return unit


def _spec(p: ParamInfo, shard: tuple[int, int] | None, layout: TPLayout | None = None) -> ShardSpec:
    """``p``'s spec; ``shard`` is ``(shard group size, this rank's index in it)``, or ``None``
    when ``p`` is kept whole; ``layout`` places it on an N-D mesh with tensor parallelism."""
    if shard is not None and not p.shape:
        raise ModelError(
            f"parameter {p.fqn!r} is a scalar (shape []); FSDP shards along dim 0 and cannot "
            "shard it.",
            subject=p.fqn,
            hint="Register it as a 1-element tensor (shape [1]), or add it to ignored_params.",
        )
    if shard is not None and not p.contiguous:
        raise ModelError(
            f"parameter {p.fqn!r} of shape {p.shape} is not contiguous (e.g. a channels_last "
            "convolution weight); FSDP2 shards contiguous parameters only.",
            subject=p.fqn,
            hint="Call model.to(memory_format=torch.contiguous_format) before prepare (you may "
            "keep channels_last inputs), or add it to ignored_params.",
        )
    dims: tuple[str, ...] = ()
    placements: tuple[Placement, ...] = ()
    block: tuple[int, ...] = ()
    if layout is not None:
        local, padded, dims, placements, block = layout.place(p, shard)
    elif shard is not None:
        local, padded = shard_shape(p.shape, *shard)
    else:
        local, padded = p.shape, p.shape
    return ShardSpec(
        fqn=p.fqn,
        names=p.names,
        shape=p.shape,
        dtype=p.dtype,
        local_shape=local,
        padded_shape=padded,
        requires_grad=p.requires_grad,
        mesh_dims=dims,
        placements=placements,
        tp_shape=block,
    )


#: The class whose ``_init_weights`` convention fprep follows (by qualified name: fprep never
#: imports transformers).
HF_PRETRAINED = "transformers.modeling_utils.PreTrainedModel"


def is_hf_init_weights(fn: object) -> bool:
    """Whether ``fn`` is a ``PreTrainedModel``'s bound ``_init_weights`` (looked at, not run)."""
    func, owner = getattr(fn, "__func__", None), getattr(fn, "__self__", None)
    if getattr(func, "__name__", None) != "_init_weights" or owner is None:
        return False
    return any(f"{k.__module__}.{k.__qualname__}" == HF_PRETRAINED for k in type(owner).__mro__)


def _post_order(tree: ModuleTree, keep: set[str]) -> tuple[str, ...]:
    """The modules in ``keep``, children before parents (``nn.Module.apply``'s order)."""
    out: list[str] = []
    stack: list[tuple[str, bool]] = [("", False)]
    while stack:
        fqn, expanded = stack.pop()
        if fqn not in keep:
            continue
        if expanded:
            out.append(fqn)
            continue
        stack.append((fqn, True))
        info = tree.module(fqn)
        stack.extend((c, False) for c in reversed(info.children if info else ()))
    return tuple(out)


def _hf_owners(tree: ModuleTree, visits: tuple[str, ...]) -> tuple[str | None, ...]:
    """Per visit, the nearest ``PreTrainedModel`` at or above it (its ``_init_weights`` runs,
    as ``initialize_weights`` dispatches to sub-models); None: none (the bound one's)."""
    out: list[str | None] = []
    for fqn in visits:
        at: str | None = fqn
        while at is not None:
            info = tree.module(at)
            if info is not None and info.is_a(HF_PRETRAINED):
                break
            at = None if at == "" else parent_fqn(at)
        out.append(at)
    return tuple(out)


def _materialize(state: PrepState, ignored: IgnoredState) -> MaterializePlan:
    """How the meta tensors become real. Precedence: ``param_init_fn``, the model's own
    convention (Hugging Face's ``_init_weights``, then torchtitan's ``init_weights``), then the
    conventions of Hugging Face sub-models of a plain model (``reset_parameters`` outside
    them), then each module's ``reset_parameters``. A module none of them can initialize is
    kept as a note (a plan never needs weights); ``prepare`` refuses it before any effect."""
    tree, cfg = state.tree, state.config
    left_on_meta = [p.fqn for p in tree.params if p.is_meta and p.fqn in ignored.params]
    left_on_meta += [b.fqn for b in tree.buffers if b.is_meta and b.fqn in ignored.buffers]
    if left_on_meta:
        raise ModelError(
            f"{left_on_meta[0]!r} is on the meta device but ignored: fprep does not initialize "
            "what it ignores, so it would stay without data.",
            subject=left_on_meta[0],
            hint="Initialize ignored modules and parameters yourself before prepare, or stop "
            "ignoring them.",
        )
    meta_owners = {parent_fqn(n) for p in tree.params if p.is_meta for n in p.names}
    meta_owners |= {parent_fqn(b.fqn) for b in tree.buffers if b.is_meta}
    meta_owners -= ignored.modules
    if not meta_owners:
        return MaterializePlan(method="none")
    if cfg.sync_module_states and state.topology.rank == 0 and cfg.param_init_fn is None:
        raise ModelError(
            "sync_module_states=True copies rank 0's weights to every rank, but rank 0's model "
            f"is on the meta device (e.g. module {min(meta_owners)!r}).",
            subject="sync_module_states",
            hint="Load real weights on rank 0 (other ranks may stay on meta), or set "
            "sync_module_states=False to initialize every rank from the same seed.",
        )
    modules = tuple(m.fqn for m in tree.modules if m.fqn in meta_owners)
    # Modules PrepConfig.weights fills completely are allocated but not initialized: only the
    # others (and the modules containing them) are visited.
    weights = state.state_dict.weights if state.state_dict is not None else None
    loaded = frozenset(weights.loaded_modules if weights is not None else ()) & meta_owners
    kept = tuple(m for m in modules if m in loaded)
    to_init = tuple(m for m in modules if m not in loaded)
    if not to_init:
        return MaterializePlan(method="reset_parameters", modules=modules, loaded=kept)
    containing = {a for fqn in to_init for a in _ancestors(fqn)} - ignored.modules
    walk = _post_order(tree, containing)
    fn = cfg.param_init_fn
    root = tree.root
    if (fn is None and root.is_a(HF_PRETRAINED)) or (fn is not None and is_hf_init_weights(fn)):
        owners = _hf_owners(tree, walk)
        return MaterializePlan(
            method="hf_init_weights",
            modules=modules,
            visits=walk,
            owners=owners,
            loaded=kept,
        )
    if fn is not None:
        return MaterializePlan(method="param_init_fn", modules=modules, visits=walk, loaded=kept)
    if root.has_init_weights:
        return MaterializePlan(method="init_weights", modules=modules, visits=("",), loaded=kept)
    nested = _hf_owners(tree, walk)
    if any(owner is not None for owner in nested):
        return _around_hf_models(tree, modules, to_init, walk, nested, kept)
    return MaterializePlan(
        method="reset_parameters",
        modules=modules,
        visits=to_init,
        unavailable=_without_reset(tree, to_init),
        loaded=kept,
    )


def _around_hf_models(
    tree: ModuleTree,
    modules: tuple[str, ...],
    to_init: tuple[str, ...],
    walk: tuple[str, ...],
    owners: tuple[str | None, ...],
    kept: tuple[str, ...],
) -> MaterializePlan:
    """A plain model holding Hugging Face sub-models (a backbone with a custom head, say):
    inside each ``PreTrainedModel`` its ``_init_weights`` runs, as ``initialize_weights``
    walks it; outside, each module holding meta tensors runs its own ``reset_parameters``
    (plain containers there hold nothing to initialize and are not visited)."""
    own = set(to_init)
    kept_visits = [(v, o) for v, o in zip(walk, owners, strict=True) if o is not None or v in own]
    outside = tuple(v for v, o in kept_visits if o is None)
    return MaterializePlan(
        method="hf_init_weights",
        modules=modules,
        visits=tuple(v for v, _ in kept_visits),
        owners=tuple(o for _, o in kept_visits),
        outside="reset_parameters",
        unavailable=_without_reset(tree, outside),
        loaded=kept,
    )


def _without_reset(tree: ModuleTree, visits: tuple[str, ...]) -> Unavailable | None:
    """The first of ``visits`` without ``reset_parameters()``, as the refusal to raise."""
    missing = next(
        (m for m in visits if not (info := tree.module(m)) or not info.has_reset_parameters),
        None,
    )
    if missing is None:
        return None
    cls = (tree.module(missing) or tree.root).class_name
    return Unavailable(
        message=f"module {missing or '<root>'!r} ({cls}) has parameters or buffers on the "
        "meta device and nothing to initialize them: no param_init_fn, no model "
        "convention (Hugging Face _init_weights, torchtitan init_weights) and no "
        "reset_parameters().",
        subject=missing,
        hint="Give the class a reset_parameters() method, or pass "
        "PrepConfig(param_init_fn=...) (called on every module holding or containing meta "
        "tensors, children before parents).",
    )


def _with_lora(state: PrepState, plan: MaterializePlan) -> MaterializePlan:
    """A peft model's LoRA factors among the visits (initialized as peft does), and a refusal
    for adapter parameters on the meta device that no LoRA factor holds (fprep cannot
    initialize them as peft would: DoRA's magnitudes, LoRA on embeddings, other tuners)."""
    layout = AdapterLayout.of(state.tree)
    if layout is None or plan.method == "none":
        return plan
    lora = layout.lora_visits(plan.visits)
    owned = set(lora)
    stray = next(
        (
            p.fqn
            for p in state.tree.params
            if p.is_meta and layout.is_adapter(p.fqn) and parent_fqn(p.fqn) not in owned
        ),
        None,
    )
    unavailable = plan.unavailable
    if stray is not None and unavailable is None:
        unavailable = Unavailable(
            message=f"adapter parameter {stray!r} is on the meta device, and fprep initializes "
            "only LoRA's lora_A / lora_B factors as peft does (not DoRA magnitudes, LoRA on "
            "embeddings or other peft methods).",
            subject=stray,
            hint="Build the peft model on a real device (get_peft_model after from_pretrained) "
            "and prepare it without weights=, or use plain LoRA on Linear layers.",
        )
    return replace(plan, lora=lora, unavailable=unavailable)


def _ancestors(fqn: str) -> list[str]:
    """``fqn`` and every module above it, up to the root."""
    out = [fqn]
    while fqn:
        fqn = parent_fqn(fqn)
        out.append(fqn)
    return out


@transition
def init_param_handles(state: PrepState) -> PrepState:
    core = need(state.core, "init_core", "init_param_handles")
    pg = need(state.process_group, "init_process_group", "init_param_handles")
    ignored = need(state.ignored, "init_ignored", "init_param_handles")
    tree = state.tree
    unit_fqns = select_units(tree, state.config.wrap, ignored)
    units = frozenset(unit_fqns)
    members: dict[str, list[ShardSpec]] = {u: [] for u in unit_fqns}
    kept: list[ShardSpec] = []
    # Looked up once: ``shard_rank`` searches the shard group (O(world) per call).
    shard = (pg.shard_size, pg.shard_rank) if core.is_sharded else None
    ext = need(state.extension, "init_extension", "init_param_handles")
    layout = None
    if ext.tensor_parallel is not None:
        layout = TPLayout.of(ext.tensor_parallel, pg, hybrid=core.strategy == "hsdp")
    for p in tree.params:
        if p.fqn in ignored.params:
            kept.append(_spec(p, None))
        else:
            members[_assign(p, units, core.is_sharded)].append(_spec(p, shard, layout))
    # The root's parameters are needed again at the very start of backward: unless the user
    # set reshard_after_forward, keep them gathered (FSDP2's own default for the root), which
    # saves one all-gather of the root per step (embeddings and output head, typically).
    root_raf = (
        False
        if state.config.reshard_after_forward is None and len(unit_fqns) > 1
        else core.reshard_after_forward
    )
    ordered = tuple(
        WrapUnit(
            fqn=fqn,
            cls=(tree.module(fqn) or tree.root).cls,
            params=tuple(members[fqn]),
            reshard_after_forward=root_raf if fqn == "" else core.reshard_after_forward,
        )
        for fqn in reversed(unit_fqns)  # inner units first, the root last
    )
    if core.is_sharded:
        check_unit_dtypes(ordered, mixed=core.precision.param_dtype is not None)
    return state.replace(
        param_handles=ParamHandleState(
            units=ordered,
            ignored=tuple(kept),
            materialize=_with_lora(state, _materialize(state, ignored)),
        )
    )
