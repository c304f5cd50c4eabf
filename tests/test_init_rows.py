"""Row-local init (``fprep.apply.init_rows``): each rank runs a module's own init on windows onto
its rows, and the rows the ranks hold, put together, are the same full parameters for every world
size. Checked in one process: the ranks are simulated by windows onto the row spans FSDP2 gives
them (``row_span``), with tiny blocks so that fills cross many block boundaries.
"""

from __future__ import annotations

import importlib
import math
from collections.abc import Callable
from typing import Any

import pytest
import torch
from _checks import bare_job, rows_of
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

R: Any = importlib.import_module("fprep.apply.init_rows")
S: Any = importlib.import_module("fprep.apply.init_schedule")
J: Any = importlib.import_module("fprep.apply.init_jobs")

CPU = torch.device("cpu")
Init = Callable[[nn.Module], Any]


def _gpt2(module: nn.Module) -> None:
    """Hugging Face style: through ``.data``, N(0, 0.02) weights and zero biases."""
    module.weight.data.normal_(mean=0.0, std=0.02)
    if getattr(module, "bias", None) is not None:
        module.bias.data.zero_()


def _scaled(module: nn.Module) -> None:
    """A fill, then pointwise arithmetic with a scalar, a 0-dim tensor and a per-column row."""
    nn.init.uniform_(module.weight, -2.0, 2.0)
    module.weight.mul_(0.5).add_(torch.tensor(0.25)).clamp_(-0.5, 0.5)
    if module.weight.dim() == 2:
        module.weight.sub_(torch.arange(module.weight.shape[1], dtype=module.weight.dtype))


def _copied(module: nn.Module) -> None:
    """``copy_`` of a full-size tensor (each rank keeps its rows of it), then a row and a column
    written through ``select`` / ``slice``."""
    w = module.weight
    w.copy_(torch.arange(w.numel(), dtype=w.dtype).reshape(w.shape))
    if w.dim() == 2 and w.shape[0] > 2 and w.shape[1]:
        w[1].fill_(-1.0)
        w[:, :1].zero_()
        w[2:].mul_(2.0)


def _truncated(module: nn.Module) -> None:
    """The inverse-CDF truncated normal (timm's, and torch's before rejection sampling)."""
    lo, hi = (
        (1.0 + math.erf(-2.0 / math.sqrt(2.0))) / 2.0,
        (1.0 + math.erf(2.0 / math.sqrt(2.0))) / 2.0,
    )
    w = module.weight
    w.uniform_(2 * lo - 1, 2 * hi - 1)
    w.erfinv_()
    w.mul_(0.02 * math.sqrt(2.0)).add_(0.0).clamp_(min=-2.0, max=2.0)


def _twice(module: nn.Module) -> None:
    """Two fills of one parameter draw different numbers (each fill has its own seeds)."""
    nn.init.normal_(module.weight)
    saved = module.weight.detach()  # a window too: no copy of values
    nn.init.kaiming_normal_(saved)


INITS: dict[str, tuple[Callable[[tuple[int, int]], nn.Module], Init]] = {
    "linear": (lambda s: nn.Linear(s[1] or 1, s[0]), lambda m: m.reset_parameters()),
    "embedding": (
        lambda s: nn.Embedding(s[0] or 1, s[1], padding_idx=0),
        lambda m: m.reset_parameters(),
    ),
    "layer_norm": (lambda s: nn.LayerNorm(s[0]), lambda m: m.reset_parameters()),
    "conv": (lambda s: nn.Conv1d(s[1] or 1, s[0], 3), lambda m: m.reset_parameters()),
    "gpt2": (lambda s: nn.Linear(s[1] or 1, s[0]), _gpt2),
    "xavier": (
        lambda s: nn.Linear(s[1] or 1, s[0], bias=False),
        lambda m: nn.init.xavier_normal_(m.weight),
    ),
    "scaled": (lambda s: nn.Linear(s[1] or 1, s[0], bias=False), _scaled),
    "copied": (lambda s: nn.Linear(s[1] or 1, s[0], bias=False), _copied),
    "twice": (lambda s: nn.Linear(s[1] or 1, s[0], bias=False), _twice),
    "truncated": (lambda s: nn.Linear(s[1] or 1, s[0], bias=False), _truncated),
}


def _on_rank(
    make: Callable[[], nn.Module], init: Init, world: int, rank: int, elements: int
) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """One simulated rank: its rows of every parameter after the init, and each one's fills."""
    module = make()
    rows: dict[str, torch.Tensor] = {}
    fills: dict[str, Any] = {}
    for name, p in list(module._parameters.items()):
        if p is None:
            continue
        start, stop = rows_of(tuple(p.shape), world, rank)
        rows[name] = torch.full((stop - start, *p.shape[1:]), float("nan"), dtype=p.dtype)
        window = R.window_for(
            p, rows[name], start, seed=3, name=name, device=CPU, elements=elements
        )
        fills[name] = window.fills
        module._parameters[name] = window
    with torch.no_grad():
        init(module)
    return rows, fills


