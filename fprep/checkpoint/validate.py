"""What a checkpoint holds versus what the live model and optimizers expect.

Compared before a single tensor is read: keys (missing from the checkpoint / unexpected in it),
global shapes and dtypes. Shape and dtype mismatches are always errors; missing and unexpected
keys are errors under ``strict=True`` and reported otherwise.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import torch

from fprep.checkpoint.states import MODEL, describe
from fprep.errors import CheckpointError

Spec = tuple[tuple[int, ...], torch.dtype]
_SHOWN = 6


@dataclass(frozen=True)
class Diff:
    missing: tuple[str, ...]  # in the live objects, not in the checkpoint
    unexpected: tuple[str, ...]  # in the checkpoint, not in the live objects
    mismatched: tuple[str, ...]  # messages, one per key whose shape or dtype differs
    first_mismatch: str = ""
    model_live: int = 0  # model keys of the live model
    model_shared: int = 0  # of those, how many the checkpoint has


def _fmt(spec: Spec) -> str:
    return f"{tuple(spec[0])} {str(spec[1]).removeprefix('torch.')}"


def compare(live: Mapping[str, Spec], saved: Mapping[str, Spec]) -> Diff:
    mismatched: list[str] = []
    first = ""
    for key in sorted(set(live) & set(saved)):
        if live[key] != saved[key]:
            first = first or key
            mismatched.append(
                f"{describe(key)}: the checkpoint has {_fmt(saved[key])}, "
                f"the live one is {_fmt(live[key])}"
            )
    return Diff(
        missing=tuple(sorted(set(live) - set(saved))),
        unexpected=tuple(sorted(set(saved) - set(live))),
        mismatched=tuple(mismatched),
        first_mismatch=first,
        model_live=sum(k.startswith(MODEL + "/") for k in live),
        model_shared=sum(k.startswith(MODEL + "/") for k in set(live) & set(saved)),
    )


def _listing(keys: tuple[str, ...]) -> str:
    shown = ", ".join(describe(k) for k in keys[:_SHOWN])
    return shown + (f" and {len(keys) - _SHOWN} more" if len(keys) > _SHOWN else "")


def check(diff: Diff, *, strict: bool, source: str) -> None:
    """Raise ``CheckpointError`` for what cannot be loaded (see the module docs)."""
    if diff.mismatched:
        raise CheckpointError(
            f"{source} does not fit: {len(diff.mismatched)} tensor(s) differ in shape or dtype: "
            + "; ".join(diff.mismatched[:_SHOWN])
            + (
                f"; and {len(diff.mismatched) - _SHOWN} more"
                if len(diff.mismatched) > _SHOWN
                else ""
            )
            + ".",
            subject=diff.first_mismatch.partition("/")[2] or diff.first_mismatch,
            hint="Build the model (and optimizers) with the configuration the checkpoint was "
            "saved from; shapes and dtypes must match even with strict=False.",
        )
    if strict and (diff.missing or diff.unexpected):
        parts = []
        if diff.missing:
            parts.append(f"missing from the checkpoint: {_listing(diff.missing)}")
        if diff.unexpected:
            parts.append(
                f"in the checkpoint but not in the live objects: {_listing(diff.unexpected)}"
            )
        other_model = diff.model_live > 0 and 2 * diff.model_shared < diff.model_live
        lead = "looks like another model's checkpoint" if other_model else "does not match"
        first = (diff.missing or diff.unexpected)[0]
        raise CheckpointError(
            f"{source} {lead}: " + "; ".join(parts) + ".",
            subject=first.partition("/")[2] if first.startswith(MODEL + "/") else first,
            hint="Load with strict=False to load the keys both have (the rest stay as they "
            "are), or pass the model and optimizers the checkpoint was saved from.",
        )
