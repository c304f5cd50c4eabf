"""One file written front to back that appears whole at its path or not at all (``export_full``).

* a local path: a temporary file beside it, fsynced, then ``os.replace`` and an fsync of the
  directory; an existing file there stays as it was until then.
* an fsspec URL: a temporary object beside it (``.<name>.tmp-<uuid>``), then ``fs.mv`` onto the
  final name: a rename on ``file://``, a server-side copy (the object created whole) and a delete
  on object stores. (fsspec's one-file transactions, ``open(..., autocommit=False)``, are not
  honoured by every file system: ``memory://`` publishes a file the moment it is opened.)
  fsspec is imported only for URLs.
"""

from __future__ import annotations

import contextlib
import os
import uuid
from pathlib import Path
from typing import Any, Protocol

from fprep.checkpoint.format.files import fsync_dir
from fprep.checkpoint.stores.backend import is_url
from fprep.errors import CheckpointError


class Sink(Protocol):
    target: Path | str

    def write(self, data: Any) -> None: ...

    def commit(self) -> None: ...

    def discard(self) -> None: ...


def _a_directory(target: object) -> CheckpointError:
    return CheckpointError(
        f"cannot export to {target}: it is a directory.",
        subject=str(target),
        hint=f"Pass the path of a file, e.g. {target}/model.safetensors.",
    )


class LocalSink:
    def __init__(self, path: str | os.PathLike[str]) -> None:
        target = Path(path)
        self.target: Path | str = target
        if target.is_dir():
            raise _a_directory(target)
        target.parent.mkdir(parents=True, exist_ok=True)
        self._tmp = target.with_name(f".{target.name}.tmp-{uuid.uuid4().hex}")
        self._file: Any = open(self._tmp, "wb")  # noqa: SIM115 - closed by commit or discard

    def write(self, data: Any) -> None:
        self._file.write(data)

    def commit(self) -> None:
        self._file.flush()
        os.fsync(self._file.fileno())
        self._file.close()
        target = Path(self.target)
        os.replace(self._tmp, target)
        self._file = None  # committed: nothing left to discard
        fsync_dir(target.parent)

    def discard(self) -> None:
        if self._file is not None:
            with contextlib.suppress(OSError):  # closing flushes: a full disk fails again here
                self._file.close()
            self._file = None
            with contextlib.suppress(OSError):
                self._tmp.unlink()


class UrlSink:
    def __init__(self, url: str) -> None:
        from fprep.checkpoint.stores.fsspec_store import file_system

        self.target: Path | str = url
        self._fs, self._path = file_system(url)
        if self._fs.isdir(self._path):
            raise _a_directory(url)
        parent, _, name = self._path.rpartition("/")
        if parent:
            self._fs.makedirs(parent, exist_ok=True)
        self._tmp = f"{parent}/.{name}.tmp-{uuid.uuid4().hex}" if parent else f".{name}.tmp"
        self._file: Any = self._fs.open(self._tmp, "wb")

    def write(self, data: Any) -> None:
        self._file.write(data)

    def commit(self) -> None:
        self._file.close()
        self._fs.mv(self._tmp, self._path)
        self._file = None  # committed: nothing left to discard

    def discard(self) -> None:
        if self._file is None:
            return
        with contextlib.suppress(Exception):
            self._file.close()
        self._file = None
        with contextlib.suppress(Exception):
            if self._fs.exists(self._tmp):
                self._fs.rm(self._tmp)


def open_sink(path: str | os.PathLike[str]) -> Sink:
    return UrlSink(str(path)) if is_url(path) else LocalSink(path)
