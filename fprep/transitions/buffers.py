"""init_buffers: every buffer's original dtype.

Mixed precision may cast buffers; checkpoints restore them to these dtypes, so a bf16 run still
saves a float32 ``running_mean``.
"""

from __future__ import annotations

from fprep.snapshot import clean_fqn
from fprep.state import BufferState, PrepState
from fprep.transitions._base import transition


@transition
def init_buffers(state: PrepState) -> PrepState:
    dtypes = sorted({clean_fqn(b.fqn): b.dtype for b in state.tree.buffers}.items())
    return state.replace(buffers=BufferState(dtypes=tuple(dtypes)))
