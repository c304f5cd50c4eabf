"""Pure matching of a weights snapshot against the model: what each rank reads, or why not.

Every parameter (by any of its names: a tied parameter is read once, from whichever of its
names the file has, canonical first; when the file has several, the load compares them first
and refuses different values: transformers would untie the parameter, fprep cannot) and every
persistent buffer must be in the file, and every tensor of the file must belong to the model,
unless ``PrepConfig.weights_missing_keys`` / ``weights_extra_keys`` allow it. Shapes must be
equal; dtypes must be of the same kind (any floating point dtype loads into any other, cast as
it is read; integers, booleans and complex numbers must match exactly).

A parameter sharded on dim 0 (fsdp, hsdp) is row-major, so this rank's rows are one contiguous
byte range of the file: ``[offset + c*r*row, offset + (c*r + rows)*row)`` with ``c`` rows per
chunk and ``rows`` this rank's rows (``fprep.sharding``); every other parameter and every buffer
is read whole.

A transformers model whose checkpoints hold its tensors under other names, or split in
several (mixture-of-experts experts, one tensor per expert), reads them as transformers'
``from_pretrained`` would: ``WeightsSnapshot.renames`` and ``conversions``
(``fprep.weights.hf_conversions``) say where each key goes, ``fprep.weights.converted`` which
runs of which tensors make this rank's rows of an assembled parameter. Pure: no I/O, no
tensors.
"""

from __future__ import annotations

import fnmatch
from collections.abc import Iterable

from fprep.adapters import AdapterLayout
from fprep.errors import CheckpointError
from fprep.sharding import chunk_rows, shard_shape
from fprep.snapshot import ModuleTree
from fprep.weights.converted import converted_read, tree
from fprep.weights.records import (
    Conversion,
    ConvertedRead,
    TensorRead,
    WeightsPlan,
    WeightsSnapshot,
    WeightsTensor,
)

_FLOATING = frozenset({"float64", "float32", "float16", "bfloat16", "float8_e4m3fn", "float8_e5m2"})
_SHOWN = 5  # names listed in an error before "and N more"


def can_cast(file_dtype: str, target_dtype: str) -> bool:
    """Whether a tensor stored as ``file_dtype`` may be loaded into ``target_dtype``."""
    if file_dtype == target_dtype:
        return True
    return file_dtype in _FLOATING and target_dtype in _FLOATING


def _matches(name: str, patterns: tuple[str, ...]) -> bool:
    return any(fnmatch.fnmatchcase(name, p) for p in patterns)


def _listing(names: list[str]) -> str:
    shown = ", ".join(repr(n) for n in names[:_SHOWN])
    return shown + (f" and {len(names) - _SHOWN} more" if len(names) > _SHOWN else "")


def _check_fits(t: WeightsTensor, name: str, shape: tuple[int, ...], dtype: str) -> None:
    if t.shape != shape:
        raise CheckpointError(
            f"{t.key!r} in {t.file} has shape {list(t.shape)}, but the model's {name!r} has "
            f"shape {list(shape)}.",
            subject=t.key,
            hint="The checkpoint was saved from a model with another configuration (hidden "
            "size, vocabulary, number of heads): build the model from the checkpoint's config.",
        )
    if not can_cast(t.dtype, dtype):
        raise CheckpointError(
            f"{t.key!r} in {t.file} is {t.dtype}, which cannot be loaded into the model's "
            f"{name!r} ({dtype}).",
            subject=t.key,
            hint="Floating point weights load into any floating point dtype; integer, boolean "
            "and complex tensors must have the model's dtype.",
        )


def _read(
    t: WeightsTensor,
    name: str,
    kind: str,
    dtype: str,
    shard: tuple[int, int] | None,
    keep: bool = False,
) -> TensorRead:
    """This rank's bytes of ``t``: its dim-0 shard (``shard``: world, rank), or everything."""
    offset, nbytes = t.offset, t.nbytes
    if shard is not None and t.shape:
        (rows, *_), _ = shard_shape(t.shape, *shard)
        row_bytes = t.nbytes // t.shape[0] if t.shape[0] else 0
        offset += chunk_rows(t.shape[0], shard[0]) * shard[1] * row_bytes if rows else 0
        nbytes = rows * row_bytes
    return TensorRead(
        name=name,
        key=t.key,
        kind="param" if kind == "param" else "buffer",
        file=t.file,
        dtype=t.dtype,
        target_dtype=dtype,
        offset=offset,
        nbytes=nbytes,
        keep=keep,
    )


