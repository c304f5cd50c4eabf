"""Checkpoints at fsspec URLs (``s3://``, ``gs://``, ``memory://``, ``file://``, ...): the same
format and checks as on a local disk, published without rename.

Object stores have no atomic rename of a directory, so every fsspec file system is treated as
one (``file://`` included; pass a plain path for ``rename`` + ``fsync`` + ``flock``). A save
writes every object of its step under the step's final prefix (a name no object has yet:
``step-<n>``, ``step-<n>.1``, ...), then the sealed ``manifest.json``, then the ``latest``
pointer, which carries the manifest's digest. Each object is written with one upload, so it is
either absent or whole; and a reader trusts only a step that a complete manifest names,
verified against the digest ``latest`` pins: until the pointer is written the new step is
invisible, and a save that dies half way leaves the previous checkpoint the one ``load``
reads. Rotation runs after the pointer is written and never deletes the step it names. Step
prefixes without a manifest (the leftovers of interrupted saves) are deleted by the next save.

No lock: one writer per root is the user's job here (as with torch DCP's ``FsspecWriter``);
``flock`` has no object-store equivalent that survives a killed holder.

Reads download each object this rank needs once into memory, verify its digest there and copy
from that same buffer, so what was verified is what is loaded (an object replaced between two
ranged reads is never seen); the price is memory for the objects read.
"""

from __future__ import annotations

import contextlib
import posixpath
import uuid
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import IO, TYPE_CHECKING, Any

from torch.distributed.checkpoint.metadata import Metadata

from fprep.checkpoint.format.files import (
    MAX_UNVERIFIED_JSON,
    FileRecord,
    check_bytes,
    check_digest,
    check_recorded_size,
    digest_of,
    record_of,
)
from fprep.checkpoint.format.storage import SafeReader, SafeWriter, Source
from fprep.checkpoint.stores import layout
from fprep.checkpoint.stores.visible import check_visible
from fprep.errors import CheckpointError
from fprep.progress import Progress

if TYPE_CHECKING:  # backend.open_store imports this module: types only, no import back
    from fprep.checkpoint.stores.backend import Releasable, StepFiles


def check_url(url: str) -> None:
    """Refuse what fprep cannot save to or load from soundly, before fsspec sees it.

    * A chained URL (``simplecache::s3://...``): a caching layer serves what it read first, so
      a long job would read a stale ``latest`` (and the cache's copy, not the store's, would be
      what ``load`` checks).
    * ``.`` or ``..`` in the path: object stores keep them as literal names, while ``file://``
      resolves them, so ``file://ROOT/x/../step-1`` would look like a new root and write into
      the published ``ROOT/step-1``; and the checks of where a save goes see the text only.
    """
    if "::" in url:
        raise CheckpointError(
            f"{url} is a chained fsspec URL; fprep saves and loads checkpoints at one file "
            "system's URL only (a cache in front of the store would serve a stale 'latest').",
            subject=url,
            hint="Pass the store's own URL (the part after the last '::', e.g. "
            f"{url.rsplit('::', 1)[-1]}).",
        )
    path = url.split("://", 1)[-1].split("?", 1)[0]
    if any(part in (".", "..") for part in path.split("/")):
        raise CheckpointError(
            f"{url} has a '.' or '..' path segment; fprep does not resolve them in URLs (object "
            "stores keep them as names, file:// resolves them).",
            subject=url,
            hint="Pass the URL with the path written out (resolved), e.g. with "
            "posixpath.normpath on its path.",
        )


def url_join(url: str, name: str) -> str:
    """``url/name``; at a file system's root (``memory://``) without a second slash."""
    return f"{url}{name}" if url.endswith("/") else f"{url}/{name}"


def _without_trailing_slash(url: str) -> str:
    """``url`` without a trailing ``/``, but the root keeps its ``scheme://``."""
    stripped = url.rstrip("/")
    return url[: len(stripped) + 2] if stripped.endswith(":") else stripped


def file_system(url: str) -> tuple[Any, str]:
    """fsspec's file system and path for ``url``; a ``CheckpointError`` without fsspec, for a
    scheme no installed file system serves, or for a URL ``check_url`` refuses."""
    check_url(url)
    try:
        import fsspec
    except ImportError:
        raise CheckpointError(
            f"{url} is a URL, and checkpoints at URLs need fsspec, which is not installed.",
            subject=url,
            hint="pip install 'fprep[fsspec]' (and the file system's package, e.g. s3fs for "
            "s3://, gcsfs for gs://), or pass a local path.",
        ) from None
    try:
        fs, path = fsspec.core.url_to_fs(url)
    except (ImportError, ValueError) as e:
        raise CheckpointError(
            f"cannot open {url} with fsspec: {e}",
            subject=url,
            hint="Install the fsspec file system for this scheme, or check the URL.",
        ) from None
    return fs, str(path)


class _NoLock:
    """Object stores: no lock (see the module docs)."""

    def release(self) -> None:
        return None


