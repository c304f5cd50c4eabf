"""transformers' checkpoint conversions, read into plain records (the one place fprep asks).

transformers 5 keeps some models' tensors in another layout than their checkpoints: a
mixture-of-experts model fuses each layer's experts into one parameter
(``mlp.experts.gate_up_proj``) while every checkpoint on the hub holds one tensor per expert
(``mlp.experts.3.gate_proj.weight``), and some families rename modules (Mixtral's
``block_sparse_moe`` is the model's ``mlp``). ``from_pretrained`` converts as it loads, with the
model's conversion mapping (``transformers.conversion_mapping.get_model_conversion_mapping``);
``save_pretrained`` writes the checkpoint layout back with the reverse conversions.

``with_conversions`` asks transformers, once while planning, where each key of the checkpoint
goes in this model (its own renaming code, so fprep follows its rules exactly) and records the
answer as plain, frozen ``WeightsSnapshot.renames`` and ``conversions``; the pure planning
(``fprep.weights.plan``, ``fprep.weights.converted``) reads those. ``checkpoint_layout`` does the
reverse for ``fprep.export_full``: the checkpoint's names and shapes for the model's tensors,
from transformers' own reverse conversion run on meta tensors (no data).

transformers is imported here only, and only for a model that is a transformers model (known by
its class's MRO, as ``fprep.snapshot`` recognizes peft): fprep never imports it otherwise.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Collection, Iterable, Sequence
from typing import Any

from fprep.adapters import AdapterLayout
from fprep.errors import CheckpointError
from fprep.snapshot import ModuleTree
from fprep.weights.converted import TRANSPOSE_IF_NEEDED
from fprep.weights.records import Conversion, ConvertedSource, WeightsSnapshot

_PRETRAINED = "transformers.modeling_utils.PreTrainedModel"


def is_transformers_model(model: object) -> bool:
    """Whether ``model`` is a transformers ``PreTrainedModel`` (without importing transformers)."""
    return any(f"{k.__module__}.{k.__qualname__}" == _PRETRAINED for k in type(model).__mro__)


def family(model: Any) -> str:
    """The name of the model's family, as transformers' mapping is keyed (``model_type``)."""
    return str(getattr(getattr(model, "config", None), "model_type", None) or type(model).__name__)


def _mapping(model: Any, *, for_saving: bool) -> list[Any] | None:
    """The model's transforms (transformers' ``WeightRenaming`` / ``WeightConverter``), or None
    when this transformers has no conversion mapping (before 5.0)."""
    try:
        from transformers.conversion_mapping import get_model_conversion_mapping
    except ImportError:
        return None
    return list(get_model_conversion_mapping(model, add_legacy=not for_saving))


def _expert_pattern(pattern: str) -> re.Pattern[str] | None:
    """``pattern`` with its ``*`` as a group of digits (the expert's number); None without one."""
    if "*" not in pattern:
        return None
    return re.compile(re.escape(pattern).replace(r"\*", r"(\d+)"))


def _expert(pattern: str, keys: Iterable[str]) -> tuple[int, str] | None:
    """The expert number in the first of ``keys`` that ``pattern`` finds, and that key with
    ``{}`` in its place."""
    regex = _expert_pattern(pattern)
    if regex is None:
        return None
    for key in keys:
        found = regex.search(key)
        if found is not None:
            a, b = found.span(1)
            return int(found.group(1)), key[:a].replace("{", "{{").replace("}", "}}") + "{}" + (
                key[b:].replace("{", "{{").replace("}", "}}")
            )
    return None


def _operation(op: Any) -> tuple[str, int | None]:
    """A transformers operation as ``Conversion.operations`` records it: its class name and
    dim. A ``Transpose`` that transposes only a tensor not already of the model's shape is
    ``"Transpose(check_dims)"`` (``fprep.weights.converted`` reads it when it is a no-op)."""
    name = type(op).__name__
    if name == "Transpose" and getattr(op, "check_dims", False):
        return TRANSPOSE_IF_NEEDED, None
    dim = getattr(op, "dim", None)
    return name, dim if isinstance(dim, int) else None


def conversions_for(
    model: Any, keys: Sequence[str], names: Collection[str], *, for_saving: bool = False
) -> tuple[tuple[tuple[str, str], ...], tuple[Conversion, ...]]:
    """Where transformers puts each of ``keys`` (a checkpoint's) in ``model`` (whose tensors are
    ``names``): ``(renames, conversions)``, as ``WeightsSnapshot`` records them."""
    mapping = _mapping(model, for_saving=for_saving)
    if not mapping:
        return (), ()
    from transformers.core_model_loading import (
        WeightConverter,
        WeightRenaming,
        apply_renamings,
        dot_natural_key,
        rename_source_key,
    )

    renamings = [t for t in mapping if isinstance(t, WeightRenaming)]
    converters = [t for t in mapping if isinstance(t, WeightConverter)]
    by_pattern = {p: c for c in converters for p in c.source_patterns}
    meta = dict.fromkeys(names, True)
    prefix = getattr(model, "base_model_prefix", None)
    renames: list[tuple[str, str]] = []
    grouped: dict[str, tuple[Any, dict[str, list[str]]]] = {}
    for key in sorted(keys, key=dot_natural_key):  # transformers' order
        renamed, pattern = rename_source_key(key, renamings, converters, prefix, meta)
        if renamed not in meta and key in meta:  # as transformers: the key was the model's
            renamed, pattern = key, None
        if pattern is None:
            if renamed != key:
                renames.append((key, renamed))
            continue
        converter = by_pattern[pattern]
        _, sources = grouped.setdefault(
            renamed, (converter, {p: [] for p in converter.source_patterns})
        )
        sources[pattern].append(key)
    name = family(model)
    conversions = []
    for target, (converter, sources) in grouped.items():
        records = []
        for pattern, matched in sources.items():
            numbers: list[int] = []
            template = ""
            for key in matched:
                found = _expert(pattern, (key, apply_renamings(key, renamings)))
                if found is None:
                    numbers = []
                    break
                numbers.append(found[0])
                template = template or found[1]
            records.append(ConvertedSource(pattern, tuple(matched), tuple(numbers), template))
        conversions.append(
            Conversion(
                target=target,
                family=name,
                sources=tuple(records),
                operations=tuple(_operation(op) for op in converter.operations),
            )
        )
    return tuple(renames), tuple(conversions)


def with_conversions(snapshot: WeightsSnapshot, model: Any, tree: ModuleTree) -> WeightsSnapshot:
    """``snapshot`` with transformers' renames and conversions of its keys for ``model`` (whose
    snapshot is ``tree``): a transformers model, or a peft model over one (its base model's
    names); anything else: unchanged. Raises ``CheckpointError`` when transformers cannot map
    them."""
    names = [n for p in tree.params for n in p.names] + [b.fqn for b in tree.buffers]
    layout = AdapterLayout.of(tree)
    if layout is not None:  # a peft model reads its base model's checkpoint
        try:
            model = model.get_submodule(layout.prefix.rstrip("."))
        except AttributeError:
            return snapshot
        names = [layout.checkpoint_key(n) for n in names]
    if not is_transformers_model(model):
        return snapshot
    keys = [t.key for t in snapshot.tensors]
    try:
        renames, conversions = conversions_for(model, keys, names)
    except Exception as e:  # transformers' own error, about its mapping
        raise CheckpointError(
            f"transformers could not map {snapshot.source}'s names onto this "
            f"{family(model)} model: {type(e).__name__}: {e}",
            subject=snapshot.source,
            hint="Load this model with transformers' from_pretrained and prepare it without "
            "weights=.",
        ) from None
    return dataclasses.replace(snapshot, renames=renames, conversions=conversions)


@dataclasses.dataclass(frozen=True)
class CheckpointLayout:
    """How transformers' ``save_pretrained`` writes a model's tensors: ``shapes`` of the
    checkpoint's tensors by name, and, read back, the ``renames`` and ``conversions`` that
    lead from them to the model's tensors (as ``WeightsSnapshot`` records them)."""

    shapes: dict[str, tuple[int, ...]]
    renames: tuple[tuple[str, str], ...]
    conversions: tuple[Conversion, ...]


def checkpoint_layout(
    model: Any, entries: Sequence[tuple[str, Any, tuple[int, ...]]]
) -> CheckpointLayout | None:
    """The checkpoint layout of the model's tensors ``entries`` (name, dtype, shape), from
    transformers' reverse conversion run on meta tensors (no data); None for a model without
    conversions (names unchanged). Raises ``CheckpointError`` when transformers cannot."""
    if not is_transformers_model(model):
        return None
    try:
        if not _mapping(model, for_saving=True):
            return None
        import torch
        from transformers.core_model_loading import revert_weight_conversion

        meta = {n: torch.empty(shape, dtype=dtype, device="meta") for n, dtype, shape in entries}
        shapes = {k: tuple(v.shape) for k, v in revert_weight_conversion(model, meta).items()}
        renames, conversions = conversions_for(model, list(shapes), [n for n, _, _ in entries])
    except Exception as e:
        raise CheckpointError(
            f"transformers could not map this {family(model)} model's tensors back to its "
            f"checkpoint layout: {type(e).__name__}: {e}",
            subject=family(model),
            hint="Call fprep.unwrap(state, model) on every rank (the full model) and save it "
            "with transformers' save_pretrained on rank 0.",
        ) from None
    return CheckpointLayout(shapes, renames, conversions)
