"""``plan``: snapshot the inputs, then run the transitions in order, stopping at the first failure.

``chain`` composes transitions like optax's ``chain`` composes gradient transformations: the
result is itself a transition, so a custom plan is ``chain(*DEFAULT_TRANSITIONS, my_check)``.
"""

from __future__ import annotations

import os
from typing import Any

from returns.result import Failure, Result, Success

from fprep.config import PrepConfig
from fprep.errors import PrepError, TopologyError
from fprep.snapshot import ModuleTree
from fprep.state import GroupSpec, MeshSpec, PrepState
from fprep.topology import Topology
from fprep.transitions import (
    Transition,
    init_buffers,
    init_core,
    init_device,
    init_extension,
    init_ignored,
    init_param_handles,
    init_pipeline,
    init_prefetching,
    init_process_group,
    init_runtime,
    init_state_dict,
)
from fprep.weights.hf_conversions import with_conversions
from fprep.weights.source import snapshot as weights_snapshot

#: The default planning pipeline, in the order each transition's inputs become available.
DEFAULT_TRANSITIONS: tuple[Transition, ...] = (
    init_process_group,
    init_pipeline,
    init_ignored,
    init_device,
    init_buffers,
    init_core,
    init_runtime,
    init_extension,
    init_state_dict,
    init_param_handles,
    init_prefetching,
)


def chain(*transitions: Transition) -> Transition:
    """One transition that runs ``transitions`` in order and stops at the first failure."""

    def chained(state: PrepState) -> Result[PrepState, PrepError]:
        result: Result[PrepState, PrepError] = Success(state)
        for step in transitions:
            if isinstance(result, Failure):
                return result
            result = step(result.unwrap())
        return result

    chained.__name__ = "chain(" + ", ".join(getattr(t, "__name__", "?") for t in transitions) + ")"
    return chained


def group_spec(group: Any) -> GroupSpec:
    """Snapshot a ``torch.distributed.ProcessGroup`` (size, rank, members); no collective."""
    if isinstance(group, GroupSpec):
        return group
    try:
        import torch.distributed as dist

        return GroupSpec(
            size=group.size(),
            rank=group.rank(),
            ranks=tuple(dist.get_process_group_ranks(group)),
        )
    except Exception as e:
        raise TopologyError(
            f"cannot read process_group {group!r}: {e}.",
            subject="process_group",
            hint="Pass a torch.distributed.ProcessGroup or a fprep.GroupSpec.",
        ) from None


def mesh_spec(mesh: Any) -> MeshSpec:
    """Snapshot a ``DeviceMesh`` (shape, names, this rank's coordinate, its root mesh)."""
    if isinstance(mesh, MeshSpec):
        return mesh
    try:
        root = mesh._get_root_mesh() if hasattr(mesh, "_get_root_mesh") else mesh
        return MeshSpec(
            shape=tuple(mesh.shape),
            dim_names=tuple(mesh.mesh_dim_names) if mesh.mesh_dim_names else None,
            coordinate=tuple(mesh.get_coordinate() or ()),
            ranks=tuple(int(r) for r in mesh.mesh.flatten().tolist()),
            root_shape=tuple(root.shape),
            root_dim_names=tuple(root.mesh_dim_names) if root.mesh_dim_names else None,
        )
    except Exception as e:
        raise TopologyError(
            f"cannot read mesh {mesh!r}: {e}.",
            subject="mesh",
            hint="Pass a torch.distributed.DeviceMesh or a fprep.MeshSpec.",
        ) from None


def initial_state(
    model_or_tree: Any,
    cfg: object = None,
    topology: Topology | None = None,
    *,
    process_group: Any = None,
    mesh: Any = None,
) -> PrepState:
    """The state before any transition: snapshots of every input. Raises ``PrepError``."""
    tree = model_or_tree if isinstance(model_or_tree, ModuleTree) else ModuleTree.of(model_or_tree)
    cfg = PrepConfig() if cfg is None else cfg
    if not isinstance(cfg, PrepConfig):
        from fprep.errors import ConfigError

        raise ConfigError(
            f"expected a fprep.PrepConfig; got {type(cfg).__qualname__}.",
            subject="cfg",
            hint="Build one with fprep.PrepConfig(...) or PrepConfig.from_dict(...).",
        )
    if topology is not None and not isinstance(topology, Topology):
        raise TopologyError(
            f"expected a fprep.Topology; got {type(topology).__qualname__}.",
            subject="topology",
            hint="Build one with fprep.Topology(world_size=..., rank=...), or leave it out to "
            "read the launcher's environment (Topology.from_env()).",
        )
    weights = None if cfg.weights is None else weights_snapshot(os.fspath(cfg.weights))
    if weights is not None and not isinstance(model_or_tree, ModuleTree):
        # the checkpoint's names as transformers maps them onto this model (its MoE experts)
        weights = with_conversions(weights, model_or_tree, tree)
    return PrepState.initial(
        tree,
        cfg,
        topology if topology is not None else Topology.from_env(),
        process_group=None if process_group is None else group_spec(process_group),
        mesh=None if mesh is None else mesh_spec(mesh),
        # Headers only (the I/O of planning, like reading a mesh): checked against the model
        # by init_state_dict, read by the load_weights step.
        weights=weights,
    )


def plan(
    model_or_tree: Any,
    cfg: PrepConfig | None = None,
    topology: Topology | None = None,
    *,
    process_group: Any = None,
    mesh: Any = None,
    transitions: tuple[Transition, ...] = DEFAULT_TRANSITIONS,
) -> Result[PrepState, PrepError]:
    """Plan the preparation of a model (or a ``ModuleTree``) without touching it.

    ``topology`` defaults to the launcher's environment (``Topology.from_env()``). Pass an
    explicit one to plan for a cluster you do not have: ``Topology(world_size=1024, rank=3)``.
    Returns ``Success(PrepState)`` or ``Failure(PrepError)``; never raises ``PrepError``.
    """
    try:
        state = initial_state(model_or_tree, cfg, topology, process_group=process_group, mesh=mesh)
    except PrepError as e:
        return Failure(e)
    return chain(*transitions)(state)
