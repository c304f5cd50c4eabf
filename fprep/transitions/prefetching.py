"""init_prefetching: which units all-gather which others ahead of time.

Forward order is module registration order (pre-order), the order a typical transformer runs its
blocks in; backward runs it in reverse. With ``forward_prefetch=k`` each unit prefetches the next
``k`` units in forward; with ``backward_prefetch=k`` the previous ``k`` in backward. The root is
left out: FSDP2 all-gathers it first anyway. Planned after init_param_handles, whose units it
names (FSDP1 kept only policies here; an explicit plan is testable and printable).
"""

from __future__ import annotations

from fprep.state import PrefetchState, PrepState, need
from fprep.transitions._base import transition


def _lists(order: tuple[str, ...], depth: int) -> tuple[tuple[str, tuple[str, ...]], ...]:
    if depth == 0:
        return ()
    return tuple(
        (fqn, order[i + 1 : i + 1 + depth]) for i, fqn in enumerate(order) if i + 1 < len(order)
    )


@transition
def init_prefetching(state: PrepState) -> PrepState:
    handles = need(state.param_handles, "init_param_handles", "init_prefetching")
    core = need(state.core, "init_core", "init_prefetching")
    if not core.is_sharded:
        return state.replace(prefetching=PrefetchState(forward=(), backward=()))
    forward = tuple(reversed([u.fqn for u in handles.units if u.fqn]))
    cfg = state.config
    return state.replace(
        prefetching=PrefetchState(
            forward=_lists(forward, cfg.forward_prefetch),
            backward=_lists(tuple(reversed(forward)), cfg.backward_prefetch),
        )
    )
