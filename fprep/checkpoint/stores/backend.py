"""Where a checkpoint lives: the seam between ``save`` / ``load`` and the storage under them.

``save`` and ``load`` touch storage only through a ``Store`` (one checkpoint root) and the
``StepFiles`` of one step directory. ``open_store`` picks the implementation from the path:

* a local path: ``LocalStore``, today's functions unchanged (``layout.py``: ``.tmp-*`` staging,
  POSIX ``rename``, ``fsync``; ``lock.py``: ``flock``). fsspec is not imported.
* a URL (``scheme://...``): ``FsspecStore`` (``fsspec_store.py``) over any fsspec file system
  (``memory://``, ``file://``, ``s3://``, ``gs://``, ...), which publishes without rename (see
  there). fsspec is an optional extra: without it a URL is refused with a ``CheckpointError``.

The seam is at the level of the layout (stage, publish, rotate, resolve) rather than of single
file operations, because that is where the two kinds of storage differ: a directory renamed
into place on a POSIX file system, a pointer written last on an object store.
"""

from __future__ import annotations

import os
import re
import shutil
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Protocol

from torch.distributed.checkpoint.metadata import Metadata

from fprep.checkpoint.format import files
from fprep.checkpoint.format.files import FileRecord
from fprep.checkpoint.format.storage import SafeReader, SafeWriter
from fprep.checkpoint.stores import layout
from fprep.checkpoint.stores.lock import lock_root
from fprep.checkpoint.stores.visible import check_visible

#: ``scheme://``, or fsspec's chained ``scheme::``: what makes a path a URL (a local path never
#: starts so; ``C:`` has no ``//``). Chained URLs are URLs too, so that they are refused as such
#: (``fsspec_store.file_system``) rather than written to a local directory named after them.
_URL = re.compile(r"[A-Za-z][A-Za-z0-9+.\-]*(://|::)")


def is_url(path: str | os.PathLike[str]) -> bool:
    return isinstance(path, str) and _URL.match(path) is not None


class Releasable(Protocol):
    def release(self) -> None: ...


class StepFiles(Protocol):
    """The files of one step directory, for ``load``."""

    #: the step directory (a ``Path`` for a local one, the URL for a remote one)
    location: Path | str

    def pointer(self) -> str:
        """Where the root's ``latest`` is (for messages)."""
        ...

    def read_small(self, name: str, what: str) -> bytes: ...

    def read_verified(self, name: str, record: FileRecord, what: str) -> bytes: ...

    def check_size(self, name: str, record: FileRecord, what: str) -> None: ...

    def reader(
        self, metadata: Metadata, records: Mapping[str, FileRecord], **options: Any
    ) -> SafeReader: ...


class Store(Protocol):
    """One checkpoint root. The saving methods are called by rank 0 only."""

    def check_root(self) -> None: ...

    def lock(self) -> Releasable: ...

    def clean_stale(self) -> list[str]: ...

    def new_staging(self, step: int) -> str:
        """A fresh name under the root that this save writes its step into."""
        ...

    def discard(self, name: str) -> None: ...

    def writer(self, name: str, *, progress: bool) -> SafeWriter: ...

    def write_manifest(self, name: str, data: bytes) -> FileRecord: ...

    def publish(self, name: str, step: int, manifest_digest: str) -> str:
        """Make the staged ``name`` the root's newest checkpoint; returns its final name.

        Refused (``visible.py``) unless every file the manifest lists is visible here."""
        ...

    def rotate(self, keep_last: int) -> list[str]: ...

    def location(self, name: str) -> Path | str: ...

    def resolve(self) -> tuple[str, str | None]:
        """The step directory to load (as text) and the manifest digest ``latest`` pins."""
        ...

    def step(self, location: str) -> StepFiles: ...


class LocalStep:
    """A local step directory: ``files.py``'s checked reads (regular files, no links)."""

    def __init__(self, path: Path) -> None:
        self.location: Path | str = path
        self.path = path

    def pointer(self) -> str:
        return str(self.path.parent / layout.LATEST)

    def read_small(self, name: str, what: str) -> bytes:
        return files.read_small(self.path / name, what)

    def read_verified(self, name: str, record: FileRecord, what: str) -> bytes:
        return files.read_verified(self.path / name, record, what)

    def check_size(self, name: str, record: FileRecord, what: str) -> None:
        files.check_size(self.path / name, record, what)

    def reader(
        self, metadata: Metadata, records: Mapping[str, FileRecord], **options: Any
    ) -> SafeReader:
        return SafeReader(self.path, metadata, records, **options)


class LocalStore:
    """A local checkpoint root: ``layout.py`` and ``lock.py`` as they are."""

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = Path(path)
        self.raw = path

    def __str__(self) -> str:
        return str(self.path)

    def check_root(self) -> None:
        layout.check_root(self.path)

    def lock(self) -> Releasable:
        return lock_root(self.path)

    def clean_stale(self) -> list[str]:
        return layout.clean_stale(self.path)

    def new_staging(self, step: int) -> str:
        return layout.new_tmp_dir(self.path, step).name

    def discard(self, name: str) -> None:
        shutil.rmtree(self.path / name, ignore_errors=True)

    def writer(self, name: str, *, progress: bool) -> SafeWriter:
        return SafeWriter(self.path / name, progress=progress)

    def write_manifest(self, name: str, data: bytes) -> FileRecord:
        return files.write_durable(self.path / name / layout.MANIFEST, data)

    def publish(self, name: str, step: int, manifest_digest: str) -> str:
        staged = self.path / name
        manifest = files.read_small(staged / layout.MANIFEST, layout.MANIFEST)
        check_visible(str(staged), manifest, manifest_digest, _listing(staged))
        return layout.publish(self.path, staged, step, manifest_digest).name

    def rotate(self, keep_last: int) -> list[str]:
        return layout.rotate(self.path, keep_last)

    def location(self, name: str) -> Path | str:
        return self.path / name

    def resolve(self) -> tuple[str, str | None]:
        target = layout.resolve(self.raw)
        return str(target.step_dir), target.pinned

    def step(self, location: str) -> StepFiles:
        return LocalStep(Path(location))


def _listing(directory: Path) -> dict[str, int] | None:
    """``name -> size`` of the regular files in ``directory``; None if it is not there."""
    try:
        with os.scandir(directory) as entries:
            return {
                e.name: e.stat(follow_symlinks=False).st_size
                for e in entries
                if e.is_file(follow_symlinks=False)
            }
    except FileNotFoundError:
        return None


def open_store(path: str | os.PathLike[str]) -> Store:
    """The store for ``path``: a URL's fsspec file system, else the local one."""
    if is_url(path):
        from fprep.checkpoint.stores.fsspec_store import FsspecStore

        return FsspecStore.open(str(path))
    return LocalStore(path)
