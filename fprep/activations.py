"""Bytes of activations one micro-batch keeps for backward, from a model's snapshot (pure).

The rule counts, for ``P = rows x sequence length`` positions and ``b`` bytes per element of the
compute dtype, what each module's forward saves for its backward:

- ``Embedding``: its token indices (``P x 8``, int64).
- a norm (a class named ``...Norm``): its input (``P x width x b``) and its statistics (fp32,
  one per position for RMSNorm, two for LayerNorm).
- an attention module (a class named ``...Attention`` holding Linears; the last is the output
  projection, the others the q, k, v projections, fused or not): its input, q, k and v (the
  projections' outputs), q and k once more (rotary embeddings make new ones; only with
  separate projections), the attention output (the output projection's input) and the
  softmax statistics (fp32, one per head and position: a fused kernel, FlashAttention or
  torch's SDPA, keeps no ``seq x seq`` matrix).
- any other Linear: its input, once for the sibling Linears that read one input (same
  ``in_features``: gate and up projections). In a module of Linears reading two widths (an
  MLP), its elementwise activations too: what the activation function and the gating product
  save (the input projections' outputs, plus the activation's output when gated).
- a Linear whose outputs are the vocabulary (the head): the cross-entropy over its logits keeps
  their log-softmax, ``P x vocab x 4`` (fp32).

Under tensor parallelism a colwise Linear's outputs and a rowwise Linear's input are ``1/tp``
per rank (so are q, k, v, the attention output and statistics, and the MLP's activations);
with sequence parallelism the norms' too. Under activation checkpointing each checkpointed
region keeps only its input (sequence-sharded under sequence parallelism). Dropout masks,
the positions' buffers and the recompute's transient memory are left out.
``tests/test_pipeline_memory.py`` holds the rule against the bytes real forwards save (fprep's
and transformers' Llama, fp32 on the CPU: the estimate is 3-7% under them).
"""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass, field

from fprep.snapshot import ModuleInfo, ModuleTree, is_within, parent_fqn

_LINEAR = "torch.nn.modules.linear.Linear"
_EMBEDDING = "torch.nn.modules.sparse.Embedding"
_HEAD_FIELDS = ("num_attention_heads", "n_heads")


@dataclass(frozen=True, kw_only=True)
class ActivationInputs:
    """What the rule needs beyond the snapshot: the micro-batch's shape and the layout."""

    rows: int
    seq_len: int
    dtype_bytes: int  # the compute dtype's
    tp: int = 1
    styles: Mapping[str, str] = field(default_factory=dict)  # module FQN -> tp style
    sequence_parallel: bool = False
    loss_parallel: bool = False
    checkpointed: tuple[str, ...] = ()  # activation-checkpointed regions (module FQNs)
    vocab: Collection[int] = ()  # embedding tables' row counts: a Linear this wide is a head

    @property
    def positions(self) -> int:
        return self.rows * self.seq_len


def _is_linear(m: ModuleInfo) -> bool:
    return m.is_a(_LINEAR)


def _is_norm(m: ModuleInfo) -> bool:
    return m.class_name.endswith("Norm") and "weight" in m.param_names


def _linear_shape(tree: ModuleTree, fqn: str) -> tuple[int, int]:
    """(out_features, in_features) of a Linear, from its weight."""
    weight = tree.param(f"{fqn}.weight" if fqn else "weight")
    if weight is None or len(weight.shape) != 2:
        return 0, 0
    return weight.shape[0], weight.shape[1]


def _linear_children(tree: ModuleTree, m: ModuleInfo) -> list[str]:
    out = []
    for child in m.children:
        info = tree.module(child)
        if info is not None and _is_linear(info):
            out.append(child)
    return out


def _is_attention(tree: ModuleTree, m: ModuleInfo | None) -> bool:
    return m is not None and "Attention" in m.class_name and len(_linear_children(tree, m)) >= 2


def _heads(tree: ModuleTree) -> int:
    counts = dict(tree.head_counts)
    return next((counts[name] for name in _HEAD_FIELDS if name in counts), 0)


def _sharded(inputs: ActivationInputs, fqn: str, kind: str) -> int:
    """The divisor for a tensor of Linear ``fqn`` that its tp style ``kind`` shards."""
    return inputs.tp if inputs.styles.get(fqn, "").startswith(kind) else 1


