"""``PrepConfig.weights`` -> a ``WeightsSnapshot``: which files, and what their headers say.

The path is a ``save_pretrained`` directory (``model.safetensors``, or shards listed by
``model.safetensors.index.json``), an index file, or one ``.safetensors`` file (what
``fprep.export_full`` writes). Only headers and the index are read here, once, while planning.
An index may only name files inside its own directory (no absolute paths, no ``..``), each file
it names must exist and hold the tensors the index says it holds. Pickle-based files
(``pytorch_model.bin``) are never read.
"""

from __future__ import annotations

import os
from pathlib import Path, PurePosixPath

from fprep.checkpoint.files import parse_json, read_failure
from fprep.errors import CheckpointError, ConfigError, PrepError
from fprep.weights.header import MAX_HEADER_BYTES, read_header
from fprep.weights.records import WeightsSnapshot, WeightsTensor

SINGLE = "model.safetensors"
INDEX = "model.safetensors.index.json"
_PICKLED = (".bin", ".pt", ".pth", ".ckpt", ".pkl")


def snapshot(path: str) -> WeightsSnapshot:
    """Read and check the headers of every file ``path`` names."""
    p = Path(path)
    if p.is_dir():
        if (p / INDEX).is_file():
            return _from_index(p / INDEX, path)
        if (p / SINGLE).is_file():
            return _from_files([(str(p / SINGLE), None)], path)
        raise _nothing_in(p)
    if p.is_file():
        if p.name.endswith(".index.json"):
            return _from_index(p, path)
        if p.suffix in _PICKLED:
            raise _pickled(p)
        return _from_files([(str(p), None)], path)
    raise ConfigError(
        f"PrepConfig.weights is {path!r}, which does not exist.",
        subject="weights",
        hint="Pass a save_pretrained directory or a .safetensors file.",
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


def _from_index(index: Path, source: str) -> WeightsSnapshot:
    what = str(index)
    try:
        size = os.stat(index).st_size
        if size > MAX_HEADER_BYTES:
            raise CheckpointError(
                f"{what} is {size} bytes, more than the {MAX_HEADER_BYTES} fprep reads.",
                subject=what,
                hint="The index is damaged; re-save the checkpoint.",
            )
        data = index.read_bytes()
    except OSError as e:
        raise read_failure(e, index) from None
    body = parse_json(data, what)
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
    if not path.is_file():
        raise CheckpointError(
            f"{what} maps {key!r} to {name!r}, but {path} does not exist.",
            subject=key,
            hint="The checkpoint is incomplete (an interrupted download or copy?): fetch the "
            "missing file.",
        )
    return path


def _from_files(files: list[tuple[str, list[str] | None]], source: str) -> WeightsSnapshot:
    """Headers of ``files``: each with the keys the index assigns it (``None``: all of them)."""
    tensors: list[WeightsTensor] = []
    sizes: list[tuple[str, int]] = []
    for file, keys in files:
        found, size = read_header(file)
        sizes.append((file, size))
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
    return WeightsSnapshot(source=source, tensors=tuple(tensors), files=tuple(sizes))
