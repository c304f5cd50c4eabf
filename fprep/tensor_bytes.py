"""The bytes of a CPU tensor, as the ``memoryview`` that file reads and writes take.

One definition for the two places that move tensor bytes through files: ``fprep.weights``
(pretrained weights read into parameters) and ``fprep.checkpoint`` (checkpoints written and
read). A wrapper tensor subclass has no storage of its own: its ``data_ptr`` is no memory of its
values (reading it once crashed a save). The view is of the inner tensor that holds the values in
place (torchao's float8 all-gather weight), or refused.
"""

from __future__ import annotations

import ctypes

import torch
from torch.utils._python_dispatch import is_traceable_wrapper_subclass


def is_wrapper(t: torch.Tensor) -> bool:
    """Whether ``t`` is a wrapper subclass: its ``data_ptr`` is no memory of its values."""
    return bool(is_traceable_wrapper_subclass(t))  # (a bool: no type narrowing of ``t``)


def values_of(t: torch.Tensor) -> torch.Tensor | None:
    """The plain tensor holding ``t``'s values in place: ``t`` itself, or the one inner tensor
    of a wrapper subclass that has ``t``'s shape and dtype (torchao's float8 all-gather weight
    keeps its high-precision values so); ``None`` for any other wrapper (a float8 tensor's
    inner data is not its values)."""
    if not is_wrapper(t):
        return t
    names, _ = t.__tensor_flatten__()  # type: ignore[attr-defined]
    inner = [getattr(t, n) for n in names]
    if len(inner) == 1 and inner[0].shape == t.shape and inner[0].dtype == t.dtype:
        return values_of(inner[0])
    return None


def byte_view(t: torch.Tensor) -> memoryview:
    """The bytes of a contiguous CPU tensor (or of the values a wrapper holds in place,
    ``values_of``), writable, without a copy. The view does not keep the tensor alive: keep a
    reference while it is used."""
    plain = values_of(t)
    if plain is None:
        raise TypeError(f"byte_view of a {type(t).__name__}: take its plain values first")
    t = plain
    if t.device.type != "cpu" or not t.is_contiguous():
        raise ValueError(f"byte_view needs a contiguous CPU tensor, not {t.device} {t.stride()}")
    n = t.numel() * t.element_size()
    if n == 0:
        return memoryview(bytearray())
    return memoryview((ctypes.c_ubyte * n).from_address(t.data_ptr())).cast("B")
