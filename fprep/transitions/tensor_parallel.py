"""Tensor parallelism, planned: which module gets which style, and what that does to each
parameter, checked against the model before anything runs.

The plan is ``PrepConfig.tp_plan`` or, without one, the model's own (``ModuleTree.tp_plan``:
transformers' ``base_model_tp_plan`` + ``_tp_plan``; ``fprep.testing.models.Llama._tp_plan``).
Refused here, naming the culprit: a pattern matching no module, a module matched twice with
different styles, a style on a module kind it cannot shard, a sharded dimension (rows, columns,
vocabulary, head counts) that tp does not divide, a tied or ignored parameter the plan shards.
With ``precision="fp8"`` the plan also says which style each float8 Linear it shards gets
(``TensorParallelState.float8``); the ``fp8`` step converts them before ``parallelize``.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from fprep.adapters import AdapterLayout
from fprep.errors import ConfigError, ModelError
from fprep.layout.placements import Placement, Replicate, Shard, StridedShard
from fprep.layout.styles import (
    BEHAVIOURS,
    REFUSED,
    RUNS_LOCAL,
    SHARDABLE,
    STYLES,
    Style,
    param_placement,
    pattern_regex,
    tp_dim,
)
from fprep.snapshot import ModuleTree, is_within, join_fqn
from fprep.state import Fp8Plan, IgnoredState, PrepState, ProcessGroupState, TensorParallelState
from fprep.transitions.fp8 import FP8_DIM_MULTIPLE
from fprep.transitions.sequence_parallel import plan_sequence_parallel


def _plan_pairs(state: PrepState) -> tuple[tuple[tuple[str, str], ...], str]:
    cfg, tree = state.config, state.tree
    if cfg.tp_plan_pairs is not None:
        return cfg.tp_plan_pairs, "config"
    if tree.tp_plan is not None:
        return tree.tp_plan, "model"
    raise ConfigError(
        f"PrepConfig.tp={cfg.tp} but no tensor-parallel plan: {tree.root.class_name} carries "
        "none (no config.base_model_tp_plan or _tp_plan) and tp_plan is not set.",
        subject="tp_plan",
        hint='Pass tp_plan={"layers.*.attn.q": "colwise", "layers.*.attn.o": "rowwise", ...} '
        "(docs/parallelism.md), or tp=1.",
    )


@dataclass(frozen=True)
class Rules:
    """A plan's rules matched against the model: ``modules`` ``(module FQN, style)`` in
    pre-order, ``params`` ``(parameter FQN, style)`` for the rules that name a parameter, and
    ``skipped``: the patterns of the model's own plan that match nothing here (transformers
    skips them too: a Qwen3-MoE plan's dense-layer patterns when every layer is sparse)."""

    modules: tuple[tuple[str, str], ...]
    params: tuple[tuple[str, str], ...] = ()
    skipped: tuple[str, ...] = ()


def _param_hits(tree: ModuleTree, rx: re.Pattern[str]) -> list[str]:
    return [
        join_fqn(m.fqn, name)
        for m in tree.modules
        if not m.is_stage_gap
        for name in m.param_names
        if rx.fullmatch(join_fqn(m.fqn, name))
    ]


