"""Per-rank memory estimate from a plan: parameters, gradients, optimizer state, in bytes.

Counts what the engines allocate for the planned dtypes: FSDP2 keeps the padded dim-0 shard of
each parameter (on the host with CPU offload) and gradients and optimizer state at the unpadded
local shard shape; DDP and fast_ddp keep everything whole (DDP adds its gradient buckets,
fast_ddp its fused buffer). The transient all-gather of the largest unit (in the compute dtype)
is reported separately. Asked for (``async_checkpoint=True``), the host memory that asynchronous
checkpoint saves keep for their staged copy of this rank's state (``checkpoint_staging``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from fprep.errors import ConfigError, need
from fprep.snapshot import dtype_bytes

if TYPE_CHECKING:  # a plan's reader, below the state it reads: no import of it at run time
    from fprep.state import PrepState


@dataclass(frozen=True, kw_only=True)
class MemoryEstimate:
    """Bytes per rank by what holds them (``estimate_memory``'s answer)."""

    params: int
    grads: int
    adam: int  # Adam / AdamW: two states per trainable element
    sgd_momentum: int  # SGD with momentum: one state per trainable element
    largest_unit_unsharded: int  # transient all-gather of the biggest unit
    fused_grad_buffer: int  # fast_ddp's flat all-reduce buffer
    ddp_buckets: int  # DDP's gradient buckets (a second copy unless gradient_as_bucket_view)
    on_host: bool  # parameters, gradients and optimizer state live in host memory (offload)
    # fprep.save(wait=False)'s staging buffers: this rank's unpadded shards, in host memory
    staged_params: int = 0  # (only with estimate_memory(..., async_checkpoint=True))

    @property
    def comm_buffers(self) -> int:
        return self.fused_grad_buffer + self.ddp_buckets

    def total(self, optimizer: str = "adam") -> int:
        """Steady-state bytes with an optimizer: "adam"/"adamw", "sgd_momentum" or "sgd"."""
        return self.params + self.grads + self._states(optimizer) + self.comm_buffers

    def checkpoint_staging(self, optimizer: str = "adam") -> int:
        """Host bytes an asynchronous save may stage (parameters and optimizer state: at most
        this; only what the background has not written by the next optimizer step), kept and
        reused from one save to the next (0 unless estimated with ``async_checkpoint``)."""
        return self.staged_params + (self._states(optimizer) if self.staged_params else 0)

    def _states(self, optimizer: str) -> int:
        states = {
            "adam": self.adam,
            "adamw": self.adam,
            "sgd_momentum": self.sgd_momentum,
            "sgd": 0,
        }
        if optimizer not in states:
            raise ConfigError(
                f"unknown optimizer {optimizer!r} for the memory estimate.",
                subject="optimizer",
                hint=f"Use one of {', '.join(map(repr, states))}.",
            )
        return states[optimizer]


def estimate_memory(state: PrepState, *, async_checkpoint: bool = False) -> MemoryEstimate:
    """This rank's bytes of parameters, gradients and optimizer state under the plan."""
    handles = need(state.param_handles, "init_param_handles", "estimate_memory")
    core = need(state.core, "init_core", "estimate_memory")
    runtime = need(state.runtime, "init_runtime", "estimate_memory")
    params = grads = trainable = largest = fused = staged = 0
    compute = core.precision.param_dtype
    for unit in handles.units:
        unsharded = 0
        for p in unit.params:
            size = dtype_bytes(p.dtype)
            params += p.padded_numel * size
            staged += p.local_numel * size
            if p.requires_grad:
                # FSDP2 allocates gradients (and optimizer state) at the unpadded local shape
                grads += p.local_numel * size
                trainable += p.local_numel * size
                if runtime.fast_ddp_dtype is not None:
                    fused += p.numel * dtype_bytes(runtime.fast_ddp_dtype)
            # FSDP2 gathers a parameter's tensor-parallel block, not the whole tensor
            unsharded += p.gathered_numel * dtype_bytes(compute or p.dtype)
        if core.is_sharded:
            largest = max(largest, unsharded)
    for p in handles.ignored:
        params += p.numel * dtype_bytes(p.dtype)
        staged += p.numel * dtype_bytes(p.dtype)
        if p.requires_grad:
            grads += p.numel * dtype_bytes(p.dtype)
            trainable += p.numel * dtype_bytes(p.dtype)
    return MemoryEstimate(
        params=params,
        grads=grads,
        adam=2 * trainable,
        sgd_momentum=trainable,
        largest_unit_unsharded=largest,
        fused_grad_buffer=fused,
        ddp_buckets=(
            grads if core.strategy == "ddp" and not state.config.ddp.gradient_as_bucket_view else 0
        ),
        on_host=core.offload == "cpu",
        staged_params=staged if async_checkpoint else 0,
    )
