"""Whether a weights file is still the one planning read, and the same on every rank.

Planning records each file's identity (device, inode, size, modification time) and a digest of
its header and of sampled blocks of every tensor in it (``WeightsFile``; ``sample_ranges``:
``TENSOR_SAMPLES`` blocks of ``BLOCK`` bytes per tensor, evenly spaced from its first byte to
its last, a tensor of at most that many bytes whole). The load opens the file again through its
resolved path, never following a link and never blocking (a FIFO swapped in would block
``open`` until a writer came), and checks, through the descriptor, that it is a regular file
with the same identity and the same digest before the first byte is written into the model;
after the reads ``fstat`` must still say the same. A file replaced by one of the same size
(tensors swapped, offsets swapped to match) has another inode or another header; one rewritten
in place has another modification time (or, if that was put back, another header).

Ranks then compare what they planned (``disagreement``): the same files (by name), sizes and
digests everywhere — ranks given different revisions, or node-local copies out of sync, are
refused — and, on one host, the same identity for the same path (a file replaced between two
ranks' planning). Sampling every tensor tells two revisions apart as soon as one tensor differs
broadly (a fine-tune with most layers frozen changes whole tensors, and only those); values
changed only between the sampled blocks (a few rows of a large embedding, a single flipped
byte) are not seen: what safetensors records does not allow more without reading every byte.
"""

from __future__ import annotations

import hashlib
import os
import stat
from collections.abc import Iterable, Sequence

from fprep.checkpoint.format.files import OPEN_FLAGS
from fprep.errors import CheckpointError
from fprep.weights.records import WeightsFile

#: Blocks sampled per tensor by the digest, and their size: ~16 KiB of each tensor.
TENSOR_SAMPLES, BLOCK = 4, 4096
#: Sampled ranges closer than this are read (and hashed) as one: the small tensors of a layer
#: (norms, biases), read whole, lie next to each other. Small, so that a file of many tensors
#: just above ``TENSOR_SAMPLES * BLOCK`` bytes is not read whole through merged gaps.
MERGE_GAP = BLOCK
_STEP = 1 << 20  # bytes hashed per read
_SHOWN = 5  # tensors named in a message before "and N more"

_KINDS = (
    (stat.S_ISDIR, "a directory"),
    (stat.S_ISFIFO, "a FIFO (named pipe)"),
    (stat.S_ISCHR, "a character device"),
    (stat.S_ISBLK, "a block device"),
    (stat.S_ISSOCK, "a socket"),
    (stat.S_ISLNK, "a symbolic link"),
)

_REPLACED = (
    "Something replaced or modified the weights after prepare planned (a download or sync "
    "still running?); nothing was loaded. Run prepare again once the files are complete."
)


def kind_of(mode: int) -> str:
    """What a file of ``mode`` is, in words."""
    return next((name for test, name in _KINDS if test(mode)), "not a regular file")


def not_regular(path: str, mode: int) -> CheckpointError:
    return CheckpointError(
        f"{path} is {kind_of(mode)}, not a regular file; weights are read from regular "
        "safetensors files only.",
        subject=path,
        hint="Pass a .safetensors file or a save_pretrained directory.",
    )


def open_regular(real: str, shown: str) -> tuple[int, os.stat_result]:
    """``real`` opened for reading without following a link or blocking, checked to be a
    regular file through its descriptor; ``(fd, fstat)``. Raises ``OSError`` as ``os.open``."""
    fd = os.open(real, OPEN_FLAGS | getattr(os, "O_BINARY", 0))
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            raise not_regular(shown, info.st_mode)
    except BaseException:
        os.close(fd)
        raise
    return fd, info


def _pread(fd: int, n: int, offset: int, shown: str) -> bytes:
    out = bytearray()
    while len(out) < n:
        part = os.pread(fd, n - len(out), offset + len(out))
        if not part:
            raise CheckpointError(
                f"{shown} ended at byte {offset + len(out)} while fprep checked it.",
                subject=shown,
                hint=_REPLACED,
            )
        out += part
    return bytes(out)