def match_rules(
    tree: ModuleTree,
    pairs: tuple[tuple[str, str], ...],
    field: str = "tp_plan",
    whole: ModuleTree | None = None,
    *,
    strict: bool = True,
) -> Rules:
    """Every module and parameter a pattern matches (a pattern matching a module names the
    module; otherwise the parameters it matches).

    Under pipeline parallelism ``tree`` is this rank's part and ``whole`` the whole model: a
    pattern must match in the whole model, and matches on this part only what this rank holds.
    ``strict``: a pattern matching nothing is a ConfigError (a user's plan); otherwise it is
    listed in ``Rules.skipped`` (a model's own plan covers configurations this one is not).
    """
    modules: dict[str, tuple[str, str]] = {}  # fqn -> (pattern, style)
    params: dict[str, tuple[str, str]] = {}
    skipped: list[str] = []
    for pattern, style in pairs:
        rx = pattern_regex(pattern)
        hits = [m.fqn for m in tree.modules[1:] if rx.fullmatch(m.fqn) and not m.is_stage_gap]
        chosen = modules
        if not hits:
            hits, chosen = _param_hits(tree, rx), params
        if not hits and whole is not None and any(rx.fullmatch(m.fqn) for m in whole.modules):
            continue  # another stage's modules
        if not hits and whole is not None and _param_hits(whole, rx):
            continue
        if not hits and not strict:
            skipped.append(pattern)
            continue
        if not hits:
            raise ConfigError(
                f"PrepConfig.{field} pattern {pattern!r} ({style!r}) matches no module or "
                f"parameter of {tree.root.class_name}.",
                subject=field,
                hint="Patterns are module or parameter FQNs as in model.named_modules() / "
                "named_parameters(), '*' standing for one segment (a layer number), e.g. "
                "'layers.*.attention.wq'.",
            )
        for fqn in hits:
            before = chosen.get(fqn)
            if before is not None and before[1] != style:
                raise ConfigError(
                    f"PrepConfig.{field}: {fqn!r} matches {before[0]!r} ({before[1]!r}) "
                    f"and {pattern!r} ({style!r}).",
                    subject=field,
                    hint="Give each module one style.",
                )
            chosen[fqn] = (pattern, style)
    return Rules(
        modules=tuple((m.fqn, modules[m.fqn][1]) for m in tree.modules if m.fqn in modules),
        params=tuple((fqn, style) for fqn, (_, style) in params.items()),
        skipped=tuple(skipped),
    )


def _check_kind(tree: ModuleTree, fqn: str, style: Style) -> bool:
    """Whether the module is an Embedding (colwise / rowwise need a Linear or Embedding)."""
    info = tree.module(fqn)
    assert info is not None
    is_embedding = info.is_a("Embedding")
    shards_layer = style.kind in ("colwise", "rowwise", "packed_colwise", "packed_rowwise")
    if shards_layer and not any(info.is_a(k) for k in SHARDABLE):
        raise ConfigError(
            f"PrepConfig.tp_plan gives {fqn!r} the style {style.name!r}, but it is a "
            f"{info.class_name}: {style.kind} shards nn.Linear and nn.Embedding weights only.",
            subject="tp_plan",
            hint=f"Name the Linear layers inside {fqn!r} instead.",
        )
    if style.embedding_only and not is_embedding:
        raise ConfigError(
            f"PrepConfig.tp_plan gives {fqn!r} the style {style.name!r}, but it is a "
            f"{info.class_name}, not an nn.Embedding.",
            subject="tp_plan",
            hint="Use 'colwise' or 'rowwise' for Linear layers.",
        )
    return is_embedding


def _check_known_styles(tree: ModuleTree, modules: tuple[tuple[str, str], ...]) -> None:
    """A style fprep does not apply, from the model's own plan (a user's ``tp_plan`` is checked
    when the config is built): a ConfigError naming the module, the style and why."""
    for fqn, name in modules:
        if name in STYLES:
            continue
        why = REFUSED.get(name, "a style fprep does not know")
        raise ConfigError(
            f"{tree.root.class_name}'s own tensor-parallel plan gives {fqn!r} the style "
            f"{name!r}, which fprep does not apply yet ({why}).",
            subject="tp_plan",
            hint="Pass tp_plan= yourself, without these modules or with a style fprep applies "
            "(docs/parallelism.md), or use tp=1 (fsdp shards this model without tp).",
        )


def _use_placement(
    tree: ModuleTree,
    name: str,
    modules: dict[str, str],
    rules: dict[str, str],
) -> tuple[str, Placement | None] | None:
    """``(rule's style, placement)`` of the parameter reachable as ``name`` (a rule naming it
    wins over its module's, as in transformers); None when no rule covers it."""
    owner, _, leaf = name.rpartition(".")
    p = tree.param(name)
    assert p is not None
    if name in rules:
        style = STYLES[rules[name]]
        return style.name, param_placement(style.kind, len(p.shape), leaf, own_rule=True)
    if owner not in modules:
        return None
    style = STYLES[modules[owner]]
    if style.kind in ("colwise", "rowwise", "sequence"):
        info = tree.module(owner)
        assert info is not None
        dim = tp_dim(style.kind, info.is_a("Embedding"), leaf)
        return style.name, Replicate() if dim is None else Shard(dim)
    return style.name, param_placement(style.kind, len(p.shape), leaf, own_rule=False)


