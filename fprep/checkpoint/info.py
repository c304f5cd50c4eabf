"""``LoadedInfo``: what ``fprep.load`` read (plain data, no torch import)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any


@dataclass(frozen=True, kw_only=True)
class LoadedInfo:
    """What ``fprep.load`` read. Keys are ``model/<FQN>`` / ``optimizer/<i>/state/<FQN>/<name>``."""

    step: int
    extras: Any
    path: Path | str  # the step directory that was read (its URL for an fsspec one)
    world_size: int  # when saved
    strategy: str  # when saved
    state_dict_type: str  # when saved
    missing_keys: tuple[str, ...] = ()  # live keys the checkpoint lacks (kept as they were)
    unexpected_keys: tuple[str, ...] = ()  # checkpoint keys nothing live takes (not read)
    rng_restored: bool = False
    notes: tuple[str, ...] = ()
