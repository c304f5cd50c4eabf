"""replicate: DistributedDataParallel with the planned options and communication hook.

torch refuses ``bf16_compress_hook`` by name on gloo; ``bf16_compress_allreduce`` below does the
same work (cast to bf16, all-reduce, cast back) and gloo accepts it, so bf16 compression works on
CPU too.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from fprep.apply.steps import handles_of, skipped, step
from fprep.compat import ddp_buffer_kwargs
from fprep.state import PrepState, need


def bf16_compress_allreduce(
    process_group: dist.ProcessGroup | None, bucket: Any
) -> torch.futures.Future[torch.Tensor]:
    """Average a gradient bucket in bfloat16 (the gloo-compatible bf16 compression hook)."""
    group = process_group if process_group is not None else dist.group.WORLD
    buffer = bucket.buffer()
    compressed = buffer.to(torch.bfloat16).div_(dist.get_world_size(group))
    work: Any = dist.all_reduce(compressed, group=group, async_op=True)
    future: torch.futures.Future[Any] = work.get_future()

    def decompress(fut: torch.futures.Future[Any]) -> torch.Tensor:
        out: torch.Tensor = buffer.copy_(fut.value()[0])
        return out

    return future.then(decompress)


# DDP's register_comm_hook accepts a hook whose annotations are absent or exactly
# ``dist.GradBucket`` / ``Future[Tensor]``; under ``from __future__ import annotations`` they are
# strings, which it refuses ("bucket annotation should be dist.GradBucket"). Drop them at runtime
# (the static ones above stay for type checkers).
bf16_compress_allreduce.__annotations__ = {}


def register_comm_hook(ddp: Any, hook: str, group: Any, rank: int, start_iter: int) -> None:
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook

    if hook == "fp16":
        ddp.register_comm_hook(group, default_hooks.fp16_compress_hook)
    elif hook == "bf16":
        ddp.register_comm_hook(group, default_hooks.bf16_compress_hook)
    elif hook == "bf16_gloo":
        ddp.register_comm_hook(group, bf16_compress_allreduce)
    elif hook == "powersgd":
        ps = powerSGD_hook.PowerSGDState(
            process_group=group, matrix_approximation_rank=rank, start_powerSGD_iter=start_iter
        )
        ddp.register_comm_hook(ps, powerSGD_hook.powerSGD_hook)


@step("replicate")
def replicate(state: PrepState, model: nn.Module) -> tuple[PrepState, nn.Module]:
    core = need(state.core, "init_core", "replicate")
    if core.strategy != "ddp":
        return skipped(state, model)
    runtime = need(state.runtime, "init_runtime", "replicate")
    if not any(p.requires_grad for p in model.parameters()):
        return skipped(state, model)  # nothing to synchronize: DDP would refuse the model
    from torch.nn.parallel import DistributedDataParallel

    handles = handles_of(state)
    device = handles.device
    device_ids = [device.index] if device.type in ("cuda", "xpu") else None
    kwargs: dict[str, Any] = dict(runtime.ddp_kwargs)
    # torch 2.13 renamed broadcast_buffers to forward_sync_buffers (same meaning in forward;
    # buffers are still synced once at construction): compat picks the name this torch has.
    kwargs.update(ddp_buffer_kwargs(kwargs.pop("broadcast_buffers", True)))
    ddp = DistributedDataParallel(
        model, device_ids=device_ids, process_group=handles.process_group, **kwargs
    )
    ddp.training = model.training  # a new Module starts in training mode: keep the model's
    options = state.config.ddp
    register_comm_hook(
        ddp,
        runtime.comm_hook,
        handles.process_group,
        options.powersgd_rank,
        options.powersgd_start_iter,
    )
    return state, ddp
