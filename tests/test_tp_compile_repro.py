"""torch bugs behind fprep's compile handling under tensor parallelism, reproduced in plain
torch (no fprep), so that the test fails the day torch fixes them and the workaround (or the
refusal) can go.

1. A compiled region drops the gradient of an input that is an ``AsyncCollectiveTensor`` — what
   ``DTensor.to_local()`` returns after torch's parallel styles redistribute asynchronously (the
   embedding's output entering the first block under ``compile="regional"``). AOTAutograd
   unwraps it with ``trigger_wait()``, which returns the inner tensor without ``requires_grad``:
   the input's gradient is zeros. torch 2.13.0, 2.14.1, 2.15.0; pytorch/pytorch#191113 fixes it
   upstream. fprep waits in eager before the region (``fprep.apply.async_outputs``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch.distributed._functional_collectives import AsyncCollectiveTensor

from fprep.apply.async_outputs import waited


class _ToLocal(torch.autograd.Function):
    """What ``DTensor.to_local()`` returns after an asynchronous redistribute: an
    ``AsyncCollectiveTensor`` output of an autograd function (the gradient passes through)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        return AsyncCollectiveTensor(x.detach().clone())

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        return grad


def _scaled(t: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return (t * w).sum()


def _grad_of_input(
    fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
    before: Callable[[torch.Tensor], torch.Tensor] = lambda t: t,
) -> torch.Tensor:
    x = torch.ones(4, requires_grad=True)
    w = torch.full((4,), 3.0, requires_grad=True)
    fn(before(_ToLocal.apply(x)), w).backward()
    assert x.grad is not None
    return x.grad


def test_torch_compiled_region_drops_the_gradient_of_an_async_collective_input() -> None:
    """Still broken in this torch: if this fails, torch fixed it — check the versions and let
    fprep.apply.async_outputs go for them (docs/parallelism.md)."""
    torch._dynamo.reset()
    expected = torch.full((4,), 3.0)
    assert torch.equal(_grad_of_input(_scaled), expected)  # eager
    compiled = torch.compile(_scaled, backend="aot_eager")
    assert torch.equal(_grad_of_input(compiled), torch.zeros(4)), torch.__version__


def test_waiting_before_the_region_keeps_the_gradient() -> None:
    """fprep's workaround: the same compiled region, its input waited for in eager first."""
    torch._dynamo.reset()
    compiled = torch.compile(_scaled, backend="aot_eager")
    assert torch.equal(_grad_of_input(compiled, waited), torch.full((4,), 3.0))
    value = _ToLocal.apply(torch.ones(2, requires_grad=True))
    plain = waited(value)
    assert type(plain) is torch.Tensor and plain.requires_grad and torch.equal(plain, value)
    assert waited(plain) is plain  # nothing pending: unchanged
