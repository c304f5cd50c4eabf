"""The tensor-parallel plan vocabulary, as pure data: what each style does to each weight.

The names are transformers' (``config.base_model_tp_plan``, a model class's ``_tp_plan``), so a
transformers model's own plan is used as it is; a user plan (``PrepConfig.tp_plan``) speaks the
same words. Each supported style maps to one of torch's ``ParallelStyle`` classes
(``ColwiseParallel``, ``RowwiseParallel``, ``SequenceParallel``) with its input / output
layouts; packed and mixture-of-experts styles are refused by name. ``colwise_loss_parallel``
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

Kind = Literal["colwise", "rowwise", "replicate", "sequence", "gather", "scatter"]


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
        return self.kind in ("colwise", "rowwise", "sequence")


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
    "packed_colwise": "packed (fused gate/up or qkv) weights",
    "packed_rowwise": "packed (fused) weights",
    "moe_tp_experts": "mixture-of-experts weights",
    "moe_identity_expert": "mixture-of-experts weights",
    "grouped_gemm": "expert parallelism",
    "ep_dispatch_experts": "expert parallelism",
    "mla_kv_a_proj": "multi-head latent attention projections",
    "local_params": "local (non-DTensor) parameters",
    "all_reduce": "all-reduce output hooks",
    "replicated_with_grad_allreduce": "replicated weights with gradient all-reduce hooks",
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
