"""init_process_group: the N-D mesh as one record, and who shards with whom (no process group).

The transition checks the topology, the config and any mesh or process group the user passed,
then describes the mesh once as a ``MeshPlan`` (fprep.layout.mesh): the named dimensions
``(pp, dp_replicate, dp_shard, tp)``, row-major like ``init_device_mesh``. Every field of
``ProcessGroupState`` is read from that record. For a 1-D world every rank shards with every
other. For hybrid sharding (``hsdp``) rank ``r`` shards with the ranks of its row (one node by
default) and replicates with those of its column. Under tensor parallelism the tp dimension is
innermost, so each tp group is a run of neighbouring ranks and the data-parallel peers of a rank
are those with its tp coordinate. Under pipeline parallelism pp is outermost: each pipeline
rank's block of ranks is contiguous, and data-parallel peers also share the pp coordinate.
Under expert parallelism (``PrepConfig.ep > 1``) the record gains its ep view, borrowed from
``dp_shard x tp``; an ep that does not divide those ranks is refused here, as are the
parallelisms ep does not compose with yet (``init_expert_parallel`` plans the experts).
"""

from __future__ import annotations

import dataclasses

from fprep.errors import ConfigError, TopologyError
from fprep.layout.mesh import DP_MESH_NAMES, HSDP_MESH_NAMES, MeshPlan
from fprep.state import MeshSpec, PrepState, ProcessGroupState
from fprep.transitions._base import transition
from fprep.transitions.expert_parallel import refuse_not_composed

HSDP_DIM_NAMES = HSDP_MESH_NAMES
DP_DIM_NAMES = DP_MESH_NAMES


def gradient_divide_factors(world_size: int) -> tuple[float, float]:
    """Split 1/world into a pre- and post-reduction factor (keeps fp16 sums in range).

    FSDP's rule: double ``f`` from 1 while it divides the world and ``world / f > f``; gradients
    are divided by ``f`` before the reduction and by ``world / f`` after it.
    """
    factor = 1
    while world_size % factor == 0 and world_size / factor > factor:
        factor *= 2
    return float(factor), world_size / factor


def hybrid_groups(
    world_size: int, shard_size: int
) -> tuple[tuple[tuple[int, ...], ...], tuple[tuple[int, ...], ...]]:
    """All shard groups (rows) and replicate groups (columns) of a row-major 2-D mesh."""
    mesh = MeshPlan(
        world_size=world_size,
        rank=0,
        dp_replicate=world_size // shard_size,
        dp_shard=shard_size,
        dp_mesh_names=HSDP_MESH_NAMES,
    )
    return mesh.all_groups("dp_shard"), mesh.all_groups("dp_replicate")


def _with_ep(mesh: MeshPlan, ep: int) -> MeshPlan:
    """The record with its expert-parallel view: ``ep`` ranks borrowed from dp_shard x tp."""
    if ep == 1:
        return mesh
    if mesh.world_size == 1:
        raise ConfigError(
            f"PrepConfig.ep={ep} needs {ep} processes (or a multiple), but this is one "
            "process: the script was started with plain python, not through a launcher.",
            subject="ep",
            hint=f"Launch it with torchrun, one process per device: torchrun --nproc-per-node "
            f"{ep} train.py (or a multiple of {ep}).",
        )
    borrowed = mesh.dp_shard * mesh.tp
    if borrowed % ep:
        sizes = f"dp_shard x tp = {mesh.dp_shard} x {mesh.tp}"
        raise ConfigError(
            f"PrepConfig.ep={ep} does not divide the {borrowed} ranks it borrows from "
            f"({sizes}, the mesh {mesh.describe()} over {mesh.world_size} processes): each "
            "expert-parallel group is a run of ranks that shard the same data-parallel replica.",
            subject="ep",
            hint=f"Choose ep among the divisors of {borrowed} "
            f"({', '.join(str(d) for d in range(1, borrowed + 1) if borrowed % d == 0)}).",
        )
    return dataclasses.replace(mesh, ep=ep)


def _state_of(mesh: MeshPlan, ep: int = 1) -> ProcessGroupState:
    """The process-group state read from the mesh record (with its ep view)."""
    mesh = _with_ep(mesh, ep)
    pre, post = gradient_divide_factors(mesh.dp_size)
    return ProcessGroupState(
        mesh=mesh, gradient_predivide_factor=pre, gradient_postdivide_factor=post
    )


