"""load_weights: read ``PrepConfig.weights`` straight into the parameters, as the plan says.

Runs right after ``materialize``: parameters exist (this rank's shards under fsdp / hsdp, whole
tensors otherwise) and the modules the file fills completely were allocated but not
initialized. Each read is one contiguous byte range of a file (``WeightsPlan``, computed from
the headers while planning) and lands in the parameter's own memory, the DTensor's local tensor:

* same dtype, on the CPU: ``os.preadv`` into the parameter's bytes, no copy at all;
* another dtype (a bf16 file into fp32 parameters, or back) or an accelerator: through one
  reusable buffer of ``CHUNK_BYTES``, cast (and copied to the device) chunk by chunk.

So a rank's memory grows by its shards and one buffer, never by a full tensor, and the files are
read with plain reads (no mmap: mapped pages would count as this process's memory, and no
pickle: nothing in a weights file is executed). Files are checked to still have the size they
had when the plan read their headers. Ranks agree on failure at the end (a rank that could not
read raises the same error everywhere instead of leaving the others waiting in the next step).
"""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator
from contextlib import ExitStack

import torch
from torch import nn

from fprep.apply.init_jobs import local_of
from fprep.apply.steps import skipped, step
from fprep.checkpoint.collective import Group
from fprep.checkpoint.files import read_failure
from fprep.errors import CheckpointError, PrepareError
from fprep.progress import Progress
from fprep.snapshot import clean_fqn
from fprep.state import PrepState, need
from fprep.weights.records import ITEMSIZE, TensorRead, WeightsPlan

#: Bytes of the buffer a chunk is read into when it must be cast or copied to a device.
CHUNK_BYTES = 16 << 20
#: The most one read asks for (Linux transfers at most about 2 GiB per call).
_MAX_READ = 1 << 30


def _dtype(name: str) -> torch.dtype:
    dtype = getattr(torch, name)
    assert isinstance(dtype, torch.dtype)
    return dtype


def _byte_view(t: torch.Tensor) -> memoryview:
    """The bytes of a contiguous CPU tensor, writable, without a copy."""
    if t.numel() == 0:
        return memoryview(bytearray())
    return t.view(-1).view(torch.uint8).numpy().data


def _read_into(fd: int, view: memoryview, offset: int, file: str, progress: Progress) -> None:
    done = 0
    while done < len(view):
        part = view[done : done + _MAX_READ]
        if hasattr(os, "preadv"):
            n = os.preadv(fd, [part], offset + done)
        else:  # pragma: no cover - Windows
            os.lseek(fd, offset + done, os.SEEK_SET)
            n = os.readv(fd, [part])
        if n <= 0:
            raise CheckpointError(
                f"{file} ended at byte {offset + done}, inside a tensor its header placed there.",
                subject=file,
                hint="The file was truncated or replaced after prepare read its header.",
            )
        done += n
        progress.advance(n)


class _Reader:
    """Open files (checked against the plan's sizes) and one chunk buffer, reused."""

    def __init__(self, plan: WeightsPlan, stack: ExitStack, progress: Progress) -> None:
        self.sizes = dict(plan.files)
        self.stack = stack
        self.fds: dict[str, int] = {}
        self.progress = progress
        self.buffer: torch.Tensor | None = None

    def fd(self, file: str) -> int:
        if file not in self.fds:
            fd = os.open(file, os.O_RDONLY | getattr(os, "O_BINARY", 0))
            self.stack.callback(os.close, fd)
            size = os.fstat(fd).st_size
            if size != self.sizes.get(file):
                raise CheckpointError(
                    f"{file} has {size} bytes, but {self.sizes.get(file)} when its header was "
                    "read while planning.",
                    subject=file,
                    hint="The file changed during prepare; run prepare again.",
                )
            self.fds[file] = fd
        return self.fds[file]

    def chunk(self, device: torch.device) -> torch.Tensor:
        if self.buffer is None:
            pin = device.type == "cuda" and torch.cuda.is_available()
            self.buffer = torch.empty(CHUNK_BYTES, dtype=torch.uint8, pin_memory=pin)
        return self.buffer

    def fill(self, read: TensorRead, dest: torch.Tensor) -> None:
        """Write ``read``'s bytes, cast to ``dest``'s dtype, into ``dest`` (contiguous)."""
        fd = self.fd(read.file)
        source = _dtype(read.dtype)
        if dest.device.type == "cpu" and dest.dtype == source:
            _read_into(fd, _byte_view(dest), read.offset, read.file, self.progress)
            return
        flat = dest.view(-1)
        itemsize = ITEMSIZE[read.dtype]
        buffer = self.chunk(dest.device)
        per_chunk = len(buffer) // itemsize
        for start in range(0, flat.numel(), per_chunk):
            count = min(per_chunk, flat.numel() - start)
            part = buffer[: count * itemsize]
            _read_into(
                fd, _byte_view(part), read.offset + start * itemsize, read.file, self.progress
            )
            flat[start : start + count].copy_(part.view(source))


def _targets(model: nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter and buffer by its user-facing name (wrapper parts removed)."""
    found: dict[str, torch.Tensor] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        found.setdefault(clean_fqn(name), p)
    for name, b in model.named_buffers(remove_duplicate=False):
        found.setdefault(clean_fqn(name), b)
    return found


def _destinations(plan: WeightsPlan, model: nn.Module) -> Iterator[tuple[TensorRead, torch.Tensor]]:
    targets = _targets(model)
    for read in sorted(plan.reads, key=lambda r: (r.file, r.offset)):  # in file order
        value = targets.get(read.name)
        if value is None:
            raise PrepareError(
                f"the plan reads {read.key!r} into {read.name!r}, which the model no longer has.",
                subject=read.name,
                hint="A custom step before load_weights changed the model's structure.",
            )
        local = local_of(value) if isinstance(value, nn.Parameter) else value
        if local.numel() * ITEMSIZE[read.dtype] != read.nbytes:
            raise PrepareError(
                f"{read.name!r} holds {local.numel()} elements on this rank, but the plan reads "
                f"{read.nbytes // ITEMSIZE[read.dtype]} of {read.key!r}.",
                subject=read.name,
                hint="A custom step before load_weights sharded the model differently than "
                "planned.",
            )
        yield read, local


def load(plan: WeightsPlan, model: nn.Module, *, show: bool) -> None:
    """Every read of ``plan`` into ``model`` (this rank only; no collective)."""
    if sys.byteorder != "little":  # pragma: no cover - no big-endian machines in CI
        raise CheckpointError(
            "safetensors files are little-endian; this machine is big-endian.",
            subject=plan.source,
        )
    progress = Progress(
        "fprep: load weights", plan.nbytes, enabled=None if show else False, unit="B"
    )
    with progress, ExitStack() as stack, torch.no_grad():
        reader = _Reader(plan, stack, progress)
        for read, local in _destinations(plan, model):
            if local.is_contiguous():
                reader.fill(read, local)
            else:  # a strided parameter: through one contiguous copy of it
                dest = torch.empty(local.shape, dtype=local.dtype, device=local.device)
                reader.fill(read, dest)
                local.copy_(dest)


@step("load_weights")
def load_weights(state: PrepState, model: nn.Module) -> tuple[PrepState, nn.Module]:
    plan = need(state.state_dict, "init_state_dict", "load_weights").weights
    if plan is None:
        return skipped(state, model)
    error: Exception | None = None
    try:
        load(plan, model, show=state.topology.rank == 0)
    except Exception as e:  # reported on every rank below
        error = read_failure(e, plan.source)
    Group.of(state).agree(error)
    return state, model
