"""load_weights: read ``PrepConfig.weights`` straight into the parameters, as the plan says.

Runs right after ``materialize``: parameters exist (this rank's shards under fsdp / hsdp, whole
tensors otherwise) and the modules the file fills completely were allocated but not
initialized. Each read is one contiguous byte range of a file (``WeightsPlan``, computed from
the headers while planning) and lands in the parameter's own memory, the DTensor's local tensor:

* same dtype, on the CPU: ``os.preadv`` into the parameter's bytes, no copy at all;
* another dtype (a bf16 file into fp32 parameters, or back): through reused buffers of
  ``CHUNK_BYTES``, cast chunk by chunk;
* an accelerator: pinned host buffers copied to the device on a side stream while the next
  chunks are read, cast on the device (``fprep.weights.pipeline``).

Chunks are read by up to ``default_readers`` threads. So a rank's memory grows by its shards and
a few chunk buffers (two on the device), never by a full tensor, and the files are read with
plain reads (no mmap: mapped pages would count as this process's memory, and no pickle: nothing
in a weights file is executed).

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
from collections.abc import Iterable, Iterator
from contextlib import ExitStack
from dataclasses import dataclass, field

import torch
from torch import nn

from fprep.apply.init_jobs import local_of
from fprep.apply.steps import skipped, step
from fprep.checkpoint.collective import Group
from fprep.checkpoint.format.files import read_failure
from fprep.devices import Lane
from fprep.errors import CheckpointError, PrepareError
from fprep.progress import Progress
from fprep.snapshot import clean_fqn
from fprep.state import PrepState, need
from fprep.tensor_bytes import byte_view
from fprep.weights.blocks import StridedRead, pieces
from fprep.weights.identity import (
    Fingerprint,
    changed_tensors,
    check_unchanged,
    differing,
    disagreement,
    fingerprint,
    naming,
    open_planned,
    tensor_digests,
)
from fprep.weights.pipeline import (
    CHUNK_BYTES,
    Chunk,
    PourStats,
    chunks_of,
    default_readers,
    pour,
    read_exact,
    strided_chunks_of,
)
from fprep.weights.records import ITEMSIZE, ConvertedRead, TensorRead, WeightsPlan, elements


def _dtype(name: str) -> torch.dtype:
    dtype = getattr(torch, name)
    assert isinstance(dtype, torch.dtype)
    return dtype


class _Reader:
    """Every file of the plan, opened and checked; how the chunks are read (tests shrink them)."""

    def __init__(
        self,
        plan: WeightsPlan,
        stack: ExitStack,
        progress: Progress,
        *,
        chunk_bytes: int = CHUNK_BYTES,
        readers: int | None = None,
    ) -> None:
        self.plan = plan
        self.fds: dict[str, int] = {}
        self.progress = progress
        self.chunk_bytes = chunk_bytes
        self.readers = readers
        for file in plan.files:  # all of them before the first write
            fd = open_planned(file)
            stack.callback(os.close, fd)
            self.fds[file.path] = fd

    def check_unchanged(self) -> None:
        for file in self.plan.files:
            check_unchanged(self.fds[file.path], file)

    def values(self, read: TensorRead, start: int, count: int, out: torch.Tensor) -> torch.Tensor:
        """Elements ``[start, start + count)`` of ``read``, read into ``out`` (bytes)."""
        itemsize = ITEMSIZE[read.dtype]
        part = out[: count * itemsize]
        read_exact(self.fds[read.file], byte_view(part), read.offset + start * itemsize, read.file)
        return part.view(_dtype(read.dtype))

    def chunks(self, read: TensorRead, dest: torch.Tensor) -> Iterable[Chunk]:
        """``read``'s bytes, in chunks, for ``dest`` (contiguous); a tensor-parallel block's
        column runs (``StridedRead``) as whole rows, many per chunk; a parameter assembled from
        several tensors (``ConvertedRead``) segment by segment, each into its slice of ``dest``."""
        if isinstance(read, ConvertedRead):
            return [c for part, into in pieces(read, dest) for c in self.chunks(part, into)]
        fd, source = self.fds[read.file], _dtype(read.dtype)
        if isinstance(read, StridedRead):
            return strided_chunks_of(
                fd,
                read.file,
                read.offset,
                source,
                dest,
                runs=read.runs,
                stride=read.stride,
                chunk_bytes=self.chunk_bytes,
            )
        return chunks_of(fd, read.file, read.offset, source, dest, self.chunk_bytes)

    def pour(self, chunks: Iterable[Chunk], device: torch.device) -> PourStats:
        readers = self.readers if self.readers is not None else default_readers(device)
        return pour(
            chunks,
            Lane(device),
            readers=readers,
            chunk_bytes=self.chunk_bytes,
            on_bytes=self.progress.advance,
        )


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
        if local.numel() != elements(read):
            raise PrepareError(
                f"{read.name!r} holds {local.numel()} elements on this rank, but the plan reads "
                f"{elements(read)} of {read.key!r}.",
                subject=read.name,
                hint="A custom step before load_weights sharded the model differently than "
                "planned.",
            )
        yield read, local


def load(plan: WeightsPlan, model: nn.Module, reader: _Reader, kept: _Kept) -> list[PourStats]:
    """Every read of ``plan`` into ``model`` (this rank only; no collective): one ``pour`` per
    device the destinations are on. Destinations the plan marks ``keep`` are copied into
    ``kept`` first, before the side stream starts (it waits for those copies)."""
    stats = []
    with torch.no_grad():
        by_device: dict[torch.device, list[Chunk]] = {}
        strided: list[tuple[TensorRead, torch.Tensor]] = []
        for read, local in _destinations(plan, model):
            if read.keep:
                kept.keep(local)
            if local.is_contiguous():
                by_device.setdefault(local.device, []).extend(reader.chunks(read, local))
            else:
                strided.append((read, local))
        for device, chunks in by_device.items():
            stats.append(reader.pour(chunks, device))
        for read, local in strided:  # rare: through one host copy of it, in the file's dtype
            dest = torch.empty(local.shape, dtype=_dtype(read.dtype))
            stats.append(reader.pour(reader.chunks(read, dest), dest.device))
            local.copy_(dest)
        reader.check_unchanged()
    return stats


def _located(
    mismatch: CheckpointError,
    prints: list[Fingerprint],
    group: Group,
    reader: _Reader | None,
    state: PrepState,
) -> CheckpointError:
    """``mismatch``, naming the tensors that differ when two ranks' copies of a file differ
    (one more collective, on every rank alike: only on this failure)."""
    at = differing(prints)
    snapshot = state.inputs.weights
    if at is None or reader is None or snapshot is None:
        return mismatch
    rank, index = at
    file = reader.plan.files[index]
    tensors = [t for t in snapshot.tensors if t.file == file.path]
    try:
        mine: tuple[str, ...] | None = tensor_digests(
            reader.fds[file.path], file, [(t.offset, t.nbytes) for t in tensors]
        )
    except Exception:  # the file as a whole is named all the same
        mine = None
    digests = group.all_gather(mine)
    return naming(mismatch, changed_tensors(digests[0], digests[rank], [t.key for t in tensors]))


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
            raise _located(mismatch, prints, group, reader, state)
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
