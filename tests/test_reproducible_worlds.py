"""Reproducible init for world sizes 1 to 8, in one process: hypothesis draws a model (odd row
counts, padding rows, tied weights, a buffer, a parent writing its child, an init that is not
row-local), fprep prepares it on the meta device as each rank of a fake world in turn (real
FSDP2 sharding; collectives that move no data), and the ranks' shards put together must be
bitwise the full parameters a single process gets.

The fake group moves no rows, so every rank computes the modules that are not row-local itself
(fprep's rule on backends other than gloo); the row-local ones need no communication at all.
The multi-process tests in test_materialize.py cover gloo's sharing of the rest.
"""

from __future__ import annotations

import warnings
from typing import Any

import _prepare_workers as W
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

import fprep
from fprep.testing.distributed import fake_world

Spec = tuple[tuple[str, int, int], ...]


class Rotation(nn.Module):
    """Not row-local: a QR of the whole matrix."""

    def __init__(self, rows: int, cols: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(rows, cols))

    def reset_parameters(self) -> None:
        nn.init.orthogonal_(self.weight)


class Noisy(nn.Module):
    """A row-local weight and a buffer drawn from the global RNG."""

    def __init__(self, rows: int, cols: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(rows, cols))
        self.register_buffer("noise", torch.empty(cols))

    def reset_parameters(self) -> None:
        nn.init.kaiming_normal_(self.weight)
        self.noise.normal_()


class Parent(nn.Module):
    """Writes its child's bias after the child's own init ran (plan order: parent first)."""

    def __init__(self, rows: int, cols: int) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.empty(rows))
        self.child = nn.Linear(cols, rows)

    def reset_parameters(self) -> None:
        nn.init.uniform_(self.scale, 0.5, 1.5)
        self.child.weight.data.mul_(2.0)  # (a DTensor when sharded: not a window)


def _build(kind: str, rows: int, cols: int) -> nn.Module:
    if kind == "linear":
        return nn.Linear(cols, rows)
    if kind == "embedding":
        return nn.Embedding(rows, cols, padding_idx=rows // 2)
    if kind == "norm":
        return nn.LayerNorm(rows)
    if kind == "conv":
        return nn.Conv1d(cols, rows, 3)
    if kind == "rotation":
        return Rotation(rows, cols)
    if kind == "noisy":
        return Noisy(rows, cols)
    return Parent(rows, cols)


class Drawn(nn.Module):
    def __init__(self, spec: Spec, tie: bool) -> None:
        super().__init__()
        self.parts = nn.ModuleList(_build(*part) for part in spec)
        self.emb = nn.Embedding(13, 4)
        self.head = nn.Linear(4, 13, bias=False)
        if tie:
            self.head.weight = self.emb.weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # never called
        return x


KINDS = ("linear", "embedding", "norm", "conv", "rotation", "noisy", "parent")
parts = st.tuples(st.sampled_from(KINDS), st.integers(1, 37), st.integers(1, 5))


def _prepared(spec: Spec, tie: bool, wrap: bool, world: int, rank: int) -> dict[str, Any]:
    with torch.device("meta"):
        model = Drawn(spec, tie)
    cfg = fprep.PrepConfig(strategy="fsdp", seed=17, wrap=nn.Linear if wrap else None)
    if world == 1:
        _, model = fprep.prepare(model, cfg, topology=fprep.Topology(world_size=1, rank=0))
    else:
        with fake_world(world, rank), warnings.catch_warnings():
            warnings.simplefilter("ignore")
            _, model = fprep.prepare(
                model, cfg, topology=fprep.Topology(world_size=world, rank=rank)
            )
    out: dict[str, Any] = W.local_shards(model)
    out.update({name: b.clone() for name, b in model.named_buffers()})
    out["tied"] = model.head.weight is model.emb.weight
    return out


@settings(max_examples=20, deadline=None)
@given(
    st.lists(parts, min_size=1, max_size=4).map(tuple),
    st.booleans(),
    st.booleans(),
    st.integers(2, 8),
)
def test_shards_put_together_are_the_single_process_parameters(
    spec: Spec, tie: bool, wrap: bool, world: int
) -> None:
    one = _prepared(spec, tie, wrap, 1, 0)
    assert one["tied"] is tie
    with W.every_rank_computes_everything():
        ranks = [_prepared(spec, tie, wrap, world, rank) for rank in range(world)]
    for name, full in one.items():
        if name == "tied":
            continue
        if name.endswith("noise"):  # a buffer: replicated, the same on every rank
            assert all(torch.equal(r[name], full) for r in ranks), name
            continue
        locals_ = [r[name] for r in ranks]
        stitched = torch.cat(locals_) if full.dim() else locals_[0]
        assert stitched.shape == full.shape, name
        assert torch.equal(stitched, full), f"{name} differs at {world} ranks ({spec})"
    assert all(r["tied"] is tie for r in ranks)
