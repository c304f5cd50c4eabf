"""``fprep.export_full``: the whole model as one safetensors file, streamed parameter by parameter.

The file holds every parameter and persistent buffer under its original FQN (tied parameters
under each of their names), buffers in their original dtype (``state.buffers``), and loads with
plain ``safetensors.torch.load_file`` — no fprep needed. A transformers model whose checkpoints
hold its tensors otherwise (a mixture-of-experts model's fused experts, one tensor per expert
on the hub) is written in the checkpoints' layout, as its ``save_pretrained`` writes it
(``_layouts``), so ``from_pretrained`` reads the file back.

Memory stays bounded by one full tensor beyond this rank's shards: the header is computed from
shapes and dtypes alone (global shapes are known without gathering), written first, then each
tensor is gathered and its bytes are appended on rank 0 before the next one is gathered.
Tensors sharded on dim 0 (FSDP, and HSDP within rank 0's replica) reach rank 0 shard by shard,
point to point, each written as it arrives: two receive buffers of one shard each on rank 0
(reused for every tensor), nothing beyond the shard elsewhere. (``DTensor.full_tensor()`` would
all-gather onto every rank, and gloo's all-gather and gather stage a second full copy.) Other
DTensors use ``full_tensor()``. Under pipeline parallelism the header lists the whole model's
tensors in one process's order (one all-gather over the pipeline ranks); rank 0's stage streams
its tensors as above, and one rank of each other stage sends each of its tensors whole to rank 0.
The file appears whole or not at all (``sink.py``: a temporary file, fsynced, then
``os.replace``; at an fsspec URL the file system's one-file transaction). Any ``OSError``
(permissions, a full disk, a path that is a directory or runs through a file) becomes a
``CheckpointError`` naming the path and what to do, raised on every rank; the temporary file is
removed and an existing file at ``path`` is left as it was.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.distributed.checkpoint.state_dict import get_model_state_dict

from fprep.checkpoint import pipeline
from fprep.checkpoint.collective import Group
from fprep.checkpoint.format.files import os_failure
from fprep.checkpoint.format.storage import plain, progress
from fprep.checkpoint.same_path import agree_on_path
from fprep.checkpoint.states import buffer_dtypes
from fprep.checkpoint.stores.backend import is_url
from fprep.checkpoint.stores.sink import Sink, open_sink
from fprep.errors import CheckpointError
from fprep.layout.mesh import DIM_ORDER
from fprep.state import PrepState
from fprep.tensor_bytes import byte_view
from fprep.unwrap import _original_class as original_class  # FSDP<Class> -> Class
from fprep.weights import hf_conversions
from fprep.weights.converted import leaf_order, tree
from fprep.weights.records import WeightsTensor

#: torch dtype -> safetensors dtype name
SAFETENSORS_DTYPES: dict[torch.dtype, str] = {
    torch.float64: "F64",
    torch.float32: "F32",
    torch.float16: "F16",
    torch.bfloat16: "BF16",
    torch.int64: "I64",
    torch.int32: "I32",
    torch.int16: "I16",
    torch.int8: "I8",
    torch.uint8: "U8",
    torch.bool: "BOOL",
    torch.float8_e4m3fn: "F8_E4M3",
    torch.float8_e5m2: "F8_E5M2",
    torch.complex64: "C64",
    torch.uint16: "U16",
    torch.uint32: "U32",
    torch.uint64: "U64",
}


def _prod(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def header(entries: list[tuple[str, torch.dtype, tuple[int, ...]]]) -> bytes:
    """The safetensors header (length prefix included) for tensors written in this order."""
    body: dict[str, Any] = {"__metadata__": {"format": "pt"}}
    offset = 0
    for name, dtype, shape in entries:
        code = SAFETENSORS_DTYPES.get(dtype)
        if code is None:
            raise CheckpointError(
                f"{name!r} has dtype {dtype}, which safetensors cannot store.",
                subject=name,
                hint="Cast the model to a supported dtype before exporting.",
            )
        size = _prod(shape) * torch.empty((), dtype=dtype).element_size()
        body[name] = {"dtype": code, "shape": list(shape), "data_offsets": [offset, offset + size]}
        offset += size
    text = json.dumps(body, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)  # align the data section to 8 bytes
    return len(text).to_bytes(8, "little") + text


#: Picks the tensors a file holds from the model's state dict, under the names to write.
Select = Callable[[dict[str, Any]], dict[str, Any]]


def export_full(path: str | os.PathLike[str], state: PrepState, model: nn.Module) -> Path | str:
    """Write ``path`` (one ``.safetensors`` file, or an fsspec URL) with the full model; call it
    on every rank.

    Returns ``path`` (a ``Path``; the URL, a ``str``, for a URL). Rank 0 writes; every rank
    takes part in the gathers.
    """
    return export_selected(path, state, model, None)


def export_selected(
    path: str | os.PathLike[str], state: PrepState, model: nn.Module, select: Select | None
) -> Path | str:
    """``export_full`` of the tensors ``select`` picks from the model's state dict (every
    rank must pick the same ones), under the names it gives them; None: all of them."""
    group = Group.of(state)
    target = agree_on_path(group, "fprep.export_full", path, _target)  # one file, every rank
    return _write_full(target, group, state, model, select)


def _target(path: str | os.PathLike[str]) -> Path | str:
    """What ``export_full`` returns for ``path``."""
    return str(path) if is_url(path) else Path(path)


@dataclass(frozen=True)
class _Entry:
    """One tensor of the file: its name, dtype and shape there; ``value`` is this rank's (None
    when another pipeline stage holds it); ``sender`` the rank that sends it whole to rank 0
    when rank 0's stage does not hold it (None: rank 0's stage gathers it as without pp)."""

    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    value: torch.Tensor | None
    sender: int | None = None


def _write_full(
    target: Path | str, group: Group, state: PrepState, model: nn.Module, select: Select | None
) -> Path | str:
    """``export_selected`` once the ranks agree on ``target``."""
    error: BaseException | None = None
    values: list[tuple[str, torch.Tensor, torch.dtype, str]] = []
    entries: list[_Entry] = []
    sink: Sink | None = None
    try:
        values = _values(state, model, select)
    except Exception as e:
        error = _failed(e, target)
    whole = _whole_entries(state, None if error is not None else values)  # pp: a collective
    try:
        if error is None:
            entries = (
                whole
                if whole is not None
                else [_Entry(n, d, tuple(v.shape), v) for n, v, d, _ in values]
            )
            head = header(
                [
                    h
                    for e, layout in zip(entries, _layouts(model, entries, select), strict=True)
                    for h in layout
                ]
            )
            if group.rank == 0:
                sink = open_sink(target)
                sink.write(head)
    except Exception as e:
        error = _failed(e, target)
    try:
        group.agree(error)
    except BaseException:
        _discard(sink)
        raise
    error = None
    buffers = _Buffers()
    total = sum(_prod(e.shape) * e.dtype.itemsize for e in entries)
    bar = progress("fprep: export", total, group.rank == 0)
    try:
        with bar:
            for entry in entries:
                for part in _parts(entry, buffers, group.rank):  # collectives: in order
                    if sink is not None and error is None:
                        try:
                            data = part.to(device="cpu", dtype=entry.dtype).contiguous()
                            sink.write(byte_view(data))
                            bar.advance(data.numel() * data.element_size())
                            del data
                        except Exception as e:  # keep taking part in the gathers; report later
                            error = _failed(e, target)
                    del part
        if sink is not None and error is None:
            sink.commit()
            sink = None
    except Exception as e:
        error = _failed(e, target)
    finally:
        _discard(sink)
    group.agree(error)
    return target


def _values(
    state: PrepState, model: nn.Module, select: Select | None
) -> list[tuple[str, torch.Tensor, torch.dtype, str]]:
    """This rank's tensors to write: (name in the file, value, dtype to write, state-dict key)."""
    originals = buffer_dtypes(state)
    everything = get_model_state_dict(model)
    picked = select(everything) if select is not None else everything
    by_id = {id(v): k for k, v in everything.items()}
    values = []
    for name, value in picked.items():
        key = by_id.get(id(value), name)
        original = originals.get(key)
        if isinstance(value, torch.Tensor):
            values.append((name, value, original if original is not None else value.dtype, key))
    return values


