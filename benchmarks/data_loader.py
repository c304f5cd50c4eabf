"""Throughput of a loader prepared by fprep against the hand-written distributed loader.

Run: ``python benchmarks/data_loader.py [--quick] [--rounds N]``.

Both read rank 0's share (of 2 ranks) of the same shuffled map-style dataset, with the same batch
size, for ``num_workers`` 0 and 2:

* ``torch``: ``DataLoader(dataset, batch_size, sampler=DistributedSampler(dataset,
  num_replicas=2, rank=0, shuffle=True, seed=0))``, with ``sampler.set_epoch(epoch)`` before each
  epoch, as the PyTorch docs write it;
* ``fprep``: ``fprep.prepare_data_loader(state, DataLoader(dataset, batch_size, shuffle=True))``
  with ``state`` an explicit plan for ``fprep.Topology(world_size=2, rank=0)`` and
  ``strategy="ddp"`` (no process group is needed to iterate), batches placed on the compute device
  (the CPU) as ``prepare`` does by default, the epoch advanced by the loader itself;
* ``torch again``: a second hand-written loader, the noise floor of the comparison.

With workers, both keep them between epochs (``persistent_workers=True``) so an epoch measures
reading, not process start-up. The dataset is small tensors (``TensorDataset``), so the loaders'
own per-batch cost is what shows: a heavier ``__getitem__`` only dilutes it.

Every round reads one whole epoch with each loader, in an order shuffled each round; figures are
medians over rounds of samples per second, and of the per-round ratio to ``torch`` with its
spread (25th-75th percentile). Target: fprep / torch >= 0.98.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import torch
from _timing import Loop, interleaved
from torch import nn
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

import fprep

TARGET = 0.98
N = 16384
BATCH = 64
FEATURES = 32
WORLD, RANK = 2, 0
CONTROL = "torch again"

Epoch = Callable[[], int]  # reads one epoch, returns the number of samples read


def dataset() -> TensorDataset:
    gen = torch.Generator().manual_seed(0)
    return TensorDataset(torch.randn(N, FEATURES, generator=gen), torch.randint(0, 10, (N,)))


def _consume(loader: Iterable[Any]) -> int:
    seen = 0
    for _x, y in loader:
        seen += y.shape[0]
    return seen


def torch_epochs(data: TensorDataset, workers: int) -> Epoch:
    sampler: DistributedSampler[Any] = DistributedSampler(
        data, num_replicas=WORLD, rank=RANK, shuffle=True, seed=0
    )
    loader = DataLoader(
        data,
        batch_size=BATCH,
        sampler=sampler,
        num_workers=workers,
        persistent_workers=workers > 0,
    )
    epoch = 0

    def read() -> int:
        nonlocal epoch
        sampler.set_epoch(epoch)
        epoch += 1
        return _consume(loader)

    return read


def fprep_epochs(data: TensorDataset, workers: int) -> Epoch:
    topology = fprep.Topology(world_size=WORLD, rank=RANK)
    state = fprep.plan(nn.Linear(2, 2), fprep.PrepConfig(strategy="ddp", seed=0), topology)
    loader = fprep.prepare_data_loader(
        state.unwrap(),
        DataLoader(
            data,
            batch_size=BATCH,
            shuffle=True,
            num_workers=workers,
            persistent_workers=workers > 0,
        ),
    )
    assert loader.device == torch.device("cpu")  # placement on, as prepare does by default

    def read() -> int:
        return _consume(loader)  # the loader advances its epoch itself

    return read


def measure(epochs: dict[str, Epoch], rounds: int, seed: int = 0) -> dict[str, list[float]]:
    """Samples per second of each round's epoch of every loader (``_timing.interleaved``: one
    epoch each per round, in a shuffled order)."""
    names = list(epochs)
    counts = {name: epochs[name]() for name in names}  # warm-up (and workers started)
    assert len(set(counts.values())) == 1, f"the loaders read different amounts: {counts}"
    read: dict[str, list[int]] = {name: [] for name in names}

    def reading(name: str) -> Loop:
        return lambda: read[name].append(epochs[name]())

    seconds = interleaved({name: reading(name) for name in names}, rounds, warmup=0, seed=seed)
    return {name: [n / t for n, t in zip(read[name], seconds[name], strict=True)] for name in names}


def _quantile(values: Sequence[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(q * (len(ordered) - 1))))]


def paired_ratio(rates: dict[str, list[float]], name: str) -> tuple[float, float, float]:
    """Median, 25th and 75th percentile of the per-round ratio rate(name) / rate(torch)."""
    ratios = [a / b for a, b in zip(rates[name], rates["torch"], strict=True)]
    return statistics.median(ratios), _quantile(ratios, 0.25), _quantile(ratios, 0.75)


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a short run (a smoke test)")
    parser.add_argument("--rounds", type=int, default=None, help="epochs per loader (default 40)")
    args = parser.parse_args(argv)
    rounds = args.rounds or (5 if args.quick else 40)
    torch.set_num_threads(1)
    start = time.perf_counter()
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    print(
        f"fprep data-loader throughput (torch {torch.__version__}, {os.cpu_count()} CPUs, "
        f"load average {load:.1f} at start)",
        flush=True,
    )
    data = dataset()
    results = {}
    for workers in (0, 2):
        epochs = {
            "torch": torch_epochs(data, workers),
            "fprep": fprep_epochs(data, workers),
            CONTROL: torch_epochs(data, workers),
        }
        results[workers] = measure(epochs, rounds)
        del epochs  # shuts persistent workers down
    print(
        f"\nrank {RANK} of {WORLD}: {N // WORLD} of {N} samples ({FEATURES} floats + a label) per "
        f"epoch, batch {BATCH}, shuffled; median over {rounds} epochs each "
        "[25th-75th percentile of the per-epoch ratio]"
    )
    print(
        f"   {'workers':<9}{'torch':>14}{'fprep':>14}   {'fprep / torch':<24}"
        f"{'control / torch':<24}target >= {TARGET}"
    )
    for workers, rates in results.items():
        r, lo, hi = paired_ratio(rates, "fprep")
        c, clo, chi = paired_ratio(rates, CONTROL)
        print(
            f"   {workers:<9}{statistics.median(rates['torch']) / 1e3:8.0f} k/s"
            f"{statistics.median(rates['fprep']) / 1e3:10.0f} k/s   "
            f"{f'{r:.3f} [{lo:.3f}, {hi:.3f}]':<24}{f'{c:.3f} [{clo:.3f}, {chi:.3f}]':<24}"
            f"{'ok' if r >= TARGET else 'MISSED'}"
        )
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    print(f"\n({time.perf_counter() - start:.0f} s; load average {load:.1f} at the end)")


if __name__ == "__main__":
    main()