def _check_param_rules(tree: ModuleTree, rules: Rules, modules: dict[str, str]) -> None:
    """A rule naming a parameter gives it a layout; its module must then run on local shards
    (transformers' ``local_params``, ``moe_tp_experts``), or its forward would mix a sharded
    parameter with whole activations."""
    for fqn, name in rules.params:
        style = STYLES[name]
        if style.kind not in ("colwise", "rowwise", "packed_colwise", "packed_rowwise", "grad_sum"):
            if style.kind == "replicate":
                continue
            raise ConfigError(
                f"tp plan gives the parameter {fqn!r} the style {name!r}, which applies to "
                "modules only.",
                subject="tp_plan",
                hint="Name the module that holds it.",
            )
        owner = fqn.rpartition(".")[0]
        around = modules.get(owner)
        if style.kind != "grad_sum" and (around is None or STYLES[around].kind not in RUNS_LOCAL):
            raise ConfigError(
                f"tp plan shards the parameter {fqn!r} ({name!r}), but its module "
                f"{owner or tree.root.class_name!r} "
                + (f"has the style {around!r}" if around else "has no style")
                + ", so its forward would mix the shard with whole activations.",
                subject="tp_plan",
                hint=f"Give {owner!r} 'local_params' (or 'moe_tp_experts' for fused experts), "
                "or leave the parameter out of the plan.",
            )


def _placements(
    tree: ModuleTree,
    rules: Rules,
    tp: int,
    ignored: IgnoredState,
    *,
    strict: bool,
    notes: list[str],
) -> tuple[tuple[tuple[str, Placement], ...], frozenset[str]]:
    """Every tp parameter's placement, checked; and the modules whose rules a tied parameter's
    disagreeing uses drop (the model's own plan only; a user's plan is refused instead)."""
    modules = dict(rules.modules)
    own = dict(rules.params)
    for fqn, name in rules.modules:
        style = STYLES[name]
        if style.kind == "packed_rowwise":
            raise ConfigError(
                f"tp plan gives the module {fqn!r} the style {name!r}, which lays out a fused "
                "parameter (Llama 4's experts' gate_up_proj); on a module it would cut its "
                "weights with no forward to match.",
                subject="tp_plan",
                hint="Name the parameter itself, inside a module with 'moe_tp_experts' or "
                "'local_params'.",
            )
        if style.shards_params:
            if any(is_within(fqn, m) for m in ignored.modules):
                raise ConfigError(
                    f"PrepConfig.tp_plan shards {fqn!r}, which is ignored (kept whole on every "
                    "rank).",
                    subject="tp_plan",
                    hint="Stop ignoring it, or leave it out of the plan.",
                )
            _check_kind(tree, fqn, style)
    _check_param_rules(tree, rules, modules)
    candidates = [join_fqn(f, n) for f, _ in rules.modules for n in _module_params(tree, f)]
    candidates += [f for f, _ in rules.params]
    out: dict[str, Placement] = {}
    dropped: set[str] = set()
    for name in dict.fromkeys(candidates):
        p = tree.param(name)
        assert p is not None
        if p.fqn in out:
            continue
        uses = {n: _use_placement(tree, n, modules, own) for n in p.names if tree.param(n)}
        placed = {u[1] for u in uses.values() if u is not None}
        if len(p.names) > 1 and (len(placed) > 1 or None in {u and u[1] for u in uses.values()}):
            described = ", ".join(
                f"{n} ({u[0]}: {u[1] or 'whole'})" if u else f"{n} (no style)"
                for n, u in uses.items()
            )
            if strict:
                raise ModelError(
                    f"parameter {p.fqn!r} is tied ({', '.join(p.names)}) and the tp plan lays "
                    f"its uses out differently: {described}. One tensor has one layout.",
                    subject=p.fqn,
                    hint="Give every use the same layout (e.g. 'embedding_rowwise' on the "
                    "embedding with 'colwise_gather_output' on the head: both cut the "
                    "vocabulary), untie it (tie_word_embeddings=False), or leave its modules "
                    "out of the plan.",
                )
            owners = {n.rpartition(".")[0] for n in uses}
            dropped |= owners & set(modules)
            notes.append(
                f"{p.fqn!r} is tied and the model's plan lays its uses out differently "
                f"({described}): {', '.join(sorted(owners & set(modules)))} kept whole on "
                "every tp rank."
            )
            continue
        placement = next(iter(placed), None)
        if placement is None:
            continue
        dim = placement.dim if isinstance(placement, Shard | StridedShard) else None
        parts = tp * (placement.split_factor if isinstance(placement, StridedShard) else 1)
        if dim is not None and p.shape[dim] % parts:
            raise ConfigError(
                f"PrepConfig.tp={tp} does not divide dim {dim} (size {p.shape[dim]}) of "
                f"{p.fqn!r} {p.shape}, which the tp plan shards"
                + (" in two halves" if parts > tp else "")
                + f" ({placement}).",
                subject="tp",
                hint=f"Choose tp dividing {p.shape[dim] // (parts // tp)}, or leave "
                f"{p.fqn!r} replicated.",
            )
        out[p.fqn] = placement
    return tuple(out.items()), frozenset(dropped)


