"""Loop helpers for tensor parallelism: vocabulary-parallel loss.

With the ``colwise_loss_parallel`` style on the output head the logits stay a DTensor sharded
on the vocabulary: each tp rank holds ``vocab / tp`` columns, and cross-entropy must run under
torch's ``loss_parallel()`` (it reduces the softmax across the tp ranks instead of gathering the
logits). ``fprep.loss_parallel(state)`` is that context when the plan keeps the logits sharded
and does nothing otherwise, so one loop serves every layout.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

from fprep.state import PrepState


def uses_loss_parallel(state: PrepState) -> bool:
    """Whether the output is a vocabulary-sharded DTensor (the loss must be parallel)."""
    tps = state.tensor_parallel
    return tps is not None and tps.loss_parallel


@contextlib.contextmanager
def loss_parallel(state: PrepState) -> Iterator[None]:
    """Compute (and backpropagate) the loss inside this block::

    with fprep.loss_parallel(state):
        loss = F.cross_entropy(logits.flatten(0, 1), targets.flatten())
        fprep.backward(state, model, loss)
    """
    if not uses_loss_parallel(state):
        yield
        return
    from torch.distributed.tensor.parallel import loss_parallel as torch_loss_parallel

    with torch_loss_parallel():
        yield
