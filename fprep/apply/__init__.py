"""The imperative shell: steps that apply a validated plan with PyTorch's engines."""

from fprep.apply.connect import connect, make_connect
from fprep.apply.fast_ddp import all_reduce_gradients, fast_ddp
from fprep.apply.fp8 import fp8
from fprep.apply.materialize import materialize
from fprep.apply.place import place
from fprep.apply.precision import precision
from fprep.apply.regions import checkpoint, compile_regions, compile_whole
from fprep.apply.replicate import replicate
from fprep.apply.shard import shard
from fprep.apply.steps import Handles, Step, pipeline, step
from fprep.apply.sync import sync_module_states

__all__ = [
    "Handles",
    "Step",
    "all_reduce_gradients",
    "checkpoint",
    "compile_regions",
    "compile_whole",
    "connect",
    "fast_ddp",
    "fp8",
    "make_connect",
    "materialize",
    "pipeline",
    "place",
    "precision",
    "replicate",
    "shard",
    "step",
    "sync_module_states",
]
