"""Pure helpers that suggest wrap policies from a snapshot."""

from __future__ import annotations

from collections import Counter

from fprep.snapshot import ModuleTree, is_within

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
                # (another pipeline stage's pass-throughs are no blocks of this rank's part)
                if info is not None and info.cls not in _CONTAINERS and not info.is_stage_gap:
                    counts[info.cls] += 1
    return tuple(cls for cls, n in counts.items() if n >= 2)


#: Classes whose forward reads their children's parameters instead of calling the children:
#: ``nn.MultiheadAttention`` hands ``out_proj.weight`` to ``F.multi_head_attention_forward``
#: (``nn.Transformer*`` layers reach it through their ``self_attn``). A child of one of these
#: cannot be its own wrap unit: FSDP would only gather its parameters around a forward that
#: never runs. FSDP1's size policy treats them as leaves (``FORCE_LEAF_MODULES``) too.
PARENT_FORWARD_CLASSES: tuple[str, ...] = ("torch.nn.modules.activation.MultiheadAttention",)


def used_by_parent_forward(tree: ModuleTree) -> dict[str, str]:
    """Each module strictly inside a ``PARENT_FORWARD_CLASSES`` module -> that module's FQN
    (the outermost one)."""
    inside: dict[str, str] = {}
    leaf: str | None = None  # the enclosing such module; modules come in pre-order
    for m in tree.modules:
        if leaf is not None and m.fqn != leaf and is_within(m.fqn, leaf):
            inside[m.fqn] = leaf
            continue
        leaf = m.fqn if any(m.is_a(c) for c in PARENT_FORWARD_CLASSES) else None
    return inside