def _full(
    make: Callable[[], nn.Module], init: Init, world: int, elements: int
) -> tuple[dict[str, torch.Tensor], list[dict[str, Any]]]:
    ranks = [_on_rank(make, init, world, rank, elements) for rank in range(world)]
    names = ranks[0][0]
    full = {name: torch.cat([rows[name] for rows, _ in ranks]) for name in names}
    return full, [fills for _, fills in ranks]


@settings(max_examples=60, deadline=None)
@given(
    st.sampled_from(sorted(INITS)),
    st.tuples(st.integers(1, 23), st.integers(0, 5)),
    st.integers(2, 5),
    st.sampled_from([1, 3, 16, 1 << 18]),
)
def test_the_ranks_rows_make_the_same_full_parameters_for_every_world_size(
    which: str, shape: tuple[int, int], world: int, elements: int
) -> None:
    factory, init = INITS[which]
    make = lambda: factory(shape)  # noqa: E731
    one, _ = _full(make, init, 1, elements)
    many, fills = _full(make, init, world, elements)
    for name, tensor in one.items():
        if not tensor.numel():
            continue
        assert not tensor.isnan().any(), name  # every row written
        assert torch.equal(many[name], tensor), f"{which} {shape} at {world} ranks: {name}"
    # each rank drew its own rows, plus at most one partial block at each end
    for rank, per_rank in enumerate(fills):
        for name, f in per_rank.items():
            row = math.prod(one[name].shape[1:])
            start, stop = rows_of(tuple(one[name].shape), world, rank)
            assert f.drawn <= f.count * (stop - start + 2 * f.per_block) * row


def test_a_rank_draws_only_its_rows() -> None:
    """A 4096 x 1024 weight at 2 ranks: each rank draws its 2048 rows, not the 4096."""
    make = lambda: nn.Linear(1024, 4096, bias=False)  # noqa: E731
    _, fills = _full(make, lambda m: m.reset_parameters(), 2, S.BLOCK_ELEMENTS)
    assert [f["weight"].drawn for f in fills] == [2048 * 1024, 2048 * 1024]


def test_a_seed_and_a_name_make_their_own_numbers() -> None:
    def weight(seed: int, name: str) -> torch.Tensor:
        p = nn.Parameter(torch.empty(6, 3))
        rows = torch.empty(6, 3)
        window = R.window_for(p, rows, 0, seed=seed, name=name, device=CPU)
        with torch.no_grad():
            window.normal_()
        return rows

    assert torch.equal(weight(1, "w"), weight(1, "w"))
    assert not torch.equal(weight(1, "w"), weight(2, "w"))
    assert not torch.equal(weight(1, "w"), weight(1, "v"))


def test_an_index_out_of_bounds_is_an_error_as_in_eager() -> None:
    for rank in range(2):
        with pytest.raises(IndexError, match="out of bounds"):
            _on_rank(lambda: nn.Linear(4, 6), lambda m: m.weight[6].zero_(), 2, rank, 16)
    rows, _ = _on_rank(lambda: nn.Linear(4, 6), lambda m: m.weight[-1].fill_(7.0), 2, 1, 16)
    assert torch.equal(rows["weight"][-1], torch.full((4,), 7.0))  # rank 1 holds rows 3..5


REFUSED: dict[str, Init] = {
    "orthogonal_ (QR of the whole matrix)": lambda m: nn.init.orthogonal_(m.weight),
    "trunc_normal_ (rejection loop)": lambda m: nn.init.trunc_normal_(m.weight),
    "a generator of its own": lambda m: nn.init.normal_(m.weight, generator=torch.Generator()),
    "reading values": lambda m: m.weight.sum(),
    "a reshape": lambda m: m.weight.view(-1).fill_(0.0),
    "a fill of a view": lambda m: m.weight[0].normal_(),
    "an operand with rows of its own": lambda m: m.weight.add_(torch.ones(5, 4)),
    "eye_ (depends on the row index)": lambda m: nn.init.eye_(m.weight),
}


@pytest.mark.parametrize("init", REFUSED.values(), ids=list(REFUSED))
def test_what_is_not_row_local_is_refused(init: Init) -> None:
    with pytest.raises(R.NotRowLocal):
        _on_rank(lambda: nn.Linear(4, 6), init, 2, 0, S.BLOCK_ELEMENTS)


