"""Checkpoint throughput of ``fprep.save`` / ``fprep.load`` against raw DCP, and the peak memory of
``fprep.export_full``.

Run: ``python benchmarks/checkpoint.py [--quick] [--rounds N]``.

1. Throughput (MB/s of tensor data: model + AdamW state) at 1 rank (no strategy) and 2 ranks
   (fsdp, gloo, one thread each). The raw baseline is what a hand-written DCP checkpoint does
   with the same state dict: ``get_state_dict`` + ``dcp.save`` (``FileSystemWriter``, files
   fsynced, as fprep's) and ``get_state_dict`` + ``dcp.load`` + ``set_state_dict``. fprep does
   more: a BLAKE3 digest of every file, a JSON manifest, an atomic publish (save); parsing and
   verifying every file it reads before touching the model (load). Target:
   fprep / raw >= 0.95. Within a round the four measurements are interleaved (and which of raw
   and fprep goes first alternates); figures are medians over the rounds.
2. Peak memory of ``export_full`` at 2 ranks (fsdp) on rank 0: resident memory (RSS) above the
   level just before the export (sampled every 2 ms from the page tables; glibc is told to give
   freed memory back, so that reused memory cannot hide), in a fresh process per measurement
   after one unmeasured warm-up run, against the largest parameter, this rank's shard of the
   model, and the full model; and, for contrast, gathering a full state dict
   (``get_model_state_dict(full_state_dict=True, cpu_offload=True)``) and saving it with
   ``safetensors.torch.save_file``.
"""

from __future__ import annotations

import argparse
import gc
import os
import shutil
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import nn

import fprep
from fprep.testing.distributed import run_ranks

TARGET = 0.95
MB = 1e6


class Stack(nn.Module):
    """An embedding (the largest parameter) and ``layers`` square linear layers."""

    def __init__(self, d: int, layers: int, vocab: int) -> None:
        super().__init__()
        self.emb = nn.Embedding(vocab, d)
        self.layers = nn.ModuleList(nn.Linear(d, d) for _ in range(layers))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.emb(x)
        for layer in self.layers:
            h = layer(h)
        return h


def sizes(quick: bool) -> dict[str, int]:
    if quick:
        return {"d": 512, "layers": 8, "vocab": 4096}
    return {"d": 1024, "layers": 24, "vocab": 16384}


