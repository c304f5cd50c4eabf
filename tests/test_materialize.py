"""The materialize step: its pure core (property tests), and what it does on 1, 2 and 3 gloo ranks.

Reproducible mode must give bitwise the same full parameters for every world size, whether each
rank draws only its own rows (row-local inits, ``init_rows``), the ranks share the full
computation (other inits, on gloo) or every rank computes everything (other backends); a module
computed on one rank that fails must fail every rank, not leave them waiting. Non-reproducible
mode must give each shard rank its own numbers (raw FSDP2 on a CPU mesh gives every rank the same
ones), deterministically for a given world size, with buffers that agree.
"""

from __future__ import annotations

import contextlib
import importlib
import itertools
from collections.abc import Iterator
from typing import Any

import _prepare_workers as W
import pytest
import torch
import torch.distributed as dist
from _checks import shard_spec
from hypothesis import given
from hypothesis import strategies as st
from torch import nn

import fprep
from fprep.errors import PrepareError
from fprep.sharding import shard_shape
from fprep.testing.distributed import run_ranks

#: materialize's pure planning, its per-module jobs, and the step itself
S: Any = importlib.import_module("fprep.apply.init_schedule")
J: Any = importlib.import_module("fprep.apply.init_jobs")
M: Any = importlib.import_module("fprep.apply.materialize")

SEED = 11
TIMEOUT_S = 240.0
needs_gloo = pytest.mark.skipif(
    not (dist.is_available() and dist.is_gloo_available()), reason="needs gloo"
)


