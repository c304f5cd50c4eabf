"""The pipeline split as pure functions: which modules make each stage, which stages each rank runs.

Three ways to split a model into stages:

- ``default_split``: torchtitan's rule for language models. The embedding and the final norm +
  head each weigh as much as one layer; the weighted layers are spread evenly and the first
  stages take the remainder (4 stages x 32 layers: [emb + 8], [9], [8], [7 + norm + head]).
- ``user_split``: module names per stage, checked.
- (later) a transformers model's own ``base_model_pp_plan``.

``stages_of_rank`` places stages on pipeline ranks the way ``torch.distributed.pipelining``'s
schedules expect: one stage per rank for single-stage schedules, ``stages_per_rank`` stages
round-robin (rank ``r`` runs ``r, r + P, r + 2P, ...``) for looped ones, and stages ``r`` and
``2P - 1 - r`` for the V schedules.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence

from fprep.errors import ConfigError

SINGLE_STAGE_SCHEDULES = ("GPipe", "1F1B")
LOOPED_SCHEDULES = ("Interleaved1F1B", "LoopedBFS", "InterleavedZeroBubble")
V_SCHEDULES = ("ZBVZeroBubble", "DualPipeV")
SCHEDULES = SINGLE_STAGE_SCHEDULES + LOOPED_SCHEDULES + V_SCHEDULES

Split = tuple[tuple[str, ...], ...]


def default_split(
    num_stages: int,
    num_layers: int,
    *,
    first: Sequence[str] = ("tok_embeddings",),
    layers: str = "layers",
    last: Sequence[str] = ("norm", "output"),
    layer_names: Sequence[str] | None = None,
) -> Split:
    """torchtitan's split of a language model with ``num_layers`` blocks ``{layers}.{i}``.

    ``first`` (the embedding) opens stage 0 and ``last`` (final norm and head) closes the last
    stage; each counts as one layer when the layers are spread. ``layer_names`` gives the
    blocks' names when they are not ``{layers}.{i}`` (a ModuleDict's keys).
    """
    if num_layers < 1:
        raise ConfigError(
            f"num_layers={num_layers}: a pipeline needs at least one layer to split.",
            subject="num_layers",
        )
    _check_positive("num_stages", num_stages)
    names = (
        list(layer_names)
        if layer_names is not None
        else [f"{layers}.{i}" for i in range(num_layers)]
    )
    if num_stages == 1:
        return ((*first, *names, *last),)
    weighted = num_layers + 2  # the embedding and the head each weigh one layer
    if num_stages > weighted:
        raise ConfigError(
            f"num_stages={num_stages} is more than the {num_layers} layers plus embedding and "
            f"head ({weighted} weighted layers): some stage would hold nothing.",
            subject="num_stages",
            hint=f"Use at most {weighted} stages (fewer pipeline ranks or stages per rank).",
        )
    per_stage, extra = divmod(weighted, num_stages)
    stages: list[tuple[str, ...]] = []
    taken = 0
    for index in range(num_stages):
        weight = per_stage + (1 if index < extra else 0)
        if index == 0:
            count = weight - 1
            stages.append((*first, *names[taken : taken + count]))
        elif index == num_stages - 1:
            count = num_layers - taken
            stages.append((*names[taken:], *last))
        else:
            count = weight
            stages.append(tuple(names[taken : taken + count]))
        taken += count
    return tuple(stages)


def user_split(stages: Sequence[Sequence[str]], known: Collection[str] | None = None) -> Split:
    """A split given as module names per stage, checked: no empty stage, no name twice, and
    (when ``known`` is given) every name a module of the model."""
    if isinstance(stages, str) or not stages:
        raise ConfigError(
            "the pipeline split lists no stages.",
            subject="stages",
            hint="Give a list of stages, each a list of module names.",
        )
    seen: set[str] = set()
    out = []
    for index, stage in enumerate(stages):
        if isinstance(stage, str) or not stage:
            raise ConfigError(
                f"stage {index} of the pipeline split is {stage!r}, not a non-empty list of "
                "module names.",
                subject="stages",
                hint="Give each stage a list of module names, e.g. ['layers.0', 'layers.1'].",
            )
        for name in stage:
            if name in seen:
                raise ConfigError(
                    f"module {name!r} is in two stages of the pipeline split.",
                    subject="stages",
                    hint="Put every module in exactly one stage.",
                )
            if known is not None and name not in known:
                raise ConfigError(
                    f"stage {index} names {name!r}, which is not a module of the model.",
                    subject="stages",
                    hint="Use the names model.named_modules() gives.",
                )
            seen.add(name)
        out.append(tuple(stage))
    return tuple(out)


def num_stages(pp: int, schedule: str, stages_per_rank: int = 2) -> int:
    """How many stages a pipeline of ``pp`` ranks runs under ``schedule``."""
    return pp * _stages_per_rank(schedule, stages_per_rank)


def stages_of_rank(
    pp_rank: int, pp: int, schedule: str, stages_per_rank: int = 2
) -> tuple[int, ...]:
    """The stage indices pipeline rank ``pp_rank`` of ``pp`` runs under ``schedule``."""
    _check_positive("pp", pp)
    if not 0 <= pp_rank < pp:
        raise ConfigError(
            f"pipeline rank {pp_rank} is outside the {pp} pipeline ranks.", subject="pp_rank"
        )
    per_rank = _stages_per_rank(schedule, stages_per_rank)
    if schedule in V_SCHEDULES:
        return (pp_rank, 2 * pp - 1 - pp_rank)
    return tuple(pp_rank + k * pp for k in range(per_rank))


def _stages_per_rank(schedule: str, stages_per_rank: int) -> int:
    if schedule not in SCHEDULES:
        raise ConfigError(
            f"schedule={schedule!r} is not a pipeline schedule fprep knows.",
            subject="schedule",
            hint=f"Use one of {', '.join(SCHEDULES)}.",
        )
    _check_positive("stages_per_rank", stages_per_rank)
    if schedule in SINGLE_STAGE_SCHEDULES:
        return 1
    if schedule in V_SCHEDULES and stages_per_rank != 2:
        raise ConfigError(
            f"schedule={schedule!r} runs exactly two stages per rank (a V); "
            f"stages_per_rank={stages_per_rank} was asked.",
            subject="stages_per_rank",
            hint="Leave stages_per_rank at 2 for ZBVZeroBubble and DualPipeV.",
        )
    return stages_per_rank


def _check_positive(name: str, value: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ConfigError(f"{name}={value!r} must be a whole number of at least 1.", subject=name)


def check_microbatches(schedule: str, microbatches: int, pp: int, stages: int) -> None:
    """Refuse a micro-batch count ``schedule`` cannot run with ``pp`` ranks and ``stages``
    stages in all, as torch's schedules would (but before anything runs)."""
    _check_positive("pp_microbatches", microbatches)
    if schedule in ("1F1B", "ZBVZeroBubble", "DualPipeV") and microbatches < stages:
        raise ConfigError(
            f"pp_schedule={schedule!r} needs at least as many micro-batches as stages "
            f"({stages}); pp_microbatches={microbatches}.",
            subject="pp_microbatches",
            hint=f"Use pp_microbatches >= {stages} (more micro-batches also shrink the bubble).",
        )
    if schedule in ("Interleaved1F1B", "InterleavedZeroBubble"):
        rounds = max(1, microbatches // pp)
        if microbatches % rounds:
            raise ConfigError(
                f"pp_schedule={schedule!r} runs micro-batches in rounds of the {pp} pipeline "
                f"ranks; pp_microbatches={microbatches} is not a multiple of its "
                f"{rounds} rounds.",
                subject="pp_microbatches",
                hint=f"Use a multiple of {pp} micro-batches (or fewer than {2 * pp}).",
            )


def microbatch_sizes(batch: int, microbatches: int) -> tuple[int, ...]:
    """How ``torch.tensor_split`` cuts a batch of ``batch`` rows into ``microbatches`` chunks."""
    size, extra = divmod(batch, microbatches)
    return tuple(size + (1 if i < extra else 0) for i in range(microbatches))