def build(spec: dict[str, int], strategy: str) -> tuple[Any, nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = Stack(**spec)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    cfg = fprep.PrepConfig(strategy=strategy, wrap=nn.Linear)  # type: ignore[arg-type]
    state, model, opt = fprep.prepare(model, cfg, opt)
    model(torch.zeros(2, 4, dtype=torch.long)).sum().backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    return state, model, opt


def tensor_bytes(model: nn.Module, opt: torch.optim.Optimizer) -> int:
    """Global bytes of model parameters/buffers and optimizer state tensors."""
    total = sum(t.numel() * t.element_size() for t in model.state_dict().values())
    for st in opt.state.values():
        total += sum(v.numel() * v.element_size() for v in st.values() if torch.is_tensor(v))
    return total


# -- the four operations -------------------------------------------------------------------------
def raw_save(path: Path, model: nn.Module, opt: torch.optim.Optimizer) -> None:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    msd, osd = get_state_dict(model, opt)
    dcp.save({"model": msd, "optim": osd}, checkpoint_id=path)


def raw_load(path: Path, model: nn.Module, opt: torch.optim.Optimizer) -> None:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    msd, osd = get_state_dict(model, opt)
    sd = {"model": msd, "optim": osd}
    dcp.load(sd, checkpoint_id=path)
    set_state_dict(model, opt, model_state_dict=sd["model"], optim_state_dict=sd["optim"])


def fprep_save(path: Path, state: Any, model: nn.Module, opt: torch.optim.Optimizer) -> None:
    fprep.save(path, state, model, optimizers=(opt,))


def fprep_load(
    path: Path, state: Any, model: nn.Module, opt: torch.optim.Optimizer, verify: bool = True
) -> None:
    fprep.load(path, state, model, optimizers=(opt,), verify_hashes=verify)


def barrier() -> None:
    import torch.distributed as dist

    if dist.is_initialized():
        dist.barrier()


def timed(fn: Callable[[], None]) -> float:
    barrier()
    gc.collect()
    start = time.perf_counter()
    fn()
    barrier()
    return time.perf_counter() - start


def throughput(spec: dict[str, int], rounds: int, strategy: str, base: str) -> dict[str, Any]:
    """Median seconds of each operation (interleaved rounds); run on every rank."""
    import warnings

    warnings.filterwarnings("ignore", message="torch.distributed is disabled")
    warnings.filterwarnings("ignore", message="Detected an existing checkpoint")
    warnings.filterwarnings("ignore", message="FSDP2-wrapped module")
    torch.set_num_threads(1)
    state, model, opt = build(spec, strategy)
    rank = int(os.environ.get("RANK", "0"))
    root = Path(base)
    raw_dir, fp_dir = root / "raw", root / "fprep"
    ops = ("raw save", "fprep save", "raw load", "fprep load", "fprep load unverified")
    times: dict[str, list[float]] = {k: [] for k in ops}

    def clean() -> None:
        barrier()
        if rank == 0:
            shutil.rmtree(raw_dir, ignore_errors=True)
            shutil.rmtree(fp_dir, ignore_errors=True)
        barrier()

    # one warm-up round, not measured (imports, first-touch allocations)
    raw_save(raw_dir, model, opt)
    fprep_save(fp_dir, state, model, opt)
    raw_load(raw_dir, model, opt)
    fprep_load(fp_dir, state, model, opt)
    for r in range(rounds):
        clean()
        saves = [
            ("raw save", lambda: raw_save(raw_dir, model, opt)),
            ("fprep save", lambda: fprep_save(fp_dir, state, model, opt)),
        ]
        loads = [
            ("raw load", lambda: raw_load(raw_dir, model, opt)),
            ("fprep load", lambda: fprep_load(fp_dir, state, model, opt)),
            ("fprep load unverified", lambda: fprep_load(fp_dir, state, model, opt, False)),
        ]
        if r % 2:
            saves.reverse()
            loads.reverse()
        for name, fn in (*saves, *loads):
            times[name].append(timed(fn))
    clean()
    return {
        "bytes": tensor_bytes_global(model, opt),
        "median": {k: statistics.median(v) for k, v in times.items()},
    }


def tensor_bytes_global(model: nn.Module, opt: torch.optim.Optimizer) -> int:
    """Tensor bytes of the whole checkpoint (DTensor shapes are global)."""
    from torch.distributed.checkpoint.state_dict import get_state_dict

    msd, osd = get_state_dict(model, opt)
    total = sum(v.numel() * v.element_size() for v in msd.values())
    for entry in osd["state"].values():
        total += sum(v.numel() * v.element_size() for v in entry.values() if torch.is_tensor(v))
    return total


# -- export memory -------------------------------------------------------------------------------
def rss() -> int:
    """Resident memory, by walking the page tables (``smaps_rollup``). The counters behind
    ``statm`` and ``VmHWM`` are cached per thread and can miss allocations faulted in with few
    (huge) pages, so they are only the fallback."""
    try:
        with open("/proc/self/smaps_rollup") as f:
            for line in f:
                if line.startswith("Rss:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def exact_rss_accounting() -> None:
    """Make RSS follow live memory: glibc serves allocations of 64 KiB and more with their own
    mappings (returned to the OS when freed, instead of being kept for reuse), and what it
    holds now is trimmed. Without this, memory freed earlier hides new allocations."""
    import ctypes

    try:
        libc = ctypes.CDLL("libc.so.6")
        libc.mallopt(-3, 64 * 1024)  # M_MMAP_THRESHOLD (fixed: no dynamic adjustment)
        libc.malloc_trim(0)
    except (OSError, AttributeError):  # not glibc: the figures are upper bounds of nothing
        pass


class PeakRSS:
    """Peak resident memory of this process while active: ``rss()`` sampled every 2 ms on a
    thread (memory that lives for less than that may be missed)."""

    def __init__(self) -> None:
        self.peak = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            self.peak = max(self.peak, rss())
            time.sleep(0.002)

    def __enter__(self) -> PeakRSS:
        gc.collect()
        exact_rss_accounting()
        self.base = rss()
        self.peak = self.base
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, rss())

    @property
    def above(self) -> int:
        return self.peak - self.base


def export_memory(spec: dict[str, int], base: str, mode: str) -> dict[str, Any]:
    """Peak RSS of one way of writing a full safetensors file (a fresh process per mode)."""
    import warnings

    warnings.filterwarnings("ignore")
    torch.set_num_threads(1)
    state, model, _ = build(spec, "fsdp")
    params = dict(model.named_parameters())
    largest = max(p.numel() * p.element_size() for p in params.values())
    full = sum(p.numel() * p.element_size() for p in params.values())
    shard = sum(
        (p.to_local() if hasattr(p, "to_local") else p).numel() * p.element_size()
        for p in params.values()
    )
    path = Path(base) / f"{mode}.safetensors"

    def write(target: Path) -> None:
        if mode == "stream":
            fprep.export_full(target, state, model)
            return
        from safetensors.torch import save_file
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        sd = get_model_state_dict(
            model, options=StateDictOptions(full_state_dict=True, cpu_offload=True)
        )
        if sd:
            save_file(sd, str(target))
        del sd

    # A first, unmeasured run: imports, and whatever the first state-dict call frees (freed
    # memory would otherwise offset the allocations being measured).
    write(Path(base) / f"{mode}-warmup.safetensors")
    barrier()
    with PeakRSS() as peak:
        write(path)
    barrier()
    return {
        "largest": largest,
        "shard": shard,
        "full": full,
        "peak": peak.above,
        "size": path.stat().st_size if path.exists() else 0,
    }


def run_two(fn: Callable[..., Any], *args: Any) -> Any:
    return run_ranks(fn, 2, *args, timeout_s=1800.0)[0]


def report(title: str, result: dict[str, Any]) -> list[float]:
    """Print one table; return the ratios the target is about (save, verified load)."""
    mb = result["bytes"] / MB
    med = result["median"]
    print(f"\n{title}: {mb:.1f} MB of tensors per checkpoint")
    print(f"  {'operation':<30} {'raw DCP':>12} {'fprep':>12} {'fprep/raw':>10}")
    rows = [
        ("save", "raw save", "fprep save"),
        ("load (digests verified)", "raw load", "fprep load"),
        ("load (verify_hashes=False)", "raw load", "fprep load unverified"),
    ]
    ratios = []
    for label, raw_op, fp_op in rows:
        raw, fp = mb / med[raw_op], mb / med[fp_op]
        ratios.append(fp / raw)
        print(f"  {label:<30} {raw:>7.0f} MB/s {fp:>7.0f} MB/s {fp / raw:>9.2f}x")
    return ratios[:2]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a small model, 3 rounds")
    parser.add_argument("--rounds", type=int, default=None, help="rounds (default 7, quick 3)")
    args = parser.parse_args(argv)
    rounds = args.rounds or (3 if args.quick else 7)
    spec = sizes(args.quick)
    print(
        f"fprep checkpoint benchmark (torch {torch.__version__}, {os.cpu_count()} CPUs, "
        f"model d={spec['d']} layers={spec['layers']} vocab={spec['vocab']}, AdamW, "
        f"{rounds} interleaved rounds, medians)"
    )
    ratios: list[float] = []
    with tempfile.TemporaryDirectory() as tmp:
        one = throughput(spec, rounds, "none", str(Path(tmp) / "one"))
        ratios += report("1 rank (no strategy)", one)
        two = run_two(throughput, spec, rounds, "fsdp", str(Path(tmp) / "two"))
        ratios += report("2 ranks (fsdp, gloo)", two)
        mem = run_two(export_memory, spec, tmp, "stream")
        naive = run_two(export_memory, spec, tmp, "naive")
    print("\nexport_full at 2 ranks (fsdp), rank 0, peak RSS above the level before the call:")
    print(f"  largest parameter           {mem['largest'] / MB:8.1f} MB")
    print(f"  this rank's model shard     {mem['shard'] / MB:8.1f} MB")
    print(
        f"  full model                  {mem['full'] / MB:8.1f} MB (file {mem['size'] / MB:.1f} MB)"
    )
    print(
        f"  export_full                 {mem['peak'] / MB:8.1f} MB "
        f"({mem['peak'] / mem['largest']:.2f}x the largest parameter, "
        f"{mem['peak'] / mem['shard']:.2f}x the shard)"
    )
    print(
        f"  full state dict + save_file {naive['peak'] / MB:8.1f} MB "
        f"({naive['peak'] / mem['largest']:.2f}x the largest parameter)"
    )
    worst = min(ratios)
    verdict = "meets" if worst >= TARGET else "misses"
    print(f"\nworst fprep/raw throughput ratio {worst:.2f}x: {verdict} the {TARGET:.2f}x target")
    sys.stdout.flush()


if __name__ == "__main__":
    main()
