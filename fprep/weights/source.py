"""``PrepConfig.weights`` -> a ``WeightsSnapshot``: which files, and what their headers say.

The path is a ``save_pretrained`` directory (``model.safetensors``, or shards listed by
``model.safetensors.index.json``), an index file, or one ``.safetensors`` file (what
``fprep.export_full`` writes). Only headers and the index are read here, once, while planning.
An index may only name files inside its own directory (no absolute paths, no ``..``), each file
it names must exist and hold exactly the tensors the index says it holds (a tensor a shard holds
but the index does not list for it -- a key in two shards, a stale shard -- is refused, as an
unexpected tensor in a single file is). A directory holding both ``model.safetensors`` and an
index is read as transformers' ``from_pretrained`` reads it: the single file (the plan notes
it). Pickle-based files (``pytorch_model.bin``) are never read; URLs are not fetched.
"""

from __future__ import annotations

import os
import re
import stat
from pathlib import Path, PurePosixPath

from fprep.checkpoint.format.files import parse_json, read_failure
from fprep.errors import CheckpointError, ConfigError, PrepError
from fprep.weights.header import read_header
from fprep.weights.identity import kind_of, open_regular
from fprep.weights.records import WeightsSnapshot, WeightsTensor

SINGLE = "model.safetensors"
INDEX = "model.safetensors.index.json"
_PICKLED = (".bin", ".pt", ".pth", ".ckpt", ".pkl")
#: Bounds on an index checked before parsing it (a real one is far smaller: ~150k entries,
#: ~15 MB, for the largest public MoE checkpoints).
MAX_INDEX_BYTES = 64 << 20
MAX_INDEX_ENTRIES = 1 << 20
_URL = re.compile(r"^[A-Za-z][A-Za-z0-9+.-]*(://|::)")


def snapshot(path: str) -> WeightsSnapshot:
    """Read and check the headers of every file ``path`` names."""
    p = Path(path)
    mode = _mode(path)
    if stat.S_ISDIR(mode):
        if (p / SINGLE).exists():
            both = (p / INDEX).exists()
            return _from_files([(str(p / SINGLE), None)], path, _both_note(p) if both else ())
        if (p / INDEX).exists():
            return _from_index(p / INDEX, path)
        raise _nothing_in(p)
    if not stat.S_ISREG(mode):
        raise ConfigError(
            f"PrepConfig.weights is {path!r}, which is {kind_of(mode)}, not a regular file or "
            "a directory.",
            subject="weights",
            hint="Pass a save_pretrained directory or a .safetensors file.",
        )
    if p.name.endswith(".index.json"):
        return _from_index(p, path)
    if p.suffix in _PICKLED:
        raise _pickled(p)
    return _from_files([(str(p), None)], path)


def _mode(path: str) -> int:
    """``st_mode`` of ``path`` (links followed), or a ConfigError saying why there is none."""
    if "\x00" in path:  # os.stat would raise a bare ValueError
        raise ConfigError(
            f"PrepConfig.weights is {path!r}, which holds a NUL character: no file has that name.",
            subject="weights",
            hint="Pass a save_pretrained directory or a .safetensors file.",
        )
    try:
        return os.stat(path).st_mode
    except FileNotFoundError:
        if _URL.match(path):
            raise ConfigError(
                f"PrepConfig.weights is {path!r}, a URL; weights= reads local files only "
                "(each rank reads its byte ranges with positioned reads).",
                subject="weights",
                hint="Download the checkpoint first (e.g. huggingface_hub.snapshot_download"
                "(repo_id)) and pass the local directory.",
            ) from None
        raise ConfigError(
            f"PrepConfig.weights is {path!r}, which does not exist.",
            subject="weights",
            hint="Pass a save_pretrained directory or a .safetensors file.",
        ) from None
    except OSError as e:
        raise read_failure(e, path) from None


def _both_note(p: Path) -> tuple[str, ...]:
    return (
        f"weights: {p} holds both {SINGLE} and {INDEX}; {SINGLE} is read, as transformers' "
        "from_pretrained reads it (the index and its shards are not used).",
    )


def _nothing_in(p: Path) -> PrepError:
    names = sorted(c.name for c in p.iterdir())[:8]
    pickled = [n for n in names if n.endswith(_PICKLED)]
    if pickled:
        return _pickled(p / pickled[0])
    others = [n for n in names if n.endswith(".safetensors")]
    return ConfigError(
        f"PrepConfig.weights is the directory {p}, which has neither {SINGLE} nor {INDEX} "
        f"(it has: {', '.join(names) or 'nothing'}).",
        subject="weights",
        hint=f"Pass the file itself, e.g. weights={str(p / others[0])!r}."
        if others
        else "Pass the directory model.save_pretrained(...) wrote, or a .safetensors file.",
    )


