"""fast_ddp: data parallelism without a wrapper (optimum-habana's ``fast_ddp``).

The step broadcasts parameters and buffers once, from the data-parallel group's first rank (rank
0 of the job for the default group). After each backward, ``all_reduce_gradients(state, model)``
packs every gradient into one fused buffer (dtype from ``PrepConfig.fast_ddp_dtype``), scales it
by 1/world, all-reduces it once and unpacks it: one collective per step instead of DDP's bucketed
hooks. Parameters that got no gradient on any rank receive zeros.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from fprep.apply.steps import handles_of, skipped, step
from fprep.collectives import collective
from fprep.errors import PrepareError
from fprep.state import PrepState, need

#: Attribute ``fprep.accumulate`` sets on a fast_ddp model while gradient sync is deferred.
DEFER_SYNC_ATTR = "_fprep_defer_grad_sync"


@step("fast_ddp")
def fast_ddp(state: PrepState, model: nn.Module) -> tuple[PrepState, nn.Module]:
    core = need(state.core, "init_core", "fast_ddp")
    if core.strategy != "fast_ddp":
        return skipped(state, model)
    group = handles_of(state).process_group
    with torch.no_grad():
        for tensor in [*model.parameters(), *model.buffers()]:
            # From the group's first rank: global rank 0 is not in every data-parallel group.
            dist.broadcast(tensor, group=group, group_src=0)
    return state, model


def all_reduce_gradients(state: PrepState, model: nn.Module) -> None:
    """Average gradients across ranks with one fused all-reduce (strategy ``fast_ddp``)."""
    runtime = need(state.runtime, "init_runtime", "all_reduce_gradients")
    if runtime.fast_ddp_dtype is None or runtime.fast_ddp_scale is None:
        raise PrepareError(
            "all_reduce_gradients is for strategy 'fast_ddp'; this model was prepared with "
            f"{need(state.core, 'init_core', 'all_reduce_gradients').strategy!r}.",
            subject="strategy",
            hint="DDP and FSDP reduce gradients during backward by themselves.",
        )
    params = [p for p in model.parameters() if p.requires_grad]
    if not params:
        return
    dtype = getattr(torch, runtime.fast_ddp_dtype)
    device = params[0].device
    flat = torch.cat(
        [
            (p.grad if p.grad is not None else torch.zeros_like(p)).reshape(-1).to(dtype)
            for p in params
        ]
    ).to(device)
    flat.mul_(runtime.fast_ddp_scale)
    group = handles_of(state).process_group
    with collective("fprep.all_reduce_gradients", state.config.timeout_s, group, arrive=False):
        dist.all_reduce(flat, group=group)
    offset = 0
    for p in params:
        n = p.numel()
        chunk = flat[offset : offset + n].view_as(p)
        if p.grad is None:
            p.grad = chunk.to(p.dtype).clone()
        else:
            p.grad.copy_(chunk)
        offset += n
