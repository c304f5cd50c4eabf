"""File primitives: strict JSON, size + digest records, durable writes, OS errors explained.

Every file of a checkpoint is recorded with its size and a cryptographic digest: BLAKE3 for new
checkpoints (about 4x the speed of sha256 on one core, and still a cryptographic hash, so a
manifest whose own digest is kept elsewhere vouches for every byte), sha256 in checkpoints
written before (still read and verified).

Everything fprep reads from a checkpoint goes through here or through ``storage.py``: JSON is
parsed with the standard library's parser only (no object hooks that build anything but dicts,
lists, strings, numbers, bools and None), duplicate keys and non-standard constants (``NaN``,
``Infinity``) are refused, and files are checked to be regular files of the recorded size and
hash before their contents are interpreted.
"""

from __future__ import annotations

import errno
import hashlib
import io
import json
import os
import stat
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import blake3
from typing_extensions import Buffer

from fprep.errors import CheckpointError

#: Refuse JSON files larger than this unless the caller knows their size from a verified record.
MAX_UNVERIFIED_JSON = 64 * 1024 * 1024


#: The digest new checkpoints record.
ALGORITHM = "blake3"
#: The digests fprep verifies (sha256: checkpoints written before BLAKE3 was adopted).
ALGORITHMS = ("blake3", "sha256")


@dataclass(frozen=True, kw_only=True)
class FileRecord:
    """What the manifest records for one file: its size in bytes and its digest (lowercase hex
    of ``algorithm``, one of ``ALGORITHMS``)."""

    size: int
    algorithm: str
    digest: str


class Hasher(Protocol):
    """The part of ``hashlib``'s and ``blake3``'s hashers that fprep uses."""

    def update(self, data: Buffer, /) -> object: ...

    def hexdigest(self) -> str: ...


def new_hasher(algorithm: str = ALGORITHM) -> Hasher:
    """A fresh hasher. Both kinds release the GIL while hashing large buffers (blake3 above
    2 KiB, hashlib above 2 KiB), so several threads hash in parallel."""
    if algorithm == "blake3":
        return blake3.blake3()
    if algorithm == "sha256":
        return hashlib.sha256()
    raise CheckpointError(
        f"unknown hash algorithm {algorithm!r}; fprep verifies {', '.join(ALGORITHMS)}.",
        subject=algorithm,
        hint="The checkpoint was written by a newer fprep: upgrade fprep to load it.",
    )


def digest_of(data: Buffer, algorithm: str = ALGORITHM) -> str:
    hasher = new_hasher(algorithm)
    hasher.update(data)
    return hasher.hexdigest()


#: What to do about an ``OSError``, by errno (the default: check the path and permissions).
_OS_HINTS = {
    errno.EACCES: "This process may not access it: check the permissions of the path and of "
    "the directories above it.",
    errno.EPERM: "The operation is not permitted there: check the permissions and the file "
    "system's mount options.",
    errno.ENOSPC: "The file system is full: free space or use another file system.",
    errno.EDQUOT: "The disk quota is exhausted: free space or use another file system.",
    errno.EROFS: "The file system is read-only: use a writable location.",
    errno.ENOTDIR: "A part of the path is a file, not a directory: choose another path.",
    errno.EEXIST: "A file is in the way of a directory that is needed: choose another path.",
    errno.EISDIR: "The path is a directory where a file is needed: pass a file path.",
    errno.ENOENT: "It does not exist (was it moved or deleted meanwhile?): check the path.",
    errno.ENAMETOOLONG: "The path is too long for the file system: use a shorter one.",
    errno.EIO: "The storage reported an I/O error: check the disk or the network file system.",
    errno.ELOOP: "A symbolic link is where a checkpoint file should be: fprep only reads "
    "regular files.",
    errno.ENODEV: "The file system cannot memory-map files: copy the checkpoint to a local "
    "or network file system that can.",
    errno.ENOMEM: "The system ran out of memory (or of memory maps): free memory and retry.",
}


def os_failure(
    error: OSError, doing: str, path: str | os.PathLike[str], *, subject: str, then: str = ""
) -> CheckpointError:
    """A ``CheckpointError`` for an ``OSError``: the path, the system's reason, what to do.

    ``doing`` reads after the path ("cannot <doing> <path>"); ``then`` is appended to the hint
    (what fprep left behind, e.g. that the previous checkpoints are untouched).
    """
    reason = error.strerror or str(error) or type(error).__name__
    where = f" ({error.filename})" if error.filename and str(error.filename) != str(path) else ""
    hint = _OS_HINTS.get(error.errno or 0, "Check that the path exists and is accessible.")
    wrapped = CheckpointError(
        f"cannot {doing} {path}: {reason}{where} [{type(error).__name__}].",
        subject=subject,
        hint=f"{hint} {then}".strip(),
    )
    wrapped.__cause__ = error
    return wrapped


def read_failure(error: Exception, path: str | os.PathLike[str]) -> Exception:
    """An ``OSError`` met while loading from ``path``, as a ``CheckpointError`` naming the file it
    concerns; any other exception as it is."""
    if not isinstance(error, OSError):
        return error
    where = error.filename or path
    return os_failure(error, "read", where, subject=str(where))


def _reject_constant(name: str) -> Any:
    raise ValueError(f"non-standard JSON constant {name}")