def _module_params(tree: ModuleTree, fqn: str) -> tuple[str, ...]:
    info = tree.module(fqn)
    assert info is not None
    return info.param_names


#: the styles fprep applies to a float8 Linear: torchao's with tensorwise scales, else torch's
FLOAT8_STYLES = {
    True: {"colwise": "Float8ColwiseParallel", "rowwise": "Float8RowwiseParallel"},
    False: {"colwise": "ColwiseParallel", "rowwise": "RowwiseParallel"},
}


def _float8_styles(
    tree: ModuleTree, modules: tuple[tuple[str, str], ...], fp8: Fp8Plan, tp: int
) -> tuple[tuple[str, str], ...]:
    """``(FQN, style class)`` for each module both plans touch. torchao's float8 styles cast a
    module's input tensorwise (one all-reduced amax per tensor), so they serve the tensorwise
    recipe only; a rowwise recipe keeps torch's styles, as torchtitan does. So do the layers
    meeting the sequence-sharded stream (``*_sequence``): torchao's styles would move float8
    tensors across the sequence (the backward all-gathers a float8 gradient), which gloo cannot
    do ("Invalid scalar type") and which is not verified on NCCL. Each rank's float8 matmul
    runs on its shard, whose sharded dimension must stay float8-sized."""
    converted = frozenset(fp8.modules)
    out: list[tuple[str, str]] = []
    for fqn, name in modules:
        kind = STYLES[name].kind
        if fqn not in converted or kind not in ("colwise", "rowwise"):
            continue
        weight = tree.param(join_fqn(fqn, "weight"))
        assert weight is not None
        dim = 0 if kind == "colwise" else 1
        local = weight.shape[dim] // tp
        if local % FP8_DIM_MULTIPLE:
            raise ConfigError(
                f"precision='fp8' with tp={tp}: {fqn!r} ({name}) keeps {local} of its "
                f"{weight.shape[dim]} {'rows' if dim == 0 else 'columns'} per tp rank, not a "
                f"multiple of {FP8_DIM_MULTIPLE} (float8 matmuls need both dimensions to be).",
                subject="fp8.skip",
                hint=f"Keep it in bf16 (fp8={{'skip': [{fqn!r}]}}), or choose a tp for which "
                f"{weight.shape[dim]} / tp is a multiple of {FP8_DIM_MULTIPLE}.",
            )
        torchao = fp8.recipe == "tensorwise" and not STYLES[name].sequence
        out.append((fqn, FLOAT8_STYLES[torchao][kind]))
    return tuple(out)


