"""Distributed data loading: each rank its share, batches on the device, resumable.

``rank_indices`` is the pure core: which dataset indices a rank reads in an epoch, from the
dataset length, the topology and the loader settings alone (property-tested: the union over all
ranks is the dataset). ``prepare_data_loader`` builds a ``PreparedDataLoader`` — a real
``DataLoader`` subclass — around it, or shards an iterable dataset by position.

* ``even_batches`` (default on): every rank gets the same number of batches; the last ones are
  filled by wrapping around to the start of the epoch's order. ``gather_for_metrics`` drops
  those duplicates again. Off: ranks may differ by one batch and nothing is repeated.
* ``split_batches``: the loader's batch size is the global batch, split across ranks (it must
  divide); otherwise each rank gets batches of the loader's batch size.
* Shuffling is seeded from ``seed + epoch``; the epoch advances by itself at each new pass.
* Resume: ``load_state_dict({"epoch": e, "batches": k})`` makes the next pass start at batch
  ``k`` of epoch ``e``: a map-style dataset without reading the skipped samples, an iterable
  one by reading and dropping the items of the first ``k`` batches (it cannot seek) — they
  are never collated, placed on the device or yielded.
* The loader has its own generator, reseeded from ``(seed, epoch, rank)`` at each pass: starting
  a pass never draws from the global RNG (torch's DataLoader otherwise takes the workers' base
  seed from it, so a training loop's dropout would depend on how many passes began), and the
  workers' seeds depend only on ``(seed, epoch, rank)``, so a resumed pass uses the same ones.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils.data import DataLoader, IterableDataset, Sampler, get_worker_info

from fprep.errors import ConfigError
from fprep.state import PrepState, need


@dataclass(frozen=True, kw_only=True)
class LoaderSpec:
    """How one rank reads a dataset; plain data."""

    rank: int
    world: int
    batch_size: int  # per rank
    shuffle: bool = False
    seed: int = 0
    even_batches: bool = True
    drop_last: bool = False


def epoch_order(n: int, *, shuffle: bool, seed: int, epoch: int) -> list[int]:
    """The global order of an epoch: identical on every rank."""
    if not shuffle:
        return list(range(n))
    gen = torch.Generator().manual_seed(seed + epoch)
    order: list[int] = torch.randperm(n, generator=gen).tolist()
    return order


def pass_seed(spec: LoaderSpec, epoch: int) -> int:
    """The seed of the loader's own generator for one pass (workers' base seed comes from it)."""
    return (spec.seed * 1_000_003 + epoch) * 65_537 + spec.rank


def rank_indices(n: int, spec: LoaderSpec, epoch: int = 0) -> list[int]:
    """Indices rank ``spec.rank`` reads in ``epoch``, in order (interleaved across ranks)."""
    order = epoch_order(n, shuffle=spec.shuffle, seed=spec.seed, epoch=epoch)
    world, bs = spec.world, spec.batch_size
    if spec.drop_last:
        order = order[: (n // (world * bs)) * world * bs]
    elif spec.even_batches and order and len(order) % world:
        pad = world - len(order) % world
        order = order + (order * (pad // len(order) + 1))[:pad]
    return order[spec.rank :: world]


def rank_count(n: int, spec: LoaderSpec) -> int:
    """``len(rank_indices(n, spec, epoch))`` for any epoch, by arithmetic (no permutation)."""
    world, rank = spec.world, spec.rank
    if spec.drop_last:
        return (n // (world * spec.batch_size)) * spec.batch_size
    if spec.even_batches and n:
        return -(-n // world)
    return max(0, -(-(n - rank) // world))


def padded_count(n: int, spec: LoaderSpec) -> int:
    """How many samples even batches repeat in an epoch (0 when off or already even)."""
    if spec.drop_last or not spec.even_batches or n == 0 or n % spec.world == 0:
        return 0
    return spec.world - n % spec.world


class ShardedSampler(Sampler[int]):
    """Yields ``rank_indices`` for the current epoch, optionally skipping whole batches."""

    def __init__(self, n: int, spec: LoaderSpec) -> None:
        self.n = n
        self.spec = spec
        self.epoch = 0
        self.skip_batches = 0

    def __iter__(self) -> Iterator[int]:
        indices = rank_indices(self.n, self.spec, self.epoch)
        return iter(indices[self.skip_batches * self.spec.batch_size :])

    def __len__(self) -> int:  # called per len(loader): no O(n) permutation here
        total = rank_count(self.n, self.spec)
        return max(0, total - self.skip_batches * self.spec.batch_size)


class ShardedIterable(IterableDataset[Any]):
    """An iterable dataset's share for one rank: of each run of ``world * batch_size`` items,
    rank ``r`` takes items ``[r*bs, (r+1)*bs)``. Workers of a loader take alternate runs.

    The last, incomplete run is filled by wrapping around to the first items when
    ``even_batches`` is on, split as it is when off, and dropped with ``drop_last``.

    Run ``j`` is this rank's batch ``j``, so resuming at batch ``k`` (``skip_runs = k``) reads
    and drops the first ``k`` runs' items — an iterable cannot seek — without collating,
    placing or yielding them; the runs after them go to the workers in turn from the first, as
    the loader asks for them. ``skip_runs`` holds for one pass: ``iter`` takes it and resets it
    (in a worker, its own copy's), so the next pass starts at the beginning.
    """

    def __init__(self, dataset: IterableDataset[Any], spec: LoaderSpec) -> None:
        self.dataset = dataset
        self.spec = spec
        self.skip_runs = 0

    def __iter__(self) -> Iterator[Any]:
        skip, self.skip_runs = self.skip_runs, 0  # taken now: the generator below starts late
        return self._items(skip)

    def _items(self, skip: int) -> Iterator[Any]:
        spec = self.spec
        run_len = spec.world * spec.batch_size
        lo, hi = spec.rank * spec.batch_size, (spec.rank + 1) * spec.batch_size
        info = get_worker_info()
        workers, worker = (info.num_workers, info.id) if info is not None else (1, 0)
        first: list[Any] = []
        run: list[Any] = []
        runs = 0
        for item in self.dataset:
            if len(first) < run_len:
                first.append(item)
            run.append(item)
            if len(run) == run_len:
                if runs >= skip and (runs - skip) % workers == worker:
                    yield from run[lo:hi]
                run, runs = [], runs + 1
        if not run or spec.drop_last or runs < skip or (runs - skip) % workers != worker:
            return
        if spec.even_batches:
            run = run + (first * (run_len // max(len(first), 1) + 1))[: run_len - len(run)]
        yield from run[lo:hi]


def to_device(batch: Any, device: torch.device, non_blocking: bool = False) -> Any:
    """Move every tensor of a (nested) batch to ``device``, keeping the containers.

    Runs once per batch, so the common shapes (tensors already in place, plain lists, tuples
    and dicts) are checked first, before the abstract-base-class checks.
    """
    kind = type(batch)
    if kind is torch.Tensor or isinstance(batch, torch.Tensor):
        if batch.device == device:  # Tensor.to would return it too, at ~4x the cost
            return batch
        return batch.to(device, non_blocking=non_blocking)
    if kind is list or kind is tuple:
        return kind(to_device(v, device, non_blocking) for v in batch)
    if kind is dict:
        return {k: to_device(v, device, non_blocking) for k, v in batch.items()}
    if isinstance(batch, Mapping):
        return type(batch)(  # type: ignore[call-arg]
            {k: to_device(v, device, non_blocking) for k, v in batch.items()}
        )
    if isinstance(batch, tuple) and hasattr(batch, "_fields"):
        return type(batch)(*(to_device(v, device, non_blocking) for v in batch))
    if isinstance(batch, Sequence) and not isinstance(batch, str | bytes):
        return type(batch)(to_device(v, device, non_blocking) for v in batch)  # type: ignore[call-arg]
    if dataclasses.is_dataclass(batch) and not isinstance(batch, type):
        return dataclasses.replace(
            batch,
            **{
                f.name: to_device(getattr(batch, f.name), device, non_blocking)
                for f in dataclasses.fields(batch)
                if f.init
            },
        )
    return batch


def data_parallel_position(
    state: PrepState, needed_by: str = "fprep.process_index"
) -> tuple[int, int]:
    """This rank's data-parallel index and the number of data-parallel ranks, read from the
    mesh record (``dp_rank``, ``dp_size``): ranks that differ only in their tensor- or
    pipeline-parallel coordinate get the same index, so they read the same batch. ``(0, 1)``
    without data parallelism (``CoreState.is_distributed``: the strategy is ``"none"``)."""
    pg = need(state.process_group, "init_process_group", needed_by)
    if state.core is None or not state.core.is_distributed:
        return 0, 1
    return pg.mesh.dp_rank, pg.mesh.dp_size


class PreparedDataLoader(DataLoader[Any]):
    """A ``DataLoader`` that reads this rank's share, places batches, and can resume."""

    def __init__(
        self,
        *args: Any,
        fprep_spec: LoaderSpec,
        fprep_device: torch.device | None,
        fprep_dataset_len: int | None,
        **kwargs: Any,
    ) -> None:
        kwargs["generator"] = torch.Generator()  # never the global RNG (see module docs)
        super().__init__(*args, **kwargs)
        self.spec = fprep_spec
        self.device = fprep_device
        self.dataset_len = fprep_dataset_len
        self.epoch = 0  # the epoch the next pass reads
        self.batches = 0  # batches yielded so far in the current epoch
        self._resume_at = 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch, self.batches, self._resume_at = epoch, 0, 0

    def __iter__(self) -> Iterator[Any]:  # type: ignore[override]
        sampler = self.sampler
        if isinstance(sampler, ShardedSampler):
            sampler.epoch = self.epoch
            sampler.skip_batches = self._resume_at
        elif isinstance(self.dataset, ShardedIterable):
            self.dataset.skip_runs = self._resume_at  # taken by this pass's iter(dataset)
        self.batches = self._resume_at
        self._resume_at = 0
        assert self.generator is not None
        self.generator.manual_seed(pass_seed(self.spec, self.epoch))
        non_blocking = bool(self.pin_memory)
        batches = super().__iter__()  # starts the workers, with their copy of the dataset
        if isinstance(self.dataset, ShardedIterable):
            self.dataset.skip_runs = 0  # taken (or copied to the workers): this pass only
        for batch in batches:
            self.batches += 1
            yield batch if self.device is None else to_device(batch, self.device, non_blocking)
        self.epoch += 1
        self.batches = 0

    def state_dict(self) -> dict[str, int]:
        """Position: the epoch being read and how many of its batches were consumed."""
        return {"epoch": self.epoch, "batches": self.batches}

    def load_state_dict(self, state: Mapping[str, int]) -> None:
        """Start the next pass at batch ``state["batches"]`` of epoch ``state["epoch"]``."""
        self.epoch = int(state["epoch"])
        self._resume_at = int(state["batches"])
        self.batches = self._resume_at
        if isinstance(self.dataset, ShardedIterable) and self.persistent_workers:
            # Persistent workers iterate their own copy of the dataset, made when they started:
            # drop them (DataLoader's own handle), so the next pass starts workers that skip.
            self._iterator = None

    @property
    def remainder(self) -> int:
        """Samples repeated by even batches in an epoch (dropped by ``gather_for_metrics``)."""
        return 0 if self.dataset_len is None else padded_count(self.dataset_len, self.spec)


def _shuffles(loader: DataLoader[Any]) -> bool:
    """Whether the loader shuffles; a sampler fprep cannot reproduce per rank is refused.

    fprep replaces the sampler by its own (each rank its share of a sequential or seeded-shuffled
    order): any other sampler would be silently dropped, weights and all.
    """
    from torch.utils.data import RandomSampler, SequentialSampler

    sampler = loader.sampler
    if isinstance(loader.dataset, IterableDataset) or type(sampler) is SequentialSampler:
        return False
    if (
        type(sampler) is RandomSampler
        and not sampler.replacement
        and sampler.num_samples == len(sampler.data_source)  # a permutation of all of it
    ):
        return True
    raise ConfigError(
        f"data loaders with a {type(sampler).__name__} cannot be sharded by fprep: it reads "
        "each rank's share of a sequential or shuffled order (shuffle=False / True) and would "
        "drop this sampler.",
        subject="data_loader.sampler",
        hint="Use shuffle=True or False (the seed is PrepConfig.seed), or shard the data "
        "yourself (e.g. DistributedSampler) and keep that loader out of prepare.",
    )


def prepare_data_loader(
    state: PrepState,
    loader: DataLoader[Any],
    *,
    even_batches: bool | None = None,
    split_batches: bool | None = None,
    seed: int | None = None,
    device_placement: bool | None = None,
) -> PreparedDataLoader:
    """A new loader over the same dataset that reads this rank's share (see module docs).

    ``even_batches`` / ``split_batches`` default to the PrepConfig fields of the same names.
    """
    if even_batches is None:
        even_batches = state.config.even_batches
    if split_batches is None:
        split_batches = state.config.split_batches
    if isinstance(loader, PreparedDataLoader):
        raise ConfigError(
            "this data loader is already prepared.",
            subject="data_loader",
            hint="Prepare the original DataLoader once.",
        )
    if loader.batch_size is None:
        raise ConfigError(
            "data loaders with batch_size=None (or a custom batch_sampler) cannot be sharded "
            "by fprep.",
            subject="data_loader.batch_size",
            hint="Give the DataLoader a batch_size (and a sampler, not a batch_sampler).",
        )
    device_state = need(state.device, "init_device", "prepare_data_loader")
    rank, world = data_parallel_position(state, "prepare_data_loader")
    batch_size = loader.batch_size
    if split_batches:
        if batch_size % world:
            raise ConfigError(
                f"split_batches needs the batch size {batch_size} to be divisible by the "
                f"number of ranks {world}.",
                subject="data_loader.batch_size",
                hint=f"Use a batch size that is a multiple of {world}, or split_batches=False.",
            )
        batch_size //= world
    shuffle = _shuffles(loader)
    if seed is None:
        seed = state.config.seed if state.config.seed is not None else 0
    spec = LoaderSpec(
        rank=rank,
        world=world,
        batch_size=batch_size,
        shuffle=shuffle,
        seed=seed,
        even_batches=even_batches,
        drop_last=loader.drop_last,
    )
    place = state.config.device_placement if device_placement is None else device_placement
    device = torch.device(device_state.compute_device) if place else None
    dataset: Any = loader.dataset
    common: dict[str, Any] = {
        "batch_size": batch_size,
        "num_workers": loader.num_workers,
        "collate_fn": loader.collate_fn,
        "pin_memory": loader.pin_memory,
        "timeout": loader.timeout,
        "worker_init_fn": loader.worker_init_fn,
        "multiprocessing_context": loader.multiprocessing_context,
        "persistent_workers": loader.persistent_workers,
        "fprep_spec": spec,
        "fprep_device": device,
    }
    if loader.num_workers > 0:
        common["prefetch_factor"] = loader.prefetch_factor
    if isinstance(dataset, IterableDataset):
        return PreparedDataLoader(
            ShardedIterable(dataset, spec), drop_last=False, fprep_dataset_len=None, **common
        )
    n = len(dataset)
    return PreparedDataLoader(
        dataset,
        sampler=ShardedSampler(n, spec),
        drop_last=loader.drop_last,
        fprep_dataset_len=n,
        **common,
    )


__all__ = [
    "LoaderSpec",
    "PreparedDataLoader",
    "ShardedIterable",
    "ShardedSampler",
    "epoch_order",
    "padded_count",
    "prepare_data_loader",
    "rank_count",
    "rank_indices",
    "to_device",
]
