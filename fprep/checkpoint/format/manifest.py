"""``manifest.json``: everything about a checkpoint that is not tensor data, as plain JSON.

The manifest is the checkpoint's root of trust for integrity: it records the size and digest of
every other file (``{"size": n, "blake3": hex}``; ``"sha256"`` in version 1 manifests, still
read), which are checked before a file is used. Since version 3 it is *sealed*: the file is
``{"blake3":"<digest of B>","format":"fprep-checkpoint","manifest":B,"version":3}`` where ``B``
is the manifest's canonical JSON, and ``parse`` checks the file's exact frame and ``B``'s digest
before parsing ``B``, so any change to any byte of it is refused. (``latest`` also carries the
digest of the whole file, see ``layout.py``.) Version 1 and 2 manifests have no seal; they are
read as before. It also holds the step, the user's
extras, the scheduler state, the non-tensor part of each optimizer's state (hyperparameters,
parameter names; tensors are ``{"$tensor": key}`` references into DCP), and per rank the RNG
states and the data-loader position. It is parsed as strict JSON and validated field by field.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

from fprep.checkpoint.format.files import ALGORITHMS, FileRecord, digest_of, dump_json, parse_json
from fprep.checkpoint.format.metadata import DATA_FILE, METADATA_FILE
from fprep.errors import CheckpointError

FORMAT = "fprep-checkpoint"
#: 3: sealed (the file carries its own BLAKE3 digest). 2: BLAKE3 digests (an older fprep reading
#: one says "version 2 is not 1 (written by a newer fprep?)" instead of failing on the record).
#: 1: sha256 digests.
VERSION = 3
READABLE_VERSIONS = (1, 2, 3)
UNSEALED_VERSIONS = (1, 2)
_HEX_DIGEST = re.compile(r"[0-9a-f]{64}")  # 32 bytes: sha256 and BLAKE3's default
#: A sealed manifest, byte for byte (the body is the canonical JSON the digest is of).
_SEAL_HEAD = b'{"blake3":"'
_SEAL_MIDDLE = f'","format":"{FORMAT}","manifest":'.encode()
_SEAL_TAIL = f',"version":{VERSION}}}'.encode()
_SEALED = re.compile(
    re.escape(_SEAL_HEAD)
    + rb"([0-9a-f]{64})"
    + re.escape(_SEAL_MIDDLE)
    + rb"(.*)"
    + re.escape(_SEAL_TAIL),
    re.DOTALL,
)


def seal(body: bytes) -> bytes:
    """The sealed file for a manifest's canonical JSON ``body``."""
    return _SEAL_HEAD + digest_of(body).encode() + _SEAL_MIDDLE + body + _SEAL_TAIL


@dataclass(frozen=True, kw_only=True)
class RankRecord:
    """What one rank saved of its own: RNG states and data-loader position (JSON data)."""

    rng: Any = None
    loader: Any = None


@dataclass(frozen=True, kw_only=True)
class OptimizerRecord:
    """One optimizer: its class (``module.QualName``, compared, never imported) and its
    encoded state dict without tensors."""

    cls: str
    state: Any


@dataclass(frozen=True, kw_only=True)
class Manifest:
    step: int
    world_size: int
    strategy: str
    state_dict_type: str
    files: dict[str, FileRecord] = field(default_factory=dict)
    optimizers: tuple[OptimizerRecord, ...] = ()
    scheduler: Any = None  # encoded scheduler state, None when none was saved
    grad_scaler: Any = None  # encoded fp16 GradScaler state, None without one (version >= 2)
    ranks: tuple[RankRecord, ...] = ()
    extras: Any = None  # encoded user extras
    fprep_version: str = ""
    torch_version: str = ""

    def to_json_bytes(self) -> bytes:
        """The sealed file (see the module docs)."""
        return seal(self.body())

    def body(self) -> bytes:
        """The canonical JSON the seal covers."""
        return dump_json(
            {
                "format": FORMAT,
                "version": VERSION,
                "step": self.step,
                "world_size": self.world_size,
                "strategy": self.strategy,
                "state_dict_type": self.state_dict_type,
                "fprep_version": self.fprep_version,
                "torch_version": self.torch_version,
                "files": {
                    name: {"size": r.size, r.algorithm: r.digest} for name, r in self.files.items()
                },
                "optimizers": [{"class": o.cls, "state_dict": o.state} for o in self.optimizers],
                "scheduler": self.scheduler,
                "grad_scaler": self.grad_scaler,
                "ranks": [{"rng": r.rng, "loader": r.loader} for r in self.ranks],
                "extras": self.extras,
            }
        )


