"""File primitives: strict JSON, sha256 records, durable writes.

Everything fprep reads from a checkpoint goes through here or through ``storage.py``: JSON is
parsed with the standard library's parser only (no object hooks that build anything but dicts,
lists, strings, numbers, bools and None), duplicate keys and non-standard constants (``NaN``,
``Infinity``) are refused, and files are checked to be regular files of the recorded size and
hash before their contents are interpreted.
"""

from __future__ import annotations

import hashlib
import json
import os
import stat
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from fprep.errors import CheckpointError

#: Refuse JSON files larger than this unless the caller knows their size from a verified record.
MAX_UNVERIFIED_JSON = 64 * 1024 * 1024


@dataclass(frozen=True, kw_only=True)
class FileRecord:
    """What the manifest records for one file: its size in bytes and its sha256 (hex)."""

    size: int
    sha256: str


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
        raise CheckpointError(f"cannot read {what} at {path}: {e}.", subject=what) from None
    if not stat.S_ISREG(info.st_mode):
        raise CheckpointError(
            f"{what} at {path} is not a regular file (a link, directory or device).",
            subject=what,
            hint="fprep only reads regular files inside a checkpoint directory.",
        )
    return info.st_size


def read_small(path: Path, what: str, limit: int = MAX_UNVERIFIED_JSON) -> bytes:
    """The contents of a regular file of at most ``limit`` bytes."""
    size = regular_file_size(path, what)
    if size > limit:
        raise CheckpointError(
            f"{what} is {size} bytes, more than the {limit} bytes fprep accepts for it.",
            subject=what,
            hint="The file was not written by fprep.save; it was not read.",
        )
    with open(path, "rb") as f:
        return f.read(limit + 1)[:limit]


def check_size(path: Path, record: FileRecord, what: str) -> None:
    size = regular_file_size(path, what)
    if size != record.size:
        kind = "truncated" if size < record.size else "longer than recorded"
        raise CheckpointError(
            f"{what} is {kind}: {size} bytes on disk, the manifest records {record.size}.",
            subject=what,
            hint="The checkpoint is damaged (an interrupted copy?); load another one.",
        )


def check_digest(digest: str, record: FileRecord, what: str) -> None:
    if digest != record.sha256:
        raise CheckpointError(
            f"{what} does not match its sha256 in the manifest (got {digest[:16]}…, "
            f"recorded {record.sha256[:16]}…).",
            subject=what,
            hint="The file was modified or damaged after it was saved; it was not used.",
        )


def read_verified(path: Path, record: FileRecord, what: str) -> bytes:
    """The contents of ``path``, checked against its size and sha256 before being returned."""
    check_size(path, record, what)
    with open(path, "rb") as f:
        data = f.read(record.size + 1)
    check_size_of(data, record, what)
    check_digest(hashlib.sha256(data).hexdigest(), record, what)
    return data


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
    return FileRecord(size=len(data), sha256=hashlib.sha256(data).hexdigest())


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
