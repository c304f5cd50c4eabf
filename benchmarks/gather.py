"""Per-batch cost of gathering an evaluation batch from 2 gloo ranks: fprep, Accelerate, torch.

Run: ``python benchmarks/gather.py [--quick] [--rounds N] [--rows R]``.

Each rank holds ``(logits, labels)``: ``R x 10`` floats and ``R`` ints. Variants, all on the
process group ``prepare`` created (DDP over 2 ranks, CPU):

* ``torch``        ``dist.all_gather`` of each tensor into preallocated lists, then ``cat``: the
  floor (it assumes every rank holds the same shapes and checks nothing)
* ``fprep``        ``fprep.gather_for_metrics(state, (logits, labels))``: the structure, dtypes
  and shapes are exchanged first (one small all-gather), then one all-gather per tensor
* ``accelerate``   ``accelerator.gather_for_metrics((logits, labels))`` (skipped when
  accelerate is not installed)

Rounds interleave the variants in a shuffled order after a barrier (benchmarks/_timing.py);
the figures are rank 0's medians in microseconds and the spread of the difference over chunks.
"""

from __future__ import annotations

import argparse
import statistics
import warnings
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist
from _timing import CHUNKS, Times, interleaved, overhead_us
from torch import nn

import fprep
from fprep.testing.distributed import run_ranks

CLASSES = 10


def _cases(rounds: int, warmup: int, rows: int) -> Times:
    state, _ = fprep.prepare(nn.Linear(2, 2), fprep.PrepConfig(strategy="ddp"))
    gen = torch.Generator().manual_seed(fprep.process_index(state))
    logits = torch.randn(rows, CLASSES, generator=gen)
    labels = torch.randint(0, CLASSES, (rows,), generator=gen)
    world = dist.get_world_size()
    into = [[torch.empty_like(t) for _ in range(world)] for t in (logits, labels)]

    def torch_loop() -> None:
        for out, t in zip(into, (logits, labels), strict=True):
            dist.all_gather(out, t)
            torch.cat(out)

    loops: dict[str, Any] = {
        "torch": torch_loop,
        "fprep": lambda: fprep.gather_for_metrics(state, (logits, labels)),
    }
    try:
        warnings.simplefilter("ignore")
        from accelerate import Accelerator
    except ImportError:  # pragma: no cover - accelerate is a test extra
        pass
    else:
        accelerator = Accelerator(cpu=True)  # joins the group prepare created
        loops["accelerate"] = lambda: accelerator.gather_for_metrics((logits, labels))
    return interleaved(loops, rounds, warmup)


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a short run (a smoke test)")
    parser.add_argument("--rounds", type=int, default=None, help="rounds (default 2000)")
    parser.add_argument("--rows", type=int, default=64, help="rows per rank (default 64)")
    args = parser.parse_args(argv)
    rounds = args.rounds or (50 if args.quick else 2000)
    warmup = 5 if args.quick else 50
    times = run_ranks(_cases, 2, rounds, warmup, args.rows, timeout_s=1800.0)[0]
    print(f"gather of ({args.rows} x {CLASSES} float32, {args.rows} int64) from 2 gloo ranks, ")
    print(f"{rounds} rounds; rank 0's medians, spread over {CHUNKS} chunks of rounds:")
    for name in times:
        median = statistics.median(times[name]) * 1e6
        line = f"  {name:<11} {median:8.1f} us"
        if name != "torch":
            diff, low, high = overhead_us(times, name)
            line += f"   {diff:+8.1f} us over torch ({low:+.1f} .. {high:+.1f})"
        print(line)


if __name__ == "__main__":
    main()
