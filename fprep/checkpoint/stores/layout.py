"""The checkpoint root on disk: step directories, the ``latest`` pointer, publishing, rotation.

::

    root/
      latest                    "step-00000120 blake3:<digest of its manifest.json>\\n"
      .lock                     the root's lock (``lock.py``)
      step-00000100/            one complete checkpoint (never modified once published)
      step-00000120/
      step-00000120.1/          a second save at step 120 (saving never overwrites)
      .tmp-00000130-<uuid>/     a save in progress, or one that was killed: ignored, and
                                removed when the next save starts

A save writes everything into a fresh ``.tmp-*`` directory, fsyncs it, and publishes it with
one ``rename`` to its step name (atomic on POSIX file systems), then replaces ``latest``
atomically (written to a temporary file, fsynced, ``os.replace``-d). A process killed at any
moment therefore leaves every published checkpoint intact and ``latest`` naming one of them;
the interrupted one is either complete (published) or an ignored ``.tmp-*`` directory.

``latest`` pins what it names: besides the directory's name it carries the BLAKE3 digest of that
directory's ``manifest.json`` (which seals the rest), so a damaged pointer cannot silently name
another checkpoint. Pointers of older fprep versions (the name alone) are still read.

Saving, rotating and cleaning up happen only under the root's lock (``lock.py``), so no two
savers ever touch one root at once; cleanup removes ``.tmp-*`` names only, never a published one.
"""

from __future__ import annotations

import os
import re
import shutil
import stat
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from fprep.checkpoint.format.files import fsync_dir, read_small
from fprep.checkpoint.format.metadata import METADATA_FILE
from fprep.errors import CheckpointError

LATEST = "latest"
MANIFEST = "manifest.json"
TMP_PREFIX = ".tmp-"
STEP_DIR = re.compile(r"step-(\d{8,20})(?:\.(\d{1,9}))?")
#: ``latest`` as fprep writes it: a step directory name and the digest of its manifest.json.
_POINTER = re.compile(rb"(step-\d{8,20}(?:\.\d{1,9})?) blake3:([0-9a-f]{64})\n")


@dataclass(frozen=True)
class Target:
    """The step directory to load and, when ``latest`` named it, the digest it pins."""

    step_dir: Path
    pinned: str | None = None


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


def parse_latest(text: bytes) -> tuple[str, str | None] | None:
    """``(name, pinned digest)`` of a pointer (``None`` digest: an older fprep's, the name
    alone), None when ``text`` is not a pointer."""
    match = _POINTER.fullmatch(text)
    if match is not None:
        return match.group(1).decode(), match.group(2).decode()
    try:
        name = text.decode("ascii").strip()
    except UnicodeDecodeError:
        return None
    return (name, None) if parse_step_name(name) is not None else None


def read_latest(root: Path) -> tuple[str, str | None] | None:
    """``(name, pinned digest)`` of ``latest``, None when there is no pointer."""
    path = root / LATEST
    if not os.path.lexists(path):
        return None
    text = read_small(path, LATEST, limit=256)
    parsed = parse_latest(text)
    if parsed is None:
        raise CheckpointError(
            f"{path} does not name a step directory (it holds {text[:40]!r}).",
            subject=LATEST,
            hint="It was not written by fprep.save; pass the step directory to load instead.",
        )
    return parsed


def resolve(path: str | os.PathLike[str]) -> Target:
    """The step directory to load: ``path`` itself when it holds a manifest, else the one its
    ``latest`` names (with the manifest digest it pins), else its newest step directory."""
    root = Path(path)
    if os.path.lexists(root / MANIFEST):
        if os.path.lexists(root / LATEST):
            raise both_step_and_root(str(root))
        return Target(root)
    if not root.is_dir():
        raise CheckpointError(
            f"no checkpoint at {root}: it is not a directory.",
            subject=str(root),
            hint="Pass the directory given to fprep.save, or one of its step-* directories.",
        )
    pointer = read_latest(root)
    name, pinned = pointer if pointer is not None else (None, None)
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
    try:
        mode = os.lstat(step_dir).st_mode
    except FileNotFoundError:
        mode = None
    if mode is not None and stat.S_ISLNK(mode):
        raise CheckpointError(
            f"{root / LATEST} names {name}, which is a symbolic link (to "
            f"{os.readlink(step_dir)!r}).",
            subject=LATEST,
            hint="fprep loads step directories inside the root only; pass the directory the link "
            "points to, if you trust it, to load it.",
        )
    if mode is None or not stat.S_ISDIR(mode):
        raise CheckpointError(
            f"{root / LATEST} names {name}, which does not exist.",
            subject=LATEST,
            hint="The checkpoint it named was deleted; pass another step directory to load.",
        )
    return Target(step_dir, pinned)


