"""Pure layout math: the N-D mesh record, typed placements and the pipeline stage split.

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
