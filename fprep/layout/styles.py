"""The tensor-parallel plan vocabulary, as pure data: what each style does to each weight.

The names are transformers' (``config.base_model_tp_plan``, a model class's ``_tp_plan``), so a
transformers model's own plan is used as it is; a user plan (``PrepConfig.tp_plan``) speaks the
same words. A rule names a module or a parameter (``layers.*.mlp.experts.gate_up_proj``, a 3-D
tensor of fused experts); a module's rule also covers its own parameters that have no rule of
their own, as in transformers. The Linear / Embedding styles map to torch's ``ParallelStyle``
classes (``ColwiseParallel``, ``RowwiseParallel``, ``SequenceParallel``) with their input /
output layouts; the others (packed gate/up halves, replicated weights whose gradients are summed,
mixture-of-experts experts, multi-head latent attention, local parameters, all-reduced outputs)
are a placement per parameter (``param_placement``) plus a module behaviour that fprep installs
with DTensor (``fprep.apply.tp_module_styles``). The expert-parallel styles are refused by name
until ``ep`` exists. ``colwise_loss_parallel``
is fprep's own: a column-sharded output head whose logits stay a vocabulary-sharded DTensor for
``fprep.loss_parallel``. Sequence parallelism (``PrepConfig.sequence_parallel``) adds the
``*_sequence`` variants (the residual stream around them is sharded on the sequence, dim 1:
torchtitan's layout) and ``sequence_gather`` / ``sequence_scatter``, which move a module's
input or output between that stream and whole sequences. Patterns are module FQNs where ``*``
stands for one dotted segment (``"layers.*.attn.q"``), as transformers matches them.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, replace
from typing import Literal

from fprep.errors import ConfigError
from fprep.layout.placements import Placement, Replicate, Shard, StridedShard

Kind = Literal[
    "colwise",
    "rowwise",
    "replicate",
    "sequence",
    "gather",
    "scatter",
    # transformers' styles beyond torch's classes: the apply installs a module behaviour
    "packed_colwise",  # fused (gate | up) output halves, each sharded on its own
    "packed_rowwise",  # fused halves along the input dim
    "grad_sum",  # replicated weight whose gradient is summed over tp (q / k norms)
    "local",  # the module runs on its parameters' local shards (attention sinks)
    "all_reduce",  # the module's output is partial: summed over tp
    "mla_kv_a",  # DeepSeek's kv_a projection: the rope part's gradient summed over tp
    "moe_experts",  # every expert sharded; inputs' gradients and the output summed over tp
    "moe_identity",  # an identity expert beside sharded ones: input divided by tp
]

#: kinds whose forward fprep installs itself (a module behaviour; ``packed_colwise`` only on a
#: module, where it runs the Linear on its local halves)
BEHAVIOURS: frozenset[Kind] = frozenset(
    {"packed_colwise", "grad_sum", "local", "all_reduce", "mla_kv_a", "moe_experts", "moe_identity"}
)
#: behaviours under which a module's forward sees its parameters' local shards, so a parameter
#: a rule of its own shards can live there
#: (``all_reduce``: a module computing a partial sum from its parameters' shards, then summed)
RUNS_LOCAL: frozenset[Kind] = frozenset(
    {"packed_colwise", "local", "moe_experts", "grad_sum", "all_reduce"}
)


@dataclass(frozen=True, kw_only=True)
class Style:
    """One style: torch's class (``kind``) and the layouts of the module's input and output."""

    name: str
    kind: Kind
    input_replicated: bool = True  # False: the input arrives sharded on its last dim
    output_replicated: bool = False  # True: the output is gathered (all-reduced for rowwise)
    embedding_only: bool = False
    dtensor_output: bool = False  # output kept a DTensor sharded on the vocabulary (loss parallel)
    #: sequence parallelism: the input (colwise heads) or output (rowwise) is the residual
    #: stream, a DTensor sharded on the sequence (dim 1)
    sequence: bool = False

    @property
    def shards_params(self) -> bool:
        """Whether the module's parameters become tp DTensors (sharded or replicated)."""
        return self.kind in ("colwise", "rowwise", "sequence", "packed_colwise", "grad_sum")

    @property
    def is_behaviour(self) -> bool:
        """Whether the apply installs this style's forward itself (not a torch class)."""
        return self.kind in BEHAVIOURS


def _sequence_variant(style: Style) -> Style:
    return replace(style, name=f"{style.name}_sequence", sequence=True)


#: the styles that meet the residual stream, and their sequence-parallel variants
SEQUENCE_VARIANTS = {
    "rowwise": "rowwise_sequence",
    "embedding_rowwise": "embedding_rowwise_sequence",
    "colwise_rep": "colwise_rep_sequence",
    "colwise_gather_output": "colwise_gather_output_sequence",
    "colwise_loss_parallel": "colwise_loss_parallel_sequence",
}