def _from_mesh(
    mesh: MeshSpec, rank: int, world: int, strategy: str, shard_size: int | None = None
) -> MeshPlan:
    """The record of a mesh the user passed: its own ranks and names, checked against the world."""
    hybrid = strategy == "hsdp"
    want = 2 if hybrid else 1
    if mesh.ndim != want:
        raise TopologyError(
            f"strategy {strategy!r} needs a {want}-D mesh; "
            f"got a {mesh.ndim}-D mesh of shape {mesh.shape}.",
            subject="mesh",
            hint="For hsdp pass a (replicate, shard) mesh; otherwise a 1-D data-parallel mesh "
            "(slice it from a larger mesh by name, e.g. mesh['dp']).",
        )
    root_size = 1
    for d in mesh.root_shape or mesh.shape:
        root_size *= d
    if root_size != world:
        raise TopologyError(
            f"the mesh covers {root_size} ranks but the world size is {world}.",
            subject="mesh",
            hint="Build the mesh over every rank of the job (init_device_mesh with the world).",
        )
    ranks = mesh.ranks or tuple(range(mesh.size))
    if (
        len(ranks) != mesh.size
        or len(set(ranks)) != len(ranks)
        or any(not 0 <= r < world for r in ranks)
    ):
        raise TopologyError(
            f"the mesh of shape {mesh.shape} lists ranks {ranks}: it needs {mesh.size} distinct "
            f"ranks below the world size {world}.",
            subject="mesh",
        )
    if rank not in ranks:
        raise TopologyError(
            f"rank {rank} is not a member of the mesh {ranks}.",
            subject="mesh",
            hint="Pass each rank the mesh it belongs to.",
        )
    if hybrid and shard_size is not None and mesh.shape[1] != shard_size:
        raise TopologyError(
            f"hsdp_shard_size={shard_size} contradicts the mesh's shard dimension "
            f"{mesh.shape[1]} (shape {mesh.shape}, dims (replicate, shard)).",
            subject="hsdp_shard_size",
            hint="Leave hsdp_shard_size unset when passing a mesh.",
        )
    if mesh.dim_names is not None and len(mesh.dim_names) != mesh.ndim:
        raise TopologyError(
            f"the mesh of shape {mesh.shape} names {len(mesh.dim_names)} dimensions "
            f"{mesh.dim_names}.",
            subject="mesh",
            hint="Give one name per mesh dimension, as DeviceMesh.mesh_dim_names does.",
        )
    names = mesh.dim_names or (HSDP_DIM_NAMES if hybrid else DP_DIM_NAMES)
    return MeshPlan(
        world_size=world,
        rank=rank,
        dp_replicate=mesh.shape[0] if hybrid else 1,
        dp_shard=mesh.shape[-1],
        ranks=ranks,
        dp_mesh_names=names,
    )


TP_DIM_NAME = "tp"


def _model_parallel_name(state: PrepState) -> str:
    """The config field that asks for a model-parallel mesh (for error messages)."""
    cfg = state.config
    return "tp" if cfg.tp > 1 else "pp"


