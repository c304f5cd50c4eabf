"""Tied parameters under tensor parallelism: one DTensor again after the styles ran.

torch's styles replace each module's parameters with new DTensor parameters, module by module,
so a parameter two modules share (an embedding tied to the output head) comes out as two equal
DTensors. The plan allows a tied parameter only where every use lays it out the same way
(``embedding_rowwise`` and ``colwise_gather_output`` both cut the vocabulary), so the copies
are interchangeable; ``retie`` puts the first one back under every name, so the optimizer,
FSDP2 and the checkpoints see one tensor, as they did before ``parallelize``.
"""

from __future__ import annotations

from torch import nn

from fprep.snapshot import ModuleTree


def retie(model: nn.Module, tree: ModuleTree, planned: tuple[str, ...]) -> None:
    """Register the parameter now at each tied ``planned`` FQN under all of its names."""
    for fqn in planned:
        info = tree.param(fqn)
        if info is None or len(info.names) < 2:
            continue
        param = model.get_parameter(info.fqn)
        for name in info.names:
            owner, _, leaf = name.rpartition(".")
            module = model.get_submodule(owner)
            if module._parameters.get(leaf) is not param:
                module.register_parameter(leaf, param)