def plan_weights(
    tree: ModuleTree,
    weights: WeightsSnapshot,
    *,
    extra_keys: tuple[str, ...] = (),
    missing_keys: tuple[str, ...] = (),
    whole: Iterable[str] = (),
    shard: tuple[int, int] | None = None,
    other_stages: Iterable[str] = (),
) -> WeightsPlan:
    """Match ``weights`` against ``tree``; raise ``CheckpointError`` for anything that does not
    fit. ``shard``: ``(shard group size, this rank's index)`` when parameters are sharded on dim
    0; ``whole``: parameters kept whole all the same (ignored ones); ``other_stages``: the
    model's tensors other pipeline stages hold (not read here, and not unexpected).

    A peft model (``fprep.adapters``) reads its base model's checkpoint: each name is looked up
    as the base model names it, and the adapters, which no base checkpoint holds, are left to
    their initialization (peft's)."""
    layout = AdapterLayout.of(tree)
    key_of = layout.checkpoint_key if layout is not None else _same
    adapter = layout.is_adapter if layout is not None else _never
    by_file_key = {t.key: t for t in weights.tensors}
    by_model_name = dict(by_file_key)
    for key, _ in weights.renames:  # transformers' renames: the model's name only
        by_model_name.pop(key, None)
    for key, renamed in weights.renames:
        by_model_name[renamed] = by_file_key[key]
    converted = {c.target: c for c in weights.conversions}
    for c in weights.conversions:  # a key transformers converts is read through its conversion
        for source in c.sources:
            for key in source.keys:
                by_model_name.pop(key, None)
    names = [n for p in tree.params for n in p.names] + [b.fqn for b in tree.buffers]
    by_key = {n: by_model_name[key_of(n)] for n in names if key_of(n) in by_model_name}
    kept_whole = frozenset(whole)
    used: set[str] = set()
    reads: list[TensorRead] = []
    same_as: list[TensorRead] = []
    missing: list[str] = []
    allowed_missing: list[str] = []
    provided: set[str] = set()  # model names (every name of a tied parameter) read from the file
    for p in tree.params:
        present = [n for n in p.names if n in by_key]
        conversion = next((converted[key_of(n)] for n in p.names if key_of(n) in converted), None)
        if not present and conversion is not None:
            split = None if p.fqn in kept_whole or not p.shape else shard
            reads.append(
                _converted(conversion, p.fqn, p.shape, p.dtype, by_file_key, split, not p.is_meta)
            )
            used.update(k for source in conversion.sources for k in source.keys)
            provided.update(p.names)
            continue
        if not present:
            allowed = adapter(p.fqn) or _matches(p.fqn, missing_keys)
            allowed = allowed or _matches(key_of(p.fqn), missing_keys)
            (allowed_missing if allowed else missing).append(p.fqn)
            continue
        for n in present:  # a tied parameter saved under several names: all must fit
            _check_fits(by_key[n], n, p.shape, p.dtype)
        used.update(by_key[n].key for n in present)
        provided.update(p.names)
        split = None if p.fqn in kept_whole or not p.shape else shard
        keep = not p.is_meta
        reads.append(_read(by_key[present[0]], p.fqn, "param", p.dtype, split, keep))
        # the file's other names of a tied parameter: compared with the first before loading
        same_as.extend(_read(by_key[n], p.fqn, "param", p.dtype, split) for n in present[1:])
    for b in tree.buffers:
        t = by_key.get(b.fqn) if b.persistent else None
        if t is None:
            if b.persistent:
                allowed = _matches(b.fqn, missing_keys) or _matches(key_of(b.fqn), missing_keys)
                (allowed_missing if allowed else missing).append(b.fqn)
            continue
        _check_fits(t, b.fqn, b.shape, b.dtype)
        used.add(t.key)
        provided.add(b.fqn)
        reads.append(_read(t, b.fqn, "buffer", b.dtype, None, not b.is_meta))
    if missing:
        shown = [key_of(n) for n in missing]
        raise CheckpointError(
            f"{weights.source} has no tensor for the model's {_listing(shown)} "
            f"({len(missing)} missing).",
            subject=missing[0],
            hint="Check that the checkpoint was saved from this model class (names are the "
            "model's state_dict keys), or allow them with PrepConfig(weights_missing_keys=...) "
            "to initialize them as without weights.",
        )
    theirs = _file_keys((key_of(n) for n in other_stages), weights)
    unexpected = [t for t in weights.tensors if t.key not in used and t.key not in theirs]
    refused = [t for t in unexpected if not _matches(t.key, extra_keys)]
    if refused:
        raise CheckpointError(
            f"{refused[0].file} holds {_listing([t.key for t in refused])}, which the model "
            f"does not have ({len(refused)} unexpected).",
            subject=refused[0].key,
            hint="Check that the checkpoint belongs to this model class, or allow them with "
            "PrepConfig(weights_extra_keys=...) (they are then not read).",
        )
    return WeightsPlan(
        source=weights.source,
        reads=tuple(reads),
        files=weights.files,
        loaded_modules=_loaded_modules(tree, provided),
        skipped_keys=tuple(t.key for t in unexpected),
        missing_keys=tuple(allowed_missing),
        same_as=tuple(same_as),
        notes=weights.notes + _conversion_notes(reads, weights),
    )


