"""The safetensors header, parsed and checked without trusting anything in it.

A safetensors file is an 8-byte little-endian header length ``n``, ``n`` bytes of JSON (an
object: per tensor ``dtype``, ``shape`` and ``data_offsets`` relative to the data section, and
an optional ``__metadata__`` object), then the raw bytes. Everything a reader relies on is
checked here, before a single tensor byte is read: an absurd length, a header that is not a
JSON object (or has duplicate keys), unknown dtypes, shapes that are not lists of non-negative
ints, offsets whose size is not ``numel * itemsize``, ranges outside the file or overlapping
each other. Each problem is a ``CheckpointError`` naming the file and the key. ``parse`` is pure
(bytes in, records out) so that it can be fuzzed; ``read_header`` does the I/O.
"""

from __future__ import annotations

import itertools
import os
from typing import Any

from fprep.checkpoint.format.files import parse_json, read_failure
from fprep.errors import CheckpointError
from fprep.weights.identity import digest, open_regular, sample_ranges
from fprep.weights.records import SAFETENSORS_DTYPES, WeightsFile, WeightsTensor

#: Bounds checked before a header is parsed (parsing costs ~700 bytes of Python objects per
#: entry: 1.4M entries cost ~1 GB). Real headers are far smaller: a shard of a large MoE
#: checkpoint lists a few thousand tensors (well under 1 MB of header); even DeepSeek-V3's or
#: Kimi-K2's ~90k-150k tensors in one file would need ~10-20 MB. The safetensors library itself
#: accepts up to 100 MB.
MAX_HEADER_BYTES = 32 << 20
MAX_TENSORS = 1 << 18
_CHUNK = 1 << 20

_NOT_SAFETENSORS = (
    "Pass a .safetensors file or a save_pretrained directory (model.safetensors, or shards with "
    "model.safetensors.index.json); re-save other formats with save_pretrained."
)


def _bad(file: str, message: str, key: str = "") -> CheckpointError:
    where = f"tensor {key!r} in {file}" if key else file
    return CheckpointError(
        f"{where}: {message}",
        subject=key or file,
        hint="The file is damaged, truncated or not a safetensors file; nothing was read from "
        "it. Re-save the checkpoint.",
    )


def header_length(prefix: bytes, file_size: int, file: str) -> int:
    """The header length from the first 8 bytes, checked against the file's size."""
    if len(prefix) < 8 or file_size < 8:
        raise CheckpointError(
            f"{file} is not a safetensors file: {file_size} bytes, shorter than the 8-byte "
            "header length.",
            subject=file,
            hint=_NOT_SAFETENSORS,
        )
    n = int.from_bytes(prefix[:8], "little")
    if n < 2 or n > MAX_HEADER_BYTES or n > file_size - 8:
        raise CheckpointError(
            f"{file} is not a safetensors file fprep reads: its first 8 bytes give a header of "
            f"{n} bytes (the file has {file_size - 8} after them; at most {MAX_HEADER_BYTES} "
            "accepted).",
            subject=file,
            hint=_NOT_SAFETENSORS,
        )
    return n


def _too_many(file: str) -> CheckpointError:
    return CheckpointError(
        f"{file}'s header describes more than {MAX_TENSORS} tensors (counted before parsing "
        "it); no real checkpoint file holds that many.",
        subject=file,
        hint=_NOT_SAFETENSORS,
    )


def _read_bounded(fd: int, n: int, file: str) -> bytes:
    """The ``n`` header bytes after the length, refused as soon as they open more objects than
    ``MAX_TENSORS`` entries need (every entry is a JSON object: one ``{`` each)."""
    chunks: list[bytes] = []
    objects = 0
    for start in range(8, 8 + n, _CHUNK):
        part = os.pread(fd, min(_CHUNK, 8 + n - start), start)
        objects += part.count(b"{")
        if objects > MAX_TENSORS + 2:  # + the header itself and __metadata__
            raise _too_many(file)
        chunks.append(part)
        if len(part) < min(_CHUNK, 8 + n - start):
            break
    header = b"".join(chunks)
    if len(header) != n:
        raise _bad(file, f"the file changed while its header was read ({len(header)} of {n}).")
    return header