def _attention(tree: ModuleTree, m: ModuleInfo, inputs: ActivationInputs) -> int:
    linears = _linear_children(tree, m)
    projections, output = linears[:-1], linears[-1]
    shapes = [_linear_shape(tree, p) for p in projections]
    shard = _sharded(inputs, projections[0], "colwise")
    features = shapes[0][1] * inputs.dtype_bytes  # the shared input, whole on every tp rank
    qkv = sum(out for out, _ in shapes)
    rotated = sum(out for out, _ in shapes[:2]) if len(shapes) >= 3 else 0
    attended = _linear_shape(tree, output)[1]
    features += (qkv + rotated + attended) * inputs.dtype_bytes // shard
    features += _heads(tree) * 4 // shard
    return inputs.positions * features


def _linear(tree: ModuleTree, fqn: str, inputs: ActivationInputs) -> int:
    parent = tree.module(parent_fqn(fqn))
    siblings = _linear_children(tree, parent) if parent is not None else [fqn]
    out_features, in_features = _linear_shape(tree, fqn)
    widths = {s: _linear_shape(tree, s) for s in siblings}
    total = 0
    if next(s for s in siblings if widths[s][1] == in_features) == fqn:
        total += in_features * inputs.dtype_bytes // _sharded(inputs, fqn, "rowwise")
    first_in = widths[siblings[0]][1]
    if fqn == siblings[0] and any(w[1] != first_in for w in widths.values()):
        reading = [s for s in siblings if widths[s][1] == first_in]
        elementwise = sum(widths[s][0] for s in reading)
        if len(reading) >= 2:  # gated: the activation's output meets the other projection
            elementwise += out_features
        total += elementwise * inputs.dtype_bytes // _sharded(inputs, fqn, "colwise")
    if out_features in inputs.vocab:  # a head: the loss keeps the logits' log-softmax in fp32
        shard = inputs.tp if inputs.loss_parallel else 1
        total += out_features * 4 // shard
    return inputs.positions * total


def _norm(tree: ModuleTree, m: ModuleInfo, inputs: ActivationInputs) -> int:
    weight = tree.param(f"{m.fqn}.weight" if m.fqn else "weight")
    width = weight.shape[0] if weight is not None and weight.shape else 0
    stats = 2 if "LayerNorm" in m.class_name else 1
    shard = inputs.tp if inputs.sequence_parallel else 1
    return inputs.positions * (width * inputs.dtype_bytes + stats * 4) // shard


def _module(tree: ModuleTree, m: ModuleInfo, inputs: ActivationInputs) -> int:
    if m.is_a(_EMBEDDING):
        return inputs.positions * 8
    if _is_norm(m):
        return _norm(tree, m, inputs)
    if _is_attention(tree, m):
        return _attention(tree, m, inputs)
    if _is_linear(m) and not _is_attention(tree, tree.module(parent_fqn(m.fqn))):
        return _linear(tree, m.fqn, inputs)
    return 0


def _input_width(tree: ModuleTree, region: str) -> int:
    """The width of a region's input: its first norm's or Linear's."""
    for m in tree.subtree(region):
        if _is_norm(m):
            weight = tree.param(f"{m.fqn}.weight" if m.fqn else "weight")
            return weight.shape[0] if weight is not None and weight.shape else 0
        if _is_linear(m):
            return _linear_shape(tree, m.fqn)[1]
    return 0


def stage_activations(tree: ModuleTree, modules: Sequence[str], inputs: ActivationInputs) -> int:
    """Bytes one micro-batch of ``inputs.rows x inputs.seq_len`` keeps for backward in the
    modules ``modules`` of ``tree`` (a pipeline stage; ``("",)`` for the whole model)."""
    regions = [r for r in inputs.checkpointed if r and any(is_within(r, s) for s in modules)]
    # a block's input is sharded on the sequence under sequence parallelism
    shard = inputs.tp if inputs.sequence_parallel else 1
    total = sum(
        inputs.positions * _input_width(tree, r) * inputs.dtype_bytes // shard for r in regions
    )
    seen: set[str] = set()
    for name in modules:
        for m in tree.subtree(name):
            if m.fqn in seen or any(is_within(m.fqn, r) for r in regions):
                continue
            seen.add(m.fqn)
            total += _module(tree, m, inputs)
    return total
