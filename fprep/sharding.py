"""The dim-0 shard shape FSDP2 gives each rank (``torch.chunk`` semantics), as pure arithmetic.

A parameter of ``n`` rows over ``w`` ranks is cut into chunks of ``c = ceil(n / w)`` rows; rank
``r`` holds rows ``[c*r, min(c*(r+1), n))`` — possibly none — and allocates a full chunk of ``c``
rows (the padding makes the all-gather buffer even). A parameter with a zero-size dimension other
than dim 0 has no elements: FSDP2 gives every rank zero rows of it, and still allocates (pads to)
``c`` rows. Verified against ``fully_shard`` in tests/test_plan_vs_fsdp.py.
"""

from __future__ import annotations


def chunk_rows(rows: int, world: int) -> int:
    """Rows per chunk: ``ceil(rows / world)`` (0 for an empty dimension)."""
    return -(-rows // world)


def local_rows(rows: int, world: int, rank: int) -> int:
    """Rows rank ``rank`` really holds (0 when the chunks run out before it)."""
    c = chunk_rows(rows, world)
    return max(0, min(rows - c * rank, c))


def shard_shape(
    shape: tuple[int, ...], world: int, rank: int
) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """``(local_shape, padded_shape)`` of a dim-0 shard; a scalar cannot be sharded."""
    if not shape:
        raise ValueError("a scalar (0-d) parameter has no dimension to shard")
    rows, rest = shape[0], shape[1:]
    # A shard without elements is narrowed to zero rows by FSDP2, also where ``torch.chunk``
    # gives it rows of zero width (shape ``(8, 0)``: local ``(0, 0)``, padded ``(c, 0)``).
    local = local_rows(rows, world, rank) if all(rest) else 0
    return (local, *rest), (chunk_rows(rows, world), *rest)