def _int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def parse(header: bytes, file_size: int, file: str) -> tuple[WeightsTensor, ...]:
    """The tensors a header describes (``header``: the JSON bytes after the length), checked.

    Offsets in the result are absolute (from the start of the file).
    """
    start = 8 + len(header)
    data_size = file_size - start
    if data_size < 0:
        raise _bad(file, f"the header runs past the end of the file ({file_size} bytes).")
    try:
        body = parse_json(header, f"the header of {file}")
    except CheckpointError as e:
        raise CheckpointError(
            f"{file} is not a safetensors file: {e.message}", subject=file, hint=_NOT_SAFETENSORS
        ) from None
    if not isinstance(body, dict):
        raise CheckpointError(
            f"{file} is not a safetensors file: its header is a JSON "
            f"{type(body).__name__}, not an object.",
            subject=file,
            hint=_NOT_SAFETENSORS,
        )
    tensors: list[WeightsTensor] = []
    for key, entry in body.items():
        if key == "__metadata__":
            if not isinstance(entry, dict):
                raise _bad(file, f"__metadata__ is a {type(entry).__name__}, not an object.")
            continue
        if not key:
            raise _bad(file, "a tensor has an empty name.")
        if not isinstance(entry, dict) or not {"dtype", "shape", "data_offsets"} <= set(entry):
            raise _bad(file, "needs an object with dtype, shape and data_offsets.", key)
        code, shape, offsets = entry["dtype"], entry["shape"], entry["data_offsets"]
        known = SAFETENSORS_DTYPES.get(code) if isinstance(code, str) else None
        if known is None:
            raise _bad(
                file,
                f"dtype {code!r} is not one fprep reads ({', '.join(sorted(SAFETENSORS_DTYPES))}).",
                key,
            )
        if not isinstance(shape, list) or not all(_int(d) for d in shape):
            raise _bad(file, f"shape {shape!r} is not a list of non-negative ints.", key)
        if (
            not isinstance(offsets, list)
            or len(offsets) != 2
            or not all(_int(o) for o in offsets)
            or offsets[0] > offsets[1]
        ):
            raise _bad(
                file, f"data_offsets {offsets!r} is not [begin, end] with begin <= end.", key
            )
        dtype, itemsize = known
        numel = 1
        for d in shape:
            numel *= d
        begin, end = offsets
        if end - begin != numel * itemsize:
            raise _bad(
                file,
                f"data_offsets {offsets} hold {end - begin} bytes, but shape {shape} of {code} "
                f"needs {numel * itemsize}.",
                key,
            )
        if end > data_size:
            raise _bad(
                file,
                f"data_offsets {offsets} end past the data section ({data_size} bytes).",
                key,
            )
        tensors.append(WeightsTensor(key, file, dtype, tuple(shape), start + begin, end - begin))
    spans = sorted((t for t in tensors if t.nbytes), key=lambda t: t.offset)
    for before, after in itertools.pairwise(spans):
        if after.offset < before.offset + before.nbytes:
            raise _bad(file, f"its bytes overlap those of {before.key!r}.", after.key)
    return tuple(tensors)


def read_header(path: str) -> tuple[tuple[WeightsTensor, ...], WeightsFile]:
    """The tensors of the safetensors file at ``path``, read and checked, and what the load
    checks it still is (``WeightsFile``).

    Only the header (and the digest's sampled blocks of every tensor) is read. Symbolic links
    are resolved here, once (the Hugging Face cache links every file to a blob); the target is
    opened without following links or blocking and must be a regular file.
    """
    real = os.path.realpath(path)
    try:
        fd, info = open_regular(real, path)
        try:
            n = header_length(os.pread(fd, 8, 0), info.st_size, path)
            header = _read_bounded(fd, n, path)
            tensors = parse(header, info.st_size, path)
            samples = sample_ranges((t.offset, t.nbytes) for t in tensors)
            prefix = n.to_bytes(8, "little") + header
            dig = digest(fd, info.st_size, 8 + n, samples, path, prefix)
        finally:
            os.close(fd)
    except OSError as e:
        raise read_failure(e, path) from None
    file = WeightsFile(
        path=path,
        real=real,
        size=info.st_size,
        device=info.st_dev,
        inode=info.st_ino,
        mtime_ns=info.st_mtime_ns,
        header_bytes=8 + n,
        samples=samples,
        digest=dig,
    )
    return tensors, file
