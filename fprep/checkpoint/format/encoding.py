"""Nested state (optimizer, scheduler, loader, extras) as plain JSON, tensors set apart.

``encode`` turns a value made of dicts, lists, tuples, strings, numbers, bools, None and tensors
into JSON data; each tensor is replaced by ``{"$tensor": key}`` and returned separately (it is
written through DCP), so nothing but tensors ever becomes checkpoint bytes. Tuples, dicts whose
keys are not strings (or start with ``$``) and non-finite floats are tagged so that they come
back as they were. ``decode`` is the inverse and builds nothing but those types: an unknown tag or
any other shape of data is a ``CheckpointError``.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from typing import Any

import torch

from fprep.errors import CheckpointError

TENSOR = "$tensor"
TUPLE = "$tuple"
DICT = "$dict"
FLOAT = "$float"
_TAGS = (TENSOR, TUPLE, DICT, FLOAT)
_MAX_DEPTH = 64


def _where(path: tuple[str, ...]) -> str:
    return "/".join(path) or "(top level)"


def encode(
    value: Any,
    prefix: str,
    tensors: dict[str, torch.Tensor] | None,
    path: tuple[str, ...] = (),
) -> Any:
    """JSON data for ``value``; tensors go to ``tensors`` under ``prefix/path`` keys.

    ``tensors=None`` refuses tensors (for values that must be plain data).
    """
    if len(path) > _MAX_DEPTH:
        raise CheckpointError(
            f"{prefix} is nested more than {_MAX_DEPTH} levels deep at {_where(path)}.",
            subject=prefix,
        )
    if value is None or isinstance(value, bool | int | str):
        return value
    if isinstance(value, float):
        return value if math.isfinite(value) else {FLOAT: repr(value)}
    if isinstance(value, torch.Tensor):
        if tensors is None:
            raise CheckpointError(
                f"{prefix} holds a tensor at {_where(path)}; it must be plain data.",
                subject=f"{prefix}/{_where(path)}",
                hint="Convert it with .tolist() or .item() before saving.",
            )
        key = "/".join((prefix, *path))
        if key in tensors:
            raise CheckpointError(
                f"two tensors of {prefix} would be stored under the same key {key!r}.",
                subject=key,
                hint="Avoid '/' in the keys of saved state.",
            )
        tensors[key] = value
        return {TENSOR: key}
    if isinstance(value, tuple):
        return {TUPLE: [encode(v, prefix, tensors, (*path, str(i))) for i, v in enumerate(value)]}
    if isinstance(value, list):
        return [encode(v, prefix, tensors, (*path, str(i))) for i, v in enumerate(value)]
    if isinstance(value, Mapping):
        if all(isinstance(k, str) and not k.startswith("$") for k in value):
            return {k: encode(v, prefix, tensors, (*path, k)) for k, v in value.items()}
        return {
            DICT: [
                [
                    encode(k, prefix, None, (*path, "<key>")),
                    encode(v, prefix, tensors, (*path, str(k))),
                ]
                for k, v in value.items()
            ]
        }
    raise CheckpointError(
        f"{prefix} holds a value of type {type(value).__qualname__} at {_where(path)}, which "
        "fprep cannot store as plain data.",
        subject=f"{prefix}/{_where(path)}",
        hint="Checkpoints store dicts, lists, tuples, str, int, float, bool, None and tensors "
        "(tensors only in model and optimizer state).",
    )


def _bad(what: str, path: tuple[str, ...], detail: str) -> CheckpointError:
    return CheckpointError(
        f"{what} has unexpected data at {_where(path)}: {detail}.",
        subject=what,
        hint="The manifest was not written by fprep.save, or was modified; it was not used.",
    )


def decode(
    data: Any,
    what: str,
    tensor: Callable[[str], torch.Tensor] | None = None,
    path: tuple[str, ...] = (),
) -> Any:
    """The value ``encode`` produced ``data`` from; ``tensor(key)`` supplies tensors."""
    if len(path) > _MAX_DEPTH:
        raise _bad(what, path, "nested too deeply")
    if data is None or isinstance(data, bool | int | float | str):
        return data
    if isinstance(data, list):
        return [decode(v, what, tensor, (*path, str(i))) for i, v in enumerate(data)]
    if not isinstance(data, dict):
        raise _bad(what, path, type(data).__name__)
    tags = [k for k in data if k in _TAGS]
    if not tags:
        for k in data:
            if k.startswith("$"):
                raise _bad(what, path, f"unknown tag {k!r}")
        return {k: decode(v, what, tensor, (*path, k)) for k, v in data.items()}
    if len(data) != 1:
        raise _bad(what, path, f"tag {tags[0]!r} with other keys")
    tag, body = tags[0], data[tags[0]]
    if tag == TENSOR:
        if not isinstance(body, str) or tensor is None:
            raise _bad(what, path, "a tensor where none is allowed")
        return tensor(body)
    if tag == FLOAT:
        if body not in ("nan", "inf", "-inf"):
            raise _bad(what, path, f"float {body!r}")
        return float(body)
    if not isinstance(body, list):
        raise _bad(what, path, f"{tag} of {type(body).__name__}")
    if tag == TUPLE:
        return tuple(decode(v, what, tensor, (*path, str(i))) for i, v in enumerate(body))
    out: dict[Any, Any] = {}
    for item in body:
        if not (isinstance(item, list) and len(item) == 2):
            raise _bad(what, path, "a $dict entry that is not a [key, value] pair")
        key = decode(item[0], what, None, (*path, "<key>"))
        try:
            hash(key)
        except TypeError:
            raise _bad(what, path, f"an unhashable key {key!r}") from None
        out[key] = decode(item[1], what, tensor, (*path, str(key)))
    return out


def tensor_keys(data: Any) -> list[str]:
    """Every ``$tensor`` key in encoded data (for validation), in order."""
    keys: list[str] = []

    def walk(node: Any) -> None:
        if isinstance(node, list):
            for v in node:
                walk(v)
        elif isinstance(node, dict):
            if set(node) == {TENSOR} and isinstance(node[TENSOR], str):
                keys.append(node[TENSOR])
            else:
                for v in node.values():
                    walk(v)

    walk(data)
    return keys