def test_an_op_that_fails_fails_on_every_rank_even_one_without_rows() -> None:
    """A 2-row weight at 3 ranks: rank 2 holds no row, yet the broken op fails there too (ops
    run on zero rows), so no rank takes another way than the others."""
    make = lambda: nn.Linear(4, 2, bias=False)  # noqa: E731
    for rank in range(3):
        with pytest.raises(RuntimeError, match="size"):
            _on_rank(make, lambda m: m.weight.add_(torch.ones(3)), 3, rank, S.BLOCK_ELEMENTS)


class Flagged(nn.Module):
    """Marks itself done (as Hugging Face's init does) and draws a buffer, then needs a QR."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(5, 3))
        self.register_buffer("noise", torch.zeros(4))

    def reset_parameters(self) -> None:
        self.done = True
        self.noise = torch.ones(4)
        self.register_buffer("scratch", torch.ones(2), persistent=False)
        nn.init.orthogonal_(self.weight)


def test_a_refused_init_leaves_the_module_as_it_was() -> None:
    module = Flagged()
    weight, noise = module.weight, module.noise
    ok = R.init_by_rows(bare_job(module), lambda m: m.reset_parameters(), CPU, 1, 0)
    assert ok is False
    assert module._parameters["weight"] is weight and module.noise is noise
    assert not hasattr(module, "done")
    assert "scratch" not in module._buffers and not module._non_persistent_buffers_set
    assert torch.equal(weight, torch.zeros(5, 3))  # the attempt never wrote a value
    assert module.weight.__class__ is nn.Parameter


def test_an_accepted_init_writes_the_parameters_in_place() -> None:
    module = nn.Linear(3, 5)
    weight = module.weight
    weight.data.zero_()
    assert R.init_by_rows(bare_job(module), lambda m: m.reset_parameters(), CPU, 1, 0)
    assert module.weight is weight and weight.abs().sum() > 0
    assert isinstance(weight, nn.Parameter) and type(weight) is nn.Parameter


def test_an_init_that_keeps_a_window_is_refused() -> None:
    """No window outlives its init (a kept one would point into this rank's rows only)."""
    module = nn.Linear(3, 5)

    def keep(m: nn.Module) -> None:
        m.reset_parameters()
        m.saved = m.weight.detach()

    assert not R.init_by_rows(bare_job(module), keep, CPU, 1, 0)
    assert not hasattr(module, "saved")


def test_a_parameter_the_init_adds_stays_as_in_eager() -> None:
    module = nn.Linear(3, 5)

    def add(m: nn.Module) -> None:
        m.reset_parameters()
        m.register_parameter("scale", nn.Parameter(torch.ones(5)))

    assert R.init_by_rows(bare_job(module), add, CPU, 1, 0)
    assert torch.equal(module.scale, torch.ones(5))


def test_an_init_that_replaces_its_parameter_is_refused() -> None:
    module = nn.Linear(3, 5)

    def replace(m: nn.Module) -> None:
        m.weight = nn.Parameter(torch.ones(5, 3))

    assert not R.init_by_rows(bare_job(module), replace, CPU, 1, 0)


# -- the pure pieces -----------------------------------------------------------------------------
@given(st.lists(st.integers(0, 9), max_size=3), st.integers(1, 1 << 20))
def test_blocks_depend_on_the_full_shape_alone(shape: list[int], elements: int) -> None:
    per = S.block_rows(shape, elements)
    row = math.prod(shape[1:])
    assert per >= 1
    assert per == 1 or per * max(row, 1) <= elements


@given(st.integers(0, 60), st.integers(1, 9), st.integers(1, 7))
def test_blocks_over_cover_a_span_exactly_once(rows: int, per: int, world: int) -> None:
    chunk = -(-rows // world) if rows else 0
    for rank in range(world):
        start, stop = min(rows, chunk * rank), min(rows, chunk * (rank + 1))
        blocks = S.blocks_over(start, stop, rows, per)
        assert all(lo % per == 0 and hi - lo <= per and hi <= rows for lo, hi in blocks)
        covered = [r for lo, hi in blocks for r in range(max(lo, start), min(hi, stop))]
        assert covered == list(range(start, stop))


@given(st.integers(0, 2**62), st.text(max_size=8), st.integers(0, 5), st.integers(0, 1000))
def test_block_seeds_differ_in_their_low_32_bits(seed: int, name: str, draw: int, b: int) -> None:
    mine = S.block_seed(seed, name, draw, b)
    assert mine == S.block_seed(seed, name, draw, b) and 0 <= mine < 2**63
    low = {S.block_seed(seed, name, draw, b + k) % 2**32 for k in range(8)}
    assert len(low) == 8  # the CPU generator keeps only these bits
