"""init_pipeline: the model cut into pipeline stages, and this rank's part of it (pure).

Runs only when ``PrepConfig.pp > 1``, right after ``init_process_group`` (it reads the pp
coordinate from the mesh record). It decides

- the split: the user's ``pp_split``, or torchtitan's rule over the model's own pipeline plan
  (``ModuleTree.pp_plan``: the embedding and the final norm + head weigh one layer each, the
  layers spread evenly, the first stages take the remainder);
- which stages this rank runs (``fprep.layout.stages.stages_of_rank``) and the micro-batch count;
- this rank's part: the snapshot restricted to its stages' modules, under their own names, with a
  pass-through (``StageGap``) standing in for every module of another stage. Every later
  transition plans that part only (FSDP units, tensor parallelism, initialization, ``weights=``
  reads), exactly as for a smaller model.

It refuses, before any effect: a model that declares no pipeline plan (its forward might not
pass activations through a missing module, and a wrong split would train silently wrong), a split
that cuts inside a block or out of order, a parameter shared by two stages, parameters outside
every stage, micro-batch counts the schedule cannot run, compiled stages under the zero-bubble
schedules, and what would act on the whole model, which no rank runs (compile='whole',
checkpointing or regional compile without wrap=, sync_module_states).
"""

from __future__ import annotations

import dataclasses

from fprep.errors import ConfigError, ModelError
from fprep.layout import stages as layout
from fprep.snapshot import STAGE_GAP_CLS, ModuleInfo, ModuleTree, is_within
from fprep.state import PipelineState, PrepState, need
from fprep.transitions._base import transition

_GAP_MRO = (STAGE_GAP_CLS, "torch.nn.modules.module.Module")

#: Schedules that split backward into input and weight gradients; torch runs them eagerly only.
ZERO_BUBBLE_SCHEDULES = ("InterleavedZeroBubble", "ZBVZeroBubble", "DualPipeV")


def _units(tree: ModuleTree, order: tuple[str, ...]) -> tuple[tuple[str, ...], str | None]:
    """The modules a stage boundary may fall between, in forward order (each entry of the
    pipeline plan, a container's children in its place), and the container's name."""
    units: list[str] = []
    containers = []
    for name in order:
        info = tree.module(name)
        if info is None:
            raise ModelError(
                f"the model's pipeline plan names {name!r}, which is not one of its modules.",
                subject=name,
                hint="Fix the model's _pp_plan (or its config's base_model_pp_plan).",
            )
        if info.can_run_forward:
            units.append(name)
        else:
            containers.append(name)
            units.extend(info.children)
    return tuple(units), containers[0] if len(containers) == 1 else None


def _default_split(
    tree: ModuleTree, order: tuple[str, ...], container: str | None, num_stages: int
) -> layout.Split:
    if container is None:
        raise ConfigError(
            f"the model's pipeline plan {list(order)} has no single list of blocks to spread "
            "over the stages.",
            subject="pp_split",
            hint="Give pp_split=[[module names of stage 0], [stage 1], ...].",
        )
    info = tree.module(container)
    assert info is not None
    at = order.index(container)
    children = info.children
    try:
        return layout.default_split(
            num_stages,
            len(children),
            first=order[:at],
            layers=container,
            last=order[at + 1 :],
            layer_names=children,
        )
    except ConfigError as e:
        raise ConfigError(
            e.message.replace("num_stages=", "the pipeline's "),
            subject="pp",
            hint=e.hint or "Use fewer pipeline ranks or stages per rank.",
        ) from None