def _fail(detail: str) -> CheckpointError:
    return CheckpointError(
        f"manifest.json is not valid: {detail}.",
        subject="manifest.json",
        hint="The file was not written by fprep.save, or was modified; nothing was loaded.",
    )


def _int(data: dict[str, Any], name: str, minimum: int) -> int:
    value = data.get(name)
    if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
        raise _fail(f"{name!r} must be an int >= {minimum}, got {value!r}")
    return value


def _str(data: dict[str, Any], name: str) -> str:
    value = data.get(name)
    if not isinstance(value, str):
        raise _fail(f"{name!r} must be a string, got {type(value).__name__}")
    return value


def _check_digest(data: bytes, recorded: str, problem: str, hint: str) -> None:
    """``data``'s BLAKE3 digest must be ``recorded``; ``problem`` says where it is recorded."""
    digest = digest_of(data)
    if digest != recorded:
        raise CheckpointError(
            f"manifest.json {problem} (got {digest[:16]}…, recorded {recorded[:16]}…).",
            subject="manifest.json",
            hint=hint,
        )


def check_pinned(data: bytes, pinned: str | None, pointer: str) -> None:
    """``data`` must be the manifest ``pointer`` (``latest``) names by its digest ``pinned``."""
    if pinned is not None:
        _check_digest(
            data,
            pinned,
            f"does not match the blake3 digest {pointer} records for it",
            "The manifest or the pointer was modified or damaged; nothing was loaded. Load a "
            "step directory by its path to use its own (sealed) manifest.",
        )


def unseal(data: bytes) -> tuple[bytes, bool]:
    """``(body, True)`` for a sealed manifest, its body checked against its digest;
    ``(data, False)`` for an unsealed one (``parse`` accepts only versions 1 and 2 then)."""
    match = _SEALED.fullmatch(data)
    if match is None:
        return data, False
    body = match.group(2)
    _check_digest(
        body,
        match.group(1).decode(),
        "is damaged: its contents do not match the blake3 digest it records",
        "The file was modified or damaged after it was saved; nothing was loaded. Load another "
        "checkpoint.",
    )
    return body, True


