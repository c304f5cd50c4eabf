"""fprep: prepare PyTorch models for distributed and mixed-precision training, functionally.

A frozen ``PrepState`` is computed by pure transitions over snapshots of the model, the topology
and the config (``fprep.plan``); effectful steps then apply it with PyTorch's own engines.
"""

from fprep.apply import Handles, Step, all_reduce_gradients, pipeline, step
from fprep.config import DDPOptions, PrepConfig
from fprep.errors import (
    ConfigError,
    DeviceError,
    IgnoredStateError,
    ModelError,
    PlanOrderError,
    PrepareError,
    PrepError,
    TopologyError,
)
from fprep.memory import MemoryEstimate, estimate_memory
from fprep.planning import DEFAULT_TRANSITIONS, chain, initial_state, plan
from fprep.prepare import backward, default_steps, prepare
from fprep.snapshot import BufferInfo, ModuleInfo, ModuleTree, ParamInfo
from fprep.state import (
    GroupSpec,
    MeshSpec,
    PrepState,
    ShardSpec,
    WrapUnit,
)
from fprep.topology import Topology
from fprep.transitions import (
    Transition,
    init_buffers,
    init_core,
    init_device,
    init_extension,
    init_ignored,
    init_param_handles,
    init_prefetching,
    init_process_group,
    init_runtime,
    init_state_dict,
    transition,
)

__version__ = "0.1.0"

__all__ = [
    "DEFAULT_TRANSITIONS",
    "BufferInfo",
    "ConfigError",
    "DDPOptions",
    "DeviceError",
    "GroupSpec",
    "Handles",
    "IgnoredStateError",
    "MemoryEstimate",
    "MeshSpec",
    "ModelError",
    "ModuleInfo",
    "ModuleTree",
    "ParamInfo",
    "PlanOrderError",
    "PrepConfig",
    "PrepError",
    "PrepState",
    "PrepareError",
    "ShardSpec",
    "Step",
    "Topology",
    "TopologyError",
    "Transition",
    "WrapUnit",
    "all_reduce_gradients",
    "backward",
    "chain",
    "default_steps",
    "estimate_memory",
    "init_buffers",
    "init_core",
    "init_device",
    "init_extension",
    "init_ignored",
    "init_param_handles",
    "init_prefetching",
    "init_process_group",
    "init_runtime",
    "init_state_dict",
    "initial_state",
    "pipeline",
    "plan",
    "prepare",
    "step",
    "transition",
]