def _layouts(
    model: nn.Module, entries: list[_Entry], select: Select | None
) -> list[list[tuple[str, torch.dtype, tuple[int, ...]]]]:
    """How each entry is written: ``(name, dtype, shape)`` of the file's tensors it becomes,
    whose bytes, one after the other, are the entry's own bytes in order.

    A transformers model whose checkpoints hold its tensors otherwise (mixture-of-experts
    experts, one tensor per expert; Mixtral's ``block_sparse_moe``) is written as
    ``save_pretrained`` writes it, so ``from_pretrained`` reads the file back: the names
    transformers' reverse conversion gives (``fprep.weights.hf_conversions``), each fused
    parameter as its experts' tensors in the order its bytes hold them. A parameter whose
    conversion fprep cannot stream that way (transformers' other operations), every other
    model and a selection (``select``) are written under the model's own names, which
    ``from_pretrained`` reads as well."""
    plain = [[(e.name, e.dtype, e.shape)] for e in entries]
    root = _transformers_root(model)
    if select is not None or root is None:
        return plain
    layout = hf_conversions.checkpoint_layout(root, [(e.name, e.dtype, e.shape) for e in entries])
    if layout is None:
        return plain
    names = layout.shapes
    renamed = {target: key for key, target in layout.renames}
    by_target = {c.target: c for c in layout.conversions}
    out = []
    for e in entries:
        conversion = by_target.get(e.name)
        if conversion is None:
            out.append([(renamed.get(e.name, e.name), e.dtype, e.shape)])
            continue
        tensors = {
            k: WeightsTensor(k, "", "float32", names[k], 0, 0)
            for source in conversion.sources
            for k in source.keys
        }
        try:
            order = leaf_order(tree(conversion, e.shape, tensors))
        except CheckpointError:  # an operation fprep does not stream
            order = None
        if order is None:  # the model's own name, which from_pretrained reads as well
            out.append([(e.name, e.dtype, e.shape)])
            continue
        out.append([(k, e.dtype, names[k]) for k in order])
    return out


