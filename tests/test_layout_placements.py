"""fprep.layout.placements: typed placements round-trip through torch's own classes' reprs."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st
from torch.distributed.tensor import placement_types as pt

from fprep import ConfigError
from fprep.apply.placements import to_torch
from fprep.layout.placements import (
    Partial,
    Replicate,
    Shard,
    StridedShard,
    parse,
    parse_all,
)

dims = st.integers(-4, 7)
torch_placements = st.one_of(
    dims.map(pt.Shard),
    st.builds(lambda d, sf: pt._StridedShard(d, split_factor=sf), dims, st.integers(1, 16)),
    st.just(pt.Replicate()),
    st.sampled_from(("sum", "avg", "max", "min")).map(pt.Partial),
)


@given(torch_placements)
def test_torch_reprs_parse_to_values_that_give_them_back(placement: pt.Placement) -> None:
    value = parse(repr(placement))
    assert str(value) == repr(placement)
    back = to_torch(value)
    assert type(back) is type(placement) and back == placement


def test_the_parsed_values_are_typed() -> None:
    assert parse_all(("Shard(dim=0)", "_StridedShard(dim=1, sf=2)", "Replicate()")) == (
        Shard(0),
        StridedShard(1, 2),
        Replicate(),
    )
    assert parse("Partial(avg)") == Partial("avg") and Partial() == Partial("sum")
    assert len({Shard(0), Shard(0), Replicate()}) == 2  # hashable values


@pytest.mark.parametrize("text", ["Shard(0)", "S(0)", "Replicate", "_MaskPartial(x)", ""])
def test_anything_else_is_refused_naming_the_field(text: str) -> None:
    with pytest.raises(ConfigError) as caught:
        parse(text)
    assert caught.value.subject == "placements" and repr(text) in caught.value.message


@pytest.mark.parametrize(
    ("strategy", "world", "shard", "kinds"),
    [
        ("fsdp", 4, None, {Shard, StridedShard}),
        ("hsdp", 8, 2, {Shard, StridedShard, Replicate}),
        ("fsdp", 2, None, {Shard}),
    ],
)
def test_every_placement_a_tp_plan_stores_parses_back_to_itself(
    strategy: str, world: int, shard: int | None, kinds: set[type]
) -> None:
    """ShardSpec.placements holds typed values, one per mesh dim, whose text (what summaries
    print) is torch's repr and parses back to the same value."""
    import fprep
    from fprep.testing.models import llama_tiny

    cfg = fprep.PrepConfig(strategy=strategy, tp=2, hsdp_shard_size=shard)
    topology = fprep.Topology(world_size=world, rank=world - 1, local_world_size=world)
    state = fprep.plan(llama_tiny("meta"), cfg, topology).unwrap()
    specs = state.param_handles.specs  # type: ignore[union-attr]
    seen = set()
    for spec in specs:
        typed = spec.placements
        assert all(isinstance(p, Shard | StridedShard | Replicate) for p in typed)
        assert parse_all(tuple(map(str, typed))) == typed
        assert tuple(repr(to_torch(p)) for p in typed) == tuple(map(str, typed))
        assert len(typed) == len(spec.mesh_dims)  # none for a whole tensor (tp = world)
        seen.update(type(p) for p in typed)
    assert kinds <= seen
