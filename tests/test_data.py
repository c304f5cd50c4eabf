"""Distributed data loading: each rank its share, even batches, seeded shuffle, resume."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from torch.utils.data import DataLoader, Dataset, IterableDataset, TensorDataset

import fprep
from fprep.data import (
    LoaderSpec,
    PreparedDataLoader,
    ShardedIterable,
    padded_count,
    prepare_data_loader,
    rank_indices,
)

specs = st.builds(
    lambda world, bs, shuffle, seed, even, drop: [
        LoaderSpec(
            rank=r,
            world=world,
            batch_size=bs,
            shuffle=shuffle,
            seed=seed,
            even_batches=even,
            drop_last=drop,
        )
        for r in range(world)
    ],
    st.integers(1, 8),
    st.integers(1, 5),
    st.booleans(),
    st.integers(0, 1000),
    st.booleans(),
    st.booleans(),
)


@given(st.integers(0, 60), specs, st.integers(0, 3))
def test_ranks_cover_the_dataset(n: int, ranks: list[LoaderSpec], epoch: int) -> None:
    parts = [rank_indices(n, spec, epoch) for spec in ranks]
    seen = [i for part in parts for i in part]
    spec = ranks[0]
    if spec.drop_last:
        kept = (n // (spec.world * spec.batch_size)) * spec.world * spec.batch_size
        assert len(seen) == kept == len(set(seen))
        assert len({len(p) for p in parts}) <= 1
        return
    assert set(seen) == set(range(n))  # the union of all ranks' samples is the dataset
    if spec.even_batches:
        assert len({len(p) for p in parts}) <= 1  # equal batch counts
        assert len(seen) - n == padded_count(n, spec)  # only the padding repeats
    else:
        assert sorted(seen) == list(range(n))  # nothing repeated


@given(st.integers(1, 40), specs)
def test_shuffle_is_seeded_and_changes_with_the_epoch(n: int, ranks: list[LoaderSpec]) -> None:
    spec = ranks[0]
    assert rank_indices(n, spec, 1) == rank_indices(n, spec, 1)
    if spec.shuffle and n > 8 and not spec.drop_last:
        orders = {tuple(rank_indices(n, spec, e)) for e in range(4)}
        assert len(orders) > 1


def _cpu_state(world: int = 1, rank: int = 0, strategy: str = "auto") -> fprep.PrepState:
    topo = fprep.Topology(world_size=world, rank=rank)
    return fprep.plan(torch.nn.Linear(2, 2), fprep.PrepConfig(strategy=strategy), topo).unwrap()  # type: ignore[arg-type]


def _loader(n: int = 10, **kwargs: object) -> DataLoader[tuple[torch.Tensor, ...]]:
    return DataLoader(TensorDataset(torch.arange(n)), **kwargs)  # type: ignore[arg-type]


def _epoch(loader: PreparedDataLoader) -> list[int]:
    return [int(v) for (batch,) in loader for v in batch]


@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("even", [True, False])
def test_prepared_loaders_partition_an_epoch(world: int, even: bool) -> None:
    loaders = [
        prepare_data_loader(
            _cpu_state(world, r, "ddp"), _loader(10, batch_size=2), even_batches=even
        )
        for r in range(world)
    ]
    epochs = [_epoch(ld) for ld in loaders]
    assert set().union(*epochs) == set(range(10))
    if even:
        assert len({len(e) for e in epochs}) == 1
        assert sum(len(e) for e in epochs) - 10 == loaders[0].remainder
    else:
        assert sorted(i for e in epochs for i in e) == list(range(10))


def test_split_batches_divides_the_global_batch() -> None:
    ld = prepare_data_loader(_cpu_state(2, 1, "ddp"), _loader(8, batch_size=4), split_batches=True)
    assert [len(b) for (b,) in ld] == [2, 2]
    with pytest.raises(fprep.ConfigError) as info:
        prepare_data_loader(_cpu_state(2, 0, "ddp"), _loader(8, batch_size=3), split_batches=True)
    assert info.value.subject == "data_loader.batch_size"


def test_epoch_advances_and_shuffle_is_deterministic() -> None:
    state = _cpu_state()
    a = prepare_data_loader(state, _loader(20, batch_size=4, shuffle=True), seed=3)
    b = prepare_data_loader(state, _loader(20, batch_size=4, shuffle=True), seed=3)
    first, second = _epoch(a), _epoch(a)
    assert first != second and sorted(first) == sorted(second) == list(range(20))
    assert a.epoch == 2
    assert _epoch(b) == first  # same seed, same first epoch


def test_resume_skips_batches_without_reading_them() -> None:
    reads: list[int] = []

    class Counting(TensorDataset):
        def __getitem__(self, i: int) -> tuple[torch.Tensor, ...]:
            reads.append(i)
            return super().__getitem__(i)

    state = _cpu_state()
    ld = prepare_data_loader(
        state, DataLoader(Counting(torch.arange(12)), batch_size=3, shuffle=True)
    )
    full = [b.tolist() for (b,) in ld]  # epoch 0
    it = iter(ld)
    next(it)
    position = ld.state_dict()
    assert position == {"epoch": 1, "batches": 1}
    fresh = prepare_data_loader(
        state, DataLoader(Counting(torch.arange(12)), batch_size=3, shuffle=True)
    )
    fresh.load_state_dict(position)
    reads.clear()
    rest = [b.tolist() for (b,) in fresh]
    assert len(reads) == 9  # three batches read, the first one skipped
    expected = list(iter(prepare_data_loader(state, _loader(12, batch_size=3, shuffle=True))))
    del full, expected
    again = prepare_data_loader(state, _loader(12, batch_size=3, shuffle=True))
    again.set_epoch(1)
    assert rest == [b.tolist() for (b,) in again][1:]


def test_workers_and_device_placement() -> None:
    state = _cpu_state(2, 0, "ddp")
    ld = prepare_data_loader(state, _loader(9, batch_size=2, num_workers=2))
    values = _epoch(ld)
    assert set(values) == set(rank_indices(9, ld.spec, 0))
    batch = next(iter(ld))
    assert batch[0].device == torch.device("cpu")


class WorkerSeeds(Dataset[int]):
    """Each item is the torch seed of the worker that loaded it."""

    def __len__(self) -> int:
        return 16  # 4 batches of 2 per rank at world 2

    def __getitem__(self, i: int) -> int:
        return torch.initial_seed()


def test_a_pass_never_draws_from_the_global_rng_and_worker_seeds_depend_on_the_epoch() -> None:
    state = _cpu_state(2, 1, "ddp")
    ld = prepare_data_loader(state, DataLoader(WorkerSeeds(), batch_size=2, num_workers=2))
    torch.manual_seed(0)
    expected = torch.rand(3)
    torch.manual_seed(0)
    first = [int(v) for batch in ld for v in batch]
    second = [int(v) for batch in ld for v in batch]
    assert torch.equal(torch.rand(3), expected)  # two passes with workers: global RNG untouched
    assert len(set(first)) == 2 and set(first).isdisjoint(second)  # per worker, per epoch

    again = prepare_data_loader(state, DataLoader(WorkerSeeds(), batch_size=2, num_workers=2))
    again.load_state_dict({"epoch": 1, "batches": 1})  # resume epoch 1 after its first batch
    resumed = [int(v) for batch in again for v in batch]
    assert len(resumed) == 6 and set(resumed) == set(second)  # the same workers' seeds
    other_rank = prepare_data_loader(
        _cpu_state(2, 0, "ddp"), DataLoader(WorkerSeeds(), batch_size=2, num_workers=2)
    )
    assert set(first).isdisjoint(int(v) for batch in other_rank for v in batch)


class Stream(IterableDataset[int]):
    def __init__(self, n: int) -> None:
        self.n = n

    def __iter__(self) -> Iterator[int]:
        return iter(range(self.n))


@pytest.mark.parametrize("even", [True, False])
def test_iterable_datasets_are_sharded(even: bool) -> None:
    world, n = 3, 20
    parts = []
    for r in range(world):
        spec = LoaderSpec(rank=r, world=world, batch_size=2, even_batches=even)
        parts.append(list(ShardedIterable(Stream(n), spec)))
    assert set().union(*map(set, parts)) == set(range(n))
    if even:
        assert len({len(p) for p in parts}) == 1
    else:
        assert sorted(i for p in parts for i in p) == list(range(n))


def test_iterable_with_workers_reads_each_item_once() -> None:
    state = _cpu_state(2, 1, "ddp")
    ld = prepare_data_loader(
        state, DataLoader(Stream(16), batch_size=2, num_workers=2), even_batches=False
    )
    got = sorted(int(v) for batch in ld for v in batch)
    assert got == sorted(i for i in range(16) if (i // 2) % 2 == 1)


def test_two_prepared_loaders_coexist() -> None:
    state = _cpu_state(2, 0, "ddp")
    a = prepare_data_loader(state, _loader(10, batch_size=2), even_batches=True)
    b = prepare_data_loader(state, _loader(10, batch_size=5), even_batches=False, seed=7)
    assert _epoch(a) == [0, 2, 4, 6, 8] and _epoch(b) == [0, 2, 4, 6, 8]
    assert a.spec != b.spec and a.epoch == b.epoch == 1


def test_refuses_unshardable_loaders() -> None:
    state = _cpu_state()
    with pytest.raises(fprep.ConfigError):
        prepare_data_loader(state, _loader(4, batch_size=None))
    ld = prepare_data_loader(state, _loader(4, batch_size=2))
    with pytest.raises(fprep.ConfigError):
        prepare_data_loader(state, ld)