def _no_duplicates(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in pairs:
        if key in out:
            raise ValueError(f"duplicate key {key!r}")
        out[key] = value
    return out


def parse_json(data: bytes, what: str) -> Any:
    """Parse ``data`` as strict JSON (UTF-8, no duplicate keys, no NaN / Infinity)."""
    try:
        return json.loads(
            data.decode("utf-8"),
            object_pairs_hook=_no_duplicates,
            parse_constant=_reject_constant,
        )
    except (UnicodeDecodeError, ValueError, RecursionError) as e:
        raise CheckpointError(
            f"{what} is not valid JSON ({e}).",
            subject=what,
            hint="The file is damaged or was not written by fprep.save; it was not used.",
        ) from None


def dump_json(value: Any) -> bytes:
    """Canonical JSON bytes (sorted keys, no NaN) for a value made of plain data."""
    return json.dumps(value, sort_keys=True, allow_nan=False, separators=(",", ":")).encode()


def regular_file_size(path: Path, what: str) -> int:
    """The size of ``path``, which must exist and be a regular file (not a link or device)."""
    try:
        info = os.lstat(path)
    except FileNotFoundError:
        raise CheckpointError(
            f"{what} is missing: {path}.",
            subject=what,
            hint="The checkpoint is incomplete; load another one (or the step directory itself).",
        ) from None
    except OSError as e:
        raise os_failure(e, f"read {what} at", path, subject=what) from None
    if not stat.S_ISREG(info.st_mode):
        raise _not_regular(path, what)
    return info.st_size


#: How checkpoint files are opened: never through a link, never blocking (a FIFO swapped in
#: after ``regular_file_size`` looked would otherwise block the open until a writer came).
OPEN_FLAGS = (
    os.O_RDONLY
    | getattr(os, "O_NOFOLLOW", 0)
    | getattr(os, "O_NONBLOCK", 0)
    | getattr(os, "O_CLOEXEC", 0)
)


def open_regular(path: Path, what: str, size: int | None = None) -> io.FileIO:
    """``path`` opened for reading (unbuffered) after ``regular_file_size`` checked it: checked
    again through the descriptor (a regular file, of ``size`` bytes when given), so what is read
    is what was checked, whatever the path names meanwhile."""
    try:
        fd = os.open(path, OPEN_FLAGS)
    except OSError as e:
        raise os_failure(e, f"read {what} at", path, subject=what) from None
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            raise _not_regular(path, what)
        if size is not None and info.st_size != size:
            raise CheckpointError(
                f"{what} changed while it was read (now not a regular file of {size} bytes).",
                subject=what,
                hint="Something modifies the checkpoint while it is loaded; load it when it is "
                "not.",
            )
    except BaseException:
        os.close(fd)
        raise
    return io.FileIO(fd, "rb")


def _not_regular(path: Path, what: str) -> CheckpointError:
    return CheckpointError(
        f"{what} at {path} is not a regular file (a link, directory or device).",
        subject=what,
        hint="fprep only reads regular files inside a checkpoint directory.",
    )


def read_small(path: Path, what: str, limit: int = MAX_UNVERIFIED_JSON) -> bytes:
    """The contents of a regular file of at most ``limit`` bytes."""
    size = regular_file_size(path, what)
    if size > limit:
        raise CheckpointError(
            f"{what} is {size} bytes, more than the {limit} bytes fprep accepts for it.",
            subject=what,
            hint="The file was not written by fprep.save; it was not read.",
        )
    try:
        with open_regular(path, what) as f:
            return f.read(limit + 1)[:limit]
    except OSError as e:
        raise os_failure(e, f"read {what} at", path, subject=what) from None


def check_size(path: Path, record: FileRecord, what: str) -> None:
    check_recorded_size(regular_file_size(path, what), record, what)


def check_recorded_size(size: int, record: FileRecord, what: str) -> None:
    """A file of ``size`` bytes must be as long as ``record`` says."""
    if size != record.size:
        kind = "truncated" if size < record.size else "longer than recorded"
        raise CheckpointError(
            f"{what} is {kind}: {size} bytes on disk, the manifest records {record.size}.",
            subject=what,
            hint="The checkpoint is damaged (an interrupted copy?); load another one.",
        )


def check_digest(digest: str, record: FileRecord, what: str) -> None:
    if digest != record.digest:
        raise CheckpointError(
            f"{what} does not match its {record.algorithm} digest in the manifest (got "
            f"{digest[:16]}…, recorded {record.digest[:16]}…).",
            subject=what,
            hint="The file was modified or damaged after it was saved; it was not used.",
        )


def read_verified(path: Path, record: FileRecord, what: str) -> bytes:
    """The contents of ``path``, checked against its size and digest before being returned."""
    check_size(path, record, what)
    try:
        with open_regular(path, what, record.size) as f:
            data = f.read(record.size + 1)
    except OSError as e:
        raise os_failure(e, f"read {what} at", path, subject=what) from None
    check_bytes(data, record, what)
    return data


def check_bytes(data: bytes, record: FileRecord, what: str) -> None:
    """``data`` (a whole file's contents) has the size and digest ``record`` records."""
    check_size_of(data, record, what)
    check_digest(digest_of(data, record.algorithm), record, what)


def check_size_of(data: bytes, record: FileRecord, what: str) -> None:
    if len(data) != record.size:  # changed between stat and read
        raise CheckpointError(
            f"{what} changed while it was read ({len(data)} bytes, recorded {record.size}).",
            subject=what,
        )


def write_durable(path: Path, data: bytes) -> FileRecord:
    """Write ``data`` to ``path`` and fsync it; return its record."""
    with open(path, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    return record_of(data)


def record_of(data: bytes) -> FileRecord:
    """The record of a file whose contents are ``data``."""
    return FileRecord(size=len(data), algorithm=ALGORITHM, digest=digest_of(data))


def fsync_dir(path: Path) -> None:
    """Make a directory's entries (new names, renames) durable. A no-op where unsupported."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)