class _Buffered(Source):
    """One object of a step, downloaded once: verified and copied from the same bytes."""

    def __init__(self, data: bytes, record: FileRecord, what: str) -> None:
        check_recorded_size(len(data), record, what)
        self.data = memoryview(bytearray(data))
        self.record, self.what, self.path = record, what, Path(what)

    def read_into(self, view: memoryview, offset: int) -> None:
        view[:] = self.data[offset : offset + len(view)]

    def verify(self, bar: Progress | None) -> None:
        check_digest(digest_of(self.data, self.record.algorithm), self.record, self.what)
        if bar is not None:
            bar.advance(self.record.size)

    def mapping(self) -> Any:
        return self.data

    def close(self) -> None:
        return None


class FsspecStep:
    """A step directory on an fsspec file system."""

    def __init__(self, fs: Any, path: str, url: str) -> None:
        self.fs, self.path = fs, path
        self.location: Path | str = url

    def pointer(self) -> str:
        parent = str(self.location).rsplit("/", 1)[0]
        return url_join(_without_trailing_slash(parent + "/"), layout.LATEST)

    def _size(self, name: str, what: str) -> int:
        try:
            info = self.fs.info(posixpath.join(self.path, name))
        except FileNotFoundError:
            raise CheckpointError(
                f"{what} is missing: {self.location}/{name}.",
                subject=what,
                hint="The checkpoint is incomplete; load another one (or the step directory "
                "itself).",
            ) from None
        if info.get("type") != "file":
            raise CheckpointError(
                f"{what} at {self.location}/{name} is not a file.",
                subject=what,
                hint="fprep only reads files inside a checkpoint directory.",
            )
        return int(info["size"])

    def _cat(self, name: str) -> bytes:
        return bytes(self.fs.cat_file(posixpath.join(self.path, name)))

    def read_small(self, name: str, what: str) -> bytes:
        size = self._size(name, what)
        if size > MAX_UNVERIFIED_JSON:
            raise CheckpointError(
                f"{what} is {size} bytes, more than the {MAX_UNVERIFIED_JSON} bytes fprep "
                "accepts for it.",
                subject=what,
                hint="The file was not written by fprep.save; it was not read.",
            )
        return self._cat(name)[:MAX_UNVERIFIED_JSON]

    def check_size(self, name: str, record: FileRecord, what: str) -> None:
        check_recorded_size(self._size(name, what), record, what)

    def read_verified(self, name: str, record: FileRecord, what: str) -> bytes:
        self.check_size(name, record, what)
        data = self._cat(name)
        check_bytes(data, record, what)
        return data

    def _source(self, name: str, record: FileRecord) -> Source:
        self.check_size(name, record, name)
        return _Buffered(self._cat(name), record, name)

    def reader(
        self, metadata: Metadata, records: Mapping[str, FileRecord], **options: Any
    ) -> SafeReader:
        return SafeReader(str(self.location), metadata, records, source=self._source, **options)


