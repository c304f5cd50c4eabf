"""init_device: the one device this rank computes on, from config, parameters or accelerator.

Order of evidence: ``PrepConfig.device``; else the device the managed parameters already sit on
(CPU and meta do not count); else this process's accelerator; else the CPU. Parameters on two
device types or two devices are refused, and so is a ``device`` that contradicts them.
"""

from __future__ import annotations

from fprep.errors import DeviceError
from fprep.state import DeviceState, PrepState, need
from fprep.topology import DEFAULT_BACKEND
from fprep.transitions._base import transition

_HOST = ("cpu", "meta")


def normalize_device(device: str, local_rank: int) -> str:
    """``"cuda"`` -> ``"cuda:<local_rank>"``; Gaudi and MPS processes each see one device (0)."""
    kind, _, index = device.partition(":")
    if kind in _HOST:
        return kind
    if index:
        return f"{kind}:{int(index)}"
    return f"{kind}:{local_rank if kind in ('cuda', 'xpu') else 0}"


@transition
def init_device(state: PrepState) -> PrepState:
    ignored = need(state.ignored, "init_ignored", "init_device")
    tree, cfg, topo = state.tree, state.config, state.topology

    first_on: dict[str, str] = {}  # device -> first managed parameter on it
    for p in tree.params:
        if p.fqn not in ignored.params:
            first_on.setdefault(normalize_device(p.device, topo.local_rank), p.fqn)
    placed = {d: n for d, n in first_on.items() if d not in _HOST}
    kinds = {d.partition(":")[0] for d in placed}
    listing = ", ".join(f"{d} (e.g. {n!r})" for d, n in placed.items())
    if len(kinds) > 1:
        raise DeviceError(
            f"parameters are on several device types: {listing}.",
            subject=next(iter(placed.values())),
            hint="Move the whole model to one device type before prepare, or ignore the "
            "modules that must stay elsewhere.",
        )
    if len(placed) > 1:
        raise DeviceError(
            f"parameters are on several devices: {listing}.",
            subject=next(iter(placed.values())),
            hint="Move the model to one device, or set PrepConfig.device after moving it to CPU.",
        )
    current = next(iter(placed), None)

    if cfg.device is not None:
        device = normalize_device(cfg.device, topo.local_rank)
        kind = device.partition(":")[0]
        if kind != "cpu" and kind != topo.device_type:
            raise DeviceError(
                f"PrepConfig.device={cfg.device!r} but this process has no {kind} device "
                f"(topology device_type={topo.device_type!r}).",
                subject="device",
                hint=f"Use device='{topo.device_type}', or plan with "
                f"Topology(device_type='{kind}', ...) for a machine that has one.",
            )
        if current is not None and current != device:
            raise DeviceError(
                f"PrepConfig.device={cfg.device!r} resolves to {device} on local rank "
                f"{topo.local_rank}, but parameters are already on {current} "
                f"(e.g. {placed[current]!r}).",
                subject="device",
                hint=f"Set device={current!r}, or move the model to CPU and let fprep place it.",
            )
        source = "config"
    elif current is not None:
        if "cpu" in first_on:
            raise DeviceError(
                f"some parameters are on cpu (e.g. {first_on['cpu']!r}) and some on {current} "
                f"(e.g. {placed[current]!r}).",
                subject=first_on["cpu"],
                hint=f"Set PrepConfig.device={current!r} to move the CPU part, or move the "
                "model to one device.",
            )
        device, source = current, "parameters"
    elif topo.device_type != "cpu":
        device, source = normalize_device(topo.device_type, topo.local_rank), "accelerator"
    else:
        device, source = "cpu", "cpu"

    kind = device.partition(":")[0]
    return state.replace(
        device=DeviceState(
            device_type=kind,
            compute_device=device,
            source=source,  # type: ignore[arg-type]
            param_devices=tuple(first_on),
            backend=topo.backend or DEFAULT_BACKEND[kind],
        )
    )