def _pickled(p: Path) -> ConfigError:
    return ConfigError(
        f"PrepConfig.weights names pickle-based weights ({p}); fprep never unpickles files "
        "(loading one can run any code in it).",
        subject="weights",
        hint="Convert once where you trust the file: load it and call "
        "model.save_pretrained(dir) (safetensors), then pass that directory.",
    )


def _too_big(what: str, message: str) -> CheckpointError:
    return CheckpointError(
        f"{what} {message}", subject=what, hint="The index is damaged; re-save the checkpoint."
    )


def _read_index(index: Path) -> bytes:
    """The index's bytes: a regular file (opened without blocking), within the bounds."""
    what = str(index)
    try:
        fd, info = open_regular(os.path.realpath(index), what)
        try:
            if info.st_size > MAX_INDEX_BYTES:
                raise _too_big(
                    what, f"is {info.st_size} bytes, more than the {MAX_INDEX_BYTES} fprep reads."
                )
            data = os.pread(fd, MAX_INDEX_BYTES + 1, 0)
        finally:
            os.close(fd)
    except OSError as e:
        raise read_failure(e, index) from None
    if data.count(b",") + 1 > MAX_INDEX_ENTRIES:  # counted before parsing: an upper bound
        raise _too_big(what, f"lists more than {MAX_INDEX_ENTRIES} tensors.")
    return data


def _from_index(index: Path, source: str) -> WeightsSnapshot:
    what = str(index)
    body = parse_json(_read_index(index), what)
    weight_map = body.get("weight_map") if isinstance(body, dict) else None
    if not isinstance(weight_map, dict):
        raise CheckpointError(
            f"{what} has no 'weight_map' object (name -> file).",
            subject=what,
            hint="The index is damaged or not a save_pretrained index; re-save the checkpoint.",
        )
    by_file: dict[str, list[str]] = {}
    for key, name in weight_map.items():
        by_file.setdefault(str(_inside(index.parent, key, name, what)), []).append(key)
    return _from_files(list(by_file.items()), source)


def _inside(directory: Path, key: str, name: object, what: str) -> Path:
    """The file ``name`` (from an index) in ``directory``; refused if it could be elsewhere."""
    parts = PurePosixPath(name).parts if isinstance(name, str) else ()
    if (
        not isinstance(name, str)
        or not parts
        or "\x00" in name
        or "\\" in name
        or PurePosixPath(name).is_absolute()
        or any(part in ("..", "") for part in parts)
    ):
        raise CheckpointError(
            f"{what} maps {key!r} to {name!r}, which is not a file name inside its directory.",
            subject=key,
            hint="An index may only name files in its own directory; this one was not used.",
        )
    path = directory.joinpath(*parts)
    try:
        found = path.exists()
    except OSError as e:  # a name too long for the file system, a permission denied
        raise CheckpointError(
            f"{what} maps {key!r} to {name!r}, which cannot be looked up: {e.strerror or e}.",
            subject=key,
            hint="The index does not belong to a checkpoint in this directory, or the directory "
            "is not readable; re-save or re-download the checkpoint.",
        ) from None
    if not found:
        raise CheckpointError(
            f"{what} maps {key!r} to {name!r}, but {path} does not exist.",
            subject=key,
            hint="The checkpoint is incomplete (an interrupted download or copy?): fetch the "
            "missing file.",
        )
    return path


def _from_files(
    files: list[tuple[str, list[str] | None]], source: str, notes: tuple[str, ...] = ()
) -> WeightsSnapshot:
    """Headers of ``files``: each with the keys the index assigns it (``None``: all of them)."""
    tensors: list[WeightsTensor] = []
    records = []
    for file, keys in files:
        found, record = read_header(file)
        records.append(record)
        if keys is None:
            tensors.extend(found)
            continue
        by_key = {t.key: t for t in found}
        for key in keys:
            if key not in by_key:
                raise CheckpointError(
                    f"the index of {source} maps {key!r} to {file}, which holds no such tensor.",
                    subject=key,
                    hint="The index and the files do not belong together; re-save the checkpoint.",
                )
            tensors.append(by_key[key])
        listed = set(keys)
        unlisted = [t.key for t in found if t.key not in listed]
        if unlisted:
            raise CheckpointError(
                f"{file} holds {unlisted[0]!r}, which the index of {source} does not list for "
                f"it ({len(unlisted)} such tensors): a key in two shards, or a shard that does "
                "not belong to this index. Which value is meant is ambiguous.",
                subject=unlisted[0],
                hint="The index and the files do not belong together; re-save the checkpoint.",
            )
    return WeightsSnapshot(source=source, tensors=tuple(tensors), files=tuple(records), notes=notes)
