"""Topology: who this process is in the job, as plain data.

Built explicitly (``Topology(world_size=1024, rank=3)``, to plan for a cluster you do not have) or
read from a launcher's environment (``Topology.from_env()``: torchrun, or MPI as the Gaudi stack
launches it). Reading it never touches a process group.
"""

from __future__ import annotations

import importlib.util
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Literal

import torch

from fprep.errors import TopologyError

DeviceType = Literal["cpu", "cuda", "hpu", "xpu", "mps"]
DEVICE_TYPES: tuple[str, ...] = ("cpu", "cuda", "hpu", "xpu", "mps")

#: Launcher variables, in order of preference: (world size, rank, local rank, local world size).
_LAUNCHER_VARS: tuple[tuple[str, tuple[str, str, str, str]], ...] = (
    ("torchrun", ("WORLD_SIZE", "RANK", "LOCAL_RANK", "LOCAL_WORLD_SIZE")),
    (
        "mpi",
        (
            "OMPI_COMM_WORLD_SIZE",
            "OMPI_COMM_WORLD_RANK",
            "OMPI_COMM_WORLD_LOCAL_RANK",
            "OMPI_COMM_WORLD_LOCAL_SIZE",
        ),
    ),
    ("mpi", ("PMI_SIZE", "PMI_RANK", "MPI_LOCALRANKID", "MPI_LOCALNRANKS")),
)

#: Every variable a launcher sets that fprep reads: the ones above and the rendezvous address.
LAUNCHER_VARIABLES: tuple[str, ...] = (
    *(name for _, names in _LAUNCHER_VARS for name in names),
    "MASTER_ADDR",
    "MASTER_PORT",
)

#: The process-group backend each device type uses by default.
DEFAULT_BACKEND: Mapping[str, str] = {
    "cpu": "gloo",
    "cuda": "nccl",
    "hpu": "hccl",
    "xpu": "xccl",
    "mps": "gloo",
}


def detect_device_type() -> str:
    """The accelerator this process would train on, or ``"cpu"``; imports nothing heavy.

    Gaudi is recognised by the presence of ``habana_frameworks`` without importing it (importing
    it registers devices and backends, an effect that belongs to the prepare steps).
    """
    acc = torch.accelerator.current_accelerator() if torch.accelerator.is_available() else None
    if acc is not None and acc.type in DEVICE_TYPES:
        return acc.type
    if importlib.util.find_spec("habana_frameworks") is not None:
        return "hpu"
    return "cpu"


@dataclass(frozen=True, kw_only=True)
class Topology:
    """World size, rank and node layout of one process.

    ``local_world_size`` (processes per node) defaults to the whole world on one node;
    ``local_rank`` defaults to ``rank % local_world_size``.
    """

    world_size: int = 1
    rank: int = 0
    local_rank: int = field(default=-1)
    local_world_size: int = field(default=-1)
    device_type: str = "cpu"
    backend: str | None = None
    launcher: str = "explicit"

    def __post_init__(self) -> None:
        for name in ("world_size", "rank", "local_rank", "local_world_size"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool):
                raise TopologyError(f"Topology.{name} must be an int; got {value!r}.", subject=name)
        if self.world_size < 1:
            raise TopologyError(
                f"Topology.world_size must be >= 1; got {self.world_size}.", subject="world_size"
            )
        if not 0 <= self.rank < self.world_size:
            raise TopologyError(
                f"Topology.rank must be in [0, {self.world_size}); got {self.rank}.",
                subject="rank",
            )
        if self.local_world_size == -1:
            object.__setattr__(self, "local_world_size", self.world_size)
        if not 1 <= self.local_world_size <= self.world_size:
            raise TopologyError(
                f"Topology.local_world_size must be in [1, {self.world_size}]; "
                f"got {self.local_world_size}.",
                subject="local_world_size",
            )
        if self.local_rank == -1:
            object.__setattr__(self, "local_rank", self.rank % self.local_world_size)
        if not 0 <= self.local_rank < self.local_world_size:
            raise TopologyError(
                f"Topology.local_rank must be in [0, {self.local_world_size}); "
                f"got {self.local_rank}.",
                subject="local_rank",
            )
        if self.device_type not in DEVICE_TYPES:
            raise TopologyError(
                f"Topology.device_type must be one of {', '.join(DEVICE_TYPES)}; "
                f"got {self.device_type!r}.",
                subject="device_type",
            )

    @property
    def num_nodes(self) -> int:
        """Nodes in the job (``world_size / local_world_size``; the plan checks it divides)."""
        return self.world_size // self.local_world_size

    @property
    def node_rank(self) -> int:
        return self.rank // self.local_world_size

    @property
    def is_distributed(self) -> bool:
        return self.world_size > 1

    @property
    def default_backend(self) -> str:
        return self.backend or DEFAULT_BACKEND[self.device_type]

    @classmethod
    def from_env(
        cls, env: Mapping[str, str] | None = None, *, device_type: str | None = None
    ) -> Topology:
        """Read the launcher's variables (torchrun, then Open MPI, then MPICH/Intel MPI).

        With none set this is a single process. A variable that is set but not an integer is a
        ``TopologyError`` naming it.
        """
        env = os.environ if env is None else env
        dev = device_type or detect_device_type()
        for launcher, names in _LAUNCHER_VARS:
            if names[0] not in env:
                continue
            values: list[int] = []
            for name in names:
                raw = env.get(name)
                if raw is None:
                    values.append(-1)
                    continue
                try:
                    values.append(int(raw))
                except ValueError:
                    raise TopologyError(
                        f"Environment variable {name}={raw!r} is not an integer.",
                        subject=name,
                        hint="Launch with torchrun (or mpirun), or unset the variable.",
                    ) from None
            world, rank, local_rank, local_world = values
            if rank < 0 and world > 1:
                raise TopologyError(
                    f"{names[0]}={world} is set but {names[1]} is not.",
                    subject=names[1],
                    hint="Every process needs its own rank: launch with torchrun or mpirun.",
                )
            return cls(
                world_size=world,
                rank=max(rank, 0),
                local_rank=local_rank,
                local_world_size=local_world,
                device_type=dev,
                launcher=launcher,
            )
        return cls(device_type=dev, launcher="none")
