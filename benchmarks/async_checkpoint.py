"""Asynchronous checkpoint saves: how long the training loop stalls per save, and how long until
the checkpoint is published, for ``fprep.save(wait=False)``, a synchronous ``fprep.save`` and
torch's ``dcp.async_save``.

Run: ``python benchmarks/async_checkpoint.py [--quick] [--rounds N]``.

2 ranks, fsdp, gloo, one thread each; a ~200M-parameter model (an embedding and square linear
layers; ``--quick``: ~6M) with AdamW state, so each checkpoint holds about 2.4 GB of tensors
(1.2 GB per rank). Every round runs a training step, then each variant once, in a random order
(the same on both ranks):

* ``fprep sync``: ``fprep.save(...)``; the stall is the whole save.
* ``fprep async``: ``handle = fprep.save(..., wait=False)``, then ``handle.wait()``.
* ``dcp.async_save``: ``get_state_dict`` + ``dcp.async_save`` (its default stager, files
  fsynced), then ``future.result()``.

Stall: from the call until it returns (the next step could start). Published: from the call
until the checkpoint is complete on disk (``wait`` / ``result`` return, nothing else running).
Figures are the slower rank's, medians over the rounds; the first (warm-up) save of each variant
is reported apart (fprep allocates its staging buffers and its process group there, DCP
allocates its staging copy at every save). Goals: fprep's async stall <= 0.1x the synchronous
save and <= dcp.async_save's stall; published throughput >= 0.95x the synchronous save's.
"""

from __future__ import annotations

import argparse
import os
import random
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from checkpoint import MB, Stack, tensor_bytes_global
from torch import nn

import fprep
from fprep.testing.distributed import run_ranks

STALL_TARGET = 0.1
THROUGHPUT_TARGET = 0.95
VARIANTS = ("fprep sync", "fprep async", "dcp.async_save")


def sizes(quick: bool) -> dict[str, int]:
    if quick:
        return {"d": 512, "layers": 8, "vocab": 4096}  # 6.3M parameters
    return {"d": 2048, "layers": 40, "vocab": 16384}  # 201.4M parameters


