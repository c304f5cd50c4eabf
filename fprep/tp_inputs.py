"""Every rank of a tensor-parallel group must be given the same input; this checks it.

The ranks of a tp group hold slices of one model and compute one forward together: their inputs
must be equal. A loader that is not fprep's, or one seeded per rank, hands them different
batches, and nothing in torch notices: the collectives add up slices of different batches and
training goes on, on a mix of them. fprep checks the first forward of a prepared model (a
forward pre-hook on the root, which removes itself: later steps pay nothing) and, on demand,
any inputs (``fprep.check_tp_inputs``).

The check costs one all-gather of one number per rank over the tp group: each rank reduces its
inputs to a 64-bit digest of every tensor's name, shape, dtype and bits, position-weighted so
that a permutation of rows (a batch shuffled differently) changes it. The digest is computed
where the tensors are, in chunks, with integer arithmetic only (exact: equal bits give equal
digests on every rank).
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterator, Mapping
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from fprep.collectives import collective
from fprep.errors import PrepareError

_CHUNK = 1 << 22  # elements per step of the checksum: bounds its temporary memory
_MULTIPLIER = 0x9E3779B1  # odd, so that weight(i) differs for every position i below 2**32
_INT_VIEWS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def _tensors(value: Any, path: str) -> Iterator[tuple[str, torch.Tensor]]:
    """The plain tensors in ``value`` (nested tuples, lists and mappings), with where they sit."""
    if isinstance(value, torch.Tensor):
        if not hasattr(value, "device_mesh"):  # a DTensor is already laid out over the ranks
            yield path, value
    elif isinstance(value, Mapping):
        for key, item in value.items():
            yield from _tensors(item, f"{path}.{key}")
    elif isinstance(value, list | tuple):
        for i, item in enumerate(value):
            yield from _tensors(item, f"{path}[{i}]")


def _checksum(t: torch.Tensor) -> torch.Tensor:
    """A position-weighted sum of ``t``'s bits (int64, wrapping), on ``t``'s device."""
    flat = t.detach().reshape(-1)
    if flat.dtype == torch.bool:
        flat = flat.to(torch.uint8)
    if flat.is_complex():
        flat = torch.view_as_real(flat).reshape(-1)
    bits = flat.contiguous().view(_INT_VIEWS[flat.element_size()])
    total = torch.zeros((), dtype=torch.int64, device=flat.device)
    for start in range(0, bits.numel(), _CHUNK):
        part = bits[start : start + _CHUNK].to(torch.int64)
        weight = torch.arange(start, start + part.numel(), device=flat.device)
        total += (part * (weight * _MULTIPLIER + 1)).sum()
    return total


def input_digest(inputs: Any) -> int:
    """One signed 64-bit digest of every plain tensor in ``inputs``: names, shapes, dtypes and
    values, in order."""
    found = list(_tensors(inputs, "input"))
    sums = torch.stack([_checksum(t).cpu() for _, t in found]).tolist() if found else []
    text = repr(
        [(p, tuple(t.shape), str(t.dtype), s) for (p, t), s in zip(found, sums, strict=True)]
    )
    digest = hashlib.blake2b(text.encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little", signed=True)


def check_same_inputs(
    inputs: Any, group: Any, device: torch.device, call: str, timeout_s: float
) -> None:
    """A PrepareError, on every rank of ``group``, unless all of them were given equal
    ``inputs`` (one all-gather of one number)."""
    ranks = dist.get_process_group_ranks(group)
    mine = torch.tensor([input_digest(inputs)], dtype=torch.int64, device=device)
    gathered = [torch.empty_like(mine) for _ in ranks]
    with collective(call, timeout_s, group, arrive=False):
        dist.all_gather(gathered, mine, group=group)
    digests = [int(t.item()) for t in gathered]
    if len(set(digests)) > 1:
        raise _different(call, ranks, digests)


def _different(call: str, ranks: list[int], digests: list[int]) -> PrepareError:
    alike: dict[int, list[int]] = {}
    for rank, digest in zip(ranks, digests, strict=True):
        alike.setdefault(digest, []).append(rank)
    sets = " and ".join(f"ranks {members}" for members in alike.values())
    return PrepareError(
        f"{call}: the tensor-parallel ranks {ranks} were given different inputs ({sets} "
        "each saw their own): they compute one forward together, so training would go on, "
        "silently, on a mix of batches.",
        subject=f"tp group {ranks}",
        hint="Give every rank of a tp group the same batch: fprep.prepare_data_loader(state, "
        "loader) reads one share per data-parallel rank; a loader of your own must shard by "
        "the data-parallel rank (not the global rank) and seed the ranks of a tp group alike.",
    )


class FirstInputsCheck:
    """A forward pre-hook: checks the first forward's inputs across the tp group, then removes
    itself (whether they agree or not: a failed check is raised once, on every rank)."""

    def __init__(self, group: Any, device: torch.device, timeout_s: float) -> None:
        self.group = group
        self.device = device
        self.timeout_s = timeout_s
        self.handle: Any = None

    def install(self, model: nn.Module) -> None:
        self.handle = model.register_forward_pre_hook(self, with_kwargs=True, prepend=True)

    def __call__(self, module: nn.Module, args: Any, kwargs: Any) -> None:
        _check_first(self, args, kwargs)


@torch.compiler.disable  # type: ignore[untyped-decorator]  # (torch leaves it untyped)
def _check_first(check: FirstInputsCheck, args: Any, kwargs: Any) -> None:
    """Outside compiled code: a digest needs the values, and the hook goes once it has run."""
    if check.handle is not None:
        check.handle.remove()
        check.handle = None
    check_same_inputs(
        (args, kwargs), check.group, check.device, "the first forward", check.timeout_s
    )