def _beside_model_parallel(state: PrepState) -> MeshPlan:
    """The N-D mesh ``(pp, dp_replicate, dp_shard, tp)`` over the world: pp outermost, tp
    innermost, so each tp group is a run of neighbouring ranks (inside a node when tp divides
    the processes per node) and each pipeline stage's ranks are a contiguous block. This rank's
    data-parallel peers are those with its pp and tp coordinates."""
    topo, cfg = state.topology, state.config
    world, rank, tp, pp = topo.world_size, topo.rank, cfg.tp, cfg.pp
    name = _model_parallel_name(state)
    asked = " x ".join(f"{n}={v}" for n, v in (("pp", pp), ("tp", tp)) if v > 1)
    if state.inputs.mesh is not None or state.inputs.process_group is not None:
        raise ConfigError(
            f"PrepConfig.{asked}: fprep builds the N-D mesh itself; a mesh or process group "
            "was also given.",
            subject=name,
            hint="Pass neither (fprep lays out (pp, dp..., tp) from the world), or set "
            f"{name}=1 and apply that parallelism yourself.",
        )
    model_parallel = pp * tp
    if world == 1:
        raise ConfigError(
            f"PrepConfig.{asked} needs {model_parallel} processes (or a multiple), but this is "
            "one process: the script was started with plain python, not through a launcher.",
            subject=name,
            hint=f"Launch it with torchrun, one process per device: torchrun "
            f"--nproc-per-node {model_parallel} train.py (or a multiple of {model_parallel}; "
            "'fprep env' shows the topology each process sees).",
        )
    if world % model_parallel:
        raise ConfigError(
            f"PrepConfig.{asked} does not divide the world size {world}: the product of the "
            f"mesh dims (pp x data-parallel x tp) must equal the world size.",
            subject=name,
            hint=f"Choose {name} among the divisors of {world}."
            if pp == 1 or tp == 1
            else f"Choose pp and tp whose product (here {model_parallel}) divides {world}.",
        )
    dp = world // model_parallel
    if cfg.strategy == "hsdp":
        shard = cfg.hsdp_shard_size or max(1, topo.local_world_size // tp)
        if dp % shard:
            raise ConfigError(
                f"hsdp shards over groups of {shard} ranks, which does not divide the "
                f"{dp} data-parallel ranks (world {world} / {asked.replace('=', ' ')}).",
                subject="hsdp_shard_size",
                hint="Choose hsdp_shard_size as a divisor of the data-parallel ranks.",
            )
        return MeshPlan(
            world_size=world,
            rank=rank,
            pp=pp,
            dp_replicate=dp // shard,
            dp_shard=shard,
            tp=tp,
            dp_mesh_names=HSDP_DIM_NAMES,
        )
    return MeshPlan(world_size=world, rank=rank, pp=pp, dp_shard=dp, tp=tp)


@transition
def init_process_group(state: PrepState) -> PrepState:
    topo, cfg = state.topology, state.config
    group, mesh = state.inputs.process_group, state.inputs.mesh
    world, rank = topo.world_size, topo.rank
    hybrid = cfg.strategy == "hsdp"
    if cfg.ep > 1:
        refuse_not_composed(cfg)
        if group is not None or mesh is not None:
            raise ConfigError(
                f"PrepConfig.ep={cfg.ep}: fprep builds the expert-parallel groups itself; a "
                "mesh or process group was also given.",
                subject="ep",
                hint="Pass neither (fprep borrows the ep ranks from the world), or set ep=1.",
            )
    if group is not None and mesh is not None:
        raise TopologyError(
            "both a process group and a device mesh were given.",
            subject="process_group",
            hint="Pass only one: the mesh (preferred) or the process group.",
        )
    if world % topo.local_world_size != 0:
        raise TopologyError(
            f"the world size {world} is not divisible by local_world_size "
            f"{topo.local_world_size} (processes per node); nodes must be equal.",
            subject="local_world_size",
            hint="Launch the same number of processes on every node.",
        )
    if cfg.tp > 1 or cfg.pp > 1:
        return state.replace(process_group=_state_of(_beside_model_parallel(state), cfg.ep))
    if mesh is not None:
        layout = _from_mesh(mesh, rank, world, cfg.strategy, cfg.hsdp_shard_size)
        return state.replace(process_group=_state_of(layout, cfg.ep))
    if group is not None:
        if hybrid:
            raise TopologyError(
                "hsdp needs two groups (replicate x shard) but one process group was given.",
                subject="process_group",
                hint="Pass a 2-D DeviceMesh with dims ('replicate', 'shard'), or nothing and "
                "fprep builds it from hsdp_shard_size.",
            )
        ranks = group.ranks or tuple(range(group.size))
        if (
            len(ranks) != group.size
            or len(set(ranks)) != len(ranks)
            or any(not 0 <= r < world for r in ranks)
            or not 0 <= group.rank < group.size
            or ranks[group.rank] != rank
        ):
            raise TopologyError(
                f"the process group snapshot is inconsistent with rank {rank} of {world}: "
                f"size {group.size}, rank {group.rank}, ranks {ranks}.",
                subject="process_group",
                hint="Pass this rank's own group: distinct global ranks below the world size, "
                "with ranks[group rank] == this rank.",
            )
        layout = MeshPlan(world_size=world, rank=rank, dp_shard=group.size, ranks=ranks)
        return state.replace(process_group=_state_of(layout, cfg.ep))
    if hybrid:
        shard = cfg.hsdp_shard_size or topo.local_world_size
        if world % shard != 0:
            raise TopologyError(
                f"hsdp shards over groups of {shard} ranks, which does not divide the world "
                f"size {world}.",
                subject="hsdp_shard_size",
                hint="Choose hsdp_shard_size as a divisor of the world size (by default it is "
                "the number of processes per node).",
            )
        layout = MeshPlan(
            world_size=world,
            rank=rank,
            dp_replicate=world // shard,
            dp_shard=shard,
            dp_mesh_names=HSDP_DIM_NAMES,
        )
    else:
        layout = MeshPlan(world_size=world, rank=rank, dp_shard=world)
    return state.replace(process_group=_state_of(layout, cfg.ep))