def _user_split(split: layout.Split, units: tuple[str, ...], num_stages: int) -> layout.Split:
    checked = layout.user_split(split)
    if len(checked) != num_stages:
        raise ConfigError(
            f"pp_split lists {len(checked)} stages, but the pipeline runs {num_stages} "
            "(pp x stages per rank).",
            subject="pp_split",
            hint=f"Give {num_stages} stages, or change pp / pp_stages_per_rank.",
        )
    flat = [name for stage in checked for name in stage]
    for name in flat:
        if name not in units:
            raise ConfigError(
                f"pp_split names {name!r}, which is not a place the model's forward can be "
                "cut: a stage holds whole entries of its pipeline plan or whole blocks.",
                subject="pp_split",
                hint=f"Name only these modules: {', '.join(units[:8])}"
                + (" ..." if len(units) > 8 else "")
                + ".",
            )
    if tuple(flat) != units:
        missing = [u for u in units if u not in flat]
        why = (
            f"it leaves out {missing[:4]}: every module of the forward runs on one stage"
            if missing
            else "its modules are not in the order the forward runs them"
        )
        raise ConfigError(
            f"pp_split does not follow the model's forward: {why}.",
            subject="pp_split",
            hint="List every module once, in forward order, cut into consecutive stages.",
        )
    return checked


def _check_params(tree: ModuleTree, split: layout.Split) -> tuple[str, ...]:
    """Refuse parameters shared by two stages or held by no stage; return the shared
    parameter-free modules outside every stage."""
    stage_of: dict[str, int] = {}
    for index, names in enumerate(split):
        for name in names:
            stage_of[name] = index

    def owner(fqn: str) -> int | None:
        parts = fqn.split(".")
        for end in range(len(parts), 0, -1):
            found = stage_of.get(".".join(parts[:end]))
            if found is not None:
                return found
        return stage_of.get("")

    for p in tree.params:
        where = {owner(n) for n in p.names}
        if None in where:
            raise ModelError(
                f"parameter {p.fqn!r} belongs to no pipeline stage (its module is outside the "
                "model's pipeline plan).",
                subject=p.fqn,
                hint="Add its module to the model's _pp_plan, or move the parameter into one "
                "of the modules the stages hold.",
            )
        if len(where) > 1:
            shared_by = sorted(w for w in where if w is not None)
            raise ModelError(
                f"parameter {p.fqn!r} is shared by stages {shared_by}"
                f" ({', '.join(p.names)}): a pipeline stage cannot hold another stage's "
                "parameter (tied embeddings).",
                subject=p.fqn,
                hint="Untie it (e.g. tie_word_embeddings=False) to train with pp > 1.",
            )
    named = set(stage_of)
    shared: list[str] = []
    for m in tree.modules:
        if any(is_within(m.fqn, n) for n in named):
            continue
        if any(is_within(n, m.fqn) for n in named):
            continue  # an ancestor of stage modules: every stage keeps its own copy
        if not any(is_within(n, m.fqn) for n in shared):
            shared.append(m.fqn)
    return tuple(shared)


def _part(tree: ModuleTree, gaps: tuple[str, ...]) -> ModuleTree:
    """The snapshot of this rank's part: ``gaps`` become pass-throughs, their subtrees gone."""
    gap_set = set(gaps)

    def in_gap(fqn: str) -> bool:
        parts = fqn.split(".")
        return any(".".join(parts[:end]) in gap_set for end in range(1, len(parts) + 1))

    modules: list[ModuleInfo] = []
    for m in tree.modules:
        if m.fqn in gap_set:
            modules.append(
                ModuleInfo(
                    fqn=m.fqn,
                    cls=STAGE_GAP_CLS,
                    mro=_GAP_MRO,
                    has_reset_parameters=False,
                    has_forward=True,
                )
            )
        elif m.fqn == "" or not in_gap(m.fqn):
            modules.append(m)
    return dataclasses.replace(
        tree,
        modules=tuple(modules),
        params=tuple(p for p in tree.params if not in_gap(p.fqn)),
        buffers=tuple(b for b in tree.buffers if not in_gap(b.fqn)),
    )


