"""Per-step cost of a model prepared by fprep against the same loop written by hand.

Run: ``python benchmarks/step_overhead.py [--quick]``.

1. A small GPT (``fprep.testing.models``; 4 blocks, width 64, 208K parameters) trained with
   AdamW: per-step time of ``fprep.prepare`` + ``fprep.backward`` against hand-written torch with
   the same engine and settings. Target: fprep / torch <= 1.01.

   * one process, fp32: the model as it is, ``loss.backward()``;
   * one process, bf16: ``torch.autocast("cpu", dtype=torch.bfloat16)`` around the forward and
     ``.float()`` on the output (what fprep's autocast hooks do);
   * DDP, 2 ranks (gloo): ``DistributedDataParallel(model)``;
   * FSDP2, 2 ranks (gloo): ``fully_shard`` on every block, then on the root.

2. ``nn.Linear(64, 64)`` + SGD, batch 16, one process: the fixed per-step overhead, in
   microseconds, of fprep and of Hugging Face Accelerate (``Accelerator().prepare(model,
   optimizer)``, ``accelerator.backward``) over the hand-written loop, fp32 and bf16. Target for
   fprep: <= 3 us.

How: every variant trains its own copy of the same initial weights, and a second hand-written
copy ("torch again") is measured like the others, as a control: its difference from "torch" is
the noise floor of the method. Each round runs one step of every variant, in a random order (the
same on every rank), each step timed on its own; a figure is the median over rounds, so a step
that the OS interrupts on this shared machine moves it little, and slow drifts hit every variant
alike. Ratios and overheads are those of the medians; the spread in brackets is the min-max of
the same figure over 5 consecutive chunks of the rounds. Beside the times, the GPT table counts
the Python function calls of one step (cProfile, fprep / torch): a figure load cannot move, which
tells a real difference in per-step work from timing noise on a busy machine. Every process uses
one intra-op thread; the garbage collector is off while measuring; 2-rank steps start after a
barrier (not timed).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist
from _timing import Loop, Times, interleaved, overhead_us, python_calls, ratio
from torch import nn

import fprep
from fprep.testing.distributed import run_ranks
from fprep.testing.models import GPTBlock, GPTConfig, lm_loss, synthetic_batches, tiny_gpt

GPT_CONFIG = GPTConfig(vocab_size=64, block_size=64, n_layer=4, n_head=4, n_embd=64)
GPT_BATCH = 8
GPT_TARGET = 1.01
MICRO_TARGET_US = 3.0
CONTROL = "torch again"


# -- measurement --------------------------------------------------------------------------------
def _gpt_batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    batches = list(
        synthetic_batches(
            8,
            batch_size=GPT_BATCH,
            seq_len=GPT_CONFIG.block_size,
            vocab_size=GPT_CONFIG.vocab_size,
            seed=0,
        )
    )
    if dist.is_initialized():  # every rank trains on its half of each batch
        rank, world = dist.get_rank(), dist.get_world_size()
        batches = [(x.chunk(world)[rank], y.chunk(world)[rank]) for x, y in batches]
    return batches


def _gpt_loop(
    model: nn.Module,
    forward: Callable[[torch.Tensor], torch.Tensor],
    backward: Callable[[torch.Tensor], None],
) -> Loop:
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)  # after prepare / wrapping
    batches = _gpt_batches()
    i = 0

    def step() -> None:
        nonlocal i
        x, y = batches[i % len(batches)]
        i += 1
        backward(lm_loss(forward(x), y))
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    return step


def _bf16(model: Callable[[torch.Tensor], Any]) -> Callable[[torch.Tensor], torch.Tensor]:
    """The hand-written bf16 forward: autocast around the model, float32 output."""

    def forward(x: torch.Tensor) -> torch.Tensor:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out: torch.Tensor = model(x)
        return out.float()

    return forward


def _backward(loss: torch.Tensor) -> None:
    loss.backward()


def _fprep_gpt(cfg: fprep.PrepConfig) -> Loop:
    state, model = fprep.prepare(tiny_gpt(GPT_CONFIG, seed=0), cfg)
    return _gpt_loop(model, model, lambda loss: fprep.backward(state, model, loss))


def _hand_gpt(precision: str) -> Loop:
    model = tiny_gpt(GPT_CONFIG, seed=0)
    return _gpt_loop(model, _bf16(model) if precision == "bf16" else model, _backward)


Case = tuple[Times, dict[str, float]]  # step times, and Python calls per step


def _measured(loops: dict[str, Loop], rounds: int, warmup: int) -> Case:
    times = interleaved(loops, rounds, warmup)
    return times, {name: python_calls(loops[name]) for name in ("fprep", "torch")}


def single_device_case(precision: str, rounds: int, warmup: int) -> Case:
    cfg = fprep.PrepConfig(precision="bf16" if precision == "bf16" else "no")
    loops = {
        "fprep": _fprep_gpt(cfg),
        "torch": _hand_gpt(precision),
        CONTROL: _hand_gpt(precision),
    }
    return _measured(loops, rounds, warmup)


def _distributed_cases(rounds: int, warmup: int) -> dict[str, Case]:
    """On every rank: DDP and FSDP2, fprep and hand-written, all in one process group."""
    from torch.distributed.fsdp import fully_shard
    from torch.nn.parallel import DistributedDataParallel

    torch.set_num_threads(1)
    ddp_fprep = _fprep_gpt(fprep.PrepConfig(strategy="ddp"))  # creates the process group

    def ddp_hand() -> Loop:
        model = DistributedDataParallel(tiny_gpt(GPT_CONFIG, seed=0))
        return _gpt_loop(model, model, _backward)

    def fsdp_hand() -> Loop:
        model = tiny_gpt(GPT_CONFIG, seed=0)
        for block in model.blocks:
            fully_shard(block)
        fully_shard(model)
        return _gpt_loop(model, model, _backward)

    ddp = {"fprep": ddp_fprep, "torch": ddp_hand(), CONTROL: ddp_hand()}
    fsdp_cfg = fprep.PrepConfig(strategy="fsdp", wrap=GPTBlock)
    fsdp = {"fprep": _fprep_gpt(fsdp_cfg), "torch": fsdp_hand(), CONTROL: fsdp_hand()}
    return {"ddp": _measured(ddp, rounds, warmup), "fsdp2": _measured(fsdp, rounds, warmup)}


# -- the Linear(64, 64) + SGD loops -------------------------------------------------------------
def _linear() -> nn.Module:
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        return nn.Linear(64, 64)


MICRO_X = torch.randn(16, 64, generator=torch.Generator().manual_seed(0))


def _micro_loop(
    forward: Callable[[torch.Tensor], torch.Tensor],
    backward: Callable[[torch.Tensor], None],
    optimizer: Any,
) -> Loop:
    x = MICRO_X

    def step() -> None:
        backward(forward(x).square().mean())
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    return step


def _hand_micro(precision: str) -> Loop:
    model = _linear()
    forward = _bf16(model) if precision == "bf16" else model
    return _micro_loop(forward, _backward, torch.optim.SGD(model.parameters(), lr=1e-3))


def micro_loops(precision: str) -> dict[str, Loop]:
    loops = {"torch": _hand_micro(precision), CONTROL: _hand_micro(precision)}

    cfg = fprep.PrepConfig(precision="bf16" if precision == "bf16" else "no")
    state, model = fprep.prepare(_linear(), cfg)
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
    loops["fprep"] = _micro_loop(model, lambda loss: fprep.backward(state, model, loss), optimizer)

    try:
        from accelerate import Accelerator
        from accelerate.state import AcceleratorState
    except ImportError:
        return loops
    AcceleratorState._reset_state(reset_partial_state=True)  # a fresh mixed_precision
    accelerator = Accelerator(cpu=True, mixed_precision="bf16" if precision == "bf16" else "no")
    acc_model = _linear()
    acc_model, acc_opt = accelerator.prepare(
        acc_model, torch.optim.SGD(acc_model.parameters(), lr=1e-3)
    )
    loops["accelerate"] = _micro_loop(acc_model, accelerator.backward, acc_opt)
    return loops


# -- report -------------------------------------------------------------------------------------
def _spread(lo: float, hi: float, fmt: str) -> str:
    return f"[{lo:{fmt}}, {hi:{fmt}}]"


def print_gpt_table(cases: dict[str, Case], rounds: int) -> None:
    print(
        f"\n1. small GPT ({GPT_CONFIG.num_params / 1e3:.0f}K params, batch {GPT_BATCH} x "
        f"{GPT_CONFIG.block_size} tokens, AdamW): median step time over {rounds} rounds"
    )
    print(
        f"   {'case':<19}{'torch':>9}{'fprep':>9}   {'fprep / torch':<24}"
        f"{'control / torch':<24}{'calls/step fprep / torch':<28}target <= {GPT_TARGET}"
    )
    for case, (times, calls) in cases.items():
        r, lo, hi = ratio(times, "fprep")
        c, clo, chi = ratio(times, CONTROL)
        fprep_cell = f"{r:.4f} {_spread(lo, hi, '.3f')}"
        calls_cell = f"{calls['fprep']:.0f} / {calls['torch']:.0f}"
        control_cell = f"{c:.4f} {_spread(clo, chi, '.3f')}"
        print(
            f"   {case:<19}{statistics.median(times['torch']) * 1e3:6.2f} ms"
            f"{statistics.median(times['fprep']) * 1e3:6.2f} ms   "
            f"{fprep_cell:<24}{control_cell:<24}"
            f"{calls_cell:<28}"
            f"{'ok' if r <= GPT_TARGET else 'MISSED'}"
        )


def print_micro_table(results: dict[str, Times], rounds: int) -> None:
    print(
        f"\n2. nn.Linear(64, 64) + SGD, batch 16, one process: median step time over {rounds} "
        "rounds; overhead = median - torch's median"
    )
    print(
        f"   {'':<6}{'torch':>9}{'fprep':>9}{'accelerate':>12}   {'fprep overhead':<24}"
        f"{'accelerate overhead':<29}{'control':<24}target <= {MICRO_TARGET_US:g} us"
    )
    for precision, times in results.items():
        medians = [
            f"{statistics.median(times[n]) * 1e6:6.1f} us" if n in times else "-"
            for n in ("torch", "fprep", "accelerate")
        ]
        cells = []
        for name in ("fprep", "accelerate", CONTROL):
            if name not in times:
                cells.append("(not installed)")
                continue
            o, lo, hi = overhead_us(times, name)
            cells.append(f"{o:+6.2f} us {_spread(lo, hi, '+.1f')}")
        fprep_us = overhead_us(times, "fprep")[0]
        print(
            f"   {precision:<6}{medians[0]:>9}{medians[1]:>9}{medians[2]:>12}   "
            f"{cells[0]:<24}{cells[1]:<29}{cells[2]:<24}"
            f"{'ok' if fprep_us <= MICRO_TARGET_US else 'MISSED'}"
        )


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a short run (a smoke test)")
    parser.add_argument("--rounds", type=int, default=None, help="GPT rounds (default 300)")
    parser.add_argument(
        "--micro-rounds", type=int, default=None, help="Linear rounds (default 30000)"
    )
    args = parser.parse_args(argv)
    rounds = args.rounds or (10 if args.quick else 300)
    micro_rounds = args.micro_rounds or (1000 if args.quick else 30000)
    warmup = 2 if args.quick else 5

    torch.set_num_threads(1)
    start = time.perf_counter()
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    print(
        f"fprep step overhead (torch {torch.__version__}, 1 thread per process, "
        f"{os.cpu_count()} CPUs, load average {load:.1f} at start)",
        flush=True,
    )

    cases = {
        "1 proc fp32": single_device_case("fp32", rounds, warmup),
        "1 proc bf16": single_device_case("bf16", rounds, warmup),
    }
    rank0 = run_ranks(_distributed_cases, 2, rounds, warmup, timeout_s=3600.0)[0]
    cases["DDP 2 ranks fp32"] = rank0["ddp"]
    cases["FSDP2 2 ranks fp32"] = rank0["fsdp2"]
    print_gpt_table(cases, rounds)
    sys.stdout.flush()

    micro = {p: interleaved(micro_loops(p), micro_rounds, 200) for p in ("fp32", "bf16")}
    print_micro_table(micro, micro_rounds)
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    print(f"\n({time.perf_counter() - start:.0f} s; load average {load:.1f} at the end)")


if __name__ == "__main__":
    main()