class FsspecStore:
    """A checkpoint root at an fsspec URL (see the module docs)."""

    def __init__(self, fs: Any, path: str, url: str) -> None:
        self.fs, self.path = fs, path.rstrip("/") or "/"
        self.url = _without_trailing_slash(url)
        #: ``file://``: the pointer is replaced by a rename (the one local file system); elsewhere
        #: it is one upload, whole or absent.
        self.renames = "file" in (fs.protocol if isinstance(fs.protocol, tuple) else (fs.protocol,))

    @classmethod
    def open(cls, url: str) -> FsspecStore:
        fs, path = file_system(url)
        return cls(fs, path, url)

    def __str__(self) -> str:
        return self.url

    def _join(self, *names: str) -> str:
        return posixpath.join(self.path, *names)

    def _has_manifest(self, name: str) -> bool:
        return bool(self.fs.exists(self._join(name, layout.MANIFEST)))

    def _steps(self) -> list[tuple[tuple[int, int], str]]:
        """Step prefixes under the root, oldest first (complete or not)."""
        try:
            entries = self.fs.ls(self.path, detail=False)
        except FileNotFoundError:
            return []
        found = []
        for entry in entries:
            name = posixpath.basename(str(entry).rstrip("/"))
            key = layout.parse_step_name(name)
            if key is not None:
                found.append((key, name))
        return sorted(found)

    def _pointer(self) -> tuple[str, str | None] | None:
        path = self._join(layout.LATEST)
        if not self.fs.exists(path):
            return None
        text = bytes(self.fs.cat_file(path))[:256]
        parsed = layout.parse_latest(text)
        if parsed is None:
            raise CheckpointError(
                f"{self.url}/{layout.LATEST} does not name a step directory (it holds "
                f"{text[:40]!r}).",
                subject=layout.LATEST,
                hint="It was not written by fprep.save; pass the step directory to load instead.",
            )
        return parsed

    # -- saving (rank 0) --------------------------------------------------------------------

    def check_root(self) -> None:
        """As ``layout.check_root``: ``file://`` is the local file system, checked by the same
        function (links resolved); elsewhere each prefix from the root up is looked at for a
        step's files (``layout.is_step``), whatever its name."""
        if self.renames:
            layout.check_root(Path(self.path), self.url)
            return
        path = self.path
        while True:
            if layout.is_step(posixpath.basename(path), self._files_in(path)):
                raise CheckpointError(
                    f"cannot save into {self.url}: {path} is a published checkpoint.",
                    subject=self.url,
                    hint="A checkpoint is never modified once published: pass the checkpoint "
                    "root, the directory that holds the step-* directories, or another one.",
                )
            parent = posixpath.dirname(path)
            if parent == path or path in ("", "/"):
                break
            path = parent

    def _files_in(self, path: str) -> Callable[[str], bool]:
        return lambda name: bool(self.fs.exists(posixpath.join(path, name)))

    def lock(self) -> Releasable:
        return _NoLock()

    def clean_stale(self) -> list[str]:
        """Step prefixes without a manifest: saves that died before publishing."""
        pointer = self._pointer_or_none()
        removed = []
        for _, name in self._steps():
            if name != pointer and not self._has_manifest(name):
                self.discard(name)
                removed.append(name)
        return removed

    def _pointer_or_none(self) -> str | None:
        try:
            pointer = self._pointer()
        except CheckpointError:
            return None
        return None if pointer is None else pointer[0]

    def new_staging(self, step: int) -> str:
        copy = 0
        while self.fs.exists(self._join(layout.step_name(step, copy))):
            copy += 1
        return layout.step_name(step, copy)

    def discard(self, name: str) -> None:
        with contextlib.suppress(OSError):  # already gone, or the next save removes it
            self.fs.rm(self._join(name), recursive=True)

    def _opener(self, name: str) -> Callable[[str], IO[bytes]]:
        def open_file(file: str) -> IO[bytes]:
            self.fs.makedirs(self._join(name), exist_ok=True)
            return self.fs.open(self._join(name, file), "wb")  # type: ignore[no-any-return]

        return open_file

    def writer(self, name: str, *, progress: bool) -> SafeWriter:
        return SafeWriter(
            self.location(name), progress=progress, sync_files=False, opener=self._opener(name)
        )

    def write_manifest(self, name: str, data: bytes) -> FileRecord:
        with self._opener(name)(layout.MANIFEST) as f:
            f.write(data)
        return record_of(data)

    def publish(self, name: str, step: int, manifest_digest: str) -> str:
        """Everything of ``name`` is written: the pointer last makes it the newest checkpoint
        (once every file the manifest lists is seen here, ``visible.py``)."""
        where = self.location(name)
        manifest = bytes(self.fs.cat_file(self._join(name, layout.MANIFEST)))
        check_visible(str(where), manifest, manifest_digest, self._listing(name))
        text = f"{name} blake3:{manifest_digest}\n".encode()
        latest = self._join(layout.LATEST)
        if self.renames:
            tmp = self._join(f"{layout.TMP_PREFIX}{layout.LATEST}-{uuid.uuid4().hex}")
            self.fs.pipe_file(tmp, text)
            self.fs.mv(tmp, latest)
        else:
            self.fs.pipe_file(latest, text)
        return name

    def _listing(self, name: str) -> dict[str, int] | None:
        """``file name -> size`` under the step prefix ``name`` (one listing); None if absent."""
        self.fs.invalidate_cache(self._join(name))  # other ranks wrote there: list it afresh
        try:
            entries = self.fs.ls(self._join(name), detail=True)
        except FileNotFoundError:
            return None
        return {
            posixpath.basename(str(e["name"]).rstrip("/")): int(e.get("size") or 0)
            for e in entries
            if e.get("type") == "file"
        }

    def rotate(self, keep_last: int) -> list[str]:
        """As ``layout.rotate``: the oldest beyond ``keep_last``, never the one ``latest`` names."""
        current = self._pointer_or_none()
        names = [name for _, name in self._steps() if name != current]
        removed = names[: max(len(names) + (current is not None) - keep_last, 0)]
        for name in removed:
            self.discard(name)
        return removed

    def location(self, name: str) -> Path | str:
        return url_join(self.url, name)

    # -- loading ----------------------------------------------------------------------------

    def resolve(self) -> tuple[str, str | None]:
        """As ``layout.resolve``; without ``latest``, the newest step that has a manifest."""
        if self.fs.exists(self._join(layout.MANIFEST)):
            if self.fs.exists(self._join(layout.LATEST)):
                raise layout.both_step_and_root(self.url)
            return self.url, None
        pointer = self._pointer()
        if pointer is None:
            complete = [name for _, name in self._steps() if self._has_manifest(name)]
            if not complete:
                raise CheckpointError(
                    f"no checkpoint at {self.url}: no manifest.json, no 'latest' pointer, no "
                    "step-* directory.",
                    subject=self.url,
                    hint="Pass the URL given to fprep.save, or one of its step-* directories.",
                )
            return url_join(self.url, complete[-1]), None
        name, pinned = pointer
        if not self._has_manifest(name):
            raise CheckpointError(
                f"{self.url}/{layout.LATEST} names {name}, which does not exist.",
                subject=layout.LATEST,
                hint="The checkpoint it named was deleted; pass another step directory to load.",
            )
        return url_join(self.url, name), pinned

    def step(self, location: str) -> StepFiles:
        fs, path = file_system(location)
        return FsspecStep(fs, path, _without_trailing_slash(location))
