"""fprep.layout.stages: torchtitan's default split, user splits, and stages per pipeline rank
against torch.distributed.pipelining's own stage-to-rank mapping."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st
from torch.distributed.pipelining._utils import generate_rank_to_stage_mapping

from fprep import ConfigError
from fprep.layout.stages import (
    LOOPED_SCHEDULES,
    SCHEDULES,
    SINGLE_STAGE_SCHEDULES,
    V_SCHEDULES,
    default_split,
    num_stages,
    stages_of_rank,
    user_split,
)


def test_four_stages_of_32_layers_as_torchtitan_splits_them() -> None:
    split = default_split(4, 32)
    layer_counts = [sum(name.startswith("layers.") for name in stage) for stage in split]
    assert layer_counts == [8, 9, 8, 7]
    assert split[0][0] == "tok_embeddings" and split[-1][-2:] == ("norm", "output")
    assert split[1] == tuple(f"layers.{i}" for i in range(8, 17))
    # 27 layers on 4 stages: 29 weighted layers, 7 each and the one left over to stage 0.
    assert [len(stage) for stage in default_split(4, 27)] == [8, 7, 7, 8]
    assert default_split(4, 27)[3][:2] == ("layers.21", "layers.22")


@given(st.integers(1, 80), st.data())
def test_the_default_split_keeps_order_and_balance(layers: int, data: st.DataObject) -> None:
    stages = data.draw(st.integers(1, layers + 2))
    first, last = ("model.embed_tokens",), ("model.norm", "lm_head")
    split = default_split(stages, layers, first=first, layers="model.layers", last=last)
    assert len(split) == stages
    flat = [name for stage in split for name in stage]
    assert flat == [*first, *(f"model.layers.{i}" for i in range(layers)), *last]
    if stages > 1:
        # The embedding and the head (norm + lm_head) weigh one layer each; the weights differ
        # by at most one, and the heavier stages come first.
        weights = [len(s) - (1 if i == stages - 1 else 0) for i, s in enumerate(split)]
        assert max(weights) - min(weights) <= 1 and weights == sorted(weights, reverse=True)


def test_more_stages_than_weighted_layers_is_refused() -> None:
    with pytest.raises(ConfigError) as caught:
        default_split(7, 4)
    assert caught.value.subject == "num_stages" and "at most 6 stages" in str(caught.value)
    with pytest.raises(ConfigError) as caught:
        default_split(2, 0)
    assert caught.value.subject == "num_layers"


@given(st.sampled_from(SCHEDULES), st.integers(1, 8), st.integers(1, 4), st.data())
def test_stages_per_rank_are_torchs(
    schedule: str, pp: int, per_rank: int, data: st.DataObject
) -> None:
    if schedule in V_SCHEDULES:
        per_rank = 2
    total = num_stages(pp, schedule, per_rank)
    style = "v" if schedule in V_SCHEDULES else "loop"
    expected = generate_rank_to_stage_mapping(pp, total, style=style)
    for rank in range(pp):
        assert list(stages_of_rank(rank, pp, schedule, per_rank)) == sorted(expected[rank])
    if schedule in SINGLE_STAGE_SCHEDULES:
        assert total == pp
    elif schedule in LOOPED_SCHEDULES:
        assert total == pp * per_rank


@pytest.mark.parametrize(
    ("call", "subject"),
    [
        (lambda: stages_of_rank(0, 2, "Pipedream"), "schedule"),
        (lambda: stages_of_rank(0, 2, "ZBVZeroBubble", 3), "stages_per_rank"),
        (lambda: stages_of_rank(2, 2, "1F1B"), "pp_rank"),
        (lambda: stages_of_rank(0, 0, "1F1B"), "pp"),
        (lambda: num_stages(2, "Interleaved1F1B", 0), "stages_per_rank"),
    ],
)
def test_refusals_name_the_field(call: object, subject: str) -> None:
    with pytest.raises(ConfigError) as caught:
        call()  # type: ignore[operator]
    assert caught.value.subject == subject


def test_a_user_split_is_checked() -> None:
    known = {"embed", "layers.0", "layers.1", "head"}
    split = user_split([["embed", "layers.0"], ["layers.1", "head"]], known)
    assert split == (("embed", "layers.0"), ("layers.1", "head"))
    for bad, words in [
        ([], "lists no stages"),
        ([["embed"], []], "stage 1"),
        ([["embed"], ["embed"]], "in two stages"),
        ([["embed", "layers.9"]], "'layers.9'"),
        (["embed"], "stage 0"),
    ]:
        with pytest.raises(ConfigError, match=words) as caught:
            user_split(bad, known)
        assert caught.value.subject == "stages"
