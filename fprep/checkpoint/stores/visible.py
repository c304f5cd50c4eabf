"""Publish only what the publishing rank can see: every file the manifest lists, at its size.

Each rank writes its own files, and rank 0 publishes. On storage that is not shared (a
node-local disk behind the same path on every node, a per-process ``memory://``), rank 0's
``latest`` would name a step whose other files it cannot read: ``save`` would report success
and every ``load`` fail. So before the pointer moves, rank 0 reads back the manifest it wrote
(checked against the digest ``latest`` will pin) and lists the step directory once.
"""

from __future__ import annotations

import re
from collections.abc import Mapping

from fprep.checkpoint.format.files import FileRecord
from fprep.checkpoint.format.manifest import parse
from fprep.errors import CheckpointError

#: DCP's data files carry the rank that wrote them: ``__<rank>_<n>.distcp``
_RANK_FILE = re.compile(r"__(\d+)_\d+\.distcp")


def _writer(name: str) -> str:
    found = _RANK_FILE.fullmatch(name)
    return f"rank {found.group(1)}'s {name}" if found else name


def check_visible(
    where: str, manifest: bytes, digest: str, listing: Mapping[str, int] | None
) -> None:
    """A ``CheckpointError`` unless ``listing`` (file name -> size, as the publishing rank sees
    the step directory ``where``; None: the directory is not visible) holds every file the
    ``manifest`` (read back, checked against ``digest``) records, at its recorded size."""
    files: Mapping[str, FileRecord] = parse(manifest, pinned=digest, pointer="the save").files
    seen = {} if listing is None else listing
    missing = [name for name in sorted(files) if name not in seen]
    short = [
        f"{_writer(name)} ({seen[name]} of {rec.size} bytes)"
        for name, rec in sorted(files.items())
        if name in seen and seen[name] != rec.size
    ]
    if not missing and not short:
        return
    problems = [f"{_writer(name)} is not there" for name in missing[:4]] + short[:4]
    more = len(missing) + len(short) - len(problems)
    listed = "; ".join(problems) + (f"; and {more} more" if more else "")
    raise CheckpointError(
        f"cannot publish {where}: the publishing rank (0) does not see every file the ranks "
        f"wrote: {listed}. The ranks do not share this storage, so no rank could load the "
        "checkpoint; it is not published and the previous one stays the latest.",
        subject=where,
        hint="Save to storage every rank sees at the same path (a shared file system, or an "
        "object store URL such as s3://...), not a node-local disk or memory://.",
    )