def _transformers_root(model: nn.Module) -> nn.Module | None:
    """The transformers model ``model`` is or wraps (DDP's ``module``, torch.compile's
    ``_orig_mod``); None for any other model."""
    seen: object = model
    for _ in range(4):
        if hf_conversions.is_transformers_model(seen):
            assert isinstance(seen, nn.Module)
            return seen
        inner = getattr(seen, "module", None) or getattr(seen, "_orig_mod", None)
        if not isinstance(inner, nn.Module):
            return None
        seen = inner
    return None


def _whole_entries(
    state: PrepState, values: list[tuple[str, torch.Tensor, torch.dtype, str]] | None
) -> list[_Entry] | None:
    """Under pipeline parallelism, the whole model's entries in the order one process writes
    them (``values`` of every pipeline rank: one all-gather over the pp group); None without
    pp, or when a rank failed (``values=None``)."""
    plan = pipeline.plan_of(state)
    if plan is None or plan.whole is None:
        return None
    pg = state.process_group
    assert pg is not None  # a pipeline plan is made from the mesh record
    stage_ranks = pg.mesh.group(*(d for d in DIM_ORDER if d != "pp"))
    mine = None
    if values is not None:
        mine = (
            stage_ranks[0],  # sends what rank 0's stage does not hold
            0 in stage_ranks,
            [(n, str(d).removeprefix("torch."), tuple(v.shape), k) for n, v, d, k in values],
        )
    gathered = pipeline.gather_over_stages(state, mine)
    if any(g is None for g in gathered):
        return None
    order = pipeline.whole_order(plan.whole)
    own = {n: v for n, v, _, _ in values or ()}
    me = pg.mesh.coordinate("pp")
    found: dict[str, tuple[tuple[int, int, int], _Entry]] = {}
    for index, (keeper, with_rank0, listed) in enumerate(gathered):
        for position, (name, dtype, shape, key) in enumerate(listed):
            if name in found:
                continue  # a buffer every stage keeps: the first stage's
            entry = _Entry(
                name,
                getattr(torch, dtype),
                tuple(shape),
                own[name] if index == me else None,
                None if with_rank0 else keeper,
            )
            found[name] = ((order.get(key, len(order)), index, position), entry)
    return [entry for _, entry in sorted(found.values(), key=lambda item: item[0])]


