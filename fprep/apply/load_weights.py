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
pickle: nothing in a weights file is executed).

Nothing is written before every file checks out: each is opened without following links or
blocking and must be the regular file planning read (identity and digest, see
``fprep.weights.identity``); the other names of a tied parameter must hold the same values; and
the ranks, in one collective, must have planned with the same files (same digests). After the
reads ``fstat`` must still give the planned identity. A destination holding the model's own
values (a model not on the meta device) is copied aside before it is overwritten, and every such
copy is put back if anything fails afterwards, on any rank: a failed load leaves the model's
values as they were. Ranks agree on failure at the end (a rank that could not read raises the
same error everywhere instead of leaving the others waiting in the next step).
"""

from __future__ import annotations

import os
import socket
import sys
from collections.abc import Iterator
from contextlib import ExitStack
from dataclasses import dataclass, field

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
from fprep.weights.blocks import pieces
from fprep.weights.identity import check_unchanged, disagreement, fingerprint, open_planned
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


def _read_into(
    fd: int, view: memoryview, offset: int, file: str, progress: Progress | None
) -> None:
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
        if progress is not None:
            progress.advance(n)


class _Reader:
    """Every file of the plan, opened and checked, and one chunk buffer, reused."""

    def __init__(self, plan: WeightsPlan, stack: ExitStack, progress: Progress) -> None:
        self.plan = plan
        self.fds: dict[str, int] = {}
        self.progress = progress
        self.buffer: torch.Tensor | None = None
        for file in plan.files:  # all of them before the first write
            fd = open_planned(file)
            stack.callback(os.close, fd)
            self.fds[file.path] = fd

    def check_unchanged(self) -> None:
        for file in self.plan.files:
            check_unchanged(self.fds[file.path], file)

    def chunk(self, device: torch.device) -> torch.Tensor:
        if self.buffer is None:
            pin = device.type == "cuda" and torch.cuda.is_available()
            self.buffer = torch.empty(CHUNK_BYTES, dtype=torch.uint8, pin_memory=pin)
        return self.buffer

    def values(self, read: TensorRead, start: int, count: int, out: torch.Tensor) -> torch.Tensor:
        """Elements ``[start, start + count)`` of ``read``, read into ``out`` (bytes)."""
        itemsize = ITEMSIZE[read.dtype]
        part = out[: count * itemsize]
        _read_into(  # a check, not progress
            self.fds[read.file], _byte_view(part), read.offset + start * itemsize, read.file, None
        )
        return part.view(_dtype(read.dtype))

    def fill(self, read: TensorRead, dest: torch.Tensor) -> None:
        """Write ``read``'s bytes, cast to ``dest``'s dtype, into ``dest`` (contiguous)."""
        fd = self.fds[read.file]
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


_COMPARE_BYTES = 1 << 20  # per side, when the names of a tied parameter are compared


def _same(a: torch.Tensor, b: torch.Tensor, dtype: torch.dtype) -> bool:
    if a.dtype == b.dtype:  # bit for bit (NaNs included)
        return torch.equal(a.view(torch.uint8), b.view(torch.uint8))
    x, y = a.to(dtype), b.to(dtype)
    return bool(((x == y) | (x.isnan() & y.isnan())).all())


def _check_tied(reader: _Reader, plan: WeightsPlan) -> None:
    """The other names of a tied parameter must hold the first's values (this rank's rows)."""
    first = {r.name: r for r in plan.reads}
    for other in plan.same_as:
        read = first[other.name]
        count = read.nbytes // ITEMSIZE[read.dtype]
        per = _COMPARE_BYTES // max(ITEMSIZE[read.dtype], ITEMSIZE[other.dtype])
        a = torch.empty(_COMPARE_BYTES, dtype=torch.uint8)
        b = torch.empty(_COMPARE_BYTES, dtype=torch.uint8)
        target = _dtype(read.target_dtype)
        for start in range(0, count, per):
            n = min(per, count - start)
            if not _same(
                reader.values(read, start, n, a), reader.values(other, start, n, b), target
            ):
                raise CheckpointError(
                    f"{plan.source} holds both {read.key!r} and {other.key!r}, which the model "
                    f"ties (one parameter, {read.name!r}), with different values. transformers' "
                    "from_pretrained would untie them (with a warning); fprep does not choose "
                    "one silently.",
                    subject=other.key,
                    hint="Build the model untied (e.g. config.tie_word_embeddings=False) to "
                    f"load both, or remove {other.key!r} from the checkpoint.",
                )


@dataclass
class _Kept:
    """The model's own values, copied before they were overwritten; ``restore`` puts them back."""

    copies: list[tuple[torch.Tensor, torch.Tensor]] = field(default_factory=list)

    def keep(self, dest: torch.Tensor) -> None:
        self.copies.append((dest, dest.detach().clone()))

    def restore(self) -> None:
        with torch.no_grad():
            for dest, value in reversed(self.copies):
                dest.copy_(value)
        self.copies.clear()


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


def load(plan: WeightsPlan, model: nn.Module, reader: _Reader, kept: _Kept) -> None:
    """Every read of ``plan`` into ``model`` (this rank only; no collective). Destinations
    the plan marks ``keep`` are copied into ``kept`` first."""
    with torch.no_grad():
        for read, local in _destinations(plan, model):
            if read.keep:
                kept.keep(local)
            if local.is_contiguous():
                for part, into in pieces(read, local):  # (a tp block's rows: fprep.weights.blocks)
                    reader.fill(part, into)
            else:  # a strided parameter: through one contiguous copy of it
                dest = torch.empty(local.shape, dtype=local.dtype, device=local.device)
                for part, into in pieces(read, dest):
                    reader.fill(part, into)
                local.copy_(dest)
        reader.check_unchanged()


@step("load_weights")
def load_weights(state: PrepState, model: nn.Module) -> tuple[PrepState, nn.Module]:
    plan = need(state.state_dict, "init_state_dict", "load_weights").weights
    if plan is None:
        return skipped(state, model)
    if sys.byteorder != "little":  # pragma: no cover - no big-endian machines in CI
        raise CheckpointError(
            "safetensors files are little-endian; this machine is big-endian.",
            subject=plan.source,
        )
    group = Group.of(state)
    kept = _Kept()
    progress = Progress(
        "fprep: load weights",
        plan.nbytes,
        enabled=None if state.topology.rank == 0 else False,
        unit="B",
    )
    with progress, ExitStack() as stack:
        error: Exception | None = None
        reader = None
        try:  # every check before the first write
            reader = _Reader(plan, stack, progress)
            _check_tied(reader, plan)
        except Exception as e:  # reported on every rank below
            error = read_failure(e, plan.source)
        # one collective: any rank's failure, and the files every rank planned with
        prints = group.agree(error, fingerprint(plan.files, socket.gethostname()))
        mismatch = disagreement(prints)
        if mismatch is not None:
            raise mismatch
        assert reader is not None
        try:
            try:
                load(plan, model, reader, kept)
            except Exception as e:
                error = read_failure(e, plan.source)
            group.agree(error)
        except BaseException:
            kept.restore()  # on every rank: a failure anywhere leaves the values as they were
            raise
    return state, model
