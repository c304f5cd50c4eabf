"""Sharing materialize's work across a shard group (gloo): each module computed once, rows sent
point to point; plus the checks that make every rank fail together instead of waiting forever.
"""

from __future__ import annotations

import zlib
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from fprep.apply.init_jobs import (
    Init,
    Job,
    Scratch,
    blame,
    block_of,
    check_shard,
    compute,
    keep_rows,
    local_of,
    span,
)
from fprep.apply.init_schedule import assign
from fprep.errors import PrepareError
from fprep.progress import Progress


def as_bytes(t: torch.Tensor) -> torch.Tensor:
    """A contiguous tensor as flat bytes: sent bit for bit, whatever the backend's dtypes."""
    return t.reshape(-1).view(torch.uint8)


def agree(error: PrepareError | None, group: Any, rank: int, device: torch.device) -> None:
    """Raise on every rank if one rank failed, instead of the others waiting for it forever."""
    flag = torch.tensor([0 if error is None else rank + 1], dtype=torch.int32, device=device)
    dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=group)
    if error is not None:
        raise error
    failed = int(flag.item()) - 1
    if failed >= 0:
        raise PrepareError(
            f"materializing failed on shard rank {failed}; see that rank's error.",
            subject="materialize",
        )


def run_phase(
    jobs: Sequence[Job],
    init: Init,
    scratch: Scratch,
    device: torch.device,
    group: Any,
    world: int,
    rank: int,
    progress: Progress,
) -> None:
    """Share out ``jobs``: each is computed in full on one shard rank, which sends every other
    rank its rows.

    Every rank posts all its receives first (straight into its shards), then computes and sends
    its own modules: nobody waits for a peer to be ready, only for the bytes, and the ranks run
    in lockstep only at the two checks that make every rank raise if one failed.
    """
    owners = assign([job.cost for job in jobs], world)
    error: PrepareError | None = None
    try:
        for job in jobs:
            for s in job.kept:
                check_shard(s)
    except PrepareError as e:
        error = e
    agree(error, group, rank, device)
    tags = {
        (i, s.name): tag
        for tag, (i, s) in enumerate((i, s) for i, job in enumerate(jobs) for s in job.kept)
    }
    receiving: list[tuple[Any, torch.Tensor, torch.Tensor]] = []
    for i, job in enumerate(jobs):
        if owners[i] == rank:
            continue
        for s in job.kept:
            local = local_of(s.original)
            if not local.numel():
                continue
            target = local
            if not local.is_contiguous() or local.device != device:
                target = torch.empty(local.shape, dtype=local.dtype, device=device)
            work = dist.irecv(
                as_bytes(target), group=group, group_src=owners[i], tag=tags[i, s.name]
            )
            receiving.append((work, local, target))
    try:
        for i, job in enumerate(jobs):
            if owners[i] != rank:
                continue
            with blame(job):
                computed = compute(job, job.init or init, scratch, device)
            sending = []
            for s, full in computed:
                assert s.spec is not None
                rows = full.contiguous()
                for j in range(world):  # (the shard group's ranks share a tp rank)
                    block = block_of(rows, *span(s, world, j))
                    if j != rank and block.numel():
                        chunk = as_bytes(block.contiguous())
                        sending.append(
                            dist.isend(chunk, group=group, group_dst=j, tag=tags[i, s.name])
                        )
                keep_rows(s, rows, world, rank)
            for work in sending:  # the scratch buffer is reused by the next module
                work.wait()  # type: ignore[union-attr]
            progress.advance()
    except PrepareError as e:
        error = e
    agree(error, group, rank, device)
    for work, local, target in receiving:
        work.wait()
        if target is not local:
            local.copy_(target)
    progress.advance(len(jobs) - owners.count(rank))


def _same_everywhere(fqns: Sequence[str], groups: Sequence[Any], device: torch.device) -> bool:
    """Whether every rank of ``groups`` passed the same list: the maximum of its length and CRC,
    and of their negatives, all-reduced over each group in turn (the dimensions of a mesh: the
    maximum over each dimension in turn is the maximum over the whole mesh, on every rank)."""
    mine = [len(fqns), zlib.crc32("\n".join(fqns).encode())]
    both = torch.tensor([*mine, *(-x for x in mine)], dtype=torch.int64, device=device)
    for group in groups:
        dist.all_reduce(both, op=dist.ReduceOp.MAX, group=group)
    high, low = both[:2].tolist(), [-x for x in both[2:].tolist()]
    return bool(high == low)


def check_same_modules(fqns: Sequence[str], groups: Sequence[Any], device: torch.device) -> None:
    """Refuse, on every rank, when the ranks of ``groups`` (a mesh's dimensions) would
    materialize different modules (some ranks built the model on the meta device, others not):
    the ranks would otherwise wait for each other's transfers forever, or train from different
    weights."""
    if not _same_everywhere(fqns, groups, device):
        raise PrepareError(
            "the ranks disagree about which modules are on the meta device (this rank: "
            f"{len(fqns)} modules); every rank must build the model the same way.",
            subject="materialize",
            hint="Build the model on the meta device on every rank, or load real weights on "
            "rank 0 and set sync_module_states=True.",
        )


def check_same_fallbacks(fqns: Sequence[str], group: Any, device: torch.device) -> None:
    """Refuse, on every rank, when the ranks disagree about which modules' init was not
    row-local (an init that does something else on some ranks): they would otherwise wait for
    each other's rows forever."""
    if not _same_everywhere(fqns, [group], device):
        shown = ", ".join(repr(f) for f in fqns[:5]) or "none"
        raise PrepareError(
            "the ranks disagree about which modules need their full parameters computed "
            f"(this rank: {len(fqns)}: {shown}); their initialization must do the same on "
            "every rank.",
            subject="materialize",
            hint="Make reset_parameters() (or your param_init_fn) independent of the rank, "
            "or set reproducible_init=False.",
        )


def broadcast_buffers(module: nn.Module, group: Any, device: torch.device) -> None:
    """Shard rank 0's buffers to the other shard ranks (non-reproducible mode seeds per rank)."""
    for buffer in module._buffers.values():
        if buffer is None or not buffer.numel():
            continue
        work = buffer
        if not buffer.is_contiguous() or buffer.device != device:
            work = buffer.to(device).contiguous()
        dist.broadcast(as_bytes(work), group=group, group_src=0)
        if work is not buffer:
            buffer.copy_(work)
