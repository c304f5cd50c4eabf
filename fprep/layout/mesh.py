"""The one record of the N-D device mesh: named dimensions, their sizes, and every group on them.

``MeshPlan`` plays the part of torchtitan's ``ParallelDims``. Its dimensions always come in
one order, ``DIM_ORDER`` (``pp``, ``dp_replicate``, ``dp_shard``, ``cp``, ``tp``), and its ranks
are laid out row-major over them, as ``init_device_mesh`` lays out a mesh of that shape: the last
dimension (``tp``) varies fastest, so a tensor-parallel group is a run of neighbouring ranks and
stays inside a node. A dimension of size 1 is still named; it simply has one member.

Expert parallelism is a derived view, not a sixth dimension: ``ep`` ranks borrowed from
``dp_shard`` x ``tp``, as torchtitan and transformers borrow them. The ``dp_shard`` x ``tp``
ranks of a data-parallel replica are read, row-major, as ``efsdp`` x ``ep`` with
``dp_shard x tp = efsdp x ep``: ``ep`` innermost, so an expert-parallel group is a run of
neighbouring ranks, and each ``efsdp`` group holds copies of the same experts, which FSDP
shards over it.

Every group is computed from this rank's coordinate and the strides, in time proportional to the
group's size, never to the world's: a plan for rank 0 of 1024 ranks lists no other rank's group.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass, field

from fprep.errors import ConfigError, TopologyError

#: The mesh dimensions, outermost first.
DIM_ORDER = ("pp", "dp_replicate", "dp_shard", "cp", "tp")

#: What fprep names the data-parallel mesh it gives FSDP2 / DDP: 1-D, or 2-D under hsdp.
DP_MESH_NAMES = ("dp",)
HSDP_MESH_NAMES = ("replicate", "shard")


@dataclass(frozen=True, kw_only=True)
class MeshPlan:
    """The whole N-D mesh as data, and this rank's place in it.

    ``ranks`` lists the global rank at each row-major position; ``None`` means
    ``range(size)``, the mesh fprep builds over the whole world. A mesh or process group the
    user passed keeps its own ranks (a slice of a larger mesh is strided, for instance).
    ``dp_mesh_names`` are the names of the data-parallel mesh FSDP2 / DDP receive: one name
    means the 1-D mesh ``(dp_shard,)``, two the hybrid mesh ``(dp_replicate, dp_shard)``;
    left empty, they are fprep's names: ``("dp",)``, or ``("replicate", "shard")`` when
    ``dp_replicate > 1``.
    """

    world_size: int
    rank: int
    pp: int = 1
    dp_replicate: int = 1
    dp_shard: int = 1
    cp: int = 1
    tp: int = 1
    #: expert-parallel ranks, borrowed from ``dp_shard`` x ``tp`` (a view, not a dimension)
    ep: int = 1
    ranks: tuple[int, ...] | None = None
    dp_mesh_names: tuple[str, ...] = ()
    #: This rank's row-major position in ``ranks`` (derived, so not compared).
    flat_index: int = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        for name in DIM_ORDER:
            size = getattr(self, name)
            if not isinstance(size, int) or isinstance(size, bool) or size < 1:
                raise ConfigError(
                    f"the mesh dimension {name}={size!r} must be a whole number of at least 1.",
                    subject=name,
                    hint="Give every mesh dimension a size of 1 or more (1 leaves it unused).",
                )
        self._check_ep()
        if self.world_size < 1:
            raise TopologyError(
                f"world_size={self.world_size} must be at least 1.", subject="world_size"
            )
        if not self.dp_mesh_names:
            names = HSDP_MESH_NAMES if self.dp_replicate > 1 else DP_MESH_NAMES
            object.__setattr__(self, "dp_mesh_names", names)
        if len(self.dp_mesh_names) not in (1, 2) or (
            len(self.dp_mesh_names) == 1 and self.dp_replicate != 1
        ):
            raise ConfigError(
                f"dp_mesh_names={self.dp_mesh_names} must name a 1-D data-parallel mesh "
                f"(dp_replicate=1; here {self.dp_replicate}) or a 2-D one.",
                subject="dp_mesh_names",
                hint="Give one name for a plain data-parallel mesh, two for (replicate, shard).",
            )
        object.__setattr__(self, "flat_index", self._locate())

    def _check_ep(self) -> None:
        ep = self.ep
        if not isinstance(ep, int) or isinstance(ep, bool) or ep < 1:
            raise ConfigError(
                f"ep={ep!r} must be a whole number of at least 1.",
                subject="ep",
                hint="Give ep a size of 1 or more (1 leaves experts unsplit).",
            )
        borrowed = self.dp_shard * self.tp
        if borrowed % ep:
            raise ConfigError(
                f"ep={ep} does not divide dp_shard x tp = {self.dp_shard} x {self.tp} = "
                f"{borrowed}: expert-parallel ranks are borrowed from the sharded data-parallel "
                "and tensor-parallel ranks.",
                subject="ep",
                hint=f"Choose ep among the divisors of {borrowed}.",
            )
        if ep > 1 and self.cp > 1:
            raise ConfigError(
                f"ep={ep} with cp={self.cp}: expert parallelism does not borrow context-"
                "parallel ranks.",
                subject="ep",
                hint="Leave cp at 1.",
            )

    def _locate(self) -> int:
        size = self.size
        if self.ranks is None:
            if size != self.world_size:
                raise TopologyError(
                    f"the mesh {self.describe()} covers {size} ranks but world_size is "
                    f"{self.world_size}.",
                    subject="world_size",
                    hint="Choose dimension sizes whose product is the number of processes.",
                )
            if not 0 <= self.rank < self.world_size:
                raise TopologyError(
                    f"rank {self.rank} is outside the world of {self.world_size} ranks.",
                    subject="rank",
                )
            return self.rank
        ranks = self.ranks
        if len(ranks) != size:
            raise TopologyError(
                f"the mesh {self.describe()} has {size} positions but lists {len(ranks)} ranks.",
                subject="ranks",
                hint="List one global rank per mesh position, row-major.",
            )
        if len(set(ranks)) != size or any(not 0 <= r < self.world_size for r in ranks):
            raise TopologyError(
                f"the mesh's ranks must be distinct and below world_size {self.world_size}; "
                f"got {ranks}.",
                subject="ranks",
            )
        try:
            return ranks.index(self.rank)
        except ValueError:
            raise TopologyError(
                f"rank {self.rank} is not a member of the mesh {ranks}.",
                subject="rank",
                hint="Pass each rank the mesh it belongs to.",
            ) from None

    # -- the dimensions ----------------------------------------------------------------------

    @property
    def shape(self) -> tuple[int, ...]:
        """The sizes in ``DIM_ORDER``."""
        return tuple(getattr(self, name) for name in DIM_ORDER)

    @property
    def size(self) -> int:
        """How many ranks the mesh holds (the world, unless the user gave a slice)."""
        return math.prod(self.shape)

    def describe(self) -> str:
        """The dimensions larger than 1, as ``pp=2 x dp_shard=4`` (``1`` when there are none)."""
        used = [f"{n}={s}" for n, s in zip(DIM_ORDER, self.shape, strict=True) if s > 1]
        text = " x ".join(used) or "1"
        return text if self.ep == 1 else f"{text} (ep={self.ep} x efsdp={self.efsdp})"

    def coordinate(self, name: str) -> int:
        """This rank's index along the dimension ``name``."""
        size: int = getattr(self, self._check(name))
        return (self.flat_index // self._stride(name)) % size

    def global_rank(self, flat: int) -> int:
        """The global rank at row-major position ``flat``."""
        return flat if self.ranks is None else self.ranks[flat]

    # -- groups ------------------------------------------------------------------------------

    def group(self, *names: str) -> tuple[int, ...]:
        """The ranks that share this rank's coordinates on every dimension not named.

        ``group("dp_replicate", "dp_shard")`` is this rank's data-parallel group; names may be
        given in any order, the group is listed row-major in ``DIM_ORDER``. No names: this rank.
        """
        dims = self._dims(names)
        base = self.flat_index - sum(self.coordinate(d) * self._stride(d) for d in dims)
        return self._walk(base, dims)

    def all_groups(self, *names: str) -> tuple[tuple[int, ...], ...]:
        """Every group along ``names`` (see ``group``), ordered by their first position.

        This lists the whole mesh, so it costs the world's size; plans use ``group``.
        """
        dims = self._dims(names)
        others = tuple(d for d in DIM_ORDER if d not in dims)
        out = []
        for coords in itertools.product(*(range(getattr(self, d)) for d in others)):
            base = sum(c * self._stride(d) for d, c in zip(others, coords, strict=True))
            out.append(self._walk(base, dims))
        return tuple(out)

    def _walk(self, base: int, dims: tuple[str, ...]) -> tuple[int, ...]:
        strides = [self._stride(d) for d in dims]
        return tuple(
            self.global_rank(base + sum(i * s for i, s in zip(idx, strides, strict=True)))
            for idx in itertools.product(*(range(getattr(self, d)) for d in dims))
        )

    def _stride(self, name: str) -> int:
        return math.prod(getattr(self, d) for d in DIM_ORDER[DIM_ORDER.index(name) + 1 :])

    def _check(self, name: str) -> str:
        if name not in DIM_ORDER:
            raise ConfigError(
                f"{name!r} is not a mesh dimension.",
                subject=name,
                hint=f"Use one of {', '.join(DIM_ORDER)}.",
            )
        return name

    def _dims(self, names: tuple[str, ...]) -> tuple[str, ...]:
        for name in names:
            self._check(name)
        if len(set(names)) != len(names):
            raise ConfigError(f"a mesh dimension is named twice in {names}.", subject="names")
        return tuple(d for d in DIM_ORDER if d in names)

    # -- the views the rest of fprep reads ---------------------------------------------------

    @property
    def is_distributed(self) -> bool:
        """Whether this run has more than one process."""
        return self.world_size > 1

    @property
    def dp_size(self) -> int:
        """How many data-parallel peers this rank has, itself included (``dp_replicate`` x
        ``dp_shard``): the number of different batches one step reads."""
        return self.dp_replicate * self.dp_shard

    @property
    def dp_rank(self) -> int:
        """This rank's row-major index among its data-parallel peers (``dp_group``), in
        ``range(dp_size)``: the share of the data it reads. Ranks that differ only in their
        ``pp``, ``cp`` or ``tp`` coordinate have the same index, so they read the same batch."""
        return self.coordinate("dp_replicate") * self.dp_shard + self.coordinate("dp_shard")

    @property
    def dp_mesh_shape(self) -> tuple[int, ...]:
        """The shape of the data-parallel mesh FSDP2 / DDP receive (see ``dp_mesh_names``)."""
        if len(self.dp_mesh_names) == 1:
            return (self.dp_shard,)
        return (self.dp_replicate, self.dp_shard)

    @property
    def dp_coordinate(self) -> tuple[int, ...]:
        """This rank's coordinate on the data-parallel mesh."""
        shard = self.coordinate("dp_shard")
        if len(self.dp_mesh_names) == 1:
            return (shard,)
        return (self.coordinate("dp_replicate"), shard)

    @property
    def dp_group(self) -> tuple[int, ...]:
        """Every rank of this rank's data-parallel mesh, row-major."""
        return self.group("dp_replicate", "dp_shard")

    @property
    def shard_group(self) -> tuple[int, ...]:
        """The ranks this rank shards parameters with."""
        return self.group("dp_shard")

    @property
    def same_shard_ranks(self) -> tuple[int, ...]:
        """The ranks holding the same shard of every parameter as this rank (its replicas)."""
        return self.group("dp_replicate")

    @property
    def tp_group(self) -> tuple[int, ...]:
        """The ranks this rank splits tensors with."""
        return self.group("tp")

    # -- the expert-parallel view (borrowed from dp_shard x tp) ---------------------------------

    @property
    def efsdp(self) -> int:
        """How many copies of each expert a data-parallel replica holds, sharded by FSDP over
        ``efsdp_group``: ``dp_shard x tp / ep``."""
        return self.dp_shard * self.tp // self.ep

    def _borrowed_index(self) -> int:
        """This rank's row-major index over ``(dp_shard, tp)``, the ranks ep borrows."""
        return self.coordinate("dp_shard") * self.tp + self.coordinate("tp")

    @property
    def ep_rank(self) -> int:
        """This rank's index in its expert-parallel group, in ``range(ep)``: which experts it
        holds."""
        return self._borrowed_index() % self.ep

    @property
    def efsdp_rank(self) -> int:
        """This rank's index in its expert-sharding group, in ``range(efsdp)``."""
        return self._borrowed_index() // self.ep

    def _borrowed(self, indices: range) -> tuple[int, ...]:
        """The global ranks at ``(dp_shard, tp)`` indices ``indices`` beside this rank."""
        shard, tp = self._stride("dp_shard"), self._stride("tp")
        base = self.flat_index - self.coordinate("dp_shard") * shard - self.coordinate("tp") * tp
        return tuple(
            self.global_rank(base + (i // self.tp) * shard + (i % self.tp) * tp) for i in indices
        )

    @property
    def ep_group(self) -> tuple[int, ...]:
        """The ranks this rank exchanges tokens with (each holds other experts), in ep-rank
        order: neighbouring ranks."""
        start = self.efsdp_rank * self.ep
        return self._borrowed(range(start, start + self.ep))

    @property
    def efsdp_group(self) -> tuple[int, ...]:
        """The ranks holding the same experts as this rank inside its data-parallel replica,
        which FSDP shards them over."""
        return self._borrowed(range(self.ep_rank, self.dp_shard * self.tp, self.ep))