#: What makes a directory a published checkpoint, whatever its name: fprep's two metadata
#: files (``metadata.json`` is DCP's, as fprep writes it). A copy renamed ``best/`` is one too.
STEP_FILES = (MANIFEST, METADATA_FILE)


def is_step(name: str, holds: Callable[[str], bool]) -> bool:
    """Whether the directory called ``name``, holding the files for which ``holds(file)`` is
    true, is a checkpoint: it holds ``STEP_FILES`` (by content, whatever its name), or it is
    a ``step-N`` directory with a manifest (a damaged step is a step too)."""
    if not holds(MANIFEST):
        return False
    return parse_step_name(name) is not None or all(holds(f) for f in STEP_FILES[1:])


def _files_in(directory: Path) -> Callable[[str], bool]:
    return lambda name: os.path.lexists(directory / name)


def both_step_and_root(where: str) -> CheckpointError:
    """A directory that is a checkpoint and also holds a ``latest`` pointer: which one to load
    cannot be told (earlier fprep versions let a save go into a renamed copy of a step)."""
    return CheckpointError(
        f"{where} is both a checkpoint (it holds {MANIFEST}) and a checkpoint root (it holds "
        f"'{LATEST}'): fprep cannot tell which of them to load.",
        subject=where,
        hint=f"Pass the step directory you mean ({where}/step-...); or move the step-* "
        f"directories and '{LATEST}' into a directory of their own, leaving {where} one "
        "checkpoint.",
    )


def check_root(root: Path, shown: str | None = None) -> None:
    """Refuse to save into a published step directory or anywhere inside one (a checkpoint is
    never modified once published, its rotation would delete the nested one, and ``load`` of
    it would go on reading the old step).

    The path is resolved first (symbolic links, ``..``, relative parts), so every spelling of
    one directory gets the same answer; a step is recognised by its files (``is_step``), so a
    renamed copy of one is refused like the original. ``shown``: how the caller spelled the
    root (a ``file://`` URL), for the message."""
    try:
        here = root.resolve()
    except OSError:
        return  # the save fails later with the OS's reason
    for directory in (here, *here.parents):
        if not is_step(directory.name, _files_in(directory)):
            continue
        where = "it is" if directory == here else f"it is inside {directory},"
        resolved = "" if os.path.abspath(root) == str(here) else f" (it resolves to {here})"
        name = str(root) if shown is None else shown
        raise CheckpointError(
            f"cannot save into {name}{resolved}: {where} a published checkpoint.",
            subject=name,
            hint="A checkpoint is never modified once published: pass the checkpoint root, the "
            f"directory that holds the step-* directories ({directory.parent}), or another "
            "directory.",
        )


def publish(root: Path, tmp: Path, step: int, manifest_digest: str) -> Path:
    """Rename a complete ``tmp`` to a free step name, then point ``latest`` at it (pinning the
    digest of its manifest). Call it holding the root's lock."""
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
    write_latest(root, final.name, manifest_digest)
    return final


def write_latest(root: Path, name: str, manifest_digest: str) -> None:
    tmp = root / f"{TMP_PREFIX}{LATEST}-{uuid.uuid4().hex}"
    with open(tmp, "w") as f:
        f.write(f"{name} blake3:{manifest_digest}\n")
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
        pointer = read_latest(root)
    except CheckpointError:
        pointer = None
    current = None if pointer is None else pointer[0]
    dirs = [name for _, name in step_dirs(root) if name != current]
    excess = len(dirs) + (current is not None) - keep_last
    removed = dirs[: max(excess, 0)]
    for name in removed:
        _remove(root / name)
    return removed


def clean_stale(root: Path) -> list[str]:
    """Remove ``.tmp-*`` leftovers of interrupted saves; call it holding the root's lock, which
    proves that none of them is being written. Nothing but ``.tmp-*`` names is touched."""
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
