"""init_extension: the dimensions beyond data parallelism that fprep plans: tensor parallelism
(``PrepConfig.tp``, see ``tensor_parallel``).

The mesh itself (every dimension, this rank's place, its groups) is ``init_process_group``'s
record; this transition only decides what runs on its non-data-parallel dimensions. A
data-parallel mesh the user sliced from a larger one needs nothing here: its own ranks are in
the record.
"""

from __future__ import annotations

from fprep.state import ExtensionState, PrepState, need
from fprep.transitions._base import transition
from fprep.transitions.tensor_parallel import plan_tensor_parallel


@transition
def init_extension(state: PrepState) -> PrepState:
    pg = need(state.process_group, "init_process_group", "init_extension")
    ignored = need(state.ignored, "init_ignored", "init_extension")
    tp = plan_tensor_parallel(state, pg, ignored)
    return state.replace(extension=ExtensionState(tensor_parallel=tp))