# -- pure core -----------------------------------------------------------------------------------
@given(st.lists(st.integers(0, 5000), max_size=12), st.sampled_from([1, 8, 64, 512]))
def test_carve_gives_aligned_blocks_that_never_overlap(sizes: list[int], align: int) -> None:
    offsets, total = S.carve(sizes, align)
    assert len(offsets) == len(sizes)
    assert all(offset % align == 0 for offset in offsets)
    blocks = sorted((o, o + n) for o, n in zip(offsets, sizes, strict=True) if n)
    assert all(a[1] <= b[0] for a, b in itertools.pairwise(blocks))
    assert all(stop <= total for _, stop in blocks)
    assert total == sum(-(-n // align) * align for n in sizes)  # no slack beyond alignment


@given(st.lists(st.booleans(), max_size=30))
def test_schedule_keeps_plan_order_and_pools_runs_of_shareable_modules(flags: list[bool]) -> None:
    work = S.schedule(flags)
    flat = [i for item in work for i in ((item,) if isinstance(item, int) else item)]
    assert flat == list(range(len(flags)))  # every module once, in plan order
    for item in work:
        if isinstance(item, int):
            assert not flags[item]  # computed on every rank
        else:
            assert item and all(flags[i] for i in item)
    # phases are maximal: two phases are never adjacent
    assert not any(
        isinstance(a, tuple) and isinstance(b, tuple) for a, b in itertools.pairwise(work)
    )


@given(st.lists(st.integers(0, 10_000), max_size=40), st.integers(1, 9))
def test_assign_balances_work_between_ranks(costs: list[int], world: int) -> None:
    owners = S.assign(costs, world)
    assert len(owners) == len(costs) and all(0 <= k < world for k in owners)
    assert owners == S.assign(costs, world)  # the same on every rank
    loads = [sum(c for c, k in zip(costs, owners, strict=True) if k == r) for r in range(world)]
    # greedy, largest first: no rank has more than one module's worth over the least loaded
    assert max(loads) - min(loads) <= max(costs, default=0)
    if len(costs) <= world and all(costs):
        assert len(set(owners)) == len(costs)  # few modules: one per rank


@given(
    st.integers(0, 40),
    st.lists(st.integers(0, 3), max_size=2),
    st.integers(1, 9),
)
def test_row_spans_cut_the_rows_as_fsdp2_does(rows: int, rest: list[int], world: int) -> None:
    shape = (rows, *rest)
    covered: list[int] = []
    for rank in range(world):
        local, _ = shard_shape(shape, world, rank)
        start, stop = S.row_span(shard_spec("p", shape, world, rank), world, rank)
        assert stop - start == local[0]  # exactly the rows FSDP2 gives this rank
        covered += range(start, stop)
    assert covered == (list(range(rows)) if all(rest) else [])


@given(st.integers(0, 2**31), st.text(max_size=20))
def test_module_seeds_are_stable_and_one_per_shard_rank(base: int, fqn: str) -> None:
    assert S.module_seed(base, fqn) == S.module_seed(base, fqn)
    per_rank = {S.module_seed(base, fqn, rank) for rank in range(10)}
    assert len(per_rank) == 10 and all(0 <= s < 2**63 - 1 for s in per_rank)


def test_work_is_shared_only_on_gloo_with_several_ranks() -> None:
    assert S.shares_work("gloo", 2) and S.shares_work("gloo", 64)
    assert not S.shares_work("gloo", 1)
    assert not S.shares_work("nccl", 8)  # accelerators draw random numbers faster than they move


# -- a model with every kind of module materialize treats differently ---------------------------
class Noisy(nn.Module):
    """A buffer drawn at random: computed on every rank in reproducible mode, broadcast from
    shard rank 0 in non-reproducible mode."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(7, 3))
        self.register_buffer("noise", torch.empty(5))

    def reset_parameters(self) -> None:
        nn.init.normal_(self.weight)
        self.noise.normal_()


class Parent(nn.Module):
    """Not a leaf: its init also writes its child's bias, so it is computed on every rank."""

    def __init__(self) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.empty(4, 2))
        self.child = nn.Linear(2, 4)

    def reset_parameters(self) -> None:
        nn.init.uniform_(self.scale)
        nn.init.constant_(self.child.bias, 0.25)


class Rotation(nn.Module):
    """An init that is not row-local (a QR of the whole matrix): computed in full, on one rank
    where the ranks share the work."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(9, 4))

    def reset_parameters(self) -> None:
        nn.init.orthogonal_(self.weight)


class RankDependent(nn.Module):
    """An init that is row-local on the first rank only (it must not be)."""

    def __init__(self, buffered: bool) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(6, 3))
        if buffered:  # then not shared out: computed on every rank (no exchange to hang in)
            self.register_buffer("steps", torch.zeros(2))

    def reset_parameters(self) -> None:
        if dist.get_rank() == 0:
            nn.init.normal_(self.weight)
        else:
            nn.init.orthogonal_(self.weight)
        if hasattr(self, "steps"):
            self.steps.zero_()


class Broken(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(6, 2))

    def reset_parameters(self) -> None:
        raise ValueError("no luck")


class HalfLinear(nn.Linear):
    """bfloat16: its own FSDP unit (FSDP2 wants one dtype per unit)."""

    def __init__(self) -> None:
        super().__init__(6, 10, dtype=torch.bfloat16)


class Mixed(nn.Module):
    def __init__(self, broken: bool = False) -> None:
        super().__init__()
        self.emb = nn.Embedding(37, 6)
        self.odd = nn.Linear(6, 131)  # rows that do not divide by 2 or 3
        self.one = nn.Linear(6, 1)  # fewer rows than ranks
        self.low = HalfLinear()  # (not "half": a Module method)
        self.empty = nn.Linear(6, 0)  # no rows (FSDP2 cannot gather a 0-column shard)
        self.frozen = nn.Linear(6, 6).requires_grad_(False)
        self.norm = nn.LayerNorm(6)
        self.noisy = Noisy()
        self.parent = Parent()
        self.rotation = Rotation()
        self.head = nn.Linear(6, 37, bias=False)
        self.head.weight = self.emb.weight  # tied: the embedding's init wins
        if broken:
            self.broken = Broken()


def meta_mixed(broken: bool = False) -> Mixed:
    with torch.device("meta"):
        return Mixed(broken)


def _prepare(model: nn.Module, **kw: Any) -> tuple[fprep.PrepState, nn.Module]:
    # (a wrap class the model does not have is refused: wrap HalfLinear where there is one)
    wrap = HalfLinear if any(isinstance(m, HalfLinear) for m in model.modules()) else None
    cfg = fprep.PrepConfig(strategy="fsdp", wrap=wrap, seed=SEED, **kw)
    return fprep.prepare(model, cfg)


@contextlib.contextmanager
def _counting_inits() -> Iterator[dict[str, int]]:
    """Count ``reset_parameters`` calls per class on this rank (a rank process only)."""
    calls: dict[str, int] = {}
    classes = (nn.Linear, nn.Embedding, nn.LayerNorm, Noisy, Parent, Rotation)
    saved = {cls: cls.reset_parameters for cls in classes}

    def counted(cls: type[nn.Module]) -> Any:
        def reset(module: nn.Module) -> None:
            calls[cls.__name__] = calls.get(cls.__name__, 0) + 1
            saved[cls](module)  # type: ignore[operator]

        return reset

    for cls in classes:
        cls.reset_parameters = counted(cls)  # type: ignore[method-assign]
    try:
        yield calls
    finally:
        for cls, reset in saved.items():
            cls.reset_parameters = reset  # type: ignore[method-assign]


def _full(model: nn.Module) -> bytes:
    return W.dump(W.full_params(model))


@contextlib.contextmanager
def _full_computation_only() -> Iterator[None]:
    """No row-local init: every module computed in full (the path of inits that are not)."""
    M.ROW_LOCAL = False
    try:
        yield
    finally:
        M.ROW_LOCAL = True


def materialize_facts() -> dict[str, Any]:
    """Everything the multi-rank tests check, from one spawn per world size."""
    import warnings

    warnings.filterwarnings("ignore", message="DTensor random operators")
    out: dict[str, Any] = {}
    rng = torch.get_rng_state()
    # reproducible, ranks sharing the work (gloo's rule), with init calls counted
    model = meta_mixed()
    with _counting_inits() as calls:
        state, model = _prepare(model)
    out["shared"] = _full(model)
    out["calls"] = calls
    out["rng_restored"] = torch.equal(rng, torch.get_rng_state())
    out["tied"] = model.head.weight is model.emb.weight
    out["shapes"] = W.plan_vs_reality(state, model)[1]
    # reproducible, every rank computing everything (the rule on other backends)
    with W.every_rank_computes_everything():
        _, model = _prepare(meta_mixed())
    out["full"] = _full(model)
    # reproducible without the row-local path: the full computation, shared and not
    model = meta_mixed()
    with _full_computation_only(), _counting_inits() as calls:
        _, model = _prepare(model)
    out["computed"], out["computed_calls"] = _full(model), calls
    with _full_computation_only(), W.every_rank_computes_everything():
        _, model = _prepare(meta_mixed())
    out["computed_full"] = _full(model)
    # non-reproducible: this rank's shards, twice, whatever the global RNG did in between
    runs = []
    for _ in range(2):
        rng = torch.get_rng_state()
        _, model = _prepare(meta_mixed(), reproducible_init=False)
        out["fast_rng_restored"] = torch.equal(rng, torch.get_rng_state())
        runs.append(W.dump(W.local_shards(model)))
        out["fast_noise"] = W.dump({"noise": model.noisy.noise})
        out["fast_tied"] = model.head.weight is model.emb.weight
        torch.rand(100)  # move the global RNG on: the result must not depend on it
    out["fast"] = runs
    # a module whose init fails on the one rank that computes it fails every rank
    try:
        _prepare(meta_mixed(broken=True))
        out["broken"] = None
    except PrepareError as e:
        out["broken"] = (e.subject, str(e))
    # an init that is row-local on some ranks only: refused on every rank, shared or not
    for buffered in (False, True):
        with torch.device("meta"):
            model = nn.Sequential(nn.Linear(3, 6), RankDependent(buffered))
        try:
            _prepare(model)
            out[f"rank_dependent_{buffered}"] = None
        except PrepareError as e:
            out[f"rank_dependent_{buffered}"] = (e.subject, str(e))
    # rank 0 built real weights, the others meta tensors, and no sync_module_states
    model = Mixed() if W.rank_world()[0] == 0 else meta_mixed()
    try:
        _prepare(model)
        out["mismatch"] = None
    except PrepareError as e:
        out["mismatch"] = (e.subject, str(e))
    # seed=None and ranks that never seeded alike: they agree on the first rank's seed
    rank = W.rank_world()[0]
    torch.manual_seed(UNSEEDED + rank)
    _, model = fprep.prepare(meta_mixed(), fprep.PrepConfig(strategy="fsdp", wrap=HalfLinear))
    out["unseeded"] = _full(model)
    return out


@pytest.fixture(scope="module")
def facts() -> dict[int, list[dict[str, Any]]]:
    return {world: run_ranks(materialize_facts, world, timeout_s=TIMEOUT_S) for world in (2, 3)}


UNSEEDED = 1000  # rank r seeds its global RNG with UNSEEDED + r


@pytest.fixture(scope="module")
def one_rank() -> dict[str, W.Params]:
    _, rows = _prepare(meta_mixed())
    with _full_computation_only():
        _, computed = _prepare(meta_mixed())
    return {"rows": W.full_params(rows), "computed": W.full_params(computed)}


@pytest.mark.slow
@needs_gloo
def test_full_parameters_are_bitwise_the_same_for_1_2_and_3_ranks(
    facts: dict[int, list[dict[str, Any]]], one_rank: dict[str, W.Params]
) -> None:
    modes = {"shared": "rows", "full": "rows", "computed": "computed", "computed_full": "computed"}
    for world, ranks in facts.items():
        for mode, way in modes.items():
            params, expected = W.load(ranks[0][mode]), one_rank[way]
            assert sorted(params) == sorted(expected)
            for name, tensor in expected.items():
                assert torch.equal(params[name], tensor), f"{mode}, {world} ranks: {name}"
        for rank in ranks:
            assert rank["rng_restored"] and rank["tied"] and rank["shapes"] == []
    for params in one_rank.values():
        # the tied head kept the embedding's init, and the child's init came after its parent's
        assert torch.equal(params["head.weight"], params["emb.weight"])
        assert not torch.all(params["parent.child.bias"] == 0.25)
        # the init that is not row-local ran for real: orthonormal columns
        q = params["rotation.weight"]
        assert torch.allclose(q.T @ q, torch.eye(4), atol=1e-5)
    # the two ways draw different numbers (a module always goes the same way, whatever the world)
    assert not torch.equal(one_rank["rows"]["odd.weight"], one_rank["computed"]["odd.weight"])


@pytest.mark.slow
@needs_gloo
def test_without_a_seed_every_rank_uses_the_first_ranks(
    facts: dict[int, list[dict[str, Any]]],
) -> None:
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(UNSEEDED)  # rank 0's
        _, model = fprep.prepare(meta_mixed(), fprep.PrepConfig(strategy="fsdp", wrap=HalfLinear))
    expected = W.full_params(model)
    for world, ranks in facts.items():
        params = W.load(ranks[0]["unseeded"])
        for name, tensor in expected.items():
            assert torch.equal(params[name], tensor), f"{world} ranks: {name}"


@pytest.mark.slow
@needs_gloo
def test_row_local_inits_run_on_every_rank_and_the_others_are_shared(
    facts: dict[int, list[dict[str, Any]]],
) -> None:
    """Row-local inits run once on every rank (each drawing its own rows); an init that is not
    (the rotation) is tried on every rank, then computed in full on one; the tied head, whose
    init would be thrown away, nowhere."""
    for world, ranks in facts.items():
        for calls in (rank["calls"] for rank in ranks):
            # Linear: odd, one, low, empty, frozen, parent.child (not head: tied to emb)
            assert {k: calls[k] for k in ("Linear", "Embedding", "LayerNorm")} == {
                "Linear": 6,
                "Embedding": 1,
                "LayerNorm": 1,
            }
            assert calls["Noisy"] == calls["Parent"] == 1
        rotations = sorted(rank["calls"]["Rotation"] for rank in ranks)
        assert rotations == [1] * (world - 1) + [2], world


@pytest.mark.slow
@needs_gloo
def test_the_full_computation_is_shared_out(facts: dict[int, list[dict[str, Any]]]) -> None:
    """Without the row-local path, shareable modules are computed once across the ranks; the
    others on every rank."""
    for world, ranks in facts.items():
        calls = [rank["computed_calls"] for rank in ranks]
        names = ("Linear", "Embedding", "LayerNorm", "Rotation")
        total = {name: sum(c.get(name, 0) for c in calls) for name in names}
        assert total == {"Linear": 6, "Embedding": 1, "LayerNorm": 1, "Rotation": 1}, world
        assert all(c.get("Linear", 0) < 6 for c in calls)  # nobody computed them all
        for name in ("Noisy", "Parent"):
            assert [c[name] for c in calls] == [1] * world, name


@pytest.mark.slow
@needs_gloo
def test_a_failing_init_fails_every_rank(facts: dict[int, list[dict[str, Any]]]) -> None:
    for ranks in facts.values():
        errors = [rank["broken"] for rank in ranks]
        assert all(e is not None for e in errors)
        culprits = [e for e in errors if e[0] == "broken"]
        assert len(culprits) == 1 and "no luck" in culprits[0][1]  # the rank that computed it
        others = [e for e in errors if e[0] != "broken"]
        assert all("failed on shard rank" in e[1] for e in others)


@pytest.mark.slow
@needs_gloo
def test_ranks_whose_inits_go_different_ways_are_refused(
    facts: dict[int, list[dict[str, Any]]],
) -> None:
    """Row-local on rank 0, not on the others: whether the module is shared out (checked before
    any rows move) or computed on every rank (checked at the end), every rank refuses instead
    of waiting for rows or keeping rows of two different draws."""
    for ranks in facts.values():
        for rank in ranks:
            for buffered in (False, True):
                refusal = rank[f"rank_dependent_{buffered}"]
                assert refusal is not None, buffered
                subject, message = refusal
                assert subject == "materialize" and "full parameters computed" in message


@pytest.mark.slow
@needs_gloo
def test_ranks_that_built_different_models_are_refused(
    facts: dict[int, list[dict[str, Any]]],
) -> None:
    """Rank 0 real, the others on the meta device, without sync_module_states: an error on
    every rank, not ranks waiting for each other (or training from different weights)."""
    for ranks in facts.values():
        for rank in ranks:
            assert rank["mismatch"] is not None
            subject, message = rank["mismatch"]
            assert subject == "materialize" and "disagree" in message


@pytest.mark.slow
@needs_gloo
def test_non_reproducible_shards_differ_across_ranks_and_repeat(
    facts: dict[int, list[dict[str, Any]]],
) -> None:
    for world, ranks in facts.items():
        for rank in ranks:
            first, second = (W.load(run) for run in rank["fast"])
            for name, tensor in first.items():
                assert torch.equal(tensor, second[name]), f"{world} ranks: {name} not repeated"
            assert rank["fast_rng_restored"] and rank["fast_tied"]
        # every shard rank drew its own numbers ...
        shards = [W.load(rank["fast"][0])["odd.weight"] for rank in ranks]
        rows = min(s.shape[0] for s in shards)
        for a in range(world):
            for b in range(a + 1, world):
                assert not torch.equal(shards[a][:rows], shards[b][:rows])
        # ... but buffers, replicated, agree
        noise = [W.load(rank["fast_noise"])["noise"] for rank in ranks]
        assert all(torch.equal(n, noise[0]) for n in noise)


def test_a_failing_init_leaves_the_module_its_own_parameters() -> None:
    model = nn.Linear(3, 2)
    original = dict(model._parameters)
    job = J.Job(
        fqn="",
        module=model,
        stand_ins=(
            J.StandIn(
                name="weight",
                original=model.weight,
                shape=model.weight.shape,
                dtype=model.weight.dtype,
                device=model.weight.device,
                spec=None,
            ),
        ),
        seed=1,
        skip=False,
        shareable=False,
        broadcast_buffers=False,
    )

    def boom(module: nn.Module) -> None:
        assert module.weight is not original["weight"]  # a stand-in, during the init
        raise RuntimeError("boom")

    with pytest.raises(RuntimeError, match="boom"):
        J.compute(job, boom, J.Scratch([job]), torch.device("cpu"))
    assert model._parameters == original


def test_scratch_views_do_not_overlap_and_are_reused() -> None:
    def stand_in(name: str, shape: tuple[int, ...], dtype: torch.dtype) -> Any:
        p = nn.Parameter(torch.empty(0))
        return J.StandIn(
            name=name, original=p, shape=torch.Size(shape), dtype=dtype, device=p.device, spec=None
        )

    def job(*stand_ins: Any) -> Any:
        return J.Job(
            fqn="",
            module=nn.Module(),
            stand_ins=stand_ins,
            seed=0,
            skip=False,
            shareable=False,
            broadcast_buffers=False,
        )

    a = job(stand_in("w", (33, 7), torch.float32), stand_in("b", (5,), torch.bfloat16))
    b = job(stand_in("w", (3, 3), torch.float64))
    scratch = J.Scratch([a, b])
    views = scratch.views(a.stand_ins)
    views["w"].fill_(1.0)
    views["b"].fill_(2.0)
    assert views["w"].shape == (33, 7) and views["b"].dtype == torch.bfloat16
    assert torch.all(views["w"] == 1.0) and torch.all(views["b"] == 2.0)  # no overlap
    again = scratch.views(b.stand_ins)
    assert again["w"].untyped_storage().data_ptr() == views["w"].untyped_storage().data_ptr()


def test_the_global_rng_and_cuda_seed_queue_are_left_alone() -> None:
    """On a CPU only the CPU generator is seeded, and restored: ``torch.manual_seed`` would
    also queue a reseed of every CUDA device per module."""
    queued = getattr(torch.cuda, "_queued_calls", None)
    before = len(queued) if queued is not None else 0
    rng = torch.get_rng_state()
    _prepare(meta_mixed())
    assert torch.equal(rng, torch.get_rng_state())
    if queued is not None:
        assert len(queued) == before
