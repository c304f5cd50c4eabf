"""init_state_dict: how checkpoints are written and read, and what this rank reads of the
pretrained weights (``PrepConfig.weights``).

Sharded (the default) writes each rank's shards through torch.distributed.checkpoint and can be
read back at another world size. Full gathers on rank 0 only (to CPU) and, when loading, reads on
rank 0 and broadcasts: the one way to get the same weights for every world size.

Pretrained weights are matched against the model here, from the files' headers alone (read into
``state.inputs.weights`` while planning): missing or unexpected keys, shapes and dtypes that do
not fit fail the plan before anything happens to the model (see ``fprep.weights.plan``).
"""

from __future__ import annotations

from fprep.errors import ConfigError
from fprep.layout.placements import StridedShard
from fprep.state import PrepState, StateDictState, need
from fprep.transitions._base import transition
from fprep.weights.blocks import tp_weights
from fprep.weights.plan import plan_weights
from fprep.weights.records import WeightsPlan


def _weights(state: PrepState, sharded: bool) -> WeightsPlan | None:
    cfg, snapshot = state.config, state.inputs.weights
    if cfg.weights is None:
        return None
    if snapshot is None:
        raise ConfigError(
            "PrepConfig.weights is set, but the plan holds no snapshot of its files.",
            subject="weights",
            hint="Plan with fprep.plan / fprep.initial_state, which read the files' headers.",
        )
    pg = need(state.process_group, "init_process_group", "init_state_dict")
    ignored = need(state.ignored, "init_ignored", "init_state_dict")
    shard = (pg.shard_size, pg.shard_rank) if sharded else None
    plan = plan_weights(
        state.tree,
        snapshot,
        extra_keys=cfg.weights_extra_keys,
        missing_keys=cfg.weights_missing_keys,
        whole=ignored.params,
        shard=shard,
        other_stages=_other_stages(state),
    )
    tps = state.tensor_parallel
    if tps is None:
        return plan
    packed = [fqn for fqn, placement in tps.placements if isinstance(placement, StridedShard)]
    if packed:
        raise ConfigError(
            f"weights= with tp={tps.size}: {packed[0]!r} is packed (its halves each cut on their "
            "own over the tp ranks), which fprep does not read from a file yet.",
            subject="weights",
            hint="Load them at tp=1 (fsdp shards them without tp), or build the model with "
            "from_pretrained and prepare it without weights= (prepare lays the values out).",
        )
    return tp_weights(plan, snapshot, dict(tps.params), tps.size, tps.rank, shard)


def _other_stages(state: PrepState) -> frozenset[str]:
    """Under pipeline parallelism: the names of the tensors other stages hold (their ranks
    read them; this one leaves them in the files)."""
    plan = state.pipeline
    return frozenset() if plan is None else frozenset(plan.elsewhere(state.tree))


@transition
def init_state_dict(state: PrepState) -> PrepState:
    core = need(state.core, "init_core", "init_state_dict")
    cfg = state.config
    full = cfg.state_dict_type == "full"
    distributed = need(
        state.process_group, "init_process_group", "init_state_dict"
    ).mesh.is_distributed
    return state.replace(
        state_dict=StateDictState(
            type=cfg.state_dict_type,
            cpu_offload=full,
            full_on_rank0_only=full and distributed,
            broadcast_from_rank0=distributed and (full or cfg.sync_module_states),
            weights=_weights(state, core.is_sharded),
        )
    )
