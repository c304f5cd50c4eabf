"""The total norm of a model's gradients, wherever they live: plain tensors and DTensors.

Under tensor parallelism composed with FSDP2 the gradients are DTensors on several mesh objects
that are often only a few distinct meshes: FSDP2 slices ``mesh["dp"]`` anew for each module it
wraps, so Qwen2 at dp 2 x tp 2 spreads 27 gradients over seven mesh objects but two meshes,
``(dp, tp)`` and ``(dp,)``. Reducing per object (or through DTensor's own ``full_tensor``, one
reduction per mesh dimension) issues a collective per object and dimension; here gradients are
grouped by mesh *equality* and each distinct mesh costs one all-reduce of one number.

The sum is exact: every rank adds ``|x|^p`` over its local shards, counting a shard that is
replicated along a mesh dimension only on the rank at coordinate 0 of that dimension, so the sum
over the mesh's ranks counts every element of every gradient once (for the infinity norm the
maximum needs no such care). A gradient that is ``Partial`` somewhere holds summands, not
elements: it is made whole (``Replicate``) there first, a collective of its own.

The mesh's ranks are reduced over the default group when the mesh spans the world (the usual
case), over its one group when it has one dimension, and dimension after dimension otherwise.
Each all-reduce returns the same value on every rank of its group, so every rank ends with the
same norm and scales its gradients by the same factor (torch's warning that sequential
reductions "may give inconsistent results between ranks" concerns reductions whose order
differs between ranks; these run in the same order everywhere).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from fprep.errors import PrepareError


def is_dtensor(t: torch.Tensor) -> bool:
    return hasattr(t, "full_tensor") and hasattr(t, "placements")


def check_norm_type(norm_type: float) -> float:
    """``norm_type`` as a float; a PrepareError unless it is positive (or infinite)."""
    p = float(norm_type)
    if not (p > 0):  # also refuses nan
        raise PrepareError(
            f"clip_grad_norm's norm_type={norm_type!r} is not a norm fprep can sum across "
            "ranks: it takes a positive p (2.0, the default; 1.0) or math.inf.",
            subject="norm_type",
            hint="Pass norm_type=2.0, 1.0 or math.inf.",
        )
    return p


def total_norm(grads: Sequence[torch.Tensor], norm_type: float, across: Any = None) -> torch.Tensor:
    """The p-norm of all of ``grads`` as one vector, the same on every rank (a float32
    tensor on the first gradient's device); a collective when a gradient is a DTensor.

    ``across``: a process group whose ranks hold other parts of the model (the pipeline
    stages): their norms are combined with one more all-reduce of one number.
    """
    p = check_norm_type(norm_type)
    if across is not None:
        return _across(_local_power(grads, p), p, across)
    return _root(_local_power(grads, p), p)


def _root(power: torch.Tensor, p: float) -> torch.Tensor:
    return power if math.isinf(p) else power.pow(1.0 / p)


def _across(power: torch.Tensor, p: float, group: Any) -> torch.Tensor:
    op = dist.ReduceOp.MAX if math.isinf(p) else dist.ReduceOp.SUM
    dist.all_reduce(power, op=op, group=group)
    return _root(power, p)


def _local_power(grads: Sequence[torch.Tensor], p: float) -> torch.Tensor:
    """Sum of ``|x|^p`` over every element of ``grads`` (the max of ``|x|`` for the infinity
    norm), each counted once over the meshes the DTensors span."""
    plain = [g for g in grads if not is_dtensor(g)]
    by_mesh = _by_mesh([g for g in grads if is_dtensor(g)])
    parts: list[torch.Tensor] = []
    if plain:  # whole on every rank: counted as they are
        parts.append(_power(nn.utils.get_total_norm(plain, p), p))
    for mesh, group in by_mesh:
        parts.append(_mesh_power(mesh, group, p))
    if not parts:
        return torch.tensor(0.0)
    device = parts[0].device
    stacked = torch.stack([t.to(device) for t in parts])
    return stacked.max() if math.isinf(p) else stacked.sum()


def _by_mesh(sharded: list[Any]) -> list[tuple[Any, list[Any]]]:
    """DTensors grouped by mesh equality, in order of first appearance (the same on every
    rank: every rank holds the same parameters in the same order)."""
    by_id: dict[int, list[Any]] = {}
    for g in sharded:
        by_id.setdefault(id(g.device_mesh), []).append(g)
    groups: list[tuple[Any, list[Any]]] = []
    for members in by_id.values():
        mesh = members[0].device_mesh
        for known, group in groups:
            if known == mesh:
                group.extend(members)
                break
        else:
            groups.append((mesh, list(members)))
    return groups


def _power(norm: torch.Tensor, p: float) -> torch.Tensor:
    """``norm ** p`` in float32 (``norm`` itself for the infinity norm)."""
    norm = norm.float()
    return norm if math.isinf(p) else norm.pow(p)


def _mesh_power(mesh: Any, grads: list[Any], p: float) -> torch.Tensor:
    """Sum over ``mesh`` of ``|x|^p`` (the maximum of ``|x|`` for the infinity norm) over every
    element of ``grads``, each counted once: one all-reduce (one per dimension of a mesh that
    neither has one dimension nor spans the world)."""
    coordinate = mesh.get_coordinate()
    counted: list[torch.Tensor] = []
    for g in grads:
        if any(pl.is_partial() for pl in g.placements):
            g = _whole(g)
        if math.isinf(p) or all(
            c == 0 for c, pl in zip(coordinate, g.placements, strict=True) if pl.is_replicate()
        ):
            counted.append(g.to_local())
    device = grads[0].to_local().device
    local = (
        _power(nn.utils.get_total_norm(counted, p), p).to(device)
        if counted
        else torch.zeros((), device=device)
    )
    op = dist.ReduceOp.MAX if math.isinf(p) else dist.ReduceOp.SUM
    for group in _groups_spanning(mesh):
        dist.all_reduce(local, op=op, group=group)
    return local


def _whole(g: Any) -> Any:
    """``g`` with every ``Partial`` placement made ``Replicate`` (its summands added up)."""
    from torch.distributed.tensor import Replicate

    placements = [Replicate() if pl.is_partial() else pl for pl in g.placements]
    return g.redistribute(g.device_mesh, placements)


def _groups_spanning(mesh: Any) -> list[Any]:
    """Process groups whose successive all-reduces reduce over every rank of ``mesh``."""
    if mesh.ndim == 1:
        return [mesh.get_group(0)]
    if mesh.size() == dist.get_world_size():  # every rank of the world: the default group
        return [None]
    return [mesh.get_group(d) for d in range(mesh.ndim)]
