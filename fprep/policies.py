"""Pure helpers that suggest wrap policies from a snapshot."""

from __future__ import annotations

from collections import Counter

from fprep.snapshot import ModuleTree

_CONTAINERS = (
    "torch.nn.modules.container.ModuleList",
    "torch.nn.modules.container.Sequential",
)


def repeated_block_classes(tree: ModuleTree) -> tuple[str, ...]:
    """Qualified names of classes repeated (2+ times) as items of a ModuleList / Sequential.

    These are a transformer's blocks: the natural FSDP units and regional-compile regions.
    """
    counts: Counter[str] = Counter()
    for m in tree.modules:
        if m.cls in _CONTAINERS:
            for child in m.children:
                info = tree.module(child)
                if info is not None and info.cls not in _CONTAINERS:
                    counts[info.cls] += 1
    return tuple(cls for cls, n in counts.items() if n >= 2)
