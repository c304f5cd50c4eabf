"""init_prefetching: which units all-gather which others ahead of time.

Forward order is module registration order (pre-order), the order a typical transformer runs its
blocks in; backward runs it in reverse. With ``forward_prefetch=k`` each unit prefetches the next
``k`` units in forward; with ``backward_prefetch=k`` the previous ``k`` in backward. The root is
left out: FSDP2 all-gathers it first anyway. Planned after init_param_handles, whose units it
names (FSDP1 kept only policies here; an explicit plan is testable and printable).

Under pipeline parallelism each stage runs on its own (its own FSDP2 root, its micro-batches in
the schedule's order): a unit prefetches only units of its own stage.
"""

from __future__ import annotations

from fprep.snapshot import is_within
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
    pipe = state.pipeline
    runs = (
        [
            tuple(u for u in forward if any(is_within(u, m) for m in pipe.split[stage]))
            for stage in pipe.stages
        ]
        if pipe is not None
        else [forward]
    )
    return state.replace(
        prefetching=PrefetchState(
            forward=tuple(x for run in runs for x in _lists(run, cfg.forward_prefetch)),
            backward=tuple(
                x for run in runs for x in _lists(tuple(reversed(run)), cfg.backward_prefetch)
            ),
        )
    )
