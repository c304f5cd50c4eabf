"""Micro-batches in flight: how many micro-batches' activations a pipeline rank holds at once.

A stage keeps what a micro-batch's forward saved for backward until that micro-batch's backward
(its weight backward under the zero-bubble schedules, which keep the graph until then). Each
rank runs its actions in the order ``torch.distributed.pipelining``'s schedules list them; the
most it holds is the peak, over that order, of the micro-batches each of its stages has run
forward and not yet backward, weighted by the stage's bytes per micro-batch.

- GPipe: every micro-batch forward, then every backward: ``m`` on the stage.
- 1F1B: ``min(m, pp - r)`` on pipeline rank ``r`` (its warm-up forwards plus one).
- LoopedBFS: every micro-batch on every local stage (forwards of all stages first).
- Interleaved1F1B, InterleavedZeroBubble: torch's warm-up count then alternating forward and
  backward; ``rank_events`` lists the order (torch's ``_get_1f1b_rank_ops``, without the idle
  slots, which do not change what is held).
- ZBVZeroBubble, DualPipeV: the peak count of each of the two stages and of the rank are
  formulas (``v_peaks``); the bytes are bounded by filling the bigger stage to its peak first.

``tests/test_pipeline_memory.py`` holds all of it against torch's own schedule tables.
"""

from __future__ import annotations

from collections.abc import Sequence

from fprep.layout.stages import LOOPED_SCHEDULES, SCHEDULES, V_SCHEDULES

#: One step of a rank's order: (local stage index, +1 forward / -1 backward that frees it).
Event = tuple[int, int]


def _rounds(pp: int, microbatches: int) -> int:
    """Micro-batches per round of the looped schedules (torch's ``microbatches_per_round``)."""
    return microbatches // max(1, microbatches // pp)


def rank_events(
    schedule: str, pp: int, pp_rank: int, microbatches: int, stages_per_rank: int = 1
) -> tuple[Event, ...]:
    """The order in which pipeline rank ``pp_rank`` runs and frees micro-batches, per local
    stage (0 = its first), for the schedules other than the V ones."""
    m, local = microbatches, stages_per_rank
    if schedule == "GPipe":
        return ((0, 1),) * m + ((0, -1),) * m
    if schedule == "1F1B":
        warmup = min(m, pp - 1 - pp_rank)
        steady = m - warmup
        return ((0, 1),) * warmup + ((0, 1), (0, -1)) * steady + ((0, -1),) * warmup
    if schedule == "LoopedBFS":
        forwards = tuple((k, 1) for k in range(local) for _ in range(m))
        return forwards + tuple((k, -1) for k in reversed(range(local)) for _ in range(m))
    if schedule in ("Interleaved1F1B", "InterleavedZeroBubble"):
        return _interleaved(schedule == "InterleavedZeroBubble", pp, pp_rank, m, local)
    raise ValueError(f"no event order for schedule {schedule!r}")


def _interleaved(zero_bubble: bool, pp: int, rank: int, m: int, local: int) -> tuple[Event, ...]:
    per_round = _rounds(pp, m)
    ops = local * m
    factor = 1 if zero_bubble else 2
    warmup = min((local - 1) * per_round + factor * (pp - 1 - rank), ops)

    def forward_stage(op: int) -> int:
        return (op // per_round) % local

    def backward_stage(op: int) -> int:
        return local - 1 - ((op - warmup) // per_round) % local

    events: list[Event] = []
    backwards: list[int] = []  # the ops whose backward ran, in order (their weight backward next)
    weights = 0

    def backward(op: int) -> None:
        nonlocal weights
        backwards.append(op)
        if not zero_bubble:
            events.append((backward_stage(op), -1))
        elif op - warmup >= rank:  # torch defers the first ``rank`` weight backwards
            events.append((backward_stage(backwards[weights]), -1))
            weights += 1

    for op in range(warmup + ops):
        if op < ops:
            events.append((forward_stage(op), 1))
        if op >= warmup:
            backward(op)
    events.extend((backward_stage(op), -1) for op in backwards[weights:])
    return tuple(events)


def v_peaks(schedule: str, pp: int, pp_rank: int) -> tuple[tuple[int, int], int]:
    """Under ZBVZeroBubble or DualPipeV (micro-batches >= 2 pp, as fprep requires): the most
    micro-batches each of rank ``pp_rank``'s two stages holds (stage ``r``, stage ``2pp-1-r``),
    and the most the rank holds at once."""
    if schedule == "ZBVZeroBubble":
        return (2 * pp - pp_rank, pp_rank + 1), 2 * pp
    last = pp_rank == pp - 1
    return ((pp + 1 if last else 2 * pp - 1 - pp_rank), pp_rank + 1), 2 * pp + (1 if last else 0)


def peak_weighted(events: Sequence[Event], per_stage: Sequence[int]) -> int:
    """The most ``sum(held[k] * per_stage[k])`` reaches along ``events``."""
    held = [0] * len(per_stage)
    total = peak = 0
    for stage, step in events:
        held[stage] += step
        total += step * per_stage[stage]
        peak = max(peak, total)
    return peak


def fill_bound(peaks: Sequence[int], at_once: int, per_stage: Sequence[int]) -> int:
    """The most bytes ``at_once`` micro-batches can hold when stage ``k`` holds at most
    ``peaks[k]``: the biggest stages filled first (an upper bound on the real peak)."""
    total, left = 0, at_once
    for size, peak in sorted(zip(per_stage, peaks, strict=True), reverse=True):
        take = min(peak, left)
        total += take * size
        left -= take
    return total


def peak_activations(
    schedule: str,
    pp: int,
    pp_rank: int,
    microbatches: int,
    per_stage: Sequence[int],
) -> int:
    """Bytes of activations pipeline rank ``pp_rank`` holds at its peak, from each of its
    stages' bytes per micro-batch (``per_stage``, first local stage first)."""
    if schedule not in SCHEDULES:
        raise ValueError(f"unknown schedule {schedule!r}")
    if schedule in V_SCHEDULES:
        peaks, at_once = v_peaks(schedule, pp, pp_rank)
        return fill_bound(peaks, at_once, per_stage)
    local = len(per_stage) if schedule in LOOPED_SCHEDULES else 1
    return peak_weighted(rank_events(schedule, pp, pp_rank, microbatches, local), per_stage)


def peak_count(schedule: str, pp: int, pp_rank: int, microbatches: int, local: int) -> int:
    """The most micro-batches pipeline rank ``pp_rank`` holds at once (all stages together)."""
    if schedule in V_SCHEDULES:
        return v_peaks(schedule, pp, pp_rank)[1]
    return peak_weighted(rank_events(schedule, pp, pp_rank, microbatches, local), [1] * local)
