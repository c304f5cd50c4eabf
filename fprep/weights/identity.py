"""Whether a weights file is still the one planning read, and the same on every rank.

Planning records each file's identity (device, inode, size, modification time) and a digest of
its header and of ``SAMPLES`` evenly spaced blocks of its data (``WeightsFile``). The load opens
the file again through its resolved path, never following a link and never blocking (a FIFO
swapped in would block ``open`` until a writer came), and checks, through the descriptor, that
it is a regular file with the same identity and the same digest before the first byte is written
into the model; after the reads ``fstat`` must still say the same. A file replaced by one of the
same size (tensors swapped, offsets swapped to match) has another inode or another header; one
rewritten in place has another modification time (or, if that was put back, another header).

Ranks then compare what they planned (``disagreement``): the same files (by name), sizes and
digests everywhere — ranks given different revisions, or node-local copies out of sync, are
refused — and, on one host, the same identity for the same path (a file replaced between two
ranks' planning). The digest samples the data, so two revisions are told apart when their
bytes differ broadly (any fine-tuning step does), not a single flipped byte: what safetensors
records does not allow more without reading every byte.
"""

from __future__ import annotations

import hashlib
import os
import stat

from fprep.checkpoint.format.files import OPEN_FLAGS
from fprep.errors import CheckpointError
from fprep.weights.records import WeightsFile

#: Data blocks of each file the digest covers, and their size.
SAMPLES, BLOCK = 16, 4096
_STEP = 1 << 20  # header bytes hashed per read

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


def sample_offsets(header_bytes: int, size: int) -> list[int]:
    """Where the sampled data blocks start: evenly spaced over the data, the last at its end."""
    data = size - header_bytes
    if data <= 0:
        return []
    last = max(0, data - BLOCK)
    return sorted({header_bytes + last * i // (SAMPLES - 1) for i in range(SAMPLES)})


def digest(fd: int, size: int, header_bytes: int, shown: str, header: bytes = b"") -> str:
    """BLAKE2b of the size, the header (with its 8-byte length; ``header`` when already read)
    and the sampled data blocks."""
    h = hashlib.blake2b(digest_size=16)
    h.update(size.to_bytes(8, "little"))
    if header:
        h.update(header)
    for start in range(len(header), header_bytes, _STEP):
        h.update(_pread(fd, min(_STEP, header_bytes - start), start, shown))
    for offset in sample_offsets(header_bytes, size):
        h.update(_pread(fd, min(BLOCK, size - offset), offset, shown))
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
        if digest(fd, file.size, file.header_bytes, file.path) != file.digest:
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
