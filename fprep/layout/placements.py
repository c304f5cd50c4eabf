"""Typed DTensor placements as plain values, and a parser of torch's repr strings.

A plan says how each parameter lies on each mesh dimension with these values
(``ShardSpec.placements``); apply code turns them into torch's own classes
(``fprep.apply.placements.to_torch``), so planning never imports torch's distributed runtime.
``str`` of a value is torch's repr (``"Shard(dim=0)"``, ``"_StridedShard(dim=0, sf=2)"``,
``"Replicate()"``, ``"Partial(sum)"``), what summaries print; ``parse`` reads such a repr back.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from fprep.errors import ConfigError


@dataclass(frozen=True)
class Shard:
    """Split along tensor dimension ``dim`` into even chunks, one per rank of the mesh dim."""

    dim: int

    def __str__(self) -> str:
        return f"Shard(dim={self.dim})"


@dataclass(frozen=True)
class StridedShard:
    """A shard of a shard: ``dim`` split on this mesh dim before an inner split into
    ``split_factor`` pieces (what FSDP2 uses for parameters tensor parallelism already split)."""

    dim: int
    split_factor: int

    def __str__(self) -> str:
        return f"_StridedShard(dim={self.dim}, sf={self.split_factor})"


@dataclass(frozen=True)
class Replicate:
    """Every rank of the mesh dim holds the whole tensor."""

    def __str__(self) -> str:
        return "Replicate()"


@dataclass(frozen=True)
class Partial:
    """Every rank holds a partial value; the whole is their reduction by ``reduce_op``."""

    reduce_op: str = "sum"

    def __str__(self) -> str:
        return f"Partial({self.reduce_op})"


Placement = Shard | StridedShard | Replicate | Partial

_PATTERNS: tuple[tuple[re.Pattern[str], type], ...] = (
    (re.compile(r"Shard\(dim=(-?\d+)\)"), Shard),
    (re.compile(r"_StridedShard\(dim=(-?\d+), sf=(\d+)\)"), StridedShard),
    (re.compile(r"Replicate\(\)"), Replicate),
    (re.compile(r"Partial\((\w+)\)"), Partial),
)


def parse(text: str) -> Placement:
    """The placement whose torch repr is ``text``; a ConfigError names any other string."""
    cleaned = text.strip()
    for pattern, cls in _PATTERNS:
        match = pattern.fullmatch(cleaned)
        if match is None:
            continue
        if cls is Partial:
            return Partial(match.group(1))
        args = [int(g) for g in match.groups()]
        placement: Placement = cls(*args)
        return placement
    raise ConfigError(
        f"{text!r} is not a placement fprep knows.",
        subject="placements",
        hint="Use Shard(dim=N), _StridedShard(dim=N, sf=K), Replicate() or Partial(op), "
        "as torch writes them.",
    )


def parse_all(texts: tuple[str, ...]) -> tuple[Placement, ...]:
    """``parse`` over a tuple of reprs."""
    return tuple(parse(t) for t in texts)