def _conversion_notes(reads: list[TensorRead], weights: WeightsSnapshot) -> tuple[str, ...]:
    """A line saying how many parameters are assembled from the file's per-expert tensors."""
    assembled = [r for r in reads if isinstance(r, ConvertedRead)]
    if not assembled:
        return ()
    by_target = {c.target: c for c in weights.conversions}
    families = sorted({c.family for c in weights.conversions})
    tensors = sum(len(s.keys) for c in by_target.values() for s in c.sources)
    renamed = f", {len(weights.renames)} renamed" if weights.renames else ""
    return (
        f"weights: {len(assembled)} parameters assembled from {tensors} tensors of the file "
        f"({', '.join(families)} checkpoint layout, transformers' conversion{renamed}); this "
        f"rank reads {sum(r.nbytes for r in assembled)} bytes of them",
    )


def _converted(
    conversion: Conversion,
    name: str,
    shape: tuple[int, ...],
    dtype: str,
    tensors: dict[str, WeightsTensor],
    shard: tuple[int, int] | None,
    keep: bool,
) -> TensorRead:
    """This rank's read of a parameter transformers assembles from several of the file's
    tensors (its dim-0 shard, ``shard``: world, rank; or all of it)."""
    node = tree(conversion, shape, tensors)
    for source in conversion.sources:
        for key in source.keys:
            t = tensors[key]
            if not can_cast(t.dtype, dtype):
                _check_fits(t, name, t.shape, dtype)  # the dtype's error
    rows = None
    if shard is not None:
        (count, *_), _ = shard_shape(shape, *shard)
        rows = (chunk_rows(shape[0], shard[0]) * shard[1] if count else 0, count)
    return converted_read(conversion, node, tensors, name=name, dtype=dtype, rows=rows, keep=keep)


def _file_keys(names: Iterable[str], weights: WeightsSnapshot) -> set[str]:
    """The file's keys that hold the model's tensors ``names`` (as the base model names them)."""
    wanted = set(names)
    keys = set(wanted)
    keys.update(key for key, renamed in weights.renames if renamed in wanted)
    for c in weights.conversions:
        if c.target in wanted:
            keys.update(k for source in c.sources for k in source.keys)
    return keys


def _same(name: str) -> str:
    return name


def _never(name: str) -> bool:
    return False


def _loaded_modules(tree: ModuleTree, provided: set[str]) -> tuple[str, ...]:
    """Modules with at least one parameter or buffer, all of them read from the file."""
    out: list[str] = []
    for m in tree.modules:
        prefix = f"{m.fqn}." if m.fqn else ""
        names = [prefix + n for n in (*m.param_names, *m.buffer_names)]
        if names and all(n in provided for n in names):
            out.append(m.fqn)
    return tuple(out)
