"""Typed placements (``fprep.layout.placements``) as torch's own placement objects.

Only apply code calls this: it imports torch's DTensor classes, which planning never does.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from fprep.layout.placements import Partial, Placement, Replicate, Shard, StridedShard

if TYPE_CHECKING:
    from torch.distributed.tensor import Placement as TorchPlacement


def to_torch(placement: Placement) -> TorchPlacement:
    """The torch placement equal to ``placement`` (its repr is ``str(placement)``)."""
    from torch.distributed.tensor import placement_types as pt

    if isinstance(placement, Shard):
        return pt.Shard(placement.dim)
    if isinstance(placement, StridedShard):
        return pt._StridedShard(placement.dim, split_factor=placement.split_factor)
    if isinstance(placement, Replicate):
        return pt.Replicate()
    if isinstance(placement, Partial):
        return pt.Partial(placement.reduce_op)
    raise TypeError(f"not a placement: {placement!r}")
