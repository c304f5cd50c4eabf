"""The two parallel styles sequence parallelism needs beyond torch's: where whole sequences
leave the sequence-sharded residual stream (a region's input) and where they enter it (an
embedding the tp plan keeps whole).

torch's ``PrepareModuleInput`` needs to be told whether the stream arrives as a positional or a
keyword argument (transformers passes ``hidden_states=`` to attention, positionally to the
MLP); ``GatherSequence`` gathers every DTensor input, however it is passed.
"""

from __future__ import annotations

from typing import Any

from torch import nn
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.parallel import ParallelStyle

SEQUENCE_DIM = 1


class GatherSequence(ParallelStyle):
    """The module's DTensor inputs (the stream, ``Shard(1)``) arrive as whole local tensors:
    an all-gather forward, a reduce-scatter of their gradients backward."""

    def _apply(self, module: nn.Module, device_mesh: Any) -> nn.Module:
        def gather(value: Any) -> Any:
            if isinstance(value, DTensor):
                return value.redistribute(device_mesh, [Replicate()]).to_local()
            return value

        def hook(_: nn.Module, args: Any, kwargs: Any) -> tuple[Any, Any]:
            return tuple(gather(a) for a in args), {k: gather(v) for k, v in kwargs.items()}

        module.register_forward_pre_hook(hook, with_kwargs=True)
        return module


class ScatterSequence(ParallelStyle):
    """The module's output (the same on every tp rank) enters the stream: a DTensor sharded on
    the sequence (each rank keeps its slice; gradients are all-gathered backward)."""

    def _apply(self, module: nn.Module, device_mesh: Any) -> nn.Module:
        def hook(_: nn.Module, __: Any, output: Any) -> Any:
            whole = DTensor.from_local(output, device_mesh, [Replicate()], run_check=False)
            return whole.redistribute(device_mesh, [Shard(SEQUENCE_DIM)])

        module.register_forward_hook(hook)
        return module
