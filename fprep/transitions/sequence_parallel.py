"""Sequence parallelism, planned: torchtitan's layout derived from a Megatron tp plan.

Between the tensor-parallel regions (the modules whose ``colwise`` layers split the heads: an
attention, an MLP) every tp rank would hold the whole residual stream and run the same norms
and dropouts on it. Sequence parallelism shards that stream on the sequence (dim 1) instead:

* norms and dropouts outside the regions: ``sequence_parallel`` (torch's ``SequenceParallel``);
* each region gathers whole sequences on entry (``sequence_gather``, torch's
  ``PrepareModuleInput`` from ``Shard(1)`` to ``Replicate()``) and its ``rowwise`` layer
  reduce-scatters onto the stream (``rowwise_sequence``: ``output_layouts=Shard(1)``);
* the embedding enters the stream sharded (``embedding_rowwise_sequence``, or
  ``sequence_scatter`` on an embedding the plan leaves whole) and the output head reads it
  (``colwise_*_sequence``: ``input_layouts=Shard(1)``).

The stream stays a DTensor between blocks, so code that reads its shape (transformers' position
ids and masks) sees the whole sequence. Anything the layout cannot express is a ``ConfigError``
naming the module, before any effect.
"""

from __future__ import annotations

from fprep.errors import ConfigError
from fprep.layout.styles import SEQUENCE_VARIANTS, STYLES
from fprep.snapshot import ModuleInfo, ModuleTree, is_within, parent_fqn

#: styles a sequence-parallel layout can hold, beside the ones it adds
_IN_REGION = ("colwise", "rowwise")
_OUTSIDE = ("embedding_rowwise", "colwise_rep", "colwise_gather_output", "colwise_loss_parallel")
_KEPT = ("replicate", "sequence_parallel", "sequence_scatter", *SEQUENCE_VARIANTS.values())


def _refuse(message: str, hint: str) -> ConfigError:
    return ConfigError(
        f"PrepConfig.sequence_parallel: {message}", subject="sequence_parallel", hint=hint
    )


def _on_stream(info: ModuleInfo) -> bool:
    """Norms (``LayerNorm``, ``RMSNorm``, ``LlamaRMSNorm`` ...) and dropouts."""
    names = info.mro or (info.cls,)
    return info.is_a("Dropout") or any(n.rpartition(".")[2].endswith("Norm") for n in names)


def plan_sequence_parallel(
    tree: ModuleTree,
    modules: tuple[tuple[str, str], ...],
    *,
    enters: bool = True,
    leaves: bool = True,
) -> tuple[tuple[str, str], ...]:
    """``modules`` (FQN, style) rewritten into the sequence-parallel layout, in pre-order.

    Under pipeline parallelism ``tree`` is one rank's part: the stream enters it sharded from
    the previous stage unless it holds the first stage (``enters``: the embedding shards it),
    and leaves it sharded for the next unless it holds the last (``leaves``: the head reads it).
    """
    styles = dict(modules)
    regions = sorted({parent_fqn(f) for f, s in modules if s == "colwise"})
    if not regions:
        raise _refuse(
            "the tp plan has no 'colwise' layers, so no region to gather sequences for.",
            "Sequence parallelism extends a Megatron plan (colwise then rowwise layers).",
        )
    if "" in regions:
        raise _refuse(
            "'colwise' layers directly under the root: the stream around them cannot be told "
            "apart from their inputs.",
            "Plan the colwise / rowwise pairs inside submodules (attention, mlp).",
        )
    out = dict(styles)
    for fqn, name in modules:
        inside = any(parent_fqn(fqn) == r for r in regions)
        if name in _KEPT or (name in _IN_REGION and inside) or fqn in regions:
            if name == "rowwise":
                out[fqn] = SEQUENCE_VARIANTS[name]
            continue
        if name in _OUTSIDE and not any(is_within(fqn, r) for r in regions):
            out[fqn] = SEQUENCE_VARIANTS[name]
            continue
        raise _refuse(
            f"module {fqn!r} has the style {name!r}"
            + (" outside the regions that gather sequences" if name in _IN_REGION else "")
            + ", which the sequence-parallel layout cannot place.",
            "Rowwise layers must end a region of colwise ones; embeddings and output heads "
            "take embedding_rowwise / colwise_gather_output / colwise_loss_parallel.",
        )
    for region in regions:
        if styles.get(region, "sequence_gather") != "sequence_gather":
            raise _refuse(
                f"module {region!r} holds colwise layers and has the style {styles[region]!r} "
                "itself.",
                f"Leave {region!r} out of the plan.",
            )
        out[region] = "sequence_gather"
    planned = [f for f in out if STYLES[out[f]].kind != "replicate"]
    for info in tree.modules[1:]:
        if info.is_stage_gap:
            continue  # another pipeline stage's module
        if info.fqn in out or any(is_within(info.fqn, p) for p in planned):
            continue
        if _on_stream(info):
            out[info.fqn] = "sequence_parallel"
        elif info.is_a("Embedding"):
            out[info.fqn] = "sequence_scatter"  # kept whole; its output enters the stream
    if enters and not any(
        s in ("embedding_rowwise_sequence", "sequence_scatter") for s in out.values()
    ):
        raise _refuse(
            f"{tree.root.class_name} has no nn.Embedding where the sequence could be sharded.",
            "Sequence parallelism needs the token embedding inside the model.",
        )
    if leaves and not any(STYLES[s].sequence and STYLES[s].kind == "colwise" for s in out.values()):
        raise _refuse(
            "nothing reads the sequence-sharded stream back: the plan has no output head.",
            "Plan the head: tp_plan={'lm_head': 'colwise_gather_output', ...}.",
        )
    return tuple((m.fqn, out[m.fqn]) for m in tree.modules if m.fqn in out)
