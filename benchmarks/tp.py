"""Tensor parallelism with FSDP2, prepared by fprep against torchtitan's hand-written recipe:
step time and prepare peak memory, dp 2 x tp 2 on 4 CPU ranks (gloo).

Run: ``python benchmarks/tp.py [--quick] [--rounds N] [--memory-rounds N]``.

The model: ``fprep.testing.models.Llama`` (4 blocks, width 256, 8 heads / 4 kv heads, ffn 768,
vocabulary 2048: 5.2M parameters), built with real weights on every rank. Two ways to prepare it
on the 2 x 2 mesh ``("dp", "tp")``:

* ``torch``: torchtitan's ``parallelize_llama`` written out: ``init_device_mesh``, then
  ``parallelize_module`` with Megatron's plan (``RowwiseParallel`` on the embedding, ``Colwise``
  on wq / wk / wv / w1 / w3, ``Rowwise`` on wo / w2, ``Colwise`` gathering the output head) on
  ``mesh["tp"]``, then ``fully_shard`` on every block and the root over ``mesh["dp"]``;
* ``fprep``: ``fprep.prepare(model, PrepConfig(strategy="fsdp", tp=2, wrap=LlamaBlock))`` (the
  model's own ``Llama._tp_plan``: the same styles).

Step time: AdamW, cross-entropy, gradient clipping to norm 1.0, batch 2 x 64 tokens per
data-parallel rank. Clipping is part of every real loop and was the step's largest difference
(issue 27): ``fprep.clip_grad_norm`` on fprep's side; on torch's, what a careful hand-written
loop does: the gradients grouped by mesh (``DeviceMesh`` equality), each group's norm through
DTensor (``get_total_norm(...).full_tensor()``), combined, then ``clip_grads_with_norm_``. Each
round runs one step of every variant in a random order (the same on every rank; ranks meet at
a barrier before each step); figures are medians over rounds, the spread in brackets the
min-max of the same ratio over 5 chunks of rounds. ``torch again`` is a second hand-written copy
measured like the others: its ratio to ``torch`` is the noise floor. Target: fprep / torch <=
1.02. Two lines break it down: the clipping alone (both ways, on fprep's gradients) and
``fprep.check_tp_inputs`` of one batch (what the first forward of a prepared model checks once).

Prepare peak memory: every variant prepares in fresh processes (4 ranks spawned per variant
and round, variants alternating), after the process group exists, the model is built and a
tiny model was prepared once (one-time imports). The figure is the peak resident set during the
preparation (``VmHWM``, reset through ``/proc/self/clear_refs`` just before) minus the resident
set then, the worst of the 4 ranks, median over rounds. Target: fprep / torch <= 1.05.
"""

from __future__ import annotations

import argparse
import gc
import os
import statistics
import sys
import time
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from _timing import Loop, interleaved, ratio
from prepare_memory import _reset_peak, _status_kb
from torch import nn

import fprep
from fprep.testing.distributed import run_ranks
from fprep.testing.models import Llama, LlamaBlock, LlamaConfig, llama

CONFIG = LlamaConfig(dim=256, n_layers=4, n_heads=8, n_kv_heads=4, ffn_dim=768, vocab_size=2048)
TINY = LlamaConfig(dim=32, n_layers=1, n_heads=2, n_kv_heads=2, ffn_dim=32, vocab_size=64)
WORLD, TP = 4, 2
BATCH, SEQ = 2, 64
STEP_TARGET, MEMORY_TARGET = 1.02, 1.05
MAX_NORM = 1.0
CONTROL = "torch again"
MB = 1e6


def build(config: LlamaConfig = CONFIG) -> Llama:
    return llama(config, "cpu", seed=0)


