"""How long ``fprep.plan`` takes on Llama-shaped models, against the time torch takes to build them.

Run: ``python benchmarks/plan_speed.py [--quick] [--rounds N]``.

1. Build Llama 3.1 405B on the meta device (torch only: module construction).
2. ``fprep.plan`` of that model (snapshot included) with FSDP, one unit per ``LlamaBlock``,
   bf16, for world sizes 8 and 1024 (rank 3; and the last rank of 1024, where a per-parameter
   search of the shard group would show up), and the ratio plan / build. Target: <= 0.5 at
   world 1024.
3. Plan time for 8B-, 70B- and 405B-shaped models (and 405B-shaped models with 32 / 64 / 126
   layers) at world 1024, per module and per parameter tensor: the plan is linear in the model
   size, so those two columns stay flat.

Every figure is the median of ``--rounds`` rounds; within a round the measurements are
interleaved (build, plan, build, plan, ...) so drifts in machine speed hit all of them alike. The
garbage collector is paused inside each timed call (as ``timeit`` does) and run between calls.
The minimum is printed too: on a shared machine it is the steadier of the two.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import gc
import statistics
import time
from collections.abc import Callable
from typing import TypeVar

import torch
from torch import nn

import fprep
from fprep.testing.models import LLAMA_8B, LLAMA_70B, LLAMA_405B, LlamaBlock, LlamaConfig, llama

T = TypeVar("T")

CFG = fprep.PrepConfig(strategy="fsdp", wrap=LlamaBlock, precision="bf16")
TARGET = 0.5
BIG = "plan  world=1024 rank=3"  # the figure the target is about


def timed(fn: Callable[[], T]) -> tuple[float, T]:
    gc.collect()
    gc.disable()
    try:
        start = time.perf_counter()
        out = fn()
        return time.perf_counter() - start, out
    finally:
        gc.enable()


def plan_of(model: nn.Module, world: int, rank: int) -> fprep.PrepState:
    result = fprep.plan(model, CFG, fprep.Topology(world_size=world, rank=rank))
    state: fprep.PrepState = result.unwrap()  # a failure here is a bug: let it raise
    return state


def ms(seconds: float) -> str:
    return f"{seconds * 1e3:8.2f} ms"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="one round (a smoke test)")
    parser.add_argument(
        "--rounds", type=int, default=None, help="measurements per figure (default 15, quick 1)"
    )
    args = parser.parse_args(argv)
    rounds: int = args.rounds or (1 if args.quick else 15)

    print(f"fprep plan speed (torch {torch.__version__}, {rounds} interleaved rounds)")
    # Warm up imports, torch's lazily loaded meta kernels and caches once; not measured.
    plan_of(llama(LLAMA_405B), 1024, 3)

    cases = [
        ("plan  world=8    rank=3", 8, 3),
        (BIG, 1024, 3),
        ("plan  world=1024 rank=1023", 1024, 1023),
    ]
    sizes: list[tuple[str, LlamaConfig]] = [
        ("Llama 8B", LLAMA_8B),
        ("405B shape, 32 layers", dataclasses.replace(LLAMA_405B, n_layers=32)),
        ("405B shape, 64 layers", dataclasses.replace(LLAMA_405B, n_layers=64)),
        ("Llama 70B", LLAMA_70B),
    ]
    build: list[float] = []
    times: dict[str, list[float]] = {name: [] for name, _, _ in cases}
    times.update({name: [] for name, _ in sizes})
    trees: dict[str, fprep.ModuleTree] = {}
    units = 0
    for _ in range(rounds):
        # 1 and 2: build 405B on meta, then plan it for each world size.
        seconds, model = timed(functools.partial(llama, LLAMA_405B))
        build.append(seconds)
        for name, world, rank in cases:
            seconds, state = timed(functools.partial(plan_of, model, world, rank))
            times[name].append(seconds)
            trees["Llama 405B"] = state.tree
            units = len(state.param_handles.units) if state.param_handles else 0
        del model
        # 3: the other sizes, planned at world 1024, rank 3.
        for name, config in sizes:
            model = llama(config)
            seconds, state = timed(functools.partial(plan_of, model, 1024, 3))
            times[name].append(seconds)
            trees[name] = state.tree
            del model

    tree = trees["Llama 405B"]
    build_s = statistics.median(build)
    print(
        f"\nLlama 405B on meta: {tree.numel / 1e9:.1f}e9 parameters, {len(tree.params)} "
        f"parameter tensors, {len(tree.modules)} modules, {units} FSDP units"
    )
    print(f"  {'what':<28}{'median':>11}{'min':>11}{'plan/build':>12}")
    print(f"  {'build (torch, meta device)':<28}{ms(build_s):>11}{ms(min(build)):>11}{'':>12}")
    for name, _, _ in cases:
        med = statistics.median(times[name])
        print(f"  {name:<28}{ms(med):>11}{ms(min(times[name])):>11}{med / build_s:>12.3f}")
    ratio = statistics.median(times[BIG]) / build_s
    verdict = "met" if ratio <= TARGET else "MISSED"
    print(f"  target plan/build <= {TARGET} at world 1024 (medians): {verdict} ({ratio:.3f})")

    print("\nplan at world 1024, rank 3 (FSDP per LlamaBlock, bf16), by model size (medians)")
    print(
        f"  {'model':<24}{'layers':>7}{'modules':>9}{'tensors':>9}{'params':>10}"
        f"{'plan':>12}{'us/module':>11}{'us/tensor':>11}"
    )
    rows = [(name, config.n_layers) for name, config in sizes] + [(BIG, LLAMA_405B.n_layers)]
    for name, layers in rows:
        tree = trees["Llama 405B" if name == BIG else name]
        modules, tensors = len(tree.modules), len(tree.params)
        med = statistics.median(times[name])
        label = "Llama 405B" if name == BIG else name
        print(
            f"  {label:<24}{layers:>7}{modules:>9}{tensors:>9}{tree.numel / 1e9:>9.1f}B"
            f"{ms(med):>12}{med / modules * 1e6:>11.2f}{med / tensors * 1e6:>11.2f}"
        )


if __name__ == "__main__":
    main()
