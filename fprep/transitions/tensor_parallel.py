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

from fprep.adapters import AdapterLayout
from fprep.errors import ConfigError, ModelError
from fprep.snapshot import ModuleTree, is_within, join_fqn
from fprep.state import Fp8Plan, IgnoredState, PrepState, ProcessGroupState, TensorParallelState
from fprep.tp_styles import REFUSED, SHARDABLE, STYLES, Style, pattern_regex, tp_dim
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


def match_modules(
    tree: ModuleTree,
    pairs: tuple[tuple[str, str], ...],
    field: str = "tp_plan",
    whole: ModuleTree | None = None,
) -> tuple[tuple[str, str], ...]:
    """``(module FQN, style)`` for every module a pattern matches, in pre-order.

    Under pipeline parallelism ``tree`` is this rank's part and ``whole`` the whole model: a
    pattern must match a module of the whole model, and matches on this part only the modules
    this rank holds (another stage's modules are pass-throughs here, or gone).
    """
    chosen: dict[str, tuple[str, str]] = {}  # fqn -> (pattern, style)
    for pattern, style in pairs:
        rx = pattern_regex(pattern)
        hits = [m.fqn for m in tree.modules[1:] if rx.fullmatch(m.fqn) and not m.is_stage_gap]
        if not hits and whole is not None and any(rx.fullmatch(m.fqn) for m in whole.modules):
            continue  # another stage's modules
        if not hits:
            raise ConfigError(
                f"PrepConfig.{field} pattern {pattern!r} ({style!r}) matches no module of "
                f"{tree.root.class_name}.",
                subject=field,
                hint="Patterns are module FQNs as in model.named_modules(), '*' standing for "
                "one segment (a layer number), e.g. 'layers.*.attention.wq'.",
            )
        for fqn in hits:
            before = chosen.get(fqn)
            if before is not None and before[1] != style:
                raise ConfigError(
                    f"PrepConfig.{field}: module {fqn!r} matches {before[0]!r} ({before[1]!r}) "
                    f"and {pattern!r} ({style!r}).",
                    subject=field,
                    hint="Give each module one style.",
                )
            chosen[fqn] = (pattern, style)
    return tuple((m.fqn, chosen[m.fqn][1]) for m in tree.modules if m.fqn in chosen)


def _check_kind(tree: ModuleTree, fqn: str, style: Style) -> bool:
    """Whether the module is an Embedding (colwise / rowwise need a Linear or Embedding)."""
    info = tree.module(fqn)
    assert info is not None
    is_embedding = info.is_a("Embedding")
    if style.kind in ("colwise", "rowwise") and not any(info.is_a(k) for k in SHARDABLE):
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


def _params(
    tree: ModuleTree, modules: tuple[tuple[str, str], ...], tp: int, ignored: IgnoredState
) -> tuple[tuple[str, int | None], ...]:
    out: list[tuple[str, int | None]] = []
    for fqn, name in modules:
        style = STYLES[name]
        if not style.shards_params:
            continue
        if any(is_within(fqn, m) for m in ignored.modules):
            raise ConfigError(
                f"PrepConfig.tp_plan shards {fqn!r}, which is ignored (kept whole on every rank).",
                subject="tp_plan",
                hint="Stop ignoring it, or leave it out of the plan.",
            )
        is_embedding = _check_kind(tree, fqn, style)
        info = tree.module(fqn)
        assert info is not None
        for pname in info.param_names:
            p = tree.param(join_fqn(fqn, pname))
            assert p is not None
            dim = tp_dim(style.kind, is_embedding, pname)
            if p.is_tied:
                raise ModelError(
                    f"parameter {p.fqn!r} is tied ({', '.join(p.names)}) and tp_plan gives "
                    f"{fqn!r} the style {name!r}: fprep does not shard tied parameters over tp.",
                    subject=p.fqn,
                    hint="Untie it (e.g. tie_word_embeddings=False), or leave its modules "
                    "out of the tp plan.",
                )
            if dim is not None and p.shape[dim] % tp:
                raise ConfigError(
                    f"PrepConfig.tp={tp} does not divide dim {dim} (size {p.shape[dim]}) of "
                    f"{p.fqn!r} {p.shape}, which the style {name!r} shards.",
                    subject="tp",
                    hint=f"Choose tp dividing {p.shape[dim]}, or leave {fqn!r} replicated.",
                )
            out.append((p.fqn, dim))
    return tuple(out)


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


def plan_tensor_parallel(
    state: PrepState, pg: ProcessGroupState, ignored: IgnoredState
) -> TensorParallelState | None:
    cfg, tree, topo = state.config, state.tree, state.topology
    tp = pg.mesh.tp  # the record's tp dimension (PrepConfig.tp, laid out by init_process_group)
    if tp == 1:
        return None
    _check_compile(cfg.compile, cfg.activation_checkpointing, tp)
    pairs, source = _plan_pairs(state)
    modules = match_modules(tree, pairs, whole=state.pipeline.whole if state.pipeline else None)
    _check_known_styles(tree, modules)
    adapters = AdapterLayout.of(tree)
    if adapters is not None:  # peft: the styles of wrapped layers go to their parts
        modules = adapters.tensor_parallel(tree, modules, sequence=cfg.sequence_parallel)
    if cfg.sequence_parallel:
        pipe = state.pipeline
        modules = plan_sequence_parallel(
            tree,
            modules,
            enters=pipe is None or pipe.holds_first,
            leaves=pipe is None or pipe.holds_last,
        )
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
    params = _params(tree, modules, tp, ignored)
    fp8 = state.core.precision.fp8_plan if state.core is not None else None
    float8 = _float8_styles(tree, modules, fp8, tp) if fp8 is not None else ()
    notes: list[str] = []
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
    )
