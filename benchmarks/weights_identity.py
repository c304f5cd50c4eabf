"""The cost of the weights identity check (every tensor sampled), against the load it guards.

Run: ``python benchmarks/weights_identity.py [--quick] [--rounds N] [--dir DIR]``.

``PrepConfig(weights=dir)`` digests each file twice: while planning (with its header) and when
the load opens it again, before the first write; the ranks then compare digests
(``fprep.weights.identity``). The digest covers the header and ``TENSOR_SAMPLES`` blocks of
``BLOCK`` bytes of every tensor (nearby ranges merged). This script measures, on one process:

* ``check``: planning's header read and digest of the checkpoint (``fprep.weights.source.
  snapshot``), and the number of bytes and reads the digest costs;
* ``per-file``: the digest fprep used before, 16 evenly spaced 4 KiB blocks per file (blind to
  a tensor changed between them), for comparison;
* ``load``: ``fprep.prepare`` of the model on the meta device with ``weights=dir`` into float32
  parameters, one process (two digests of each file included);

each with the files in the page cache (``warm``) and evicted before the call (``cold``:
``posix_fadvise(DONTNEED)`` on the checkpoint's files only, which drops their clean pages). The
checkpoint has Qwen2.5-0.5B's shapes (hidden 896, 24 layers, MLP 4864, 14 query / 2 key-value
heads, vocabulary 151936, tied head: 494M parameters, 290 tensors), random bfloat16 values in
one ``model.safetensors`` of 0.99 GB, as that model is published. ``--quick``: 2 layers,
vocabulary 32000 (58M parameters). Timings are medians over ``--rounds``.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import statistics
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch

import fprep
from fprep.weights.identity import sample_ranges
from fprep.weights.source import snapshot

FULL = {"num_hidden_layers": 24, "vocab_size": 151936}
QUICK = {"num_hidden_layers": 2, "vocab_size": 32000}
SHAPE = {
    "hidden_size": 896,
    "intermediate_size": 4864,
    "num_attention_heads": 14,
    "num_key_value_heads": 2,
    "tie_word_embeddings": True,
}


def meta_model(quick: bool) -> torch.nn.Module:
    from transformers import Qwen2Config, Qwen2ForCausalLM

    with torch.device("meta"):
        return Qwen2ForCausalLM(Qwen2Config(**SHAPE, **(QUICK if quick else FULL)))


def save(directory: Path, quick: bool) -> tuple[int, int]:
    """Random bfloat16 values for every parameter, one file: (parameters, tensors)."""
    from safetensors.torch import save_file

    g = torch.Generator().manual_seed(0)
    tensors = {
        name: torch.randn(p.shape, generator=g, dtype=torch.float32).to(torch.bfloat16)
        for name, p in meta_model(quick).named_parameters()  # the tied head once
    }
    save_file(tensors, str(directory / "model.safetensors"), metadata={"format": "pt"})
    return sum(t.numel() for t in tensors.values()), len(tensors)


def evict(directory: Path) -> None:
    """Drop the checkpoint's pages from the page cache (its files only)."""
    for path in directory.glob("*.safetensors"):
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def per_file_digest(path: Path, header_bytes: int) -> str:
    """The digest fprep used before: the header and 16 evenly spaced 4 KiB blocks."""
    size = path.stat().st_size
    h = hashlib.blake2b(digest_size=16)
    with open(path, "rb") as f:
        h.update(f.read(header_bytes))
        last = max(0, size - header_bytes - 4096)
        for start in sorted({header_bytes + last * i // 15 for i in range(16)}):
            h.update(os.pread(f.fileno(), 4096, start))
    return h.hexdigest()


def timed(fn: Callable[[], Any], directory: Path, cold: bool, rounds: int) -> tuple[float, float]:
    """Median wall and CPU seconds of ``fn()`` over ``rounds`` calls, the files evicted before
    each when ``cold`` (CPU time: what a machine shared with other jobs does not inflate)."""
    wall, cpu = [], []
    for _ in range(rounds):
        if cold:
            evict(directory)
        start, start_cpu = time.perf_counter(), time.process_time()
        fn()
        wall.append(time.perf_counter() - start)
        cpu.append(time.process_time() - start_cpu)
    return statistics.median(wall), statistics.median(cpu)


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a 58M-parameter checkpoint")
    parser.add_argument("--rounds", type=int, default=None, help="default: 1 quick, else 3")
    parser.add_argument("--dir", default=None, help="where to write it (default: a temp dir)")
    args = parser.parse_args(argv)
    rounds = args.rounds or (1 if args.quick else 3)
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory(dir=args.dir) as tmp:
        directory = Path(tmp)
        params, count = save(directory, args.quick)
        path = directory / "model.safetensors"
        size = path.stat().st_size
        snap = snapshot(str(directory))
        (record,) = snap.files
        samples = sample_ranges((t.offset, t.nbytes) for t in snap.tensors)
        hashed = sum(n for _, n in samples)
        print(
            f"checkpoint: {params / 1e6:.0f}M parameters, {count} tensors, bfloat16, one file "
            f"of {size / 1e9:.2f} GB; the digest hashes {hashed / 1e6:.1f} MB "
            f"({hashed / size:.2%}) in {len(samples)} reads, plus the {record.header_bytes} "
            "bytes of header"
        )

        def load() -> None:
            cfg = fprep.PrepConfig(weights=str(directory))
            fprep.prepare(meta_model(args.quick), cfg)

        rows = {
            "check": lambda: snapshot(str(directory)),
            "per-file": lambda: per_file_digest(path, record.header_bytes),
            "load": load,
        }
        load()  # first-use imports and allocations, not measured
        results = {
            (name, cold): timed(fn, directory, cold, rounds)
            for cold in (False, True)
            for name, fn in rows.items()
        }
    for cold in (False, True):
        (check, check_cpu), (old, _), (whole, whole_cpu) = (results[n, cold] for n in rows)
        print(
            f"{'cold' if cold else 'warm'}: check {check * 1e3:7.1f} ms ({check_cpu * 1e3:.1f} "
            f"ms CPU), per-file {old * 1e3:6.1f} ms, load {whole:6.2f} s ({whole_cpu:.2f} s "
            f"CPU); two checks (planning and load) = {2 * check / whole:.1%} of the load "
            f"({2 * check_cpu / whole_cpu:.1%} of its CPU time)"
        )


if __name__ == "__main__":
    main()
