"""Crafting safetensors files for the weights tests (valid ones, and ones that lie)."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import torch

from fprep.checkpoint.export import header


def write_safetensors(path: Path, tensors: dict[str, torch.Tensor]) -> Path:
    """A valid file (written like fprep.export_full writes one)."""
    values = [(k, v.contiguous()) for k, v in tensors.items()]
    with open(path, "wb") as f:
        f.write(header([(k, v.dtype, tuple(v.shape)) for k, v in values]))
        for _, v in values:
            f.write(v.reshape(-1).view(torch.uint8).numpy().tobytes() if v.numel() else b"")
    return path


def write_raw(path: Path, body: Any, data: bytes = b"", *, length: int | None = None) -> Path:
    """A file with any header (a JSON-able value, or bytes) and any data."""
    text = body if isinstance(body, bytes) else json.dumps(body).encode()
    n = len(text) if length is None else length
    path.write_bytes(n.to_bytes(8, "little") + text + data)
    return path


def write_swapped(path: Path, tensors: dict[str, torch.Tensor]) -> Path:
    """A valid file of the same size as ``write_safetensors(path, tensors)`` with the same
    keys and values, but the data in reverse order (offsets swapped to match): read with the
    first file's offsets it gives the wrong tensors."""
    values = [
        (k, v.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())
        for k, v in tensors.items()
    ]
    sizes = [len(raw) for _, raw in values]
    starts = [sum(sizes[i + 1 :]) for i in range(len(values))]  # reversed layout
    body: dict[str, Any] = {"__metadata__": {"format": "pt"}}
    body |= {
        k: {
            "dtype": _CODES[v.dtype],
            "shape": list(v.shape),
            "data_offsets": [start, start + len(raw)],
        }
        for (k, raw), start, v in zip(values, starts, tensors.values(), strict=True)
    }
    text = json.dumps(body, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    data = b"".join(raw for _, raw in reversed(values))
    path.write_bytes(len(text).to_bytes(8, "little") + text + data)
    return path


_CODES = {torch.float32: "F32", torch.bfloat16: "BF16", torch.float16: "F16"}

#: An mtime far in the past: any later write to a file stamped with it changes its mtime,
#: whatever the file system's clock granularity.
OLD_MTIME_NS = 10**18


def stamp_old(path: Path) -> Path:
    os.utime(path, ns=(OLD_MTIME_NS, OLD_MTIME_NS))
    return path
