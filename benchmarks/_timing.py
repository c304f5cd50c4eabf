"""Shared measurement for the per-step benchmarks: interleaved rounds, medians, chunk spread.

Every round runs one step of every variant in a random (seeded, so identical on every rank)
order; ratios and differences are taken between medians, and their spread over ``CHUNKS``
consecutive chunks of rounds shows how much the machine's noise moves them.
"""

from __future__ import annotations

import cProfile
import gc
import pstats
import random
import statistics
import time
from collections.abc import Callable, Sequence

import torch.distributed as dist

CHUNKS = 5

Loop = Callable[[], None]  # one training step
Times = dict[str, list[float]]  # variant -> seconds of each round's step


def interleaved(loops: dict[str, Loop], rounds: int, warmup: int, seed: int = 0) -> Times:
    """Seconds of each round's step of every loop; one step each per round, in random order.

    Under a process group the ranks meet at a barrier before each timed step.
    """
    names = list(loops)
    for name in names:
        for _ in range(warmup):
            loops[name]()
    out: Times = {name: [] for name in names}
    rng = random.Random(seed)  # the same order on every rank
    distributed = dist.is_available() and dist.is_initialized()
    clock = time.perf_counter_ns
    gc.collect()
    gc.disable()
    try:
        for _ in range(rounds):
            order = names[:]
            rng.shuffle(order)
            for name in order:
                loop = loops[name]
                if distributed:
                    dist.barrier()
                start = clock()
                loop()
                out[name].append((clock() - start) * 1e-9)
    finally:
        gc.enable()
    return out


def chunks(values: Sequence[float]) -> list[Sequence[float]]:
    size = max(1, len(values) // CHUNKS)
    return [values[i * size : (i + 1) * size] for i in range(min(CHUNKS, len(values)))]


def ratio(times: Times, name: str, base: str = "torch") -> tuple[float, float, float]:
    """median(name) / median(base), and its min and max over the chunks."""
    whole = statistics.median(times[name]) / statistics.median(times[base])
    parts = [
        statistics.median(a) / statistics.median(b)
        for a, b in zip(chunks(times[name]), chunks(times[base]), strict=True)
    ]
    return whole, min(parts), max(parts)


def overhead_us(times: Times, name: str, base: str = "torch") -> tuple[float, float, float]:
    """median(name) - median(base) in microseconds, and its min and max over the chunks."""
    whole = (statistics.median(times[name]) - statistics.median(times[base])) * 1e6
    parts = [
        (statistics.median(a) - statistics.median(b)) * 1e6
        for a, b in zip(chunks(times[name]), chunks(times[base]), strict=True)
    ]
    return whole, min(parts), max(parts)


def python_calls(loop: Loop, steps: int = 10, repeats: int = 3) -> float:
    """Python function calls per step (cProfile): a count the machine's load cannot move, to
    tell a real difference in work per step from timing noise. The fewest over ``repeats``
    runs, so that one-time work (a lazy import, a cache filled) is not counted."""
    counts = []
    for _ in range(repeats):
        profile = cProfile.Profile()
        profile.enable()
        try:
            for _ in range(steps):
                loop()
        finally:
            profile.disable()
        counts.append(pstats.Stats(profile).total_calls / steps)  # type: ignore[attr-defined]
    return float(min(counts))
