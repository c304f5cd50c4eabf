"""connect: the process group and DeviceMesh the plan asks for.

An existing default process group is used as it is (its size and rank must match the plan).
Otherwise, under a launcher (torchrun or MPI variables), fprep creates it with the backend the
plan chose and ``PrepConfig.timeout_s``, over the launcher's store once every rank has reached
it (``fprep.collectives.first_contact``: a rank that never comes is named within
``min(timeout_s, FIRST_CONTACT_S)``). A single process with no launcher needs no group.
"""

from __future__ import annotations

import datetime
import os
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from fprep.apply.steps import Handles, step
from fprep.collectives import first_contact, take_contact
from fprep.devices import device_handle
from fprep.errors import PrepareError, PrepError, TopologyError
from fprep.layout.mesh import MeshPlan
from fprep.peers import clear as clear_status
from fprep.state import PrepState, need


def _device(state: PrepState) -> torch.device:
    dev = need(state.device, "init_device", "connect")
    return torch.device(dev.compute_device)


def _ensure_default_group(state: PrepState) -> bool:
    """Create the default group if needed; True when fprep created it."""
    topo = state.topology
    if dist.is_initialized():
        if (dist.get_world_size(), dist.get_rank()) != (topo.world_size, topo.rank):
            raise TopologyError(
                f"the default process group has world size {dist.get_world_size()} and rank "
                f"{dist.get_rank()}, but the plan was made for world size {topo.world_size}, "
                f"rank {topo.rank}.",
                subject="topology",
                hint="Plan with Topology.from_env() (the default) under the same launcher.",
            )
        return False
    if "MASTER_ADDR" not in os.environ or "MASTER_PORT" not in os.environ:
        raise TopologyError(
            f"the plan is for {topo.world_size} processes but no process group exists and "
            "MASTER_ADDR / MASTER_PORT are not set.",
            subject="topology",
            hint="Launch with torchrun --nproc-per-node N, or create the process group first.",
        )
    dev = need(state.device, "init_device", "connect")
    # Every rank met at the launcher's store first (prepare's plan agreement did, or we do it
    # now): a missing rank is named within min(timeout_s, FIRST_CONTACT_S), not waited for in
    # init_process_group's silence.
    store = take_contact(topo.rank, topo.world_size)
    if store is None:
        first_contact(topo.rank, topo.world_size, state.config.timeout_s)
        store = take_contact(topo.rank, topo.world_size)
    timeout = datetime.timedelta(seconds=state.config.timeout_s)
    store.set_timeout(timeout)  # as env:// would have made it (first contact waited less)
    dist.init_process_group(
        backend=dev.backend,
        store=store,
        rank=topo.rank,
        world_size=topo.world_size,
        timeout=timeout,
    )
    return True


def _build_mesh(state: PrepState, device: torch.device, user_mesh: Any, user_group: Any) -> Any:
    from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

    pg = need(state.process_group, "init_process_group", "connect")
    if user_mesh is not None:
        return user_mesh
    if user_group is not None:
        return DeviceMesh.from_group(user_group, device.type, mesh_dim_names=pg.mesh_dim_names)
    return init_device_mesh(device.type, pg.mesh_shape, mesh_dim_names=pg.mesh_dim_names)


def world_mesh_layout(record: MeshPlan) -> tuple[tuple[int, ...], tuple[str, ...]]:
    """The shape and names of the N-D DeviceMesh fprep builds under tp or pp, read from the
    mesh record: ``pp`` (when > 1), the data-parallel dims under their names, ``tp`` (when > 1).
    """
    dims = [("pp", record.pp)] if record.pp > 1 else []
    dims += zip(record.dp_mesh_names, record.dp_mesh_shape, strict=True)
    dims += [("tp", record.tp)] if record.tp > 1 else []
    return tuple(size for _, size in dims), tuple(name for name, _ in dims)


def make_connect(mesh: Any = None, process_group: Any = None) -> Any:
    """A connect step that uses the mesh or process group the caller passed to ``prepare``."""

    @step("connect")
    def connect(state: PrepState, model: nn.Module) -> tuple[PrepState, nn.Module]:
        core = need(state.core, "init_core", "connect")
        record = need(state.process_group, "init_process_group", "connect").mesh
        device = _device(state)
        handle = device_handle(device.type)
        handle.setup(distributed=record.is_distributed)  # e.g. Gaudi: hpu device, hccl backend
        if state.config.compile != "none":
            handle.check_compile()  # before any change to the model
        model_parallel = record.tp > 1 or record.pp > 1
        if not core.is_distributed and not model_parallel:
            return state.replace(handles=Handles(device=device, device_handle=handle)), model
        try:
            owns = _ensure_default_group(state)
        except (RuntimeError, ValueError) as e:
            if isinstance(e, PrepError):  # TopologyError, CollectiveError (a missing rank)
                raise
            raise PrepareError(f"creating the process group failed: {e}", subject="connect") from e
        clear_status()  # this rank takes part (again): forget an earlier "ended" or "exited"
        world_mesh = tp_mesh = pp_mesh = None
        group: Any
        if model_parallel:  # one N-D mesh (pp, dp dims..., tp); FSDP2 gets its dp sub-mesh
            from torch.distributed.device_mesh import init_device_mesh

            shape, names = world_mesh_layout(record)
            world_mesh = init_device_mesh(device.type, shape, mesh_dim_names=names)
            tp_mesh = world_mesh["tp"] if record.tp > 1 else None
            pp_mesh = world_mesh["pp"] if record.pp > 1 else None
            dp_names = record.dp_mesh_names
            dp_mesh = world_mesh[dp_names[0] if len(dp_names) == 1 else dp_names]
            mesh_obj, group = dp_mesh, dp_mesh.get_group(dp_mesh.ndim - 1)
        elif core.is_sharded:
            mesh_obj = _build_mesh(state, device, mesh, process_group)
            group = mesh_obj.get_group(mesh_obj.ndim - 1)
        else:  # DDP and fast_ddp replicate over the whole group; no mesh needed
            mesh_obj, group = None, process_group or dist.group.WORLD
        return (
            state.replace(
                handles=Handles(
                    device=device,
                    device_handle=handle,
                    mesh=mesh_obj,
                    process_group=group,
                    owns_process_group=owns,
                    tp_mesh=tp_mesh,
                    pp_mesh=pp_mesh,
                    world_mesh=world_mesh,
                )
            ),
            model,
        )

    return connect


connect = make_connect()