def _check_effects(state: PrepState, tree: ModuleTree, order: tuple[str, ...]) -> None:
    """Refuse what would act on the model prepare returns, which under pp never runs."""
    cfg = state.config
    if cfg.compile == "whole":
        raise ConfigError(
            "compile='whole' compiles the model as one graph, but under pp > 1 no rank runs "
            "the whole model: each runs its stages.",
            subject="compile",
            hint="Use compile='regional' with wrap= naming the blocks (each block compiled "
            "once, as torchtitan compiles them).",
        )
    if (cfg.activation_checkpointing or cfg.compile == "regional") and cfg.wrap is None:
        blocks = [tree.module(c) for n in order for c in _children(tree, n)]
        name = blocks[0].class_name if blocks and blocks[0] is not None else "Block"
        field = "activation_checkpointing" if cfg.activation_checkpointing else "compile"
        raise ConfigError(
            f"{field} without wrap= would act on the whole model as one region, which under "
            "pp > 1 never runs (each rank runs its stages).",
            subject="wrap",
            hint=f"Name the blocks: wrap=({name!r},) (each block then is a region).",
        )
    if cfg.precision == "fp16":
        raise ConfigError(
            "precision='fp16' needs its loss scaled before backward, which torch's pipeline "
            "schedules run themselves (without a scaler): fp16 gradients would overflow "
            "silently.",
            subject="precision",
            hint="Use precision='bf16' (no loss scaling needed).",
        )
    if cfg.sync_module_states:
        raise ConfigError(
            "sync_module_states=True sends rank 0's weights to every rank, but under pp > 1 "
            "rank 0 holds only the first stage.",
            subject="sync_module_states",
            hint="Build the model on the meta device and pass weights= (each stage reads its "
            "own tensors), or build it with the same seed on every rank.",
        )


def _children(tree: ModuleTree, name: str) -> tuple[str, ...]:
    info = tree.module(name)
    return info.children if info is not None and not info.can_run_forward else ()


@transition
def init_pipeline(state: PrepState) -> PrepState:
    cfg = state.config
    if cfg.pp == 1:
        return state
    pg = need(state.process_group, "init_process_group", "init_pipeline")
    # planned again (a custom chain may): split the whole model, not the part planned before
    tree = (
        state.pipeline.whole if state.pipeline is not None and state.pipeline.whole else state.tree
    )
    order = tree.pp_plan
    if order is None:
        raise ModelError(
            f"pp={cfg.pp}: {tree.root.class_name} declares no pipeline plan, so fprep cannot "
            "know that its forward passes activations through each top-level module (a stage "
            "stands a pass-through in for the modules other stages hold; a forward that does "
            "more would train silently wrong).",
            subject="pp",
            hint="Use a transformers model with a base_model_pp_plan, or give your model a "
            "_pp_plan dict {module name: (inputs, outputs)} listing the modules its forward "
            "runs one after another (docs/parallelism.md).",
        )
    if cfg.compile != "none" and cfg.pp_schedule in ZERO_BUBBLE_SCHEDULES:
        raise ConfigError(
            f"compile={cfg.compile!r} with pp_schedule={cfg.pp_schedule!r}: the zero-bubble "
            "schedules split each backward into input and weight gradients, which torch runs "
            "only for eager stages.",
            subject="compile",
            hint="Use compile='none', or a schedule such as 'Interleaved1F1B' or '1F1B'.",
        )
    _check_effects(state, tree, order)
    try:
        num_stages = layout.num_stages(cfg.pp, cfg.pp_schedule, cfg.pp_stages_per_rank)
        stages = layout.stages_of_rank(
            pg.mesh.coordinate("pp"), cfg.pp, cfg.pp_schedule, cfg.pp_stages_per_rank
        )
    except ConfigError as e:
        subject = "pp_stages_per_rank" if e.subject == "stages_per_rank" else e.subject
        raise ConfigError(
            e.message.replace("stages_per_rank=", "pp_stages_per_rank="),
            subject=subject,
            hint=e.hint,
        ) from None
    units, container = _units(tree, order)
    if cfg.pp_split is not None:
        split, source = _user_split(cfg.pp_split, units, num_stages), "config"
    else:
        split, source = _default_split(tree, order, container, num_stages), "model"
    microbatches = cfg.pp_microbatches or num_stages
    layout.check_microbatches(cfg.pp_schedule, microbatches, cfg.pp, num_stages)
    shared = _check_params(tree, split)
    plan = PipelineState(
        mesh=pg.mesh,
        schedule=cfg.pp_schedule,
        microbatches=microbatches,
        split=split,
        stages=stages,
        source=source,  # type: ignore[arg-type]
        shared=shared,
        whole=tree,
    )
    part = _part(tree, plan.gaps())
    return state.replace(pipeline=plan, inputs=dataclasses.replace(state.inputs, tree=part))