def _check_compile(compile_mode: str, checkpointing: bool, tp: int) -> None:
    """Compilations that fail inside torch over tensor-parallel DTensors (4 gloo ranks, CPU;
    tests/test_tp_composition.py): refused before any effect, naming the torch version."""
    from torch import __version__ as torch_version

    if compile_mode == "whole" and checkpointing:
        raise ConfigError(
            f"compile='whole' with activation_checkpointing and tp={tp} fails inside torch "
            f"{torch_version}: the checkpoint op saves the DeviceMesh for backward "
            "(AOTAutograd: 'expected all tensors_saved_with_vc_check to be Tensors'), and with "
            "torch's composable checkpoint instead AOTAutograd raises 'Mixing fake modes NYI' at "
            "the vocabulary-parallel embedding, whose _MaskPartial placement keeps its mask "
            "outside the trace (torch 2.13.0 and 2.15.0; benchmarks/tp_compile_repro.py).",
            subject="compile",
            hint="Drop one of them: compile='whole' without checkpointing, or checkpointing "
            "without compile (both tested equal to eager under tp), or compile='regional' "
            "with checkpointing.",
        )


def _extra_params(tree: ModuleTree, fqn: str) -> list[str]:
    """Parameters under module ``fqn`` other than its own ``weight`` and ``bias``: torch's
    Linear / Embedding styles would cut them too, and their output hooks would run after
    whatever those parameters do (a norm inside an embedding module)."""
    return [
        join_fqn(m.fqn, n)
        for m in tree.modules
        if is_within(m.fqn, fqn)
        for n in m.param_names
        if m.fqn != fqn or n not in ("weight", "bias")
    ]


def _own_plan_fixes(tree: ModuleTree, rules: Rules, strict: bool, notes: list[str]) -> Rules:
    """Two places where a model's own plan would break, checked for every plan:

    * a Linear / Embedding style on a module holding more than its weight and bias
      (Inkling's normed embedding): a user's plan is refused, a model's keeps the module whole;
    * ``colwise`` on a fused ``gate_up_proj`` parameter (Inkling's experts), which would give one
      rank every gate row and another every up row while the forward splits each rank's block
      in halves: a model's plan gets ``packed_colwise`` instead (each half cut on its own), a
      user's plan is refused.
    Each change to a model's plan is listed in the notes, once per kind."""
    modules: list[tuple[str, str]] = []
    whole: list[str] = []
    for fqn, name in rules.modules:
        extra = _extra_params(tree, fqn) if STYLES[name].kind in ("colwise", "rowwise") else []
        if not extra:
            modules.append((fqn, name))
            continue
        if strict:
            raise ConfigError(
                f"PrepConfig.tp_plan: {fqn!r} holds {extra[0]!r} besides its weight: the style "
                f"{name!r} (torch's Linear / Embedding styles) would cut it too and run its "
                "hooks around it.",
                subject="tp_plan",
                hint=f"Name the Linear / Embedding inside {fqn!r}, or leave it whole.",
            )
        whole.append(f"{fqn} ({extra[0]})")
    params: list[tuple[str, str]] = []
    repacked: list[str] = []
    for fqn, name in rules.params:
        if name != "colwise" or fqn.rpartition(".")[2] != "gate_up_proj":
            params.append((fqn, name))
            continue
        if strict:
            raise ConfigError(
                f"PrepConfig.tp_plan: 'colwise' on the fused {fqn!r} would give one tp rank the "
                "gate rows and another the up rows, while the forward splits each rank's block "
                "into gate and up.",
                subject="tp_plan",
                hint="Use 'packed_colwise', which cuts each half on its own.",
            )
        repacked.append(fqn)
        params.append((fqn, "packed_colwise"))
    if whole:
        notes.append(
            f"the model's plan gives {len(whole)} module(s) a Linear / Embedding style though "
            f"they hold more than a weight and bias (first: {whole[0]}); kept whole on every tp "
            "rank."
        )
    if repacked:
        notes.append(
            f"the model's plan gives 'colwise' to {len(repacked)} fused gate_up_proj "
            f"parameter(s) (first: {repacked[0]}), which would put the gate rows and the up rows "
            "on different tp ranks; planned 'packed_colwise' (each half cut on its own)."
        )
    return Rules(modules=tuple(modules), params=tuple(params), skipped=rules.skipped)


