"""Peak memory and time of loading a pretrained checkpoint into FSDP2 shards, against
``from_pretrained`` + ``fully_shard`` on every rank.

Run: ``python benchmarks/load_pretrained.py [--quick] [--rounds N] [--tp 2] [--device cuda]``.

``--device DEVICE`` (an accelerator: cuda, xpu, hpu) measures instead one process loading the
checkpoint onto the device, float32 parameters from the bfloat16 files, rounds interleaved:
``from_pretrained(dir, dtype=float32, device_map=DEVICE)`` against ``fprep.prepare`` of the meta
model with ``weights=dir``, the page-cache read bandwidth of the files (parallel ``preadv``
into one pinned buffer per thread) against ``fprep.weights.pipeline.pour``'s (files to device
parameters, every copy done), and the device memory ``pour`` added beyond the parameters
(bound: two chunk buffers). ``measure_device(directory, device, rounds)`` returns these
figures as a dict. ``--size 3b`` (with ``--device``) loads the issue's 3.0B Llama instead
(6.0 GB of files; built on the device, about a minute in all on an H100).

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
#: The issue's 3B case (device mode, ``--size 3b``): Llama-3.2-3B's layer shapes (hidden 3072,
#: 28 layers, MLP 8192, 24 query / 8 key-value heads), a 32000 vocabulary, untied: 3.0B
#: parameters, 6.0 GB of bfloat16 files, 12 GB of float32 parameters on the device.
THREE_B = {
    "hidden_size": 3072,
    "intermediate_size": 8192,
    "num_hidden_layers": 28,
    "vocab_size": 32000,
    "num_attention_heads": 24,
    "num_key_value_heads": 8,
}


def config(quick: bool, size: str | None = None) -> Any:
    """The checkpoint's config: ``--quick``'s, the default, or ``size="3b"``."""
    from transformers import LlamaConfig

    if size == "3b":
        return LlamaConfig(**THREE_B, tie_word_embeddings=False)
    sizes = QUICK if quick else FULL
    return LlamaConfig(num_attention_heads=16, num_key_value_heads=16, **sizes)


def save(directory: Path, quick: bool, size: str | None = None, device: str = "cpu") -> int:
    """Write the checkpoint (built in bfloat16, so the parent never holds a float32 copy; on
    ``device`` when given: initializing 3B parameters on a GPU takes a second, on a CPU a
    minute)."""
    from transformers import LlamaForCausalLM

    torch.manual_seed(0)
    default = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        with torch.device(device):
            model = LlamaForCausalLM(config(quick, size))
    finally:
        torch.set_default_dtype(default)
    shard = "2GB" if size == "3b" else "2MB" if quick else "100MB"
    model.save_pretrained(directory, max_shard_size=shard)
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


def _sync(device: torch.device) -> None:
    if device.type != "cpu":  # (cpu: a smoke run of this code)
        torch.accelerator.synchronize(device)


def _allocated(device: torch.device, peak: bool = False) -> int:
    if device.type == "cpu":
        return 0
    get = torch.accelerator.max_memory_allocated if peak else torch.accelerator.memory_allocated
    return int(get(device))


def _read_bandwidth(directory: Path, device: torch.device, readers: int) -> float:
    """GB/s of reading every file from the page cache into pinned memory (no device copy)."""
    from concurrent.futures import ThreadPoolExecutor

    from fprep.devices import Lane
    from fprep.tensor_bytes import byte_view
    from fprep.weights.pipeline import CHUNK_BYTES, read_exact

    lane = Lane(device)
    buffers = [lane.host_buffer(CHUNK_BYTES, torch.uint8) for _ in range(readers)]
    jobs = [
        (f, off)
        for f in sorted(directory.glob("*.safetensors"))
        for off in range(0, f.stat().st_size, CHUNK_BYTES)
    ]
    fds = {f: os.open(f, os.O_RDONLY) for f, _ in jobs}

    def read(i: int) -> None:
        buffer = buffers[i % readers]
        for f, off in jobs[i::readers]:
            n = min(CHUNK_BYTES, f.stat().st_size - off)
            read_exact(fds[f], byte_view(buffer[:n]), off, str(f))

    try:
        start = time.perf_counter()
        with ThreadPoolExecutor(readers) as pool:
            list(pool.map(read, range(readers)))
        seconds = time.perf_counter() - start
    finally:
        for fd in fds.values():
            os.close(fd)
    return sum(f.stat().st_size for f in fds) / seconds / 1e9


def _pour_files(directory: Path, device: torch.device) -> dict[str, float]:
    """Every tensor of the files into float32 tensors on ``device`` through ``pour``."""
    from fprep.devices import Lane
    from fprep.weights.pipeline import CHUNK_BYTES, chunks_of, default_readers, pour
    from fprep.weights.source import snapshot

    snap = snapshot(str(directory))
    fds = {f.path: os.open(f.real, os.O_RDONLY) for f in snap.files}
    try:
        dests = [torch.empty(t.shape, dtype=torch.float32, device=device) for t in snap.tensors]
        _sync(device)
        before = _allocated(device)
        if device.type != "cpu":
            torch.accelerator.reset_peak_memory_stats(device)
        chunks = [
            c
            for t, d in zip(snap.tensors, dests, strict=True)
            for c in chunks_of(
                fds[t.file], t.file, t.offset, getattr(torch, t.dtype), d, CHUNK_BYTES
            )
        ]
        stats = pour(chunks, Lane(device), readers=default_readers(device))
        extra = _allocated(device, peak=True) - before
    finally:
        for fd in fds.values():
            os.close(fd)
    return {
        "pour_s": stats.seconds,
        "pour_gbps": stats.gb_per_s,
        "readers": stats.readers,
        "waited_s": stats.waited_s,
        "extra_device_bytes": extra,
        "device_buffer_bytes": stats.device_buffer_bytes,
    }


def _load_on(
    variant: str, directory: Path, device: torch.device, quick: bool, size: str | None = None
) -> float:
    from transformers import AutoModelForCausalLM, LlamaForCausalLM

    _sync(device)
    start = time.perf_counter()
    if variant == "hf":
        where = {"device_map": str(device)} if device.type != "cpu" else {}  # needs accelerate
        model = AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32, **where)
    else:
        with torch.device("meta"):
            model = LlamaForCausalLM(config(quick, size))
        cfg = fprep.PrepConfig(device=str(device), weights=str(directory))
        _, model = fprep.prepare(model, cfg)
    _sync(device)
    seconds = time.perf_counter() - start
    del model
    return seconds


def measure_device(
    directory: Path, device: str, rounds: int = 3, quick: bool = False, size: str | None = None
) -> dict[str, float]:
    """The device figures (module docstring) for a checkpoint ``save`` wrote; medians."""
    from fprep.weights.pipeline import default_readers

    dev = torch.device(device)
    _load_on("fprep", directory, dev, quick, size)  # first-use imports and the page cache
    _load_on("hf", directory, dev, quick, size)
    runs: dict[str, list[float]] = {"hf": [], "fprep": [], "read_gbps": [], "pour_gbps": []}
    pours = []
    for _ in range(rounds):
        for variant in ("hf", "fprep"):
            runs[variant].append(_load_on(variant, directory, dev, quick, size))
        runs["read_gbps"].append(_read_bandwidth(directory, dev, default_readers(dev)))
        pours.append(_pour_files(directory, dev))
        runs["pour_gbps"].append(pours[-1]["pour_gbps"])
    out = {k: statistics.median(v) for k, v in runs.items()}
    out["ratio"] = statistics.median(f / h for f, h in zip(runs["fprep"], runs["hf"], strict=True))
    out["bandwidth_share"] = out["pour_gbps"] / out["read_gbps"]
    out["extra_device_bytes"] = max(p["extra_device_bytes"] for p in pours)
    out["device_buffer_bytes"] = pours[-1]["device_buffer_bytes"]
    out["readers"] = pours[-1]["readers"]
    return out


def main_device(device: str, quick: bool, rounds: int, size: str | None = None) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        directory = Path(tmp)
        n = save(directory, quick, size, device)
        if device != "cpu":  # the source model's memory back before anything is measured
            torch.accelerator.empty_cache()
        files = sum(f.stat().st_size for f in directory.glob("*.safetensors"))
        print(
            f"checkpoint: {n / 1e6:.1f}M parameters, {files / 1e9:.2f} GB of bfloat16 files "
            f"-> float32 on {device}"
        )
        r = measure_device(directory, device, rounds, quick, size)
    print(f"from_pretrained(device_map={device!r}): {r['hf']:.2f} s; fprep: {r['fprep']:.2f} s")
    print(f"fprep / hf: {r['ratio']:.2f} (goal <= 0.5)")
    print(
        f"page-cache read {r['read_gbps']:.1f} GB/s, pour {r['pour_gbps']:.1f} GB/s of file = "
        f"{r['bandwidth_share']:.0%} (goal >= 70%), {r['readers']:.0f} readers"
    )
    print(
        f"device memory beyond the parameters: {r['extra_device_bytes'] / MB:.0f} MB "
        f"(two chunk buffers: {r['device_buffer_bytes'] / MB:.0f} MB)"
    )


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a small model, one round")
    parser.add_argument("--rounds", type=int, default=None)
    parser.add_argument("--device", default=None, help="an accelerator: one process onto it")
    parser.add_argument("--tp", type=int, default=1, choices=(1, WORLD), help="fprep's tp")
    parser.add_argument(
        "--size", choices=("3b",), default=None, help="with --device: the 3.0B Llama checkpoint"
    )
    args = parser.parse_args(argv)
    if args.size is not None and args.device is None:
        parser.error("--size 3b measures one process on a device: give --device too")
    rounds = args.rounds or (1 if args.quick else 3)
    if args.device is not None:
        main_device(args.device, args.quick, rounds, args.size)
        return
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
