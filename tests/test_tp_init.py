"""Meta-device init under tensor parallelism: world-size independent (the same seed gives the
same full weights at 1 rank, dp 2 x tp 2 and tp 4), for fprep's and transformers' conventions
and for an init that is not row-local; and the rows and columns each rank initializes."""

from __future__ import annotations

from typing import Any

import _tp_init_workers as W
import _tp_workers as TPW
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from fprep.apply.init_schedule import col_span, row_span
from fprep.sharding import TPLayout
from fprep.snapshot import ParamInfo
from fprep.state import ShardSpec
from fprep.testing.distributed import run_ranks


@given(
    st.sampled_from((1, 2, 4)),
    st.integers(1, 5),
    st.integers(1, 12),
    st.integers(1, 6),
    st.sampled_from((0, 1, None)),
)
def test_row_and_column_spans_are_the_ranks_block(
    tp: int, dp: int, rows_per_tp: int, cols: int, tp_dim: int | None
) -> None:
    """What materialize initializes on each rank (``row_span`` x ``col_span``) is torch's
    block: the tp chunk (torch.chunk), then FSDP2's rows of it."""
    shape = (rows_per_tp * tp, cols * tp)
    p = ParamInfo(names=("w",), shape=shape)
    for t in range(tp):
        layout = TPLayout(tp=tp, tp_rank=t, dp_dims=("dp",), hybrid=False, params={"w": tp_dim})
        for d in range(dp):
            local, padded, dims, placements, block = layout.place(p, (dp, d))
            spec = ShardSpec(
                fqn="w",
                names=("w",),
                shape=shape,
                dtype="torch.float32",
                local_shape=local,
                padded_shape=padded,
                requires_grad=True,
                mesh_dims=dims,
                placements=placements,
                tp_shape=block,
            )
            rows, cols_ = TPW.reference_block(shape, tp, tp_dim, t, dp, d)
            start, stop = row_span(spec, dp, d, t)
            assert list(range(start, stop)) == rows.tolist()
            span = col_span(spec, t)
            got = list(range(*span)) if span is not None else list(range(shape[1]))
            assert got == cols_.tolist()


@pytest.fixture(scope="module")
def four_ranks() -> list[dict[str, Any]]:
    return run_ranks(W.four_ranks, 4, timeout_s=900)


@pytest.mark.parametrize("model", W.MODELS)
def test_same_seed_same_full_weights_at_every_layout(
    four_ranks: list[dict[str, Any]], model: str
) -> None:
    """Bitwise: every parameter and buffer, gathered from dp 2 x tp 2 and from tp 4 on every
    rank, equals what one process initializes from the same seed."""
    ref = W.one_process(model)
    assert all(np.isfinite(v).all() for v in ref.values())
    weights = [v for v in ref.values() if v.ndim == 2]
    assert weights and all(v.std() > 0 for v in weights)  # drawn, not constant
    for layout in W.LAYOUTS:
        for rank, out in enumerate(four_ranks):
            got = out[f"{model}/{layout}"]
            assert set(got) == set(ref)
            bad = [n for n in ref if got[n].tobytes() != ref[n].tobytes()]
            assert bad == [], f"{layout} rank {rank}: {bad}"
