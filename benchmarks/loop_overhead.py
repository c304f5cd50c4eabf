"""Fixed per-step cost of fprep's training-loop helpers, and of Accelerate's, over plain torch.

Run: ``python benchmarks/loop_overhead.py [--quick] [--rounds N]``.

The model is ``nn.Linear(64, 64)`` with SGD on a batch of 16, one process, fp32: a step costs a
few tens of microseconds, so the helpers' own cost is what shows. Variants (each on its own copy
of the same weights):

* ``torch``            ``loss.backward(); opt.step(); opt.zero_grad()``
* ``torch again``      the same loop, a second copy: the noise floor of the comparison
* ``fprep.backward``   ``fprep.backward(state, model, loss)`` instead of ``loss.backward()``
* ``fprep.optimizer_step``  ``fprep.optimizer_step(state, opt)`` instead of ``opt.step()``
* ``fprep.accumulate`` the forward and backward inside ``with fprep.accumulate(state, model,
  sync=True)``
* ``fprep (all three)`` the loop written with all three helpers. Target: <= 3 us over torch.
* ``accelerate``       Hugging Face Accelerate's equivalent: ``Accelerator().prepare(model, opt)``,
  ``with accelerator.accumulate(model)``, ``accelerator.backward(loss)``, and ``opt.step()`` on its
  ``AcceleratedOptimizer`` (skipped when accelerate is not installed).

Every round runs one step of every variant, in an order shuffled each round, so drifts in machine
speed hit all of them alike; the garbage collector is paused while timing. Overheads are
median(variant) - median(torch) over all rounds; the spread is the lowest and highest value of
the same difference over five consecutive chunks of the rounds.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from collections.abc import Sequence
from typing import Any

import torch
from _timing import CHUNKS, Loop, Times, interleaved, overhead_us
from torch import nn

import fprep

TARGET_US = 3.0
BATCH = 16
CONTROL = "torch again"


X = torch.randn(BATCH, 64, generator=torch.Generator().manual_seed(0))


def _linear() -> nn.Module:
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        return nn.Linear(64, 64)


def _loss(model: Any) -> torch.Tensor:
    out: torch.Tensor = model(X).square().mean()
    return out


# -- the variants --------------------------------------------------------------------------------
def torch_loop() -> Loop:
    model = _linear()
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)

    def step() -> None:
        _loss(model).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    return step


def fprep_loops() -> dict[str, Loop]:
    """The torch loop with fprep helpers in place of the calls they stand for: one helper at a
    time, then all three. Each loop is written out straight (no flags, no extra calls), so the
    differences from ``torch`` are the helpers' own."""

    def setup() -> tuple[fprep.PrepState, nn.Module, torch.optim.Optimizer]:
        state, model = fprep.prepare(_linear(), fprep.PrepConfig())
        return state, model, torch.optim.SGD(model.parameters(), lr=1e-3)

    s1, m1, o1 = setup()

    def with_backward() -> None:
        fprep.backward(s1, m1, _loss(m1))
        o1.step()
        o1.zero_grad(set_to_none=True)

    s2, m2, o2 = setup()

    def with_optimizer_step() -> None:
        _loss(m2).backward()
        fprep.optimizer_step(s2, o2)
        o2.zero_grad(set_to_none=True)

    s3, m3, o3 = setup()

    def with_accumulate() -> None:
        with fprep.accumulate(s3, m3, sync=True):
            _loss(m3).backward()
        o3.step()
        o3.zero_grad(set_to_none=True)

    s4, m4, o4 = setup()

    def with_all_three() -> None:
        with fprep.accumulate(s4, m4, sync=True):
            fprep.backward(s4, m4, _loss(m4))
        fprep.optimizer_step(s4, o4)
        o4.zero_grad(set_to_none=True)

    return {
        "fprep.backward": with_backward,
        "fprep.optimizer_step": with_optimizer_step,
        "fprep.accumulate": with_accumulate,
        "fprep (all three)": with_all_three,
    }


def accelerate_loop() -> Loop | None:
    try:
        from accelerate import Accelerator
        from accelerate.state import AcceleratorState
    except ImportError:
        return None
    AcceleratorState._reset_state(reset_partial_state=True)
    accelerator = Accelerator(cpu=True)
    model = _linear()
    model, opt = accelerator.prepare(model, torch.optim.SGD(model.parameters(), lr=1e-3))

    def step() -> None:
        with accelerator.accumulate(model):
            accelerator.backward(_loss(model))
        opt.step()
        opt.zero_grad(set_to_none=True)

    return step


def variants() -> dict[str, Loop]:
    loops: dict[str, Loop] = {
        "torch": torch_loop(),
        CONTROL: torch_loop(),
        **fprep_loops(),
    }
    acc = accelerate_loop()
    if acc is not None:
        loops["accelerate"] = acc
    return loops


# -- measurement ---------------------------------------------------------------------------------
def print_table(times: Times, rounds: int) -> None:
    print(
        f"\nnn.Linear(64, 64) + SGD, batch {BATCH}, one process, fp32: median step time over "
        f"{rounds} rounds; overhead = median - torch's median [spread over {CHUNKS} chunks]"
    )
    print(f"   {'variant':<22}{'step':>10}   {'overhead':<26}target")
    base = statistics.median(times["torch"]) * 1e6
    print(f"   {'torch':<22}{base:7.1f} us   {'(baseline)':<26}")
    for name in times:
        if name == "torch":
            continue
        o, lo, hi = overhead_us(times, name)
        cell = f"{o:+6.2f} us [{lo:+.1f}, {hi:+.1f}]"
        verdict = ""
        if name == "fprep (all three)":
            verdict = f"<= {TARGET_US:g} us: {'ok' if o <= TARGET_US else 'MISSED'}"
        print(f"   {name:<22}{statistics.median(times[name]) * 1e6:7.1f} us   {cell:<26}{verdict}")
    if "accelerate" not in times:
        print("   accelerate            (not installed: pip install accelerate)")


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a short run (a smoke test)")
    parser.add_argument("--rounds", type=int, default=None, help="rounds (default 20000)")
    args = parser.parse_args(argv)
    rounds = args.rounds or (2000 if args.quick else 20000)
    torch.set_num_threads(1)
    start = time.perf_counter()
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    print(
        f"fprep loop-helper overhead (torch {torch.__version__}, 1 thread, {os.cpu_count()} CPUs, "
        f"load average {load:.1f} at start)",
        flush=True,
    )
    times = interleaved(variants(), rounds, warmup=200)
    print_table(times, rounds)
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    print(f"\n({time.perf_counter() - start:.0f} s; load average {load:.1f} at the end)")


if __name__ == "__main__":
    main()
