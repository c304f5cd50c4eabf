"""Crafting safetensors files for the weights tests (valid ones, and ones that lie)."""

from __future__ import annotations

import json
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
