"""Peak memory and time of loading a pretrained checkpoint into FSDP2 shards, against
``from_pretrained`` + ``fully_shard`` on every rank.

Run: ``python benchmarks/load_pretrained.py [--quick] [--rounds N] [--tp 2]``.

``--tp 2``: fprep loads into a tensor-parallel layout instead (tp 2 over the two ranks: each
reads its colwise rows and rowwise column runs, ``fprep.weights.blocks``); same bound.

The checkpoint: a Llama-shaped model (hidden 1024, 12 layers, MLP 2816, vocabulary 32000,
untied head: 222M parameters), written by ``save_pretrained`` in bfloat16 over several files
(``max_shard_size="100MB"``). Two ranks (gloo, CPU, one thread each) load it into float32
parameters sharded by FSDP2, two ways:

* ``hf``: the usual recipe: ``AutoModelForCausalLM.from_pretrained(dir, dtype=float32)`` on
  every rank, then ``fully_shard`` on every decoder layer and on the root;
* ``fprep``: the model built on the meta device, then ``fprep.prepare(model, PrepConfig(
  strategy="fsdp", wrap=LlamaDecoderLayer, weights=dir))``: each rank reads only its rows.

Each variant runs in fresh processes (spawned), after the process group exists and the variant
has loaded a small checkpoint once (first-use imports); the timed region is the construction
(``from_pretrained``, or the meta model) plus the preparation. Memory is the peak resident set
(``VmHWM``, reset through ``/proc/self/clear_refs`` just before the timed region;
``ru_maxrss`` where that is not writable) minus the resident set at that moment, per rank,
the worse rank counted. Targets: fprep's peak <= 1.05 x this rank's shard (float32 bytes)
+ 64 MiB; fprep's time <= hf's.
"""

from __future__ import annotations

import argparse
import os
import resource
import statistics
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from prepare_memory import _reset_peak, _status_kb
from torch import nn

import fprep
from fprep.testing.distributed import run_ranks

WORLD, TARGET, SLACK_MB = 2, 1.05, 64 * 2**20 / 1e6
MB = 1e6
FULL = {
    "hidden_size": 1024,
    "intermediate_size": 2816,
    "num_hidden_layers": 12,
    "vocab_size": 32000,
}
QUICK = {"hidden_size": 256, "intermediate_size": 688, "num_hidden_layers": 2, "vocab_size": 4096}


def config(quick: bool) -> Any:
    from transformers import LlamaConfig

    sizes = QUICK if quick else FULL
    return LlamaConfig(num_attention_heads=16, num_key_value_heads=16, **sizes)


def save(directory: Path, quick: bool) -> int:
    """Write the checkpoint (built in bfloat16, so the parent never holds a float32 copy)."""
    from transformers import LlamaForCausalLM

    torch.manual_seed(0)
    default = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        model = LlamaForCausalLM(config(quick))
    finally:
        torch.set_default_dtype(default)
    model.save_pretrained(directory, max_shard_size="2MB" if quick else "100MB")
    return sum(p.numel() for p in model.parameters())


def _load(variant: str, directory: Path, quick: bool, tp: int = 1) -> nn.Module:
    from transformers import AutoModelForCausalLM, LlamaForCausalLM
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer

    if variant == "fprep":
        with torch.device("meta"):
            model = LlamaForCausalLM(config(quick))
        cfg = fprep.PrepConfig(strategy="fsdp", wrap=LlamaDecoderLayer, weights=str(directory))
        if tp > 1:  # tp over the whole world: no data-parallel dimension left
            cfg = fprep.PrepConfig(strategy="auto", tp=tp, weights=str(directory))
        _, model = fprep.prepare(model, cfg)
        return model
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    model = AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32)
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def _worker(variant: str, directory: Path, quick: bool, tp: int = 1) -> dict[str, Any]:
    import transformers  # noqa: F401 - imported before timing, by both variants

    dist.init_process_group("gloo")
    try:
        _load(variant, directory / "warm", True, tp)  # first-use imports, not measured
        base_kb = _status_kb("VmRSS")
        exact = _reset_peak()
        dist.barrier()
        start = time.perf_counter()
        model = _load(variant, directory, quick, tp)
        dist.barrier()
        seconds = time.perf_counter() - start
        peak_kb = (
            _status_kb("VmHWM") if exact else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        )
        shard = sum(
            (p.to_local() if hasattr(p, "to_local") else p).numel() * p.dtype.itemsize
            for p in model.parameters()
        )
        return {"s": seconds, "peak": (peak_kb - base_kb) * 1024, "shard": shard, "exact": exact}
    finally:
        dist.destroy_process_group()


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a small model, one round")
    parser.add_argument("--rounds", type=int, default=None)
    parser.add_argument("--tp", type=int, default=1, choices=(1, WORLD), help="fprep's tp")
    args = parser.parse_args(argv)
    rounds = args.rounds or (1 if args.quick else 3)
    with tempfile.TemporaryDirectory() as tmp:
        directory = Path(tmp)
        n = save(directory, args.quick)
        save(directory / "warm", True)
        files = len(list(directory.glob("*.safetensors")))
        print(
            f"checkpoint: {n / 1e6:.1f}M parameters, bfloat16, {files} files "
            f"-> float32 fsdp x{WORLD}"
        )
        runs: dict[str, list[dict[str, float]]] = {"hf": [], "fprep": []}
        for _ in range(rounds):
            for variant in runs:  # alternate within each round
                ranks = run_ranks(
                    _worker, WORLD, variant, directory, args.quick, args.tp, timeout_s=600
                )
                runs[variant].append(
                    {
                        "s": max(r["s"] for r in ranks),
                        "peak": max(r["peak"] for r in ranks),
                        "shard": max(r["shard"] for r in ranks),
                        "exact": all(r["exact"] for r in ranks),
                    }
                )
    if not all(r["exact"] for v in runs.values() for r in v):
        print("warning: /proc/self/clear_refs was not writable: peaks are ru_maxrss")

    def med(variant: str, key: str) -> float:
        return statistics.median(r[key] for r in runs[variant])

    shard = med("fprep", "shard")
    bound = TARGET * shard + SLACK_MB * MB
    print(f"this rank's shard: {shard / MB:.0f} MB (float32); target peak <= {bound / MB:.0f} MB")
    for variant in runs:
        print(
            f"{variant:>6}: {med(variant, 's'):6.2f} s, peak +{med(variant, 'peak') / MB:6.0f} MB "
            f"= {med(variant, 'peak') / shard:4.2f} x shard"
        )
    time_ratio = statistics.median(
        f["s"] / h["s"] for f, h in zip(runs["fprep"], runs["hf"], strict=True)
    )
    peak_ok = med("fprep", "peak") <= bound
    print(
        f"fprep / hf: time {time_ratio:.2f} "
        f"(target <= 1: {'met' if time_ratio <= 1 else 'MISSED'}), "
        f"peak {med('fprep', 'peak') / med('hf', 'peak'):.2f}; "
        f"peak vs 1.05 x shard + 64 MiB: {'met' if peak_ok else 'MISSED'}"
    )


if __name__ == "__main__":
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    main()
