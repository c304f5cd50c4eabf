"""The last check before an asynchronous save publishes: each rank reads back the files it
wrote and checks them against the digests it recorded, so ``latest`` never names a step whose
own files fail verification.

The digest of a data file is taken from the very bytes written (the writer hands the same
staged buffer to the file and to the hasher, and nothing else writes to that buffer:
``staging.py``), so a mismatch here means the bytes did not reach storage as written (a
failing disk, a file system that lost a write, something else writing into the ``.tmp-*``
directory). The check costs one read and hash of this rank's files, on the background thread
(the training loop does not wait for it; the files are usually still in the page cache).

Earlier versions read the parameters and optimizer state of the optimizers passed to ``save``
live in the background and relied on torch's version counters to notice other changes; that is
not sound (a DTensor's in-place op bumps the DTensor's counter, not its local tensor's; a
counter moves when an in-place kernel ends, so a read overlapping a running kernel sees
changing bytes under an unchanged version; writes through ``.data`` move no counter). A
guarantee that depends on such a race is not one, so every tensor is now copied before
``save`` returns (``staging.py``), and the written files are verified here.
"""

from __future__ import annotations

from collections.abc import Mapping

from torch.distributed.checkpoint.metadata import Metadata

from fprep.checkpoint.format.files import FileRecord
from fprep.checkpoint.stores.backend import Store
from fprep.errors import CheckpointError


def verify_written(root: Store, tmp: str, files: Mapping[str, FileRecord], step: int) -> None:
    """Read back every file of ``files`` (this rank's, in the staged step ``tmp``) and check
    its size and digest; raise a ``CheckpointError`` naming the first that fails."""
    if not files:
        return
    directory = root.step(str(root.location(tmp)))
    reader = directory.reader(Metadata(state_dict_metadata={}), files)
    try:
        reader.check_files(sorted(files))
    except CheckpointError as e:
        raise CheckpointError(
            f"step {step} is not published: a file this rank wrote does not read back as "
            f"written: {e.message}",
            subject=e.subject,
            hint="The previous checkpoint stays the latest. Check the storage under the "
            "checkpoint root (a failing disk, another process writing there).",
        ) from e
