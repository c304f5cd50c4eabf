"""The checkpoint root on disk: step directories, the ``latest`` pointer, publishing, rotation.

::

    root/
      latest                    "step-00000120\\n": the checkpoint load(root) reads
      step-00000100/            one complete checkpoint (never modified once published)
      step-00000120/
      step-00000120.1/          a second save at step 120 (saving never overwrites)
      .tmp-00000130-<uuid>/     a save in progress, or one that was killed: ignored, and
                                removed by the next save

A save writes everything into a fresh ``.tmp-*`` directory, fsyncs it, and publishes it with
one ``rename`` to its step name (atomic on POSIX file systems), then replaces ``latest``
atomically (written to a temporary file, fsynced, ``os.replace``-d). A process killed at any
moment therefore leaves every published checkpoint intact and ``latest`` naming one of them;
the interrupted one is either complete (published) or an ignored ``.tmp-*`` directory.
"""

from __future__ import annotations

import os
import re
import shutil
import uuid
from pathlib import Path

from fprep.checkpoint.files import fsync_dir, read_small
from fprep.errors import CheckpointError

LATEST = "latest"
MANIFEST = "manifest.json"
TMP_PREFIX = ".tmp-"
STEP_DIR = re.compile(r"step-(\d{8,20})(?:\.(\d{1,9}))?")


def step_name(step: int, copy: int = 0) -> str:
    return f"step-{step:08d}" if copy == 0 else f"step-{step:08d}.{copy}"


def parse_step_name(name: str) -> tuple[int, int] | None:
    """``(step, copy)`` for a step directory name, None for anything else."""
    m = STEP_DIR.fullmatch(name)
    return None if m is None else (int(m.group(1)), int(m.group(2) or 0))


def new_tmp_dir(root: Path, step: int) -> Path:
    root.mkdir(parents=True, exist_ok=True)
    path = root / f"{TMP_PREFIX}{step:08d}-{uuid.uuid4().hex}"
    path.mkdir()
    return path


def step_dirs(root: Path) -> list[tuple[tuple[int, int], str]]:
    """Published step directories of ``root``, oldest first by (step, copy)."""
    try:
        names = os.listdir(root)
    except OSError:
        return []
    found = []
    for name in names:
        key = parse_step_name(name)
        if key is not None and (root / name).is_dir() and not (root / name).is_symlink():
            found.append((key, name))
    return sorted(found)


def read_latest(root: Path) -> str | None:
    """The step directory ``latest`` names, None when there is no pointer."""
    path = root / LATEST
    if not os.path.lexists(path):
        return None
    text = read_small(path, LATEST, limit=256)
    try:
        name = text.decode("ascii").strip()
    except UnicodeDecodeError:
        name = ""
    if parse_step_name(name) is None:
        raise CheckpointError(
            f"{path} does not name a step directory (it holds {text[:40]!r}).",
            subject=LATEST,
            hint="It was not written by fprep.save; pass the step directory to load instead.",
        )
    return name


def resolve(path: str | os.PathLike[str]) -> Path:
    """The step directory to load: ``path`` itself when it holds a manifest, else the one its
    ``latest`` names, else its newest step directory."""
    root = Path(path)
    if os.path.lexists(root / MANIFEST):
        return root
    if not root.is_dir():
        raise CheckpointError(
            f"no checkpoint at {root}: it is not a directory.",
            subject=str(root),
            hint="Pass the directory given to fprep.save, or one of its step-* directories.",
        )
    name = read_latest(root)
    if name is None:
        dirs = step_dirs(root)
        if not dirs:
            raise CheckpointError(
                f"no checkpoint at {root}: no manifest.json, no 'latest' pointer, no step-* "
                "directory.",
                subject=str(root),
                hint="Pass the directory given to fprep.save, or one of its step-* directories.",
            )
        name = dirs[-1][1]
    step_dir = root / name
    if not step_dir.is_dir():
        raise CheckpointError(
            f"{root / LATEST} names {name}, which does not exist.",
            subject=LATEST,
            hint="The checkpoint it named was deleted; pass another step directory to load.",
        )
    return step_dir


def publish(root: Path, tmp: Path, step: int) -> Path:
    """Rename a complete ``tmp`` to a free step name, then point ``latest`` at it."""
    fsync_dir(tmp)
    copy = 0
    while True:
        final = root / step_name(step, copy)
        if not os.path.lexists(final):
            try:
                os.rename(tmp, final)  # atomic; fails if a directory of that name appeared
                break
            except OSError:
                if not os.path.lexists(final):
                    raise
        copy += 1
    fsync_dir(root)
    write_latest(root, final.name)
    return final


def write_latest(root: Path, name: str) -> None:
    tmp = root / f"{TMP_PREFIX}{LATEST}-{uuid.uuid4().hex}"
    with open(tmp, "w") as f:
        f.write(name + "\n")
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, root / LATEST)
    fsync_dir(root)


def _remove(path: Path) -> None:
    """Remove a directory: first renamed out of the step namespace (atomic), then deleted."""
    trash = path.parent / f"{TMP_PREFIX}trash-{uuid.uuid4().hex}"
    try:
        os.rename(path, trash)
    except OSError:
        return
    shutil.rmtree(trash, ignore_errors=True)


def rotate(root: Path, keep_last: int) -> list[str]:
    """Delete the oldest step directories beyond ``keep_last``; never the one ``latest`` names.

    Returns the names removed.
    """
    try:
        current = read_latest(root)
    except CheckpointError:
        current = None
    dirs = [name for _, name in step_dirs(root) if name != current]
    excess = len(dirs) + (current is not None) - keep_last
    removed = dirs[: max(excess, 0)]
    for name in removed:
        _remove(root / name)
    return removed


def clean_stale(root: Path) -> list[str]:
    """Remove ``.tmp-*`` leftovers of interrupted saves (call only after publishing)."""
    removed = []
    try:
        names = os.listdir(root)
    except OSError:
        return []
    for name in names:
        if not name.startswith(TMP_PREFIX):
            continue
        path = root / name
        if path.is_dir() and not path.is_symlink():
            shutil.rmtree(path, ignore_errors=True)
        else:
            try:
                path.unlink()
            except OSError:
                continue
        removed.append(name)
    return removed
