"""Pipeline parallelism with FSDP2, prepared by fprep against torchtitan's hand-written recipe:
step time and prepare peak memory, pp 2 x dp 2 on 4 CPU ranks (gloo).

Run: ``python benchmarks/pp.py [--quick] [--schedule 1F1B|Interleaved1F1B|...] [--rounds N]
[--memory-rounds N]``.

The model: ``fprep.testing.models.Llama`` (8 blocks, width 256, 8 heads / 4 kv heads, ffn 768,
vocabulary 2048: 7.3M parameters; ``--quick``: width 64, 4 blocks, 3 rounds, a smoke test),
built with real weights (the same seed) on every rank. Both sides run the same stages on the
2 x 2 mesh ``("pp", "dp")``: the split is fprep's plan (``fprep.plan(...).pipeline.split`` and
``.stages``, computed before anything is measured, as a hand-written recipe would hard-code it),
the schedule (``--schedule``, 1F1B by default) with ``MICROBATCHES`` micro-batches, ``lm_loss``
and ``scale_grads=True``:

* ``torch``: what torchtitan does by hand: ``init_device_mesh``; each stage module a copy of the
  model (torchtitan's ``pipeline_module_split``: ``copy.deepcopy``) with a pass-through, under
  the same name, in place of every module another stage holds; ``fully_shard`` on every block
  and the stage module over ``mesh["dp"]`` with ``reshard_after_forward=False``;
  ``PipelineStage(stage_module, index, num_stages, device, group=mesh["pp"].get_group())`` and
  the schedule class. The copy shares the model's parameters (``deepcopy``'s memo): torchtitan
  copies a meta-device model, where a copy costs nothing; copying real weights would charge the
  hand-written side a second model that fprep (whose stage modules share every module) never
  builds;
* ``fprep``: ``fprep.prepare(model, PrepConfig(pp=2, wrap=(LlamaBlock,), pp_schedule=...,
  pp_microbatches=MICROBATCHES))``.

Step time: AdamW, cross-entropy, gradient clipping to norm 1.0, batch ``BATCH`` x ``SEQ`` tokens
per data-parallel rank (each dp rank its own rows of one global batch; both sides see the same
batches). fprep: ``fprep.pipeline_step``, ``fprep.clip_grad_norm``; by hand: ``schedule.step``,
then the norm of the stage's DTensor gradients (one ``get_total_norm(...).full_tensor()`` per
distinct mesh), squared, all-reduced over the pp group, and ``clip_grads_with_norm_``. Before
anything is timed, the first ``CHECKED`` steps of every variant must agree: losses (on the last
stage) and clipped norms within 1e-5, else the script stops (it would compare different work).
Each round runs one step of every variant in a random order (the same on every rank; ranks meet
at a barrier before each step); figures are medians over rounds, the spread in brackets the
min-max of the same ratio over 5 chunks of rounds. ``torch again`` is a second hand-written copy
measured like the others: its ratio to ``torch`` is the noise floor. Target: fprep / torch <=
1.02. Beside it: the clipping alone, fprep's and by hand, on fprep's gradients; and the Python
calls per step of each rank (cProfile), a count the machine's load cannot move, to tell work
fprep adds from noise.

Prepare peak memory: every variant prepares in fresh processes (4 ranks spawned per variant
and round, variants alternating), after the process group exists, the model is built and a
tiny model was prepared once (one-time imports). The figure is the peak resident set during the
preparation (``VmHWM``, reset through ``/proc/self/clear_refs`` just before) minus the resident
set then, the worst of the 4 ranks, median over rounds. Target: fprep / torch <= 1.05.
"""

from __future__ import annotations

import argparse
import copy
import gc
import math
import os
import statistics
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from _timing import Loop, interleaved, python_calls, ratio
from prepare_memory import _reset_peak, _status_kb
from torch import nn

import fprep
from fprep.testing.distributed import run_ranks
from fprep.testing.models import Llama, LlamaBlock, LlamaConfig, llama, lm_loss, synthetic_batches

