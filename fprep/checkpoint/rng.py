"""Random number generator states as JSON: torch CPU, the accelerator, Python, NumPy.

Each rank saves its own states (they differ: dropout masks differ per rank) and restores its own
on load. Byte states are hex strings; restoring validates types and sizes before calling the
generator's ``set_state``, so a crafted value is a ``CheckpointError``, never executed.
"""

from __future__ import annotations

import importlib
import random
import sys
from typing import Any

import torch

from fprep.errors import CheckpointError


def _device_module(device_type: str) -> Any:
    if device_type in ("cpu", "meta"):
        return None
    module = getattr(torch, device_type, None)
    if module is None or not hasattr(module, "get_rng_state"):
        return None
    try:
        available = bool(module.is_available()) if hasattr(module, "is_available") else True
    except Exception:  # pragma: no cover - a broken device plugin
        return None
    return module if available else None


def capture(device_type: str) -> dict[str, Any]:
    """This process's generator states (the accelerator's for its current device)."""
    states: dict[str, Any] = {"torch": bytes(torch.get_rng_state().tolist()).hex()}
    module = _device_module(device_type)
    if module is not None:
        states["device"] = {
            "type": device_type,
            "state": bytes(module.get_rng_state().tolist()).hex(),
        }
    version, internal, gauss = random.getstate()
    states["python"] = {"version": version, "state": list(internal), "gauss": gauss}
    numpy = sys.modules.get("numpy")
    if numpy is not None:  # only when the program uses NumPy (fprep never imports it)
        kind, keys, pos, has_gauss, cached = numpy.random.get_state()
        states["numpy"] = {
            "kind": str(kind),
            "keys": [int(k) for k in keys],
            "pos": int(pos),
            "has_gauss": int(has_gauss),
            "cached_gaussian": float(cached),
        }
    return states


def _bad(detail: str) -> CheckpointError:
    return CheckpointError(
        f"the saved RNG state is not valid: {detail}.",
        subject="rng",
        hint="The manifest was modified or written by another program; nothing was restored.",
    )


def _byte_tensor(text: Any, what: str, like: torch.Tensor) -> torch.Tensor:
    if not isinstance(text, str):
        raise _bad(f"{what} must be a hex string")
    try:
        data = bytes.fromhex(text)
    except ValueError:
        raise _bad(f"{what} is not hex") from None
    if len(data) != like.numel():
        raise _bad(f"{what} has {len(data)} bytes, this generator uses {like.numel()}")
    return torch.tensor(list(data), dtype=torch.uint8)


def _torch_state(text: Any, what: str, generator: torch.Generator) -> torch.Tensor:
    """A saved generator state that ``generator`` (a scratch one, of the kind it will be
    restored into) accepts: its size, and its content as torch itself checks it."""
    state = _byte_tensor(text, what, generator.get_state())
    try:
        generator.set_state(state)
    except (RuntimeError, ValueError) as e:
        raise _bad(f"{what} is refused by torch ({str(e).splitlines()[0]})") from None
    return state


def _check_python(py: Any) -> None:
    """Python's ``random`` state: version 3, 624 words and an index in 0..624, a gauss value
    (``random.setstate`` of a scratch generator checks the rest)."""
    if not (
        isinstance(py, dict)
        and set(py) == {"version", "state", "gauss"}
        and isinstance(py["version"], int)
        and isinstance(py["state"], list)
        and len(py["state"]) == 625
        and all(_word(v) for v in py["state"][:624])
        and _index(py["state"][624])
        and (py["gauss"] is None or isinstance(py["gauss"], float))
    ):
        raise _bad(
            "the Python state must be a version, 624 32-bit words, an index 0..624 and "
            "a gauss value"
        )
    try:
        random.Random().setstate((py["version"], tuple(py["state"]), py["gauss"]))
    except (ValueError, TypeError) as e:
        raise _bad(f"the Python state is refused by random.setstate ({e})") from None


def _check_numpy(np_state: Any) -> None:
    """NumPy's legacy global generator: MT19937 with 624 32-bit keys and a position 0..624
    (NumPy does not check the position: a larger one crashes the process at the next draw),
    ``has_gauss`` 0 or 1 and a float."""
    if not (
        isinstance(np_state, dict)
        and set(np_state) == {"kind", "keys", "pos", "has_gauss", "cached_gaussian"}
        and np_state["kind"] == "MT19937"
        and isinstance(np_state["keys"], list)
        and len(np_state["keys"]) == 624
        and all(_word(v) for v in np_state["keys"])
        and _index(np_state["pos"])
        and np_state["has_gauss"] in (0, 1)
        and not isinstance(np_state["has_gauss"], bool)
        and isinstance(np_state["cached_gaussian"], float)
    ):
        raise _bad(
            "the NumPy state must be an MT19937 state (624 32-bit keys, a position 0..624, "
            "has_gauss 0 or 1)"
        )


def _word(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and 0 <= value < 2**32


def _index(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and 0 <= value <= 624


def check(states: Any, device_type: str) -> list[str]:
    """Validate saved states fully (raising ``CheckpointError``): ``restore`` cannot fail on
    what passes. Returns notes on what cannot apply here."""
    notes: list[str] = []
    if not isinstance(states, dict) or "torch" not in states:
        raise _bad("it must be an object with a 'torch' entry")
    unknown = set(states) - {"torch", "device", "python", "numpy"}
    if unknown:
        raise _bad(f"unknown entries {sorted(unknown)}")
    _torch_state(states["torch"], "the torch CPU state", torch.Generator())
    py = states.get("python")
    if py is not None:
        _check_python(py)
    dev = states.get("device")
    if dev is not None:
        if not (isinstance(dev, dict) and set(dev) == {"type", "state"}):
            raise _bad("the device state must have exactly 'type' and 'state'")
        module = _device_module(device_type)
        if dev["type"] != device_type or module is None:
            notes.append(
                f"the {dev['type']!r} RNG state was not restored (running on {device_type})"
            )
        else:
            _check_device(dev["state"], device_type, module)
    np_state = states.get("numpy")
    if np_state is not None:
        _check_numpy(np_state)
    return notes


def _check_device(text: Any, device_type: str, module: Any) -> None:
    """The accelerator's state: checked by a scratch generator of that device where one can be
    made, else by its size."""
    try:
        scratch = torch.Generator(device=device_type)
    except Exception:  # a device without generator objects (a plugin): its size, at least
        _byte_tensor(text, "the device state", module.get_rng_state())
        return
    _torch_state(text, "the device state", scratch)


def restore(states: dict[str, Any], device_type: str) -> None:
    """Apply states that ``check`` accepted."""
    torch.set_rng_state(_byte_tensor(states["torch"], "torch", torch.get_rng_state()))
    dev = states.get("device")
    module = _device_module(device_type)
    if dev is not None and module is not None and dev["type"] == device_type:
        module.set_rng_state(_byte_tensor(dev["state"], "device", module.get_rng_state()))
    py = states.get("python")
    if py is not None:
        random.setstate((py["version"], tuple(py["state"]), py["gauss"]))
    np_state = states.get("numpy")
    if np_state is not None:
        try:  # dynamic: NumPy is optional, and typed Any whether or not it is installed
            numpy: Any = importlib.import_module("numpy")
        except ImportError:  # saved by a program that used NumPy; this one has none
            return
        numpy.random.set_state(
            (
                "MT19937",
                numpy.array(np_state["keys"], dtype=numpy.uint32),
                np_state["pos"],
                np_state["has_gauss"],
                np_state["cached_gaussian"],
            )
        )
