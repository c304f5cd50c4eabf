"""Pure layout math: the N-D mesh record, typed placements, the tensor-parallel styles, the
pipeline stage split and the expert placement.

Nothing here imports torch's distributed runtime or touches tensor data; the modules depend only
on ``fprep.errors`` and the standard library, so every transition may use them.
"""

from fprep.layout.mesh import DIM_ORDER, MeshPlan
from fprep.layout.placements import Partial, Placement, Replicate, Shard, StridedShard

__all__ = [
    "DIM_ORDER",
    "MeshPlan",
    "Partial",
    "Placement",
    "Replicate",
    "Shard",
    "StridedShard",
]
