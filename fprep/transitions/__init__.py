"""The planning transitions, each ``PrepState -> Result[PrepState, PrepError]``: the design's
ten, ``init_pipeline`` (pipeline parallelism, pp > 1) and ``init_expert_parallel`` (expert
parallelism, ep > 1)."""

from fprep.transitions._base import Transition, transition
from fprep.transitions.buffers import init_buffers
from fprep.transitions.core import init_core
from fprep.transitions.device import init_device
from fprep.transitions.expert_parallel import init_expert_parallel
from fprep.transitions.extension import init_extension
from fprep.transitions.ignored import init_ignored
from fprep.transitions.param_handles import init_param_handles
from fprep.transitions.pipeline import init_pipeline
from fprep.transitions.prefetching import init_prefetching
from fprep.transitions.process_group import init_process_group
from fprep.transitions.runtime import init_runtime
from fprep.transitions.state_dict import init_state_dict

__all__ = [
    "Transition",
    "init_buffers",
    "init_core",
    "init_device",
    "init_expert_parallel",
    "init_extension",
    "init_ignored",
    "init_param_handles",
    "init_pipeline",
    "init_prefetching",
    "init_process_group",
    "init_runtime",
    "init_state_dict",
    "transition",
]