def _parts(entry: _Entry, buffers: _Buffers, rank: int) -> Any:
    """The pieces of ``entry`` rank 0 writes, in order (on rank 0; nothing elsewhere). A
    collective: every rank calls it for the same entries in the same order."""
    import torch.distributed as dist

    if entry.sender is None:
        if entry.value is not None:
            yield from _pieces(entry.value.detach(), buffers)
        return
    device = _wire_device()
    if entry.value is not None:  # another stage's rank gathers it, one of them sends it whole
        parts = list(_pieces(entry.value.detach(), buffers))
        if rank == entry.sender:
            whole = torch.cat(parts) if len(parts) > 1 else parts[0]
            dist.send(whole.to(device=device, dtype=entry.dtype).contiguous(), dst=0)
        return
    if rank == 0:
        received = torch.empty(entry.shape, dtype=entry.dtype, device=device)
        dist.recv(received, src=entry.sender)
        yield received


def _wire_device() -> torch.device:
    """Where point-to-point tensors travel: the GPU for NCCL, else the CPU."""
    import torch.distributed as dist

    if dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _dim0_group(value: Any) -> tuple[Any, int, int, bool] | None:
    """For a DTensor sharded on dim 0 along one mesh dimension (FSDP, HSDP), with rank 0 in its
    mesh: (that dimension's group for this rank, its size, rank 0's index in it, whether this
    rank is in rank 0's group). None for other layouts."""
    from torch.distributed.tensor import DTensor, Replicate, Shard

    if not isinstance(value, DTensor):
        return None
    placements = value.placements
    dims = [i for i, p in enumerate(placements) if isinstance(p, Shard)]
    if len(dims) != 1 or getattr(placements[dims[0]], "dim", None) != 0:
        return None
    if not all(isinstance(p, Shard | Replicate) for p in placements):
        return None
    mesh = value.device_mesh
    where = (mesh.mesh == 0).nonzero()
    coordinate = mesh.get_coordinate()
    if where.numel() == 0 or coordinate is None:
        return None
    zero = [int(c) for c in where[0].tolist()]
    d = dims[0]
    pairs = enumerate(zip(coordinate, zero, strict=True))
    with_rank0 = all(c == z for i, (c, z) in pairs if i != d)
    return mesh.get_group(d), mesh.size(d), zero[d], with_rank0


class _Buffers:
    """Two receive buffers, reused for every tensor of an export (grown when one is too small).

    Allocated zeroed, so their pages are resident (and counted) from the start rather than
    faulted in by the communication thread.
    """

    def __init__(self) -> None:
        self._flat: list[torch.Tensor | None] = [None, None]

    def like(self, slot: int, t: torch.Tensor) -> torch.Tensor:
        nbytes = t.numel() * t.element_size()
        flat = self._flat[slot]
        if flat is None or flat.numel() < nbytes or flat.device != t.device:
            self._flat[slot] = None  # free the old one first
            flat = torch.zeros(max(nbytes, 1), dtype=torch.uint8, device=t.device)
            self._flat[slot] = flat
        return flat[:nbytes].view(t.dtype).view(t.shape)