def parse(data: bytes, *, pinned: str | None = None, pointer: str = "latest") -> Manifest:
    """The manifest in ``data``: its seal (version 3) and, when it was reached through
    ``latest``, the digest ``pinned`` that the pointer records are checked before anything is
    parsed."""
    check_pinned(data, pinned, pointer)
    body, sealed = unseal(data)
    obj = parse_json(body, "manifest.json")
    if not isinstance(obj, dict) or obj.get("format") != FORMAT:
        raise _fail(f"its format is not {FORMAT!r}")
    version = obj.get("version")
    if version not in READABLE_VERSIONS or isinstance(version, bool):
        *first, last = map(str, READABLE_VERSIONS)
        readable = f"{', '.join(first)} or {last}"
        raise _fail(f"version {version!r} is not {readable} (written by a newer fprep?)")
    if not sealed and version not in UNSEALED_VERSIONS:
        raise _fail(f"a version {version} manifest must be sealed, this one is not (damaged?)")
    if sealed and version != VERSION:
        raise _fail(f"its seal is of version {VERSION}, its contents of version {version}")
    expected = {
        "format",
        "version",
        "step",
        "world_size",
        "strategy",
        "state_dict_type",
        "fprep_version",
        "torch_version",
        "files",
        "optimizers",
        "scheduler",
        "ranks",
        "extras",
    }
    if version >= 2:
        expected.add("grad_scaler")
    if set(obj) != expected:
        extra, missing = sorted(set(obj) - expected), sorted(expected - set(obj))
        raise _fail(f"unexpected fields {extra}, missing fields {missing}")
    files_obj = obj["files"]
    if not isinstance(files_obj, dict):
        raise _fail("'files' must be an object")
    files: dict[str, FileRecord] = {}
    for name, rec in files_obj.items():
        if name != METADATA_FILE and not DATA_FILE.fullmatch(name):
            raise _fail(f"'files' lists {name!r}, which is not a checkpoint file name")
        if not isinstance(rec, dict) or "size" not in rec or len(rec) != 2:
            raise _fail(
                f"the record of {name!r} must have exactly 'size' and one digest "
                f"({' or '.join(map(repr, ALGORITHMS))})"
            )
        (algorithm,) = set(rec) - {"size"}
        if algorithm not in ALGORITHMS:
            raise CheckpointError(
                f"manifest.json records {name!r} with a {algorithm!r} digest, which this fprep "
                f"cannot verify (it knows {', '.join(ALGORITHMS)}).",
                subject="manifest.json",
                hint="The checkpoint was written by a newer fprep, or modified: upgrade fprep to "
                "load it; nothing was loaded.",
            )
        size, digest = rec["size"], rec[algorithm]
        if not isinstance(size, int) or isinstance(size, bool) or size < 0:
            raise _fail(f"the size of {name!r} must be an int >= 0")
        if not isinstance(digest, str) or not _HEX_DIGEST.fullmatch(digest):
            raise _fail(f"the {algorithm} of {name!r} must be 64 lowercase hex digits")
        files[name] = FileRecord(size=size, algorithm=algorithm, digest=digest)
    if METADATA_FILE not in files:
        raise _fail(f"'files' does not list {METADATA_FILE}")
    world_size = _int(obj, "world_size", 1)
    ranks_obj = obj["ranks"]
    if not isinstance(ranks_obj, list) or len(ranks_obj) != world_size:
        raise _fail(f"'ranks' must be a list of {world_size} records")
    ranks = []
    for r in ranks_obj:
        if not isinstance(r, dict) or set(r) != {"rng", "loader"}:
            raise _fail("each rank record must have exactly 'rng' and 'loader'")
        ranks.append(RankRecord(rng=r["rng"], loader=r["loader"]))
    if not isinstance(obj["optimizers"], list):
        raise _fail("'optimizers' must be a list")
    optimizers = []
    for o in obj["optimizers"]:
        if (
            not isinstance(o, dict)
            or set(o) != {"class", "state_dict"}
            or not isinstance(o["class"], str)
        ):
            raise _fail("each optimizer record must have exactly 'class' and 'state_dict'")
        optimizers.append(OptimizerRecord(cls=o["class"], state=o["state_dict"]))
    state_dict_type = _str(obj, "state_dict_type")
    if state_dict_type not in ("sharded", "full"):
        raise _fail(f"'state_dict_type' must be 'sharded' or 'full', got {state_dict_type!r}")
    return Manifest(
        step=_int(obj, "step", 0),
        world_size=world_size,
        strategy=_str(obj, "strategy"),
        state_dict_type=state_dict_type,
        files=files,
        optimizers=tuple(optimizers),
        scheduler=obj["scheduler"],
        grad_scaler=obj.get("grad_scaler"),
        ranks=tuple(ranks),
        extras=obj["extras"],
        fprep_version=_str(obj, "fprep_version"),
        torch_version=_str(obj, "torch_version"),
    )
