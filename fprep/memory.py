"""Per-rank memory estimate from a plan: parameters, gradients, optimizer state, in bytes.

Counts what the engines allocate for the planned dtypes: FSDP2 keeps the padded dim-0 shard of
each parameter (on the host with CPU offload) and gradients and optimizer state at the unpadded
local shard shape; DDP and fast_ddp keep everything whole (DDP adds its gradient buckets,
fast_ddp its fused buffer). The transient all-gather of the largest unit (in the compute dtype)
is reported separately. Asked for (``async_checkpoint=True``), the host memory that asynchronous
checkpoint saves keep for their staged copy of this rank's state (``checkpoint_staging``).
Given a batch (``batch=(rows, seq_len)``), the activations the rank keeps for backward at its
peak: one micro-batch's per stage (``fprep.activations``) times the micro-batches the pipeline
schedule holds in flight (``fprep.layout.in_flight``); without pipeline parallelism, one
micro-batch of all the rows.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from fprep.activations import ActivationInputs, stage_activations
from fprep.errors import ConfigError, need
from fprep.layout import in_flight
from fprep.snapshot import dtype_bytes, is_within

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
    #: activations kept for backward at the peak (only with estimate_memory(..., batch=...))
    activations: int = 0
    #: the gathered (unsharded) parameters of the units below the root that stay gathered from
    #: forward to backward (``reshard_after_forward=False``: sharding="grad_op", and the default
    #: under pipeline parallelism, where every block of the rank's stages is gathered at once)
    kept_gathered: int = 0

    @property
    def comm_buffers(self) -> int:
        return self.fused_grad_buffer + self.ddp_buckets

    def total(self, optimizer: str = "adam") -> int:
        """Steady-state bytes with an optimizer: "adam"/"adamw", "sgd_momentum" or "sgd"."""
        return (
            self.params
            + self.grads
            + self._states(optimizer)
            + self.comm_buffers
            + self.activations
            + self.kept_gathered
        )

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


def estimate_memory(
    state: PrepState,
    *,
    async_checkpoint: bool = False,
    batch: tuple[int, int] | None = None,
) -> MemoryEstimate:
    """This rank's bytes of parameters, gradients and optimizer state under the plan; with
    ``batch=(rows, seq_len)`` (the rows one data-parallel rank trains per step), also the
    activations it keeps for backward at its peak."""
    handles = need(state.param_handles, "init_param_handles", "estimate_memory")
    core = need(state.core, "init_core", "estimate_memory")
    runtime = need(state.runtime, "init_runtime", "estimate_memory")
    params = grads = trainable = largest = fused = staged = kept = 0
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
            # a unit sharded over one rank is whole already; resharded ones are transient, and
            # so is the root (FSDP2 gathers it last in forward and first in backward: the
            # "largest unit gathered" line and the total's note cover it)
            if unit.fqn and unit.reshard_after_forward is False and _shard_ranks(state) > 1:
                kept += unsharded
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
        activations=activation_bytes(state, batch) if batch is not None else 0,
        kept_gathered=kept,
    )


def _shard_ranks(state: PrepState) -> int:
    pg = need(state.process_group, "init_process_group", "estimate_memory")
    return pg.shard_size


def _checked_batch(batch: tuple[int, int]) -> tuple[int, int]:
    ok = (
        isinstance(batch, tuple)
        and len(batch) == 2
        and all(isinstance(n, int) and not isinstance(n, bool) and n >= 1 for n in batch)
    )
    if not ok:
        raise ConfigError(
            f"batch={batch!r} is not (rows, sequence length): two whole numbers of at least 1.",
            subject="batch",
            hint="Pass batch=(rows per data-parallel rank, sequence length), e.g. (8, 4096).",
        )
    return batch


def _regions(state: PrepState) -> tuple[str, ...]:
    """The activation-checkpointed regions: the outermost non-root units (as the checkpoint
    step wraps them), none without activation checkpointing."""
    if not state.config.activation_checkpointing or state.param_handles is None:
        return ()
    units = [u.fqn for u in state.param_handles.units if u.fqn]
    return tuple(u for u in units if not any(o != u and is_within(u, o) for o in units))


def stage_inputs(state: PrepState, rows: int, seq_len: int) -> ActivationInputs:
    """The activation rule's inputs for a micro-batch of ``rows x seq_len`` under the plan."""
    core = need(state.core, "init_core", "estimate_memory")
    tps = state.tensor_parallel
    whole = state.pipeline.whole if state.pipeline and state.pipeline.whole else state.tree
    compute = core.precision.param_dtype or core.precision.autocast_dtype
    if compute is None:
        compute = state.tree.params[0].dtype if state.tree.params else "float32"
    return ActivationInputs(
        rows=rows,
        seq_len=seq_len,
        dtype_bytes=dtype_bytes(compute),
        tp=tps.size if tps else 1,
        styles=dict(tps.modules) if tps else {},
        sequence_parallel=bool(tps) and state.config.sequence_parallel,
        loss_parallel=bool(tps and tps.loss_parallel),
        checkpointed=_regions(state),
        vocab=frozenset(
            p.shape[0]
            for m in whole.modules
            if m.is_a("torch.nn.modules.sparse.Embedding")
            for p in [whole.param(f"{m.fqn}.weight")]
            if p is not None and p.shape
        ),
    )


def per_stage_activations(state: PrepState, batch: tuple[int, int]) -> tuple[int, ...]:
    """Bytes one micro-batch keeps for backward in each of this rank's stages (one entry, the
    whole model with all the rows, without pipeline parallelism)."""
    rows, seq_len = _checked_batch(batch)
    pipe = state.pipeline
    if pipe is None:
        return (stage_activations(state.tree, ("",), stage_inputs(state, rows, seq_len)),)
    if rows < pipe.microbatches:
        raise ConfigError(
            f"batch={batch!r}: {rows} rows cannot make {pipe.microbatches} micro-batches "
            "(pp_microbatches): some would be empty.",
            subject="batch",
            hint=f"Use at least {pipe.microbatches} rows per data-parallel rank, or fewer "
            "micro-batches.",
        )
    rows_per_microbatch = -(-rows // pipe.microbatches)  # torch.tensor_split's largest chunk
    inputs = stage_inputs(state, rows_per_microbatch, seq_len)
    return tuple(stage_activations(state.tree, pipe.split[k], inputs) for k in pipe.stages)


def activation_bytes(state: PrepState, batch: tuple[int, int]) -> int:
    """The activations this rank keeps for backward at its peak, for ``batch``."""
    per_stage = per_stage_activations(state, batch)
    pipe = state.pipeline
    if pipe is None:
        return per_stage[0]
    return in_flight.peak_activations(
        pipe.schedule, pipe.size, pipe.rank, pipe.microbatches, per_stage
    )