def _check_sequence_parallel(rules: Rules) -> None:
    """Sequence parallelism plans the Linear styles only: a behaviour or a parameter rule
    would meet sequence-sharded activations no one has checked it against."""
    for fqn, name in (*rules.modules, *rules.params):
        kind = STYLES[name].kind
        if (kind in BEHAVIOURS and kind != "grad_sum") or (fqn, name) in rules.params:
            raise ConfigError(
                f"sequence_parallel=True with the tp style {name!r} on {fqn!r}: fprep lays out "
                "sequence parallelism around Linear / Embedding styles only.",
                subject="sequence_parallel",
                hint="Use sequence_parallel=False for this model (tensor parallelism alone "
                "applies every style).",
            )


def plan_tensor_parallel(
    state: PrepState, pg: ProcessGroupState, ignored: IgnoredState
) -> TensorParallelState | None:
    cfg, tree, topo = state.config, state.tree, state.topology
    tp = pg.mesh.tp  # the record's tp dimension (PrepConfig.tp, laid out by init_process_group)
    if tp == 1:
        return None
    _check_compile(cfg.compile, cfg.activation_checkpointing, tp)
    pairs, source = _plan_pairs(state)
    strict = source == "config"
    rules = match_rules(
        tree, pairs, whole=state.pipeline.whole if state.pipeline else None, strict=strict
    )
    _check_known_styles(tree, (*rules.modules, *rules.params))
    notes: list[str] = []
    if rules.skipped:
        notes.append(
            f"the model's own tp plan names what this configuration lacks; skipped: "
            f"{', '.join(rules.skipped)}."
        )
    modules = rules.modules
    adapters = AdapterLayout.of(tree)
    if adapters is not None:  # peft: the styles of wrapped layers go to their parts
        modules = adapters.tensor_parallel(tree, modules, sequence=cfg.sequence_parallel)
    if cfg.sequence_parallel:
        _check_sequence_parallel(rules)
        pipe = state.pipeline
        modules = plan_sequence_parallel(
            tree,
            modules,
            enters=pipe is None or pipe.holds_first,
            leaves=pipe is None or pipe.holds_last,
        )
    rules = _own_plan_fixes(tree, Rules(modules=modules, params=rules.params), strict, notes)
    modules = rules.modules
    placements, dropped = _placements(tree, rules, tp, ignored, strict=strict, notes=notes)
    if dropped:
        modules = tuple((f, n) for f, n in modules if f not in dropped)
    styles = {name for _, name in modules}
    if styles & {"colwise", "colwise_rep", "colwise_gather_output"}:
        for field, count in tree.head_counts:
            if count % tp:
                raise ConfigError(
                    f"PrepConfig.tp={tp} does not divide the model's {field}={count}: each tp "
                    "rank computes a whole number of attention heads.",
                    subject="tp",
                    hint=f"Choose tp dividing {count}.",
                )
    params = tuple(
        (fqn, pl.dim if isinstance(pl, Shard | StridedShard) else None) for fqn, pl in placements
    )
    fp8 = state.core.precision.fp8_plan if state.core is not None else None
    float8 = _float8_styles(tree, modules, fp8, tp) if fp8 is not None else ()
    if topo.local_world_size % tp:
        notes.append(
            f"tp={tp} does not divide the {topo.local_world_size} processes per node: tensor-"
            "parallel groups cross nodes (their all-reduces run over the network)."
        )
    return TensorParallelState(
        mesh=pg.mesh,  # init_process_group laid out (dp..., tp) with this tp
        modules=modules,
        params=params,
        plan_source=source,  # type: ignore[arg-type]
        loss_parallel=any(STYLES[n].dtensor_output for _, n in modules),
        notes=tuple(notes),
        float8=float8,
        placements=placements,
        param_rules=rules.params,
        rope_dim=dict(tree.model_dims).get("qk_rope_head_dim"),
    )
