"""DCP checkpoints of packed tensor-parallel parameters (``_StridedShard`` on the tp dim).

A packed gate/up parameter sharded with ``_StridedShard(d, split_factor=2)`` holds, on each tp
rank, two separate row ranges of the whole tensor (its block of the gate half and of the up
half). torch 2.13's DCP describes every rank's block as one chunk (an offset and a size), so:

- ``dcp.save`` refuses such a parameter ("overlapping chunks" when validating the global plan);
- ``dcp.load`` into such a parameter fills it with the wrong rows, silently.

FSDP2's own ``_StridedShard`` (the dp dim strided ahead of a tp ``Shard`` of the same dim) gives
one contiguous block, which DCP handles; so does every other placement. The workaround uses
DTensor's own ``redistribute``, which moves such a tensor to and from plain ``Shard`` exactly:
``dcp_blocks`` gives a state dict where each packed entry is redistributed to ``Shard`` on the
same dims (a collective: every rank calls it, as it calls ``dcp.save`` / ``dcp.load``), and
``copy_back`` copies what ``dcp.load`` filled into those back into the original entries. The
checkpoint holds the whole tensors under their own names, so it loads at any other layout.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Placement
from torch.distributed.tensor.placement_types import Shard, _StridedShard


def contiguous_placements(
    placements: Sequence[Placement], mesh: DeviceMesh
) -> tuple[Placement, ...] | None:
    """``placements`` with each ``_StridedShard`` whose blocks are not contiguous made a plain
    ``Shard`` of the same dim; None when every block already is one chunk.

    A ``_StridedShard(d, split_factor=s)`` on mesh dim ``i`` gives contiguous blocks when the
    mesh dims after ``i`` shard dim ``d`` into exactly ``s`` parts (FSDP2's dp-over-tp case).
    """
    dims = [q.dim if isinstance(q, Shard | _StridedShard) else None for q in placements]
    out = list(placements)
    for i, p in enumerate(placements):
        if not isinstance(p, _StridedShard) or int(p.split_factor) == 1:
            continue
        sizes = [int(mesh.size(j)) for j in range(i + 1, len(placements)) if dims[j] == p.dim]
        if math.prod(sizes) != int(p.split_factor):
            out[i] = Shard(p.dim)
    return tuple(out) if out != list(placements) else None


def dcp_blocks(state: Mapping[str, Any]) -> dict[str, Any]:
    """``state`` for ``dcp.save`` / ``dcp.load``: each DTensor whose blocks DCP cannot describe
    redistributed to plain ``Shard`` placements (a new tensor), every other entry as it is."""
    out = dict(state)
    for key, value in state.items():
        if isinstance(value, DTensor):
            target = contiguous_placements(value.placements, value.device_mesh)
            if target is not None:
                moved: DTensor = value.redistribute(value.device_mesh, target)
                out[key] = moved.detach()
    return out


@torch.no_grad()
def copy_back(loaded: Mapping[str, Any], state: Mapping[str, Any]) -> None:
    """After ``dcp.load(loaded)`` with ``loaded = dcp_blocks(state)``: copy each redistributed
    entry back into ``state``'s tensor, in its own placements."""
    for key, value in state.items():
        got = loaded.get(key)
        if isinstance(value, DTensor) and isinstance(got, DTensor) and got is not value:
            back = got.redistribute(value.device_mesh, value.placements)
            value.to_local().copy_(back.to_local())
