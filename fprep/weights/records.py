"""Plain data about pretrained weights: what the files hold (the snapshot) and what to read.

``WeightsSnapshot`` is built once by ``fprep.weights.source.snapshot`` from the files' headers
(I/O, in ``fprep.plan``); ``WeightsPlan`` is computed from it by the pure matching in
``fprep.weights.plan`` and applied by the ``load_weights`` step. Both are frozen and hashable,
like every other part of a plan, and hold no tensors.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

#: safetensors dtype code -> (torch dtype name, bytes per element). Anything else is refused.
SAFETENSORS_DTYPES: dict[str, tuple[str, int]] = {
    "F64": ("float64", 8),
    "F32": ("float32", 4),
    "F16": ("float16", 2),
    "BF16": ("bfloat16", 2),
    "F8_E4M3": ("float8_e4m3fn", 1),
    "F8_E5M2": ("float8_e5m2", 1),
    "C64": ("complex64", 8),
    "I64": ("int64", 8),
    "I32": ("int32", 4),
    "I16": ("int16", 2),
    "I8": ("int8", 1),
    "U64": ("uint64", 8),
    "U32": ("uint32", 4),
    "U16": ("uint16", 2),
    "U8": ("uint8", 1),
    "BOOL": ("bool", 1),
}

#: Bytes per element, by torch dtype name.
ITEMSIZE: dict[str, int] = dict(SAFETENSORS_DTYPES.values())


@dataclass(frozen=True)
class WeightsTensor:
    """One tensor of a weights file: its key, its file and where its bytes are in it."""

    key: str
    file: str  # path of the file holding it
    dtype: str  # torch dtype name ("bfloat16")
    shape: tuple[int, ...]
    offset: int  # absolute byte offset of its first byte in ``file``
    nbytes: int


@dataclass(frozen=True)
class WeightsFile:
    """One weights file as planning saw it: what the load checks it still is.

    ``real`` is the path with every link resolved (the Hugging Face cache links each file to a
    blob): the load opens it without following links, so what it reads is what was planned.
    ``digest`` (``fprep.weights.identity``) covers the header and ``samples``: the byte
    ranges sampled from every tensor.
    """

    path: str  # as the checkpoint names it (in messages)
    real: str
    size: int
    device: int  # st_dev
    inode: int  # st_ino
    mtime_ns: int
    header_bytes: int  # 8 + the header's length
    samples: tuple[tuple[int, int], ...]  # (offset, nbytes) the digest hashes, in file order
    digest: str

    @property
    def identity(self) -> tuple[int, int, int, int]:
        """What ``fstat`` must still say: (device, inode, size, mtime)."""
        return (self.device, self.inode, self.size, self.mtime_ns)


@dataclass(frozen=True)
class ConvertedSource:
    """One source pattern of a conversion and the file's tensors it matched for one parameter.

    ``keys`` are in transformers' order (its natural sort of the names). ``experts`` holds the
    number each key has where the pattern has ``*`` (``experts.3.up_proj.weight``: 3), or is
    empty for a pattern without one; ``template`` is a key with ``{}`` in that place, to name
    an expert the file lacks.
    """

    pattern: str
    keys: tuple[str, ...]
    experts: tuple[int, ...] = ()
    template: str = ""


@dataclass(frozen=True)
class Conversion:
    """A parameter transformers assembles from several tensors of the file as it loads it.

    ``target`` is the model's name; ``operations`` are transformers' operations, in order, as
    ``(class name, dim)`` (``("MergeModulelist", 0)``: stack each source's tensors along 0;
    ``("Concatenate", 1)``: concatenate the sources along 1). ``family`` is whose mapping it
    is (the config's ``model_type``). Read by ``fprep.weights.converted``.
    """

    target: str
    family: str
    sources: tuple[ConvertedSource, ...]
    operations: tuple[tuple[str, int | None], ...]


@dataclass(frozen=True)
class WeightsSnapshot:
    """The headers of every file of a pretrained checkpoint (``PrepConfig.weights``).

    ``files``: what the load checks did not change since; ``notes``: how an ambiguous
    checkpoint was resolved (shown by ``fprep.summary``). For a transformers model whose
    family converts its checkpoints as it loads them (``fprep.weights.hf_conversions``):
    ``renames``, ``(file key, model name)`` pairs, and ``conversions``, the parameters
    assembled from several of the file's tensors (mixture-of-experts experts).
    """

    source: str
    tensors: tuple[WeightsTensor, ...]
    files: tuple[WeightsFile, ...]
    notes: tuple[str, ...] = ()
    renames: tuple[tuple[str, str], ...] = ()
    conversions: tuple[Conversion, ...] = ()


@dataclass(frozen=True)
class TensorRead:
    """What this rank reads for one parameter or buffer: one contiguous byte range."""

    name: str  # the model's name (a parameter's canonical FQN, or a buffer's FQN)
    key: str  # its key in the file
    kind: Literal["param", "buffer"]
    file: str
    dtype: str  # dtype in the file
    target_dtype: str  # dtype of the parameter or buffer
    offset: int  # absolute byte offset of this rank's first byte
    nbytes: int  # this rank's bytes (its rows under fsdp / hsdp, the whole tensor otherwise)
    #: The destination holds the model's own values (it was not on the meta device): they are
    #: kept aside before it is overwritten and put back if the load fails.
    keep: bool = False


@dataclass(frozen=True)
class Segment:
    """One contiguous byte range of a file, the next part of a ``ConvertedRead``."""

    key: str
    file: str
    dtype: str
    offset: int
    nbytes: int


@dataclass(frozen=True)
class ConvertedRead(TensorRead):
    """A parameter assembled from several of the file's tensors: ``segments``, read one after
    the other into this rank's part of it (``key``, ``file``, ``dtype``, ``offset``: the
    first segment's; ``nbytes``: all of them)."""

    segments: tuple[Segment, ...] = ()


def elements(read: TensorRead) -> int:
    """How many elements ``read`` fills."""
    if isinstance(read, ConvertedRead):
        return sum(s.nbytes // ITEMSIZE[s.dtype] for s in read.segments)
    return read.nbytes // ITEMSIZE[read.dtype]


@dataclass(frozen=True)
class WeightsPlan:
    """Every read of this rank, and which modules need no initialization because of them."""

    source: str
    reads: tuple[TensorRead, ...]
    files: tuple[WeightsFile, ...]
    #: Modules all of whose parameters and buffers the file provides: not initialized at all.
    loaded_modules: tuple[str, ...]
    #: Keys of the file that the model does not have, allowed by ``weights_extra_keys``.
    skipped_keys: tuple[str, ...] = ()
    #: Parameters and buffers the file lacks, allowed by ``weights_missing_keys``.
    missing_keys: tuple[str, ...] = ()
    #: A tied parameter the file holds under several names: each other name's bytes (``name``:
    #: the parameter), compared with the read of ``name`` before anything is written.
    same_as: tuple[TensorRead, ...] = ()
    notes: tuple[str, ...] = ()

    @property
    def nbytes(self) -> int:
        return sum(r.nbytes for r in self.reads)
