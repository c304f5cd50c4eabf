"""Pure planning for materialize: seeds, scratch layout, who computes which module, which rows.

No tensors and no process group here: plain numbers in, plain numbers out (property-tested in
tests/test_materialize.py). See ``fprep.apply.materialize`` for how they are used.
"""

from __future__ import annotations

import hashlib
import heapq
import zlib
from collections.abc import Sequence

from fprep.layout.placements import Shard
from fprep.sharding import local_rows
from fprep.state import ShardSpec

#: Byte alignment of views carved from a scratch buffer: at least what a fresh allocation gets
#: (64 bytes on CPU, 512 with the CUDA caching allocator), so kernels see the same alignment.
ALIGN = 512
#: Elements per block of rows that a row-local random fill draws from one generator (see
#: ``fprep.apply.init_rows``): big enough that seeding a generator per block costs nothing
#: (256 Ki elements take ~0.6 ms to draw on a CPU core), small enough that the rows a rank draws
#: only to throw away (at most one partial block at each end of its shard) cost little.
BLOCK_ELEMENTS = 1 << 18
#: Backends whose shard groups share the full computation (see the module docstring).
SHARING_BACKENDS = frozenset({"gloo"})

#: One item of a schedule: a module index (initialized on every rank), or a phase of module
#: indices (each computed on one shard rank, which sends the others their rows).
Work = int | tuple[int, ...]


def module_seed(base: int, fqn: str, shard_rank: int | None = None) -> int:
    """A stable per-module seed: the same on every rank and every run; with ``shard_rank``
    (non-reproducible mode, modules holding shards) one per shard."""
    key = fqn if shard_rank is None else f"{fqn}\x00{shard_rank}"
    return (base * 1_000_003 + zlib.crc32(key.encode())) % (2**63 - 1)


def carve(sizes: Sequence[int], align: int = ALIGN) -> tuple[tuple[int, ...], int]:
    """Byte offsets of blocks of ``sizes`` bytes laid end to end, each starting ``align``-aligned,
    and the bytes they span; blocks never overlap."""
    offsets: list[int] = []
    end = 0
    for size in sizes:
        offsets.append(end)
        end += -(-size // align) * align
    return tuple(offsets), end


def shares_work(backend: str, shard_size: int) -> bool:
    """Whether a shard group computes each module once and sends the rows (else every rank
    computes every module in full): where random numbers cost more than bytes moved."""
    return shard_size > 1 and backend in SHARING_BACKENDS


def schedule(shareable: Sequence[bool]) -> list[Work]:
    """Modules (by index, in plan order) grouped into the order of work.

    A module that cannot be shared is initialized on every rank, in plan order: it is a
    barrier, since its init may write what another module's init writes
    (``nn.MultiheadAttention`` sets its child's bias). Consecutive shareable modules (leaves
    that touch only their own, sharded parameters, so their order does not matter) form one
    phase, shared out by ``assign``.
    """
    out: list[Work] = []
    phase: list[int] = []
    for i, ok in enumerate(shareable):
        if ok:
            phase.append(i)
            continue
        if phase:
            out.append(tuple(phase))
            phase = []
        out.append(i)
    if phase:
        out.append(tuple(phase))
    return out


def assign(costs: Sequence[int], world: int) -> list[int]:
    """The shard rank that computes each module of a phase: largest first, each to the rank
    with the least work so far (the lowest on ties), so that the ranks finish together."""
    loads = [(0, k) for k in range(world)]  # a heap of (work so far, rank)
    owners = [0] * len(costs)
    for i in sorted(range(len(costs)), key=lambda i: (-costs[i], i)):
        load, k = heapq.heappop(loads)
        owners[i] = k
        heapq.heappush(loads, (load + costs[i], k))
    return owners


def tp_cut(spec: ShardSpec) -> tuple[int, int] | None:
    """``(dim, tp)``: the dimension tensor parallelism cuts ``spec`` along and into how many
    blocks (``tp`` divides it: checked by the plan); None where it does not cut it."""
    if "tp" not in spec.mesh_dims:
        return None
    placement = spec.placements[spec.mesh_dims.index("tp")]
    if not isinstance(placement, Shard):
        return None
    dim = placement.dim
    return dim, spec.shape[dim] // spec.tp_shape[dim]


def row_span(spec: ShardSpec, world: int, rank: int, tp_rank: int = 0) -> tuple[int, int]:
    """The rows ``[start, stop)`` of the full parameter that shard rank ``rank`` (tensor-
    parallel rank ``tp_rank``) holds: FSDP2's rows of the tensor-parallel block, which starts
    ``tp_rank`` blocks down where tensor parallelism cuts rows (colwise)."""
    cut = tp_cut(spec)
    base, total = 0, spec.shape[0]
    if cut is not None and cut[0] == 0:
        total = spec.tp_shape[0]
        base = total * tp_rank
    start = base + spec.padded_shape[0] * rank
    rows = local_rows(total, world, rank) if all(spec.shape[1:]) else 0
    return start, start + rows


def col_span(spec: ShardSpec, tp_rank: int) -> tuple[int, int] | None:
    """The columns ``[start, stop)`` of the full parameter that tensor-parallel rank
    ``tp_rank`` holds where tensor parallelism cuts columns (rowwise), else None (all)."""
    cut = tp_cut(spec)
    if cut is None or cut[0] != 1:
        return None
    width = spec.tp_shape[1]
    return width * tp_rank, width * (tp_rank + 1)


def block_rows(shape: Sequence[int], elements: int = BLOCK_ELEMENTS) -> int:
    """Rows per block of a parameter of ``shape``: a function of the full shape alone, so that
    every world size cuts the same blocks. A 0-dim parameter is one row."""
    row = 1
    for n in shape[1:]:
        row *= n
    return max(1, elements // max(row, 1))


def blocks_over(start: int, stop: int, rows: int, per_block: int) -> list[tuple[int, int]]:
    """The blocks ``[lo, hi)`` of a parameter with ``rows`` rows, cut every ``per_block`` rows,
    that rows ``[start, stop)`` touch, in order."""
    if start >= stop:
        return []
    first, last = start // per_block, (stop - 1) // per_block
    return [(b * per_block, min(rows, (b + 1) * per_block)) for b in range(first, last + 1)]


def block_seed(seed: int, name: str, draw: int, block: int) -> int:
    """The seed of one block of one random fill of one parameter: a 63-bit hash of all four, so
    blocks, fills and parameters draw unrelated streams (the CPU generator keeps only the low 32
    bits of a seed, so neighbouring integers would not do)."""
    key = f"{seed}\x00{name}\x00{draw}\x00{block}".encode()
    return int.from_bytes(hashlib.blake2b(key, digest_size=8).digest(), "little") >> 1
