"""Which experts each expert-parallel rank holds, and the shapes of their slices (pure).

An experts module stores its experts stacked on dimension 0 of each parameter (transformers'
``gate_up_proj`` is ``experts x 2I x H``). Under expert parallelism over ``ep`` ranks, ep rank
``r`` holds the contiguous run of experts ``r * E / ep`` to ``(r + 1) * E / ep``, so sorting
the routed tokens by expert also sorts them by the rank that runs them. The ``efsdp`` ranks that
hold the same experts then shard them with FSDP, on dimension 0 as usual, or on dimension 1 when
``efsdp x ep`` exceeds the expert count (a rank's slice would otherwise hold no whole expert,
and some ranks nothing at all): torchtitan's rule. FSDP2 shards unevenly on dimension 0 only, so
a parameter whose dimension 1 the efsdp ranks do not divide stays on dimension 0.

Sizes are plain ints; nothing here imports torch.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from fprep.errors import ConfigError
from fprep.layout.placements import Shard


def chunk_size(length: int, parts: int, index: int) -> int:
    """The length of chunk ``index`` when ``torch.chunk`` splits ``length`` into ``parts``
    (FSDP2's rule: chunks of ``ceil(length / parts)``, the last ones shorter or empty)."""
    per = -(-length // parts)
    return max(0, min(per, length - index * per))


@dataclass(frozen=True)
class ExpertLayout:
    """``num_experts`` experts spread over ``ep`` ranks, each rank's share sharded by FSDP over
    ``efsdp`` ranks."""

    num_experts: int
    ep: int
    efsdp: int = 1

    def __post_init__(self) -> None:
        for name in ("num_experts", "ep", "efsdp"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ConfigError(
                    f"{name}={value!r} must be a whole number of at least 1.", subject=name
                )
        if self.num_experts % self.ep:
            raise ConfigError(
                f"ep={self.ep} does not divide the {self.num_experts} experts: every "
                "expert-parallel rank holds the same number of whole experts.",
                subject="ep",
                hint=f"Choose ep among the divisors of {self.num_experts} "
                f"({', '.join(map(str, divisors(self.num_experts)))}).",
            )

    @property
    def local_count(self) -> int:
        """How many experts each ep rank holds."""
        return self.num_experts // self.ep

    def experts_of(self, ep_rank: int) -> range:
        """The experts ep rank ``ep_rank`` holds (a contiguous run)."""
        if not 0 <= ep_rank < self.ep:
            raise ValueError(f"ep_rank {ep_rank} is outside range({self.ep})")
        return range(ep_rank * self.local_count, (ep_rank + 1) * self.local_count)

    def owner(self, expert: int) -> int:
        """The ep rank that holds ``expert``."""
        if not 0 <= expert < self.num_experts:
            raise ValueError(f"expert {expert} is outside range({self.num_experts})")
        return expert // self.local_count

    @property
    def shards_inside_experts(self) -> bool:
        """Whether FSDP shards inside each expert (dimension 1): ``efsdp x ep`` exceeds the
        expert count, so dimension 0 has fewer rows than the ranks splitting it."""
        return self.efsdp * self.ep > self.num_experts

    def fsdp_dim(self, shape: tuple[int, ...]) -> int:
        """The dimension FSDP shards a parameter of full ``shape`` on over efsdp: 1 when
        ``shards_inside_experts`` and efsdp divides it (FSDP2 shards other dimensions evenly
        only), else 0."""
        inside = self.shards_inside_experts and len(shape) > 1 and shape[1] % self.efsdp == 0
        return 1 if inside else 0

    def fsdp_placement(self, shape: tuple[int, ...]) -> Shard:
        """FSDP's placement of an expert parameter of full ``shape`` over efsdp."""
        return Shard(self.fsdp_dim(shape))

    def ep_shape(self, shape: tuple[int, ...]) -> tuple[int, ...]:
        """The shape of an ep rank's experts of a parameter of full ``shape``."""
        self._check_shape(shape)
        return (self.local_count, *shape[1:])

    def local_shape(self, shape: tuple[int, ...], efsdp_rank: int) -> tuple[int, ...]:
        """The shape efsdp rank ``efsdp_rank`` keeps of its ep rank's experts (FSDP's shard)."""
        if not 0 <= efsdp_rank < self.efsdp:
            raise ValueError(f"efsdp_rank {efsdp_rank} is outside range({self.efsdp})")
        held = list(self.ep_shape(shape))
        dim = self.fsdp_dim(shape)
        held[dim] = chunk_size(held[dim], self.efsdp, efsdp_rank)
        return tuple(held)

    def local_bytes(self, shape: tuple[int, ...], itemsize: int, efsdp_rank: int) -> int:
        """The bytes efsdp rank ``efsdp_rank`` keeps of a parameter of full ``shape``."""
        return math.prod(self.local_shape(shape, efsdp_rank)) * itemsize

    def _check_shape(self, shape: tuple[int, ...]) -> None:
        if not shape or shape[0] != self.num_experts:
            raise ConfigError(
                f"a parameter of shape {tuple(shape)} does not stack {self.num_experts} experts "
                "on its first dimension.",
                subject="ep_plan",
                hint="Name in the expert-parallel plan only modules whose parameters are "
                "experts x ... (transformers' fused experts).",
            )


def divisors(n: int) -> tuple[int, ...]:
    """The divisors of ``n``, smallest first."""
    return tuple(d for d in range(1, n + 1) if n % d == 0)


__all__ = ["ExpertLayout", "chunk_size", "divisors"]