CONFIG = LlamaConfig(dim=256, n_layers=8, n_heads=8, n_kv_heads=4, ffn_dim=768, vocab_size=2048)
TINY = LlamaConfig(dim=32, n_layers=4, n_heads=2, n_kv_heads=2, ffn_dim=32, vocab_size=64)
#: --quick: the same shape, smaller (a smoke test of the script, not a measurement)
QUICK = LlamaConfig(dim=64, n_layers=4, n_heads=4, n_kv_heads=2, ffn_dim=128, vocab_size=256)
WORLD, PP = 4, 2
DP = WORLD // PP
BATCH, SEQ = 4, 64  # per data-parallel rank
MICROBATCHES = 4
SCHEDULES = ("1F1B", "Interleaved1F1B", "GPipe", "LoopedBFS")
STEP_TARGET, MEMORY_TARGET = 1.02, 1.05
MAX_NORM = 1.0
CHECKED, TOLERANCE = 3, 1e-5
CONTROL = "torch again"
MB = 1e6


def build(config: LlamaConfig = CONFIG) -> Llama:
    return llama(config, "cpu", seed=0)


def config_of(schedule: str) -> fprep.PrepConfig:
    return fprep.PrepConfig(
        pp=PP, wrap=(LlamaBlock,), pp_schedule=schedule, pp_microbatches=MICROBATCHES
    )


@dataclass(frozen=True)
class Layout:
    """fprep's split of the model into stages and this rank's stages (what both sides run)."""

    split: tuple[tuple[str, ...], ...]
    stages: tuple[int, ...]


def layout(schedule: str, config: LlamaConfig = CONFIG) -> Layout:
    """The plan's split, from a meta-device copy (planning touches no tensor data)."""
    topology = fprep.Topology(world_size=WORLD, rank=dist.get_rank())
    plan = fprep.plan(llama(config, "meta"), config_of(schedule), topology).unwrap().pipeline
    assert plan is not None
    return Layout(plan.split, plan.stages)