STYLES: dict[str, Style] = {
    s.name: s
    for s in (
        Style(name="colwise", kind="colwise"),
        Style(name="colwise_rep", kind="colwise", output_replicated=True),
        Style(name="colwise_gather_output", kind="colwise", output_replicated=True),
        Style(name="rowwise", kind="rowwise", input_replicated=False, output_replicated=True),
        Style(name="rowwise_rep", kind="rowwise", output_replicated=True),
        Style(name="rowwise_split_input", kind="rowwise", output_replicated=True),
        Style(
            name="embedding_rowwise", kind="rowwise", output_replicated=True, embedding_only=True
        ),
        Style(
            name="embedding_colwise", kind="colwise", output_replicated=True, embedding_only=True
        ),
        Style(name="colwise_loss_parallel", kind="colwise", dtensor_output=True),
        Style(name="replicate", kind="replicate"),
        # sequence parallelism: norms and dropouts on the sequence-sharded stream
        # (SequenceParallel), and the modules where whole sequences leave / enter it
        Style(name="sequence_parallel", kind="sequence"),
        Style(name="sequence_gather", kind="gather"),
        Style(name="sequence_scatter", kind="scatter"),
        Style(name="packed_colwise", kind="packed_colwise"),
        Style(name="packed_rowwise", kind="packed_rowwise"),
        Style(name="replicated_with_grad_allreduce", kind="grad_sum"),
        Style(name="local_params", kind="local"),
        Style(name="all_reduce", kind="all_reduce"),
        Style(name="mla_kv_a_proj", kind="mla_kv_a"),
        Style(name="moe_tp_experts", kind="moe_experts"),
        Style(name="moe_identity_expert", kind="moe_identity"),
    )
}
STYLES.update(
    {v: _sequence_variant(STYLES[k]) for k, v in SEQUENCE_VARIANTS.items()}  # after STYLES
)
#: styles that only make sense inside a sequence-parallel layout (PrepConfig.sequence_parallel)
SEQUENCE_ONLY = frozenset(
    {"sequence_parallel", "sequence_gather", "sequence_scatter", *SEQUENCE_VARIANTS.values()}
)

#: transformers styles fprep does not apply (yet), with the reason given to the user.
REFUSED: dict[str, str] = {
    "grouped_gemm": "an expert-parallel style, which belongs in an expert-parallel plan",
    "ep_dispatch_experts": "an expert-parallel style, which belongs in an expert-parallel plan",
    "ep_router": "an expert-parallel router style transformers itself has removed",
}

#: Module classes (bare names, matched against the MRO) that colwise / rowwise can shard.
SHARDABLE = ("Linear", "Embedding")


def check_style(pattern: str, style: object) -> Style:
    """The ``Style`` named ``style`` for ``pattern``, or the ``ConfigError`` naming both."""
    if isinstance(style, str) and style in STYLES:
        return STYLES[style]
    if isinstance(style, str) and style in REFUSED:
        raise ConfigError(
            f"PrepConfig.tp_plan[{pattern!r}] = {style!r}: fprep does not apply this style "
            f"({REFUSED[style]}).",
            subject="tp_plan",
            hint="Leave these modules replicated ('replicate'), or apply the style yourself in "
            "a custom prepare step before 'shard'.",
        )
    raise ConfigError(
        f"PrepConfig.tp_plan[{pattern!r}] has the unknown style {style!r}.",
        subject="tp_plan",
        hint=f"Styles: {', '.join(sorted(STYLES))}.",
    )


def pattern_regex(pattern: str) -> re.Pattern[str]:
    """``*`` matches one dotted segment (a layer number, or any name)."""
    return re.compile(r"\.".join("[^.]+" if p == "*" else re.escape(p) for p in pattern.split(".")))


def param_placement(kind: Kind, ndim: int, param_name: str, *, own_rule: bool) -> Placement | None:
    """How a style lays out one parameter over the tp ranks, as transformers' styles do;
    None: the parameter stays a plain tensor (replicated, untouched by tensor parallelism).

    ``own_rule``: the rule names the parameter itself (a 3-D experts tensor, an attention sink),
    so its own shape decides: colwise cuts the output rows (dim ``ndim - 2``), rowwise the input
    columns (the last dim), the packed styles the same dims in two halves each cut on its own
    (``StridedShard(dim, 2)``). Otherwise the rule names the parameter's module, a Linear
    (``weight`` of shape (out, in), ``bias`` (out,)) for the packed styles; the colwise /
    rowwise Linear / Embedding layouts are ``tp_dim``'s.
    """
    last = max(ndim - 1, 0)
    rows = max(ndim - 2, 0)
    if own_rule:
        if kind == "colwise":
            return Shard(rows)
        if kind == "rowwise":  # a bias is added once, after the sum
            return Replicate() if param_name == "bias" else Shard(last)
        if kind == "packed_colwise":
            return StridedShard(rows, 2) if ndim >= 2 else Shard(0)
        if kind == "packed_rowwise":
            return StridedShard(last, 2) if ndim >= 2 else Replicate()
        if kind == "grad_sum":
            return Replicate()
        return None
    if kind == "packed_colwise":  # the bias is packed like the weight's rows: (gate | up)
        return StridedShard(0, 2)
    if kind == "packed_rowwise":
        return StridedShard(1, 2) if param_name == "weight" else Replicate()
    if kind == "grad_sum":
        return Replicate()
    return None


def tp_dim(kind: Kind, module_is_embedding: bool, param_name: str) -> int | None:
    """The dimension this style shards ``param_name`` (``weight``, ``bias``) of the module
    along over the tp ranks, as torch's styles do; None: replicated across the tp ranks."""
    if kind == "colwise":
        if module_is_embedding:
            return 1 if param_name == "weight" else None
        return 0  # weight (out, in) rows and bias (out,)
    if kind == "rowwise":
        if module_is_embedding:
            return 0 if param_name == "weight" else None
        return 1 if param_name == "weight" else None  # the bias is added once, replicated
    return None