def sample_ranges(spans: Iterable[tuple[int, int]]) -> tuple[tuple[int, int], ...]:
    """The ``(offset, nbytes)`` ranges of a file the digest hashes, in file order, given its
    tensors' ``(offset, nbytes)``: ``TENSOR_SAMPLES`` blocks of each, evenly spaced from its
    start to its end (a tensor of at most that many blocks whole), ranges less than
    ``MERGE_GAP`` apart merged. Pure: planning and loading compute the same ranges from the
    same header."""
    blocks: list[tuple[int, int]] = []
    for offset, nbytes in spans:
        if nbytes <= TENSOR_SAMPLES * BLOCK:
            blocks.append((offset, nbytes))
            continue
        last = nbytes - BLOCK
        steps = TENSOR_SAMPLES - 1
        blocks.extend((offset + last * i // steps, BLOCK) for i in range(TENSOR_SAMPLES))
    merged: list[tuple[int, int]] = []
    for start, n in sorted(b for b in blocks if b[1] > 0):
        if merged and start - (merged[-1][0] + merged[-1][1]) < MERGE_GAP:
            first, length = merged[-1]
            merged[-1] = (first, max(length, start + n - first))
        else:
            merged.append((start, n))
    return tuple(merged)


def digest(
    fd: int,
    size: int,
    header_bytes: int,
    samples: tuple[tuple[int, int], ...],
    shown: str,
    header: bytes = b"",
) -> str:
    """BLAKE2b of the size, the header (with its 8-byte length; ``header`` when already read)
    and the ``samples`` ranges of the data (``sample_ranges``)."""
    h = hashlib.blake2b(digest_size=16)
    h.update(size.to_bytes(8, "little"))
    if header:
        h.update(header)
    for start in range(len(header), header_bytes, _STEP):
        h.update(_pread(fd, min(_STEP, header_bytes - start), start, shown))
    for offset, nbytes in samples:
        for start in range(offset, offset + nbytes, _STEP):
            h.update(_pread(fd, min(_STEP, offset + nbytes - start), start, shown))
    return h.hexdigest()


def identity(info: os.stat_result) -> tuple[int, int, int, int]:
    return (info.st_dev, info.st_ino, info.st_size, info.st_mtime_ns)


def _changed(file: WeightsFile, now: tuple[int, int, int, int], when: str) -> CheckpointError:
    dev, ino, size, _ = now
    if size != file.size:
        what = f"has {size} bytes, but {file.size} when prepare planned"
    elif (dev, ino) != (file.device, file.inode):
        what = "is another file (another inode) than the one prepare planned with"
    else:
        what = "was modified (its modification time changed) since prepare planned"
    return CheckpointError(f"{file.path} {what} ({when}).", subject=file.path, hint=_REPLACED)


def open_planned(file: WeightsFile) -> int:
    """``file`` opened and checked to be the one planning read (identity and digest)."""
    fd, info = open_regular(file.real, file.path)
    try:
        if identity(info) != file.identity:
            raise _changed(file, identity(info), "checked when opened for loading")
        if digest(fd, file.size, file.header_bytes, file.samples, file.path) != file.digest:
            raise CheckpointError(
                f"{file.path}'s header or data is not what prepare planned with (same size, "
                "inode and modification time, another digest).",
                subject=file.path,
                hint=_REPLACED,
            )
    except BaseException:
        os.close(fd)
        raise
    return fd


def check_unchanged(fd: int, file: WeightsFile) -> None:
    """After reading: ``fstat`` must still give the planned identity."""
    now = identity(os.fstat(fd))
    if now != file.identity:
        raise _changed(file, now, "checked after its tensors were read; nothing was kept")


Fingerprint = tuple[str, tuple[tuple[str, str, int, str, tuple[int, int, int, int]], ...]]


def fingerprint(files: tuple[WeightsFile, ...], host: str) -> Fingerprint:
    """What ranks compare: the host, and per file its name, resolved path, size, digest and
    identity."""
    return host, tuple(
        (os.path.basename(f.path), f.real, f.size, f.digest, f.identity) for f in files
    )


def differing(prints: list[Fingerprint]) -> tuple[int, int] | None:
    """``(rank, file index)`` of the first file whose size or digest differs from rank 0's,
    when every rank has the same file names (pure: every rank finds the same)."""
    _, files0 = prints[0]
    for rank, (_, files) in enumerate(prints[1:], start=1):
        if [f[0] for f in files] != [f[0] for f in files0]:
            return None
        for index, (mine, first) in enumerate(zip(files, files0, strict=True)):
            if (mine[2], mine[3]) != (first[2], first[3]):
                return rank, index
    return None


def tensor_digests(fd: int, file: WeightsFile, spans: Sequence[tuple[int, int]]) -> tuple[str, ...]:
    """The digest of ``file``'s header, then one per tensor (``spans``: each tensor's
    ``(offset, nbytes)``, in the header's order) of that tensor's sampled blocks: where two
    copies whose file digests differ differ."""
    out = [digest(fd, 0, file.header_bytes, (), file.path)]
    out.extend(digest(fd, 0, 0, sample_ranges([span]), file.path) for span in spans)
    return tuple(out)


def changed_tensors(
    first: Sequence[str] | None, mine: Sequence[str] | None, keys: Sequence[str]
) -> list[str]:
    """The ``keys`` whose ``tensor_digests`` differ between two copies; none when a copy's
    digests are missing (it could not be read) or the headers differ (the tensors are laid out
    differently: the file as a whole differs)."""
    if not first or not mine or len(first) != len(mine) or first[0] != mine[0]:
        return []
    return [key for key, a, b in zip(keys, first[1:], mine[1:], strict=True) if a != b]


def naming(error: CheckpointError, keys: Sequence[str]) -> CheckpointError:
    """``error`` (from ``disagreement``), its message naming the tensors that differ."""
    if not keys:
        return error
    shown = ", ".join(repr(k) for k in keys[:_SHOWN])
    more = f" and {len(keys) - _SHOWN} more" if len(keys) > _SHOWN else ""
    return CheckpointError(
        f"{error.message} The copies differ in {shown}{more} ({len(keys)} of the tensors sampled).",
        subject=error.subject,
        hint=error.hint,
    )


def disagreement(prints: list[Fingerprint]) -> CheckpointError | None:
    """The first difference between the ranks' files (pure: every rank finds the same)."""
    _, files0 = prints[0]
    for rank, (_, files) in enumerate(prints[1:], start=1):
        if [f[0] for f in files] != [f[0] for f in files0]:
            return CheckpointError(
                f"rank {rank}'s weights are other files than rank 0's "
                f"({[f[0] for f in files]} against {[f[0] for f in files0]}).",
                subject="weights",
                hint="Give every rank the same checkpoint revision (node-local copies out of "
                "sync?).",
            )
        for mine, first in zip(files, files0, strict=True):
            name, real, size, dig, _ = mine
            if (size, dig) != (first[2], first[3]):
                return CheckpointError(
                    f"rank {rank}'s {real} differs from rank 0's {first[1]} ({size} and "
                    f"{first[2]} bytes, digests {dig[:12]} and {first[3][:12]}): the ranks were "
                    "given different revisions of the weights.",
                    subject=name,
                    hint="Give every rank the same checkpoint revision (node-local copies out "
                    "of sync? a download still running on one node?).",
                )
    return _replaced(prints)


def _replaced(prints: list[Fingerprint]) -> CheckpointError | None:
    """On one host, one path must be one file (identity) on every rank."""
    seen: dict[tuple[str, str], tuple[int, tuple[int, int, int, int]]] = {}
    for rank, (host, files) in enumerate(prints):
        for name, real, _, _, ident in files:
            first, planned = seen.setdefault((host, real), (rank, ident))
            if planned != ident:
                return CheckpointError(
                    f"{real} was replaced between rank {first}'s and rank {rank}'s planning "
                    "(another inode or modification time on the same host).",
                    subject=name,
                    hint=_REPLACED,
                )
    return None
