"""Every rank names the same place: the check that runs before a checkpoint touches storage.

``save``, ``load``, ``export_full`` and ``save_pretrained`` are called on every rank with a path,
and the ranks must all mean one place: rank 0 makes the staging directory and tells the others
its name, each rank then writes its own shards there, and rank 0 publishes. Ranks that were
given different paths (each made its own ``tempfile.mkdtemp()``, or a rank-dependent name)
would write beside each other and fail deep inside the write ("cannot write .../__1_0.distcp"),
or, for a load or an export, silently use rank 0's path alone.

So before anything is written or read, the ranks exchange where their path leads (one small
all-gather of text) and, when they differ, every rank raises the same ``CheckpointError``
naming the ranks and their paths. A local path (and a ``file://`` URL, the same file system) is
compared resolved: absolute, symbolic links followed, so ``ckpt``, ``./ckpt/`` and a link to it
are one place. Another URL is compared as written (without a trailing ``/``): a remote store has
nothing to resolve here. Two hosts that mount one shared directory at different places are
refused too: pass one path that names it on every host.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import TypeVar

from fprep.checkpoint.collective import Group
from fprep.checkpoint.stores.backend import is_url
from fprep.errors import CheckpointError, PrepError

T = TypeVar("T")

#: How many different places one message lists (each with the ranks that named it).
SHOWN = 4


def checked(path: object) -> str | os.PathLike[str]:
    """``path`` when it is a path (text, or an ``os.PathLike`` of text); else a
    ``CheckpointError`` naming what it is."""
    if not isinstance(path, str | os.PathLike):
        raise CheckpointError(
            f"path must be a str or an os.PathLike (a pathlib.Path); got a "
            f"{type(path).__name__}: {path!r}.",
            subject="path",
            hint="Pass the checkpoint's directory as a str or pathlib.Path, the same on every "
            "rank.",
        )
    if not isinstance(os.fspath(path), str):
        raise CheckpointError(
            f"path must be text; got bytes: {path!r}.",
            subject="path",
            hint="Pass os.fsdecode(path).",
        )
    return path


def place(path: object) -> tuple[str, str]:
    """``(the path as given, where it leads)``: resolved for a local path or a ``file://`` URL,
    as written for another URL. A ``CheckpointError`` for what is not a path at all."""
    given = str(os.fspath(checked(path)))
    local = given
    if is_url(given):
        scheme, rest = given.split("://", 1) if "://" in given else (given, "")
        if scheme.lower() != "file":
            stripped = given.rstrip("/")  # but the root keeps its "scheme://"
            return given, given[: len(stripped) + 2] if stripped.endswith(":") else stripped
        local = rest
    return given, os.path.realpath(local)


def agree_on_path(
    group: Group,
    call: str,
    path: object,
    open_here: Callable[[str | os.PathLike[str]], T],
) -> T:
    """``open_here(path)`` on every rank, once every rank's path is known to lead to the same
    place (see the module docs); else the same ``CheckpointError`` on every rank.

    ``open_here`` (no effect on storage: e.g. ``open_store``) failing on one rank fails every
    rank with its error. One all-gather when ``group`` spans several processes, none otherwise.
    """
    if not group.distributed:
        return open_here(checked(path))
    error: BaseException | None = None
    where: tuple[str, str] | None = None
    opened: T | None = None
    try:
        where = place(path)
        opened = open_here(checked(path))
    except Exception as e:
        error = e if isinstance(e, PrepError) else _unusable(call, path, e)
    places: list[tuple[str, str]] = group.agree(error, where)
    if len({resolved for _, resolved in places}) > 1:
        raise _differ(call, places)
    return opened  # type: ignore[return-value]  # set: every rank succeeded


def _unusable(call: str, path: object, error: Exception) -> CheckpointError:
    wrapped = CheckpointError(
        f"{call} cannot use the path {path!r}: {type(error).__name__}: {error}",
        subject=str(path),
        hint="Pass the checkpoint's directory (a local path, or a URL fsspec serves), the same "
        "on every rank.",
    )
    wrapped.__cause__ = error
    return wrapped


def _differ(call: str, places: list[tuple[str, str]]) -> CheckpointError:
    """The message every rank raises: the places, each with the ranks that named it."""
    by_place: dict[str, list[int]] = {}
    for rank, (_, resolved) in enumerate(places):
        by_place.setdefault(resolved, []).append(rank)
    shown = []
    for resolved, ranks in list(by_place.items())[:SHOWN]:
        who = f"rank {ranks[0]}" if len(ranks) == 1 else f"ranks {_spans(ranks)}"
        spellings = sorted({places[r][0] for r in ranks} - {resolved})
        as_given = f" (given as {', '.join(map(repr, spellings))})" if spellings else ""
        shown.append(f"{who}: {resolved}{as_given}")
    more = len(by_place) - SHOWN
    rest = f"; and {more} other paths" if more > 0 else ""
    return CheckpointError(
        f"{call} was given different paths on different ranks: {'; '.join(shown)}{rest}. "
        "Every rank writes its part of one checkpoint into one place, so every rank must pass "
        "the same path.",
        subject="path",
        hint="Pass one path that every rank sees (shared storage, the same spelling on every "
        "host), not one made per rank (tempfile.mkdtemp() on each rank): make it on rank 0 and "
        "send it to the others (torch.distributed.broadcast_object_list), or derive it from the "
        "run's name. Nothing was read or written.",
    )


def _spans(ranks: list[int]) -> str:
    """``0-3, 6, 8-9`` for [0, 1, 2, 3, 6, 8, 9] (sorted ranks)."""
    out: list[str] = []
    start = prev = ranks[0]
    for r in [*ranks[1:], None]:
        if r is not None and r == prev + 1:
            prev = r
            continue
        out.append(str(start) if start == prev else f"{start}-{prev}")
        if r is not None:
            start = prev = r
    return ", ".join(out)