def build(spec: dict[str, int]) -> tuple[Any, nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = Stack(**spec)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    cfg = fprep.PrepConfig(strategy="fsdp", wrap=nn.Linear)
    state, model, opt = fprep.prepare(model, cfg, opt)
    return state, model, opt


def train_step(model: nn.Module, opt: torch.optim.Optimizer) -> None:
    model(torch.zeros(2, 4, dtype=torch.long)).sum().backward()
    opt.step()
    opt.zero_grad(set_to_none=True)


def slowest(seconds: float) -> float:
    out: list[float] = [0.0] * dist.get_world_size()
    dist.all_gather_object(out, seconds)
    return max(out)


def measure(
    spec: dict[str, int], rounds: int, base: str, variants: tuple[str, ...] = VARIANTS
) -> dict[str, Any]:
    """(stall, published) seconds per variant and round, the slower rank's; on every rank."""
    import warnings

    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    from fprep.checkpoint import staging

    warnings.filterwarnings("ignore")
    torch.set_num_threads(1)
    state, model, opt = build(spec)
    copies: list[float] = []  # seconds of fprep's staging copy, this rank
    real_stage = staging.Stager.stage

    def timed_stage(self: staging.Stager, tensors: Any) -> Any:
        start = time.perf_counter()
        out = real_stage(self, tensors)
        copies.append(time.perf_counter() - start)
        return out

    staging.Stager.stage = timed_stage  # type: ignore[method-assign]
    rank = dist.get_rank()
    root = Path(base)
    counter = [0]

    def fresh(name: str) -> Path:
        counter[0] += 1
        return root / f"{name.replace(' ', '_').replace('.', '_')}-{counter[0]}"

    def fprep_sync(path: Path) -> Callable[[], object]:
        fprep.save(path, state, model, optimizers=(opt,))
        return lambda: None

    def fprep_async(path: Path) -> Callable[[], object]:
        return fprep.save(path, state, model, optimizers=(opt,), wait=False).wait

    def dcp_async(path: Path) -> Callable[[], object]:
        msd, osd = get_state_dict(model, opt)
        future: Any = dcp.async_save({"model": msd, "optim": osd}, checkpoint_id=path)
        return future.result  # type: ignore[no-any-return]

    calls = {"fprep sync": fprep_sync, "fprep async": fprep_async, "dcp.async_save": dcp_async}

    def once(name: str) -> tuple[float, float]:
        path = fresh(name)
        dist.barrier()
        start = time.perf_counter()
        finish = calls[name](path)
        returned = time.perf_counter()
        finish()
        published = time.perf_counter()
        dist.barrier()
        if rank == 0:
            shutil.rmtree(path, ignore_errors=True)
        return slowest(returned - start), slowest(published - start)

    train_step(model, opt)
    first = {name: once(name) for name in variants}
    times: dict[str, list[tuple[float, float]]] = {name: [] for name in variants}
    order = list(variants)
    rng = random.Random(0)  # the same order on every rank
    step_s = []
    for _ in range(rounds):
        start = time.perf_counter()
        train_step(model, opt)  # the parameters change between saves
        step_s.append(slowest(time.perf_counter() - start))
        rng.shuffle(order)
        for name in order:
            times[name].append(once(name))
    return {
        "copy_s": slowest(statistics.median(copies[1:])),  # the first one allocates
        "bytes": tensor_bytes_global(model, opt),
        "first": first,
        "times": times,
        "step_s": statistics.median(step_s),
        "load": os.getloadavg(),
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a small model, 2 rounds")
    parser.add_argument("--rounds", type=int, default=None, help="rounds (default 5, quick 2)")
    parser.add_argument(
        "--without-dcp",
        action="store_true",
        help="fprep's two variants only (to see whether dcp.async_save's runs affect them)",
    )
    args = parser.parse_args(argv)
    rounds = args.rounds or (2 if args.quick else 5)
    variants = VARIANTS[:2] if args.without_dcp else VARIANTS
    spec = sizes(args.quick)
    before = os.getloadavg()
    print(
        f"fprep async checkpoint benchmark (torch {torch.__version__}, {os.cpu_count()} CPUs, "
        f"load average {before[0]:.1f} at the start; 2 ranks fsdp gloo, model d={spec['d']} "
        f"layers={spec['layers']} vocab={spec['vocab']}, AdamW, {rounds} rounds, medians of "
        "the slower rank)"
    )
    with tempfile.TemporaryDirectory(dir=os.environ.get("FPREP_BENCH_DIR")) as tmp:
        result = run_ranks(measure, 2, spec, rounds, tmp, variants, timeout_s=3600.0)[0]
    mb = result["bytes"] / MB
    times = result["times"]
    med = {
        name: (
            statistics.median(s for s, _ in times[name]),
            statistics.median(p for _, p in times[name]),
        )
        for name in variants
    }
    sync = med["fprep sync"][1]
    print(
        f"\n{mb:.0f} MB of tensors per checkpoint; a training step takes "
        f"{result['step_s']:.2f} s; load average {result['load'][0]:.1f} at the end"
    )
    print(
        f"  {'variant':<16}{'stall':>9}{'/ sync':>9}{'first stall':>13}"
        f"{'published':>11}{'MB/s':>8}{'vs sync':>9}"
    )
    for name in variants:
        stall, published = med[name]
        print(
            f"  {name:<16}{stall:>8.3f}s{stall / sync:>8.3f}x{result['first'][name][0]:>12.3f}s"
            f"{published:>10.2f}s{mb / published:>8.0f}{sync / published:>8.2f}x"
        )
    print(f"  (of fprep's async stall, the staging copy itself: {result['copy_s']:.3f} s)")
    for name in variants:
        rounds_text = ", ".join(f"{st:.2f}/{pub:.2f}" for st, pub in times[name])
        print(f"  {name} per round (stall/published s): {rounds_text}")
    stall_ratio = med["fprep async"][0] / sync
    throughput = sync / med["fprep async"][1]
    checks = [
        (f"async stall {stall_ratio:.3f}x the synchronous save", stall_ratio <= STALL_TARGET),
        (f"published throughput {throughput:.2f}x the synchronous save", throughput >= 0.95),
    ]
    goals = [f"<= {STALL_TARGET}x", f">= {THROUGHPUT_TARGET}x"]
    if "dcp.async_save" in med:
        vs_dcp = med["fprep async"][0] / med["dcp.async_save"][0]
        checks.append((f"async stall {vs_dcp:.2f}x dcp.async_save's", vs_dcp <= 1.0))
        goals.append("<= 1x")
    for (text, ok), goal in zip(checks, goals, strict=True):
        print(f"{text}: {'meets' if ok else 'misses'} the {goal} goal")
    sys.stdout.flush()


if __name__ == "__main__":
    main()
