"""Loop helpers for tensor parallelism: vocabulary-parallel loss, and a check that the ranks of
a tp group were given the same inputs.

With the ``colwise_loss_parallel`` style on the output head the logits stay a DTensor sharded
on the vocabulary: each tp rank holds ``vocab / tp`` columns, and cross-entropy must run under
torch's ``loss_parallel()`` (it reduces the softmax across the tp ranks instead of gathering the
logits). ``fprep.loss_parallel(state)`` is that context when the plan keeps the logits sharded
and does nothing otherwise, so one loop serves every layout.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

from torch import nn

from fprep.apply.steps import handles_of
from fprep.compat import loss_parallel_active
from fprep.errors import PrepareError
from fprep.state import PrepState
from fprep.tp_inputs import check_same_inputs


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


class LabelsNeedLossParallel:
    """A forward pre-hook on the root of a model whose logits stay vocabulary-sharded: a forward
    given ``labels=`` (a transformers model then computes its cross-entropy inside) must run
    under ``fprep.loss_parallel(state)``; otherwise a PrepareError names the fix, where torch
    would fail deep in its dispatcher."""

    def __call__(self, module: nn.Module, args: Any, kwargs: Any) -> None:
        if kwargs.get("labels") is not None and not loss_parallel_active():
            raise PrepareError(
                f"{type(module).__name__} was called with labels= (it computes its loss inside "
                "its forward), but its output head keeps the logits sharded on the vocabulary "
                "(colwise_loss_parallel): cross-entropy on them needs loss parallelism, and "
                "without it torch fails with 'got mixed torch.Tensor and DTensor'.",
                subject="labels",
                hint="Run the forward and the backward inside `with fprep.loss_parallel(state):`, "
                "or give the head colwise_gather_output instead.",
            )


def check_tp_inputs(state: PrepState, *inputs: Any, **named: Any) -> None:
    """Raise a PrepareError, on every rank, unless every rank of this rank's tensor-parallel
    group passed equal tensors (compared by a digest of names, shapes, dtypes and bits; one
    all-gather of one number). Call it on every rank, with what the model is given::

        fprep.check_tp_inputs(state, input_ids, attention_mask=mask)

    The first forward of a prepared model checks its own inputs this way; call this to check
    later batches too (a loader that changes between epochs, say). Without tensor parallelism
    it does nothing.
    """
    if state.tensor_parallel is None:
        return
    handles = handles_of(state)
    if handles.tp_mesh is None:  # planned only, never applied
        return
    check_same_inputs(
        (inputs, named),
        handles.tp_mesh.get_group(),
        handles.device,
        "fprep.check_tp_inputs",
        state.config.timeout_s,
    )
