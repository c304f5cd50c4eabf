"""The dim-0 shard shape FSDP2 gives each rank (``torch.chunk`` semantics), as pure arithmetic.

A parameter of ``n`` rows over ``w`` ranks is cut into chunks of ``c = ceil(n / w)`` rows; rank
``r`` holds rows ``[c*r, min(c*(r+1), n))`` — possibly none — and allocates a full chunk of ``c``
rows (the padding makes the all-gather buffer even). A parameter with a zero-size dimension other
than dim 0 has no elements: FSDP2 gives every rank zero rows of it, and still allocates (pads to)
``c`` rows. Verified against ``fully_shard`` in tests/test_plan_vs_fsdp.py.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from fprep.layout.placements import Placement, Replicate, Shard, StridedShard

if TYPE_CHECKING:
    from fprep.snapshot import ParamInfo
    from fprep.state import ProcessGroupState, TensorParallelState


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


@dataclass(frozen=True, kw_only=True)
class TPLayout:
    """Where a parameter lies on an N-D mesh ``(*dp dims, tp)``, as torch lays it out.

    Tensor parallelism first cuts the tp dim of a planned parameter into ``tp`` chunks
    (DTensor ``Shard(dim)``, ``torch.chunk`` semantics); FSDP2 then cuts *that local block*
    along dim 0 over the data-parallel shard ranks. When both cut dim 0, FSDP2 records its
    placement as ``_StridedShard(dim=0, sf=tp)`` (torch's ``_fsdp_param.py``), since each rank's
    rows are a stride of the full tensor; otherwise ``Shard(dim=0)``. HSDP adds ``Replicate()``
    on its replicate dim. A parameter outside the plan is a plain tensor to tensor parallelism
    (replicated over tp) and spans only the data-parallel dims.
    """

    tp: int
    tp_rank: int
    dp_dims: tuple[str, ...]
    hybrid: bool
    params: Mapping[str, int | None] = field(default_factory=dict)  # fqn -> tp shard dim
    #: fqn -> split factor of a packed parameter (``StridedShard`` on its tp dim: each of its
    #: halves cut on its own; the local block has the same shape as a plain shard's)
    strided: Mapping[str, int] = field(default_factory=dict)

    @classmethod
    def of(cls, tps: TensorParallelState, pg: ProcessGroupState, *, hybrid: bool) -> TPLayout:
        return cls(
            tp=tps.size,
            tp_rank=tps.rank,
            dp_dims=pg.mesh_dim_names,
            hybrid=hybrid,
            params=dict(tps.params),
            strided={
                fqn: pl.split_factor for fqn, pl in tps.placements if isinstance(pl, StridedShard)
            },
        )

    def place(
        self, p: ParamInfo, shard: tuple[int, int] | None
    ) -> tuple[
        tuple[int, ...], tuple[int, ...], tuple[str, ...], tuple[Placement, ...], tuple[int, ...]
    ]:
        """``(local shape, padded shape, mesh dims, placements, tp block shape)`` of ``p`` on
        this rank;
        ``shard`` is ``(dp shard group size, this rank's index)`` under FSDP2, else None."""
        in_tp = p.fqn in self.params
        dim = self.params.get(p.fqn)
        local: tuple[int, ...] = p.shape
        if dim is not None:
            local = (*local[:dim], local_rows(local[dim], self.tp, self.tp_rank), *local[dim + 1 :])
        block = local
        dims: list[str] = []
        placements: list[Placement] = []
        padded = local
        if shard is not None:
            if self.hybrid:
                placements.append(Replicate())
            placements.append(StridedShard(0, self.tp) if dim == 0 else Shard(0))
            dims.extend(self.dp_dims)
            local, padded = shard_shape(local, *shard)
        if in_tp:
            dims.append("tp")
            if dim is None:
                placements.append(Replicate())
            elif p.fqn in self.strided:
                placements.append(StridedShard(dim, self.strided[p.fqn]))
            else:
                placements.append(Shard(dim))
        return local, padded, tuple(dims), tuple(placements), block
