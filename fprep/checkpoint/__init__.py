"""Checkpoints: sharded or full, resharded on load, published atomically, read without pickle.

* ``save`` / ``load``: model and optimizer state through ``torch.distributed.checkpoint`` (each
  rank writes its shards; loading reads each rank's part of any layout, so a checkpoint moves
  between world sizes and strategies), plus scheduler state, data-loader position, per-rank RNG
  states, the step and JSON extras in a JSON manifest.
* ``save(..., wait=False)``: an asynchronous save (``asynchronous``: every tensor copied into
  host memory before it returns, written, read back and checked, and published on a thread);
  returns a ``SaveHandle``.
* ``export_full``: one safetensors file with the full model, streamed one tensor at a time.

Here: ``writing`` (save), ``reading`` (load), ``export``, ``states`` (flat tensor dicts),
``validate``, ``optim_fit``, ``rng``, ``collective``, ``same_path`` (every rank names one
place), ``pipeline`` (the whole model's checkpoint from pipeline stages), ``info``. Three
rooms below:
``format`` (raw tensor bytes and DCP metadata as JSON, the manifest, nested state as JSON, file
digests), ``stores`` (a local root or an fsspec URL: step directories, ``latest``, publishing,
the lock) and ``asynchronous`` (staging, the background thread, verification before publish).
See docs/checkpoints.md.

Each public function runs inside ``fprep.collectives.collective``: called on some ranks only,
or with a rank lost on the way, it raises a ``CollectiveError`` naming the ranks instead of
waiting forever. The functions here import their implementations (and
``torch.distributed.checkpoint``, which takes over half a second) on first use, so
``import fprep`` stays fast.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal, overload

from fprep.checkpoint.info import LoadedInfo
from fprep.collectives import collective as guarded  # (the name `collective` is a submodule)
from fprep.errors import CheckpointError

if TYPE_CHECKING:
    import torch
    from torch import nn

    from fprep.checkpoint.asynchronous.background import SaveHandle
    from fprep.state import PrepState


@overload
def save(
    path: str | os.PathLike[str],
    state: PrepState,
    model: nn.Module,
    *,
    optimizers: Sequence[torch.optim.Optimizer] | torch.optim.Optimizer = (),
    scheduler: Any = None,
    loader: Any = None,
    step: int = 0,
    extras: Any = None,
    keep_last: int | None = None,
    wait: Literal[True] = True,
) -> Path | str: ...


@overload
def save(
    path: str | os.PathLike[str],
    state: PrepState,
    model: nn.Module,
    *,
    optimizers: Sequence[torch.optim.Optimizer] | torch.optim.Optimizer = (),
    scheduler: Any = None,
    loader: Any = None,
    step: int = 0,
    extras: Any = None,
    keep_last: int | None = None,
    wait: Literal[False],
) -> SaveHandle: ...


def save(
    path: str | os.PathLike[str],
    state: PrepState,
    model: nn.Module,
    *,
    optimizers: Sequence[torch.optim.Optimizer] | torch.optim.Optimizer = (),
    scheduler: Any = None,
    loader: Any = None,
    step: int = 0,
    extras: Any = None,
    keep_last: int | None = None,
    wait: bool = True,
) -> Path | str | SaveHandle:
    """Save model, optimizers, scheduler, loader position, RNG states, step and extras.

    Call it on every rank. Returns the published step directory (``path/step-<step>``; a URL
    ``str`` when ``path`` is an fsspec URL, see docs/checkpoints.md "Remote storage"). Raises
    ``CheckpointError`` (on every rank) when anything cannot be saved; the previous checkpoints
    are untouched. See docs/checkpoints.md.

    ``wait=False`` returns a ``SaveHandle`` as soon as every tensor of this rank's state is
    copied into host buffers (reused from save to save): the checkpoint holds the values at
    the call, whatever changes them afterwards. Writing, hashing, reading the files back and
    publishing go on in the background (``handle.wait()`` returns the step directory or raises
    the failure). The next save, a load, or the process's exit wait for it first.
    """
    from fprep.checkpoint.asynchronous import background

    refuse_expert_parallel(state, "fprep.save")
    refuse_packed(state, "fprep.save")
    if not isinstance(wait, bool):
        raise CheckpointError(f"wait must be True or False; got {wait!r}.", subject="wait")
    from fprep.checkpoint.writing import SaveArgs
    from fprep.checkpoint.writing import save as _save

    args = SaveArgs(
        optimizers=optimizers,
        scheduler=scheduler,
        loader=loader,
        step=step,
        extras=extras,
        keep_last=keep_last,
    )
    if not wait:
        with guarded("fprep.save", state.config.timeout_s):  # the foreground part
            return background.start(path, state, model, args)
    background.settle()
    with guarded("fprep.save", state.config.timeout_s):
        return _save(path, state, model, args)


def load(
    path: str | os.PathLike[str],
    state: PrepState,
    model: nn.Module,
    *,
    optimizers: Sequence[torch.optim.Optimizer] | torch.optim.Optimizer = (),
    scheduler: Any = None,
    loader: Any = None,
    strict: bool = True,
    verify_hashes: bool = True,
) -> LoadedInfo:
    """Load a checkpoint saved by ``fprep.save`` (any world size, strategy or state-dict type).

    ``path`` is the root given to ``save`` (its ``latest`` checkpoint is read) or one step
    directory. Call it on every rank. Raises ``CheckpointError`` (on every rank) for anything
    that cannot be loaded safely and exactly; the model and optimizers are then unchanged.
    ``verify_hashes=False`` skips the digests of the tensor files (for storage you trust);
    sizes, structure and metadata are still checked, and nothing is ever unpickled.
    """
    from fprep.checkpoint.asynchronous import background
    from fprep.checkpoint.reading import load as _load

    refuse_expert_parallel(state, "fprep.load")
    refuse_packed(state, "fprep.load")
    background.settle()  # a save in flight is published (or its failure raised) first
    with guarded("fprep.load", state.config.timeout_s):
        return _load(
            path,
            state,
            model,
            optimizers=optimizers,
            scheduler=scheduler,
            loader=loader,
            strict=strict,
            verify_hashes=verify_hashes,
        )


def export_full(path: str | os.PathLike[str], state: PrepState, model: nn.Module) -> Path | str:
    """Write the full model to one safetensors file at ``path`` (or an fsspec URL, returned as
    the ``str`` it is); call it on every rank.

    Original FQNs, buffers in their original dtype, readable by plain ``safetensors``. Rank 0
    writes, one tensor at a time (memory bounded by one tensor beyond the shards).
    """
    from fprep.checkpoint.export import export_full as _export_full

    refuse_expert_parallel(state, "fprep.export_full")
    with guarded("fprep.export_full", state.config.timeout_s):
        return _export_full(path, state, model)


def refuse_expert_parallel(state: PrepState, what: str) -> None:
    """Under expert parallelism each rank holds its experts under the whole parameter's name:
    a checkpoint would record the ranks' different experts as copies of one tensor. Refused,
    on every rank alike (the plan is the same everywhere), until checkpoints place them."""
    plan = state.expert_parallel
    if plan is not None:
        raise CheckpointError(
            f"{what} under expert parallelism (ep={plan.ep}): fprep does not yet write or "
            "read each rank's experts at their place in the whole parameters.",
            subject="ep",
            hint="Train with ep=1 where you need checkpoints; expert-parallel checkpoints "
            "are the next step of expert parallelism.",
        )


def refuse_packed(state: PrepState, what: str) -> None:
    """A packed parameter under tensor parallelism (``StridedShard`` on tp: each rank holds its
    block of each half) is two separate row ranges on a rank, which the checkpoint's chunk
    records (one offset and size per rank) cannot describe: saving it would fail deep inside,
    and loading into it would fill the wrong rows. Refused on every rank alike before anything
    is read or written; ``export_full`` / ``save_pretrained`` gather whole tensors and work."""
    from fprep.layout.placements import StridedShard

    tps = state.tensor_parallel
    packed = [f for f, p in tps.placements if isinstance(p, StridedShard)] if tps else []
    if packed:
        raise CheckpointError(
            f"{what} with tp={tps.size if tps else 1}: {packed[0]!r} is packed (its halves each "
            "cut on their own over the tp ranks), which fprep's checkpoints do not record yet.",
            subject=packed[0],
            hint="Write the whole model with fprep.export_full / fprep.save_pretrained "
            "(from_pretrained reads it back, and prepare then lays it out at any tp), or train "
            "this model at tp=1 (fsdp shards it) where you need resumable checkpoints.",
        )


def __getattr__(name: str) -> Any:
    if name == "SaveHandle":  # imported on first use, like the functions' implementations
        from fprep.checkpoint.asynchronous.background import SaveHandle

        return SaveHandle
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = [
    "CheckpointError",
    "LoadedInfo",
    "SaveHandle",
    "export_full",
    "load",
    "refuse_expert_parallel",
    "refuse_packed",
    "save",
]
