"""Tensor-parallel outputs that enter a compiled region are waited for before it, in eager.

torch's parallel styles end with an asynchronous redistribute (``RowwiseParallel``'s all-reduce
or reduce-scatter, ``ColwiseParallel``'s all-gather), so a module like the embedding returns an
``AsyncCollectiveTensor`` (or a DTensor holding one). When that value is the input of a block
compiled on its own (``compile="regional"``), AOTAutograd unwraps it with ``trigger_wait()``
before tracing and the unwrapped tensor has lost ``requires_grad``: the compiled block computes
no gradient for its input, so everything before the block (the embedding) gets zeros — an error
in DTensor's redistribute backward without data parallelism, silently wrong gradients under
FSDP2. Seen in torch 2.13.0, 2.14.1 and 2.15.0 (``tests/test_tp_compile_repro.py`` reproduces it
in plain torch; pytorch/pytorch#191113 restores the flag upstream).

Waiting in eager, right after the producing module, hands the region a plain tensor that keeps
its autograd edge; the values are the same and no data is copied (the region would wait on
first use anyway).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from torch import nn
from torch.utils._pytree import tree_map_only


class _Waited(torch.autograd.Function):
    """An async collective's result as a plain tensor; the gradient passes through."""

    @staticmethod
    def forward(ctx: Any, value: torch.Tensor) -> torch.Tensor:
        done: torch.Tensor = value.trigger_wait()  # type: ignore[attr-defined]
        return done.view_as(done)  # a fresh alias: autograd metadata goes on it, not on elem

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        return grad


def waited(value: torch.Tensor) -> torch.Tensor:
    """``value`` with no pending async collective in it (top level or a DTensor's local)."""
    from torch.distributed._functional_collectives import AsyncCollectiveTensor
    from torch.distributed.tensor import DTensor

    if isinstance(value, AsyncCollectiveTensor):
        result: torch.Tensor = _Waited.apply(value)  # type: ignore[no-untyped-call]
        return result
    if isinstance(value, DTensor) and isinstance(value._local_tensor, AsyncCollectiveTensor):
        pending = value.to_local(grad_placements=value.placements)
        local = _Waited.apply(pending)  # type: ignore[no-untyped-call]
        return DTensor.from_local(
            local,
            value.device_mesh,
            value.placements,
            run_check=False,
            shape=value.shape,
            stride=value.stride(),
        )
    return value


def _wait_outputs(_: nn.Module, __: Any, output: Any) -> Any:
    return tree_map_only(torch.Tensor, waited, output)


def wait_outputs_of(model: nn.Module, fqns: Iterable[str]) -> None:
    """Each named module's outputs are waited for (a forward hook after the styles' own)."""
    for fqn in fqns:
        model.get_submodule(fqn).register_forward_hook(_wait_outputs)