def _pieces(value: torch.Tensor, buffers: _Buffers) -> Any:
    """The full tensor's rows, in order, as pieces on rank 0 (other ranks get none). A
    collective: call it on every rank for the same tensors in the same order."""
    import torch.distributed as dist

    plan = _dim0_group(value)
    if plan is None:
        yield plain(value.full_tensor() if hasattr(value, "full_tensor") else value)
        return
    group, size, dst, with_rank0 = plan
    if not with_rank0:  # another HSDP replica holds the same shards: nothing to send
        return
    local = plain(value.to_local())  # type: ignore[attr-defined]  # float8 all-gather wrapper
    n = value.shape[0]
    rows = -(-n // size) if n else 0  # rows of every (padded) shard: torch.chunk semantics
    padded = local.contiguous()
    if local.shape[0] != rows:
        padded = local.new_zeros((rows, *local.shape[1:]))
        padded[: local.shape[0]] = local
    if dist.get_rank(group) != dst:
        dist.send(padded, group=group, group_dst=dst)
        return
    # Point to point, shard by shard, into two alternating buffers (one receives while the
    # other is written): gloo's gather and all-gather stage the whole tensor first.
    senders = [r for r in range(size) if r != dst]
    in_flight: dict[int, tuple[int, torch.Tensor, Any]] = {}

    def post(slot: int) -> None:
        if senders:
            r = senders.pop(0)
            buffer = buffers.like(slot, padded)
            in_flight[r] = (slot, buffer, dist.irecv(buffer, group=group, group_src=r))

    post(0)
    post(1)
    for r in range(size):
        keep = min(max(n - rows * r, 0), rows)
        if r == dst:
            if keep:
                yield padded[:keep]
            continue
        slot, chunk, request = in_flight.pop(r)
        request.wait()
        if keep:
            yield chunk[:keep]
        del chunk
        post(slot)  # the buffer was written: reuse it for the next sender


def _failed(error: Exception, target: Path | str) -> Exception:
    """An ``OSError`` as a ``CheckpointError`` about ``target``; anything else as it is."""
    if not isinstance(error, OSError):
        return error
    return os_failure(
        error,
        "write",
        target,
        subject=str(target),
        then="Nothing was written at that path (an existing file there is unchanged).",
    )


def _discard(sink: Sink | None) -> None:
    if sink is not None:
        sink.discard()


#: What ``save_pretrained`` writes, under the names ``from_pretrained`` looks for.
WEIGHTS_NAME = "model.safetensors"
CONFIG_NAME = "config.json"
GENERATION_CONFIG_NAME = "generation_config.json"
#: A file that would take precedence over (or stand beside) ``model.safetensors`` for a reader.
_SHADOWING = ("model.safetensors.index.json",)


def save_pretrained(
    path: str | os.PathLike[str], state: PrepState, model: nn.Module, config: Any = None
) -> Path | str:
    """A ``from_pretrained`` directory: ``export_full``'s ``model.safetensors`` and the model's
    ``config.json`` (and ``generation_config.json`` when it has one). Call it on every rank.

    ``model.save_pretrained`` on a sharded model gathers nothing (it fails on rank 0, or writes
    a config without weights): this gathers as ``export_full`` does. The configuration is
    serialized on every rank before anything is written, so a bad one fails with no effect;
    the weights are written first and the configuration last, each file whole or not at all.
    """
    group = Group.of(state)
    directory = agree_on_path(group, "fprep.save_pretrained", path, _directory)
    error: BaseException | None = None
    files: list[tuple[str, bytes]] = []
    try:
        files = _config_files(model, config)
        if group.rank == 0:
            _refuse_shadowing(directory)
    except Exception as e:
        error = _failed(e, directory)
    group.agree(error)
    _write_full(_join(directory, WEIGHTS_NAME), group, state, model, None)
    error = None
    if group.rank == 0:
        for name, data in files:
            sink: Sink | None = None
            try:
                sink = open_sink(_join(directory, name))
                sink.write(data)
                sink.commit()
                sink = None
            except Exception as e:
                error = _failed(e, _join(directory, name))
                break
            finally:
                _discard(sink)
    group.agree(error)
    return directory


def _directory(path: str | os.PathLike[str]) -> Path | str:
    """The directory ``save_pretrained`` writes into."""
    return str(path).rstrip("/") if is_url(path) else Path(path)


def _join(directory: Path | str, name: str) -> Path | str:
    return directory / name if isinstance(directory, Path) else f"{directory}/{name}"


def _config_files(model: nn.Module, config: Any) -> list[tuple[str, bytes]]:
    """``config.json`` (and ``generation_config.json``) as transformers writes them: the config
    object's own ``to_json_string``, with ``dtype`` and ``architectures`` set as
    ``model.save_pretrained`` sets them, on a copy (the caller's config is not changed)."""
    owner = _config_owner(model)
    if config is None:
        config = getattr(owner, "config", None)
    if config is None:
        raise CheckpointError(
            f"{type(model).__name__} has no .config (it is not a transformers model), so "
            "there is no config.json to write.",
            subject="config",
            hint="Pass config= (a transformers config, or a dict), or write the weights alone "
            "with fprep.export_full(path, state, model).",
        )
    if hasattr(config, "to_json_string"):
        body = json.loads(config.to_json_string())
    elif isinstance(config, dict):
        body = dict(config)
    else:
        raise CheckpointError(
            f"config must be a transformers config or a dict; got {type(config).__name__}.",
            subject="config",
            hint="Pass the model's config (model.config), or leave it out to use it.",
        )
    dtype = next((p.dtype for p in model.parameters() if p.is_floating_point()), None)
    if owner is not None and dtype is not None:  # the dtype export_full writes them in
        body["dtype"] = str(dtype).removeprefix("torch.")
        body["architectures"] = [original_class(owner).__name__]  # not FSDP<Class>
    files = [(CONFIG_NAME, _json_bytes(body))]
    generation = getattr(owner, "generation_config", None)
    can_generate = getattr(owner, "can_generate", None)
    if generation is not None and callable(can_generate) and can_generate():
        files.append((GENERATION_CONFIG_NAME, _json_bytes(json.loads(generation.to_json_string()))))
    return files


def _config_owner(model: nn.Module) -> nn.Module | None:
    """The module that carries ``.config``: the model, or what DDP or ``torch.compile`` wrap."""
    for candidate in (model, getattr(model, "module", None), getattr(model, "_orig_mod", None)):
        if isinstance(candidate, nn.Module) and getattr(candidate, "config", None) is not None:
            return candidate
    return None


def _json_bytes(body: dict[str, Any]) -> bytes:
    return (json.dumps(body, indent=2, sort_keys=True) + "\n").encode()


def _refuse_shadowing(directory: Path | str) -> None:
    """An index left by an earlier sharded save would be read instead of the new file (by
    ``PrepConfig(weights=...)``) or beside it: refuse rather than leave an ambiguous folder."""
    for name in _SHADOWING:
        target = _join(directory, name)
        if isinstance(target, Path):
            exists = target.exists()
        else:
            from fprep.checkpoint.stores.fsspec_store import file_system

            fs, where = file_system(target)
            exists = bool(fs.exists(where))
        if exists:
            raise CheckpointError(
                f"{target} exists: it would be read instead of (or beside) the new "
                f"{WEIGHTS_NAME}, from an earlier sharded save.",
                subject=str(target),
                hint="Save into an empty directory, or remove the old index and its shards.",
            )