# -- the two preparations ---------------------------------------------------------------------
class PassThrough(nn.Module):
    """Stands in for a module another stage holds: returns its first input."""

    def forward(self, x: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        return x


@dataclass
class Hand:
    """The hand-written pipeline: this rank's stage modules, its schedule and the pp group."""

    parts: list[nn.Module]
    schedule: Any
    pp_group: Any
    holds_first: bool
    holds_last: bool

    def parameters(self) -> list[nn.Parameter]:
        seen: dict[int, nn.Parameter] = {}
        for part in self.parts:
            for p in part.parameters():
                seen.setdefault(id(p), p)
        return list(seen.values())


def stage_module(model: nn.Module, held: Sequence[str], split: Sequence[Sequence[str]]) -> Any:
    """A copy of ``model`` with a pass-through, under the same name, for every module of
    ``split`` not in ``held``; the copy shares the model's parameters and buffers."""
    memo: dict[int, Any] = {id(t): t for t in (*model.parameters(), *model.buffers())}
    for names in split:
        for name in names:
            if name not in held:
                memo[id(model.get_submodule(name))] = PassThrough()
    return copy.deepcopy(model, memo)


def hand_written(model: Llama, schedule: str, where: Layout) -> Hand:
    """torchtitan's pipeline_llama (pipeline_module_split, then FSDP2 over dp), without fprep."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.pipelining import PipelineStage
    from torch.distributed.pipelining.schedules import get_schedule_class

    mesh = init_device_mesh("cpu", (PP, DP), mesh_dim_names=("pp", "dp"))
    dp_mesh, pp_group = mesh["dp"], mesh["pp"].get_group()
    parts, stages = [], []
    for index in where.stages:
        part = stage_module(model, where.split[index], where.split)
        for module in part.modules():
            if isinstance(module, LlamaBlock):
                fully_shard(module, mesh=dp_mesh, reshard_after_forward=False)
        fully_shard(part, mesh=dp_mesh, reshard_after_forward=False)
        parts.append(part)
        stages.append(
            PipelineStage(part, index, len(where.split), torch.device("cpu"), group=pp_group)
        )
    cls = get_schedule_class(schedule)
    looped = len(stages) > 1 or schedule not in ("GPipe", "1F1B")
    runs = cls(
        stages if looped else stages[0],
        n_microbatches=MICROBATCHES,
        loss_fn=lm_loss,
        scale_grads=True,
    )
    last = len(where.split) - 1
    return Hand(parts, runs, pp_group, 0 in where.stages, last in where.stages)


# -- step time --------------------------------------------------------------------------------
def clip_by_hand(params: Sequence[nn.Parameter], max_norm: float, pp_group: Any) -> torch.Tensor:
    """Hand-written clipping of a stage's FSDP2 gradients: one DTensor norm per distinct mesh,
    squared, summed over the pipeline ranks, then torch's ``clip_grads_with_norm_``."""
    grads: list[Any] = [p.grad for p in params if p.grad is not None]
    by_mesh: dict[Any, list[Any]] = {}
    for g in grads:
        by_mesh.setdefault(g.device_mesh, []).append(g)
    norms = [nn.utils.get_total_norm(group).full_tensor() for group in by_mesh.values()]  # type: ignore[attr-defined]
    squared = torch.stack(norms).pow(2).sum() if norms else torch.zeros(())
    dist.all_reduce(squared, group=pp_group)
    total = squared.sqrt()
    nn.utils.clip_grads_with_norm_(params, max_norm, total)
    return total


def _batches(config: LlamaConfig) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """8 global batches; this rank's rows of each (its data-parallel coordinate's share)."""
    share = dist.get_rank() % DP  # pp is the outer mesh dimension: rank = pp * DP + dp
    rows = slice(share * BATCH, (share + 1) * BATCH)
    return [
        (x[rows], y[rows])
        for x, y in synthetic_batches(
            8, batch_size=BATCH * DP, seq_len=SEQ, vocab_size=config.vocab_size, seed=0
        )
    ]


Record = list[tuple[float, float]]  # (loss or nan, clipped norm) of each checked step


def _loop(variant: str, schedule: str, where: Layout, config: LlamaConfig) -> tuple[Loop, Record]:
    model = build(config)
    batches = _batches(config)
    record: Record = []
    i = 0
    if variant == "fprep":
        state, prepared = fprep.prepare(model, config_of(schedule))
        optimizer = torch.optim.AdamW(prepared.parameters(), lr=1e-3)

        def step() -> None:
            nonlocal i
            x, y = batches[i % len(batches)]
            i += 1
            loss = fprep.pipeline_step(state, prepared, x, y, lm_loss)
            norm = fprep.clip_grad_norm(state, prepared, MAX_NORM)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            if len(record) < CHECKED:
                record.append((math.nan if loss is None else loss.item(), norm.item()))

        return step, record

    hand = hand_written(model, schedule, where)
    params = hand.parameters()
    optimizer = torch.optim.AdamW(params, lr=1e-3)

    def step_by_hand() -> None:
        nonlocal i
        x, y = batches[i % len(batches)]
        i += 1
        args = (x,) if hand.holds_first else ()
        losses: list[torch.Tensor] = []
        kwargs: dict[str, Any] = {"target": y, "losses": losses} if hand.holds_last else {}
        hand.schedule.step(*args, **kwargs)
        norm = clip_by_hand(params, MAX_NORM, hand.pp_group)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if len(record) < CHECKED:
            loss = torch.stack(losses).mean().item() if losses else math.nan
            record.append((loss, norm.item()))

    return step_by_hand, record


def _check_same(records: dict[str, Record]) -> None:
    """Every variant's first steps computed the same losses and norms, on every rank; a
    RuntimeError on every rank otherwise (the benchmark would compare different work)."""
    base = records["torch"]
    worst = 0.0
    for record in records.values():
        for (loss, norm), (base_loss, base_norm) in zip(record, base, strict=True):
            if not math.isnan(base_loss):
                worst = max(worst, abs(loss - base_loss))
            worst = max(worst, abs(norm - base_norm) / max(base_norm, 1e-12))
    agreed = torch.tensor(worst)
    dist.all_reduce(agreed, op=dist.ReduceOp.MAX)
    if not agreed.item() <= TOLERANCE:
        raise RuntimeError(
            f"the variants differ by {agreed.item():.3g} (> {TOLERANCE}) in the first "
            f"{CHECKED} steps' losses or clipped norms (rank {dist.get_rank()}: {records}): "
            "they do not run the same computation"
        )


def _parts(rounds: int, schedule: str, config: LlamaConfig) -> dict[str, list[float]]:
    """Clipping alone, fprep's and by hand, on the gradients of one fprep step."""
    from torch.distributed.device_mesh import init_device_mesh

    state, model = fprep.prepare(build(config), config_of(schedule))
    x, y = _batches(config)[0]
    fprep.pipeline_step(state, model, x, y, lm_loss)
    params = list(model.parameters())
    pp_group = init_device_mesh("cpu", (PP, DP), mesh_dim_names=("pp", "dp"))["pp"].get_group()
    big = 1e9  # nothing is scaled: every round sees the same gradients
    loops = {
        "clip fprep": lambda: fprep.clip_grad_norm(state, model, big) and None,
        "clip by hand": lambda: clip_by_hand(params, big, pp_group) and None,
    }
    return interleaved(loops, rounds, warmup=2)


def step_times(
    schedule: str, rounds: int, warmup: int, config: LlamaConfig, profiled: int
) -> dict[str, Any]:
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    where = layout(schedule, config)
    built = {name: _loop(name, schedule, where, config) for name in ("fprep", "torch", CONTROL)}
    loops = {name: loop for name, (loop, _) in built.items()}
    for _ in range(CHECKED):
        for loop in loops.values():
            loop()
    _check_same({name: record for name, (_, record) in built.items()})
    times = interleaved(loops, rounds, max(0, warmup - CHECKED))
    calls = {name: python_calls(loops[name], profiled, 2) for name in ("fprep", "torch")}
    return {
        "times": {**times, **_parts(rounds, schedule, config)},
        "records": built["fprep"][1],
        "calls": calls,
    }


# -- prepare peak memory ----------------------------------------------------------------------
def _prepare(variant: str, schedule: str, model: Llama, where: Layout) -> list[nn.Parameter]:
    """Prepare ``model``; this rank's parameters."""
    if variant == "fprep":
        return list(fprep.prepare(model, config_of(schedule))[1].parameters())
    return hand_written(model, schedule, where).parameters()


def prepare_peak(variant: str, schedule: str, config: LlamaConfig) -> dict[str, Any]:
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    # one-time imports and DTensor dispatch caches
    _prepare(variant, schedule, build(TINY), layout(schedule, TINY))
    where = layout(schedule, config)
    model = build(config)
    gc.collect()
    dist.barrier()
    base_kb = _status_kb("VmRSS")
    reset = _reset_peak()
    start = time.perf_counter()
    params = _prepare(variant, schedule, model, where)
    seconds = time.perf_counter() - start
    peak_kb = _status_kb("VmHWM")
    local = sum(p.to_local().numel() for p in params)  # type: ignore[attr-defined]
    dist.barrier()
    return {
        "peak_mb": (peak_kb - base_kb) * 1024 / MB,
        "abs_mb": peak_kb * 1024 / MB,
        "seconds": seconds,
        "reset": reset,
        "local_mb": local * 4 / MB,
    }


# -- report -----------------------------------------------------------------------------------
def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a short run (a smoke test)")
    parser.add_argument(
        "--schedule", choices=SCHEDULES, default="1F1B", help="pp_schedule (default 1F1B)"
    )
    parser.add_argument("--rounds", type=int, default=None, help="step rounds (default 100)")
    parser.add_argument(
        "--memory-rounds", type=int, default=None, help="prepare rounds (default 3)"
    )
    args = parser.parse_args(argv)
    config = QUICK if args.quick else CONFIG
    rounds = args.rounds or (3 if args.quick else 100)
    memory_rounds = args.memory_rounds or (1 if args.quick else 3)
    warmup = CHECKED if args.quick else 5
    profiled = 1 if args.quick else 4  # steps per count of Python calls
    schedule = args.schedule
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    params = sum(p.numel() for p in llama(config, "meta").parameters())
    print(
        f"fprep pipeline parallelism (torch {torch.__version__}, {WORLD} ranks gloo pp {PP} x "
        f"dp {DP}, {schedule}, {MICROBATCHES} micro-batches, 1 thread per process, "
        f"{os.cpu_count()} CPUs, load average {load:.1f} at start); Llama "
        f"{params / 1e6:.1f}M params, {config.n_layers} blocks",
        flush=True,
    )
    start = time.perf_counter()
    outs = run_ranks(
        step_times, WORLD, schedule, rounds, warmup, config, profiled, timeout_s=3600.0
    )
    times = outs[0]["times"]
    last = next(o["records"] for o in outs if not math.isnan(o["records"][0][0]))
    print(
        f"\nthe first {CHECKED} steps agree within {TOLERANCE} (losses "
        f"{', '.join(f'{loss:.4f}' for loss, _ in last)}; norms "
        f"{', '.join(f'{norm:.4f}' for _, norm in last)})"
    )
    r, lo, hi = ratio(times, "fprep")
    c, clo, chi = ratio(times, CONTROL)
    print(
        f"\nstep time, median over {rounds} rounds (batch {BATCH} x {SEQ} per dp rank, AdamW, "
        f"clipping to {MAX_NORM})"
    )
    print(f"   torch {statistics.median(times['torch']) * 1e3:7.2f} ms")
    print(f"   fprep {statistics.median(times['fprep']) * 1e3:7.2f} ms")
    print(
        f"   fprep / torch {r:.4f} [{lo:.3f}, {hi:.3f}]   control / torch {c:.4f} "
        f"[{clo:.3f}, {chi:.3f}]   target <= {STEP_TARGET}: "
        f"{'ok' if r <= STEP_TARGET else 'MISSED'}",
        flush=True,
    )
    for name in ("clip fprep", "clip by hand"):
        print(f"   {name:<12} {statistics.median(times[name]) * 1e3:7.2f} ms (alone)")
    for rank, out in enumerate(outs):
        f, t = out["calls"]["fprep"], out["calls"]["torch"]
        print(
            f"   Python calls per step, rank {rank}: fprep {f:.0f}, torch {t:.0f} "
            f"({f / t:.3f}x; cProfile, the fewest of 2 counts of {profiled} steps)"
        )
    sys.stdout.flush()
    peaks: dict[str, list[float]] = {"torch": [], "fprep": []}
    absolute: dict[str, list[float]] = {"torch": [], "fprep": []}
    secs: dict[str, list[float]] = {"torch": [], "fprep": []}
    local_mb = 0.0
    reset = True
    for i in range(memory_rounds):
        for variant in ("torch", "fprep") if i % 2 == 0 else ("fprep", "torch"):
            outs = run_ranks(prepare_peak, WORLD, variant, schedule, config, timeout_s=1800.0)
            peaks[variant].append(max(o["peak_mb"] for o in outs))
            absolute[variant].append(max(o["abs_mb"] for o in outs))
            secs[variant].append(max(o["seconds"] for o in outs))
            local_mb = max(o["local_mb"] for o in outs)
            reset = reset and all(o["reset"] for o in outs)
    if not reset:
        print("warning: /proc/self/clear_refs was not writable: peaks include earlier peaks")
    full_mb = params * 4 / MB
    print(
        f"\nprepare peak memory (worst rank, median over {memory_rounds} rounds; the full "
        f"model is {full_mb:.1f} MB, the largest rank keeps {local_mb:.1f} MB)"
    )
    base = statistics.median(peaks["torch"])
    abs_base = statistics.median(absolute["torch"])
    for variant in ("torch", "fprep"):
        m, a = statistics.median(peaks[variant]), statistics.median(absolute[variant])
        r = m / base if base > 0 else float("nan")
        print(
            f"   {variant:<6} peak +{m:7.1f} MB (ratio {r:.3f})"
            f"   process peak {a:7.1f} MB (ratio {a / abs_base:.3f})"
            f"   time {statistics.median(secs[variant]):6.2f} s"
        )
    a = statistics.median(absolute["fprep"]) / abs_base
    m = statistics.median(peaks["fprep"])
    verdict = "ok" if base > 0 and m / base <= MEMORY_TARGET else "MISSED"
    print(
        f"   target fprep / torch <= {MEMORY_TARGET}: increase {verdict}, process peak "
        f"{'ok' if a <= MEMORY_TARGET else 'MISSED'}"
    )
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    print(f"\n({time.perf_counter() - start:.0f} s; load average {load:.1f} at the end)")
    sys.stdout.flush()


if __name__ == "__main__":
    main()
