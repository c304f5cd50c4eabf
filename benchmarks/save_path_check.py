"""What the same-path check adds to ``fprep.save`` at 2 gloo ranks.

Run: ``python benchmarks/save_path_check.py [--quick] [--rounds N] [--width D]``.

Before a checkpoint touches storage the ranks exchange where their path leads (one all-gather
of a short text, ``fprep/checkpoint/same_path.py``). Variants, interleaved in a shuffled order
after a barrier (benchmarks/_timing.py), on a model prepared with fsdp (2 ranks, CPU):

* ``check``          the check alone: ``agree_on_path(group, "fprep.save", root, open_store)``
* ``save``           ``fprep.save(root, ...)`` as it is (keep_last=2)
* ``save unchecked`` the same save with the check replaced by ``open_store(root)`` alone

The figures are rank 0's medians; the save's difference comes with its spread over chunks of
rounds (a loaded machine moves a save by more than the check costs: the check alone is the
figure to quote).
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
from collections.abc import Sequence
from typing import Any

from _timing import CHUNKS, Times, interleaved, overhead_us
from torch import nn

import fprep
from fprep.testing.distributed import run_ranks


def _cases(rounds: int, warmup: int, width: int, root: str) -> Times:
    from fprep.checkpoint import writing
    from fprep.checkpoint.collective import Group
    from fprep.checkpoint.same_path import agree_on_path
    from fprep.checkpoint.stores.backend import open_store

    model = nn.Sequential(nn.Linear(width, width), nn.Linear(width, width))
    state, model = fprep.prepare(model, fprep.PrepConfig(strategy="fsdp", seed=0))
    group = Group.of(state)
    step = [0]

    def unchecked(group: Any, call: str, path: Any, open_here: Any) -> Any:
        return open_here(path)

    def save() -> None:
        step[0] += 1
        fprep.save(root, state, model, step=step[0], keep_last=2)

    def save_unchecked() -> None:
        writing.agree_on_path = unchecked  # type: ignore[assignment]
        try:
            save()
        finally:
            writing.agree_on_path = agree_on_path

    loops = {
        "check": lambda: agree_on_path(group, "fprep.save", root, open_store),
        "save": save,
        "save unchecked": save_unchecked,
    }
    return interleaved(loops, rounds, warmup)


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a short run (a smoke test)")
    parser.add_argument("--rounds", type=int, default=None, help="rounds (default 200)")
    parser.add_argument("--width", type=int, default=256, help="Linear width (default 256)")
    args = parser.parse_args(argv)
    rounds = args.rounds or (10 if args.quick else 200)
    warmup = 2 if args.quick else 5
    with tempfile.TemporaryDirectory() as root:
        times = run_ranks(_cases, 2, rounds, warmup, args.width, root, timeout_s=3600.0)[0]
    params = 2 * (args.width * args.width + args.width)
    print(f"fprep.save of {params} fp32 parameters (fsdp, 2 gloo ranks), {rounds} rounds;")
    print(f"rank 0's medians, spread over {CHUNKS} chunks of rounds:")
    for name in times:
        print(f"  {name:<15} {statistics.median(times[name]) * 1e6:10.1f} us")
    diff, low, high = overhead_us(times, "save", "save unchecked")
    check = statistics.median(times["check"])
    share = check / statistics.median(times["save"])
    print(f"  save - save unchecked: {diff:+.1f} us ({low:+.1f} .. {high:+.1f})")
    print(f"  the check alone is {100 * share:.2f} % of a save")


if __name__ == "__main__":
    main()