# -- the two preparations ---------------------------------------------------------------------
def hand_written(model: Llama) -> nn.Module:
    """torchtitan's parallelize_llama (TP, then FSDP2 over dp), without fprep."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        parallelize_module,
    )

    mesh = init_device_mesh("cpu", (WORLD // TP, TP), mesh_dim_names=("dp", "tp"))
    tp_mesh, dp_mesh = mesh["tp"], mesh["dp"]
    parallelize_module(
        model,
        tp_mesh,
        {
            "tok_embeddings": RowwiseParallel(input_layouts=Replicate()),
            "output": ColwiseParallel(output_layouts=Replicate()),
        },
    )
    for block in model.layers:
        parallelize_module(
            block,
            tp_mesh,
            {
                "attention.wq": ColwiseParallel(),
                "attention.wk": ColwiseParallel(),
                "attention.wv": ColwiseParallel(),
                "attention.wo": RowwiseParallel(),
                "feed_forward.w1": ColwiseParallel(),
                "feed_forward.w3": ColwiseParallel(),
                "feed_forward.w2": RowwiseParallel(),
            },
        )
        fully_shard(block, mesh=dp_mesh)
    fully_shard(model, mesh=dp_mesh)
    return model


def prepared(variant: str, model: Llama) -> tuple[nn.Module, Any]:
    """(model, fprep state or None)."""
    if variant == "fprep":
        state, out = fprep.prepare(model, fprep.PrepConfig(strategy="fsdp", tp=TP, wrap=LlamaBlock))
        return out, state
    return hand_written(model), None


# -- step time --------------------------------------------------------------------------------
def clip_by_hand(model: nn.Module, max_norm: float) -> torch.Tensor:
    """Hand-written clipping of FSDP2 x TP gradients: one DTensor norm per distinct mesh."""
    params: list[Any] = [p for p in model.parameters() if p.grad is not None]
    by_mesh: dict[Any, list[Any]] = {}
    for p in params:
        by_mesh.setdefault(p.grad.device_mesh, []).append(p.grad)
    norms = [nn.utils.get_total_norm(group) for group in by_mesh.values()]
    norms = [n.full_tensor() for n in norms]  # type: ignore[attr-defined]
    total = torch.stack(norms).pow(2).sum().sqrt()
    # clip_grads_with_norm_ takes the parameters and scales their .grad (given the gradients,
    # it would find no .grad on them and scale nothing)
    nn.utils.clip_grads_with_norm_(params, max_norm, total)
    return total


def _batches() -> torch.Tensor:
    g = torch.Generator().manual_seed(dist.get_rank() // TP)  # one batch per tp group
    return torch.randint(0, CONFIG.vocab_size, (8, BATCH, SEQ + 1), generator=g)


def _loop(variant: str) -> Loop:
    model, state = prepared("fprep" if variant == "fprep" else "torch", build())
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    tokens = _batches()
    i = 0

    def step() -> None:
        nonlocal i
        t = tokens[i % len(tokens)]
        i += 1
        logits = model(t[:, :-1])
        loss = F.cross_entropy(logits.flatten(0, 1), t[:, 1:].flatten())
        if state is None:
            loss.backward()
            clip_by_hand(model, MAX_NORM)
            optimizer.step()
        else:
            fprep.backward(state, model, loss)
            fprep.clip_grad_norm(state, model, MAX_NORM)
            fprep.optimizer_step(state, optimizer)
        optimizer.zero_grad(set_to_none=True)

    return step


def _parts(rounds: int) -> dict[str, list[float]]:
    """Clipping alone (fprep's and by hand, on fprep's gradients) and one input check."""
    model, state = prepared("fprep", build())
    t = _batches()[0]
    logits = model(t[:, :-1])
    fprep.backward(state, model, F.cross_entropy(logits.flatten(0, 1), t[:, 1:].flatten()))
    big = 1e9  # nothing is scaled: every round sees the same gradients
    loops = {
        "clip fprep": lambda: fprep.clip_grad_norm(state, model, big) and None,
        "clip by hand": lambda: clip_by_hand(model, big) and None,
        "input check": lambda: fprep.check_tp_inputs(state, t[:, :-1]),
    }
    return interleaved(loops, rounds, warmup=2)


def step_times(rounds: int, warmup: int) -> dict[str, list[float]]:
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    loops = {name: _loop(name) for name in ("fprep", "torch", CONTROL)}
    return {**interleaved(loops, rounds, warmup), **_parts(rounds)}


# -- prepare peak memory ----------------------------------------------------------------------
def prepare_peak(variant: str) -> dict[str, Any]:
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    prepared(variant, build(TINY))  # one-time imports and DTensor dispatch caches
    model = build()
    gc.collect()
    dist.barrier()
    base_kb = _status_kb("VmRSS")
    reset = _reset_peak()
    start = time.perf_counter()
    out, _ = prepared(variant, model)
    seconds = time.perf_counter() - start
    peak_kb = _status_kb("VmHWM")
    local = sum(p.to_local().numel() for p in out.parameters())  # type: ignore[attr-defined]
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
    parser.add_argument("--rounds", type=int, default=None, help="step rounds (default 200)")
    parser.add_argument(
        "--memory-rounds", type=int, default=None, help="prepare rounds (default 3)"
    )
    args = parser.parse_args(argv)
    rounds = args.rounds or (10 if args.quick else 200)
    memory_rounds = args.memory_rounds or (1 if args.quick else 3)
    warmup = 2 if args.quick else 5
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    params = sum(p.numel() for p in llama(CONFIG, "meta").parameters())
    print(
        f"fprep tensor parallelism (torch {torch.__version__}, {WORLD} ranks gloo dp "
        f"{WORLD // TP} x tp {TP}, 1 thread per process, {os.cpu_count()} CPUs, load average "
        f"{load:.1f} at start); Llama {params / 1e6:.1f}M params",
        flush=True,
    )
    start = time.perf_counter()
    times = run_ranks(step_times, WORLD, rounds, warmup, timeout_s=3600.0)[0]
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
    for name in ("clip fprep", "clip by hand", "input check"):
        print(f"   {name:<12} {statistics.median(times[name]) * 1e3:7.2f} ms (alone)")
    sys.stdout.flush()
    peaks: dict[str, list[float]] = {"torch": [], "fprep": []}
    absolute: dict[str, list[float]] = {"torch": [], "fprep": []}
    secs: dict[str, list[float]] = {"torch": [], "fprep": []}
    local_mb = 0.0
    reset = True
    for i in range(memory_rounds):
        for variant in ("torch", "fprep") if i % 2 == 0 else ("fprep", "torch"):
            outs = run_ranks(prepare_peak, WORLD, variant, timeout_s=1800.0)
            peaks[variant].append(max(o["peak_mb"] for o in outs))
            absolute[variant].append(max(o["abs_mb"] for o in outs))
            secs[variant].append(max(o["seconds"] for o in outs))
            local_mb = outs[0]["local_mb"]
            reset = reset and all(o["reset"] for o in outs)
    if not reset:
        print("warning: /proc/self/clear_refs was not writable: peaks include earlier peaks")
    full_mb = params * 4 / MB
    print(
        f"\nprepare peak memory (worst rank, median over {memory_rounds} rounds; the full "
        f"model is {full_mb:.1f} MB, each rank keeps {local_mb:.1f} MB)"
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
        f"{'ok' if a <= MEMORY_TARGET else 'MISSED'} (the price of rollback: fprep's record "
        "keeps the original weights, by reference, until prepare returns, so the TP blocks "
        "torch copies sit beside them; torch frees each original as TP replaces it)"
    )
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    print(f"\n({time.perf_counter() - start:.0f} s; load average {load:.1f} at the end)")
    sys.stdout.flush()


if __name__ == "__main__":
    main()
