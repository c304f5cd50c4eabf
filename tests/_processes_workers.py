"""Rank functions for tests/test_processes_distributed.py: fprep.processes next to Accelerate.

Module level, so ``fprep.testing.distributed.run_ranks`` can pickle them into spawned ranks. One
rank function (``two_ranks``) runs every case on a DDP preparation; for each, a rank returns
what fprep gave and, where Accelerate has the same function, what Accelerate gave for the same
inputs (its functions run on the process group ``prepare`` created). Plain data only; the
tests assert in the parent process.
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.utils.data import DataLoader

import fprep

#: (dataset length, batch size) pairs for the epoch-long gather_for_metrics comparison
EPOCHS = [(5, 2), (7, 3), (8, 2), (9, 4), (3, 2), (1, 2)]
#: lengths of the lists split between the processes (0: every process gets nothing)
SPLIT_LENGTHS = [0, 1, 2, 3, 5, 8]


def rank_inputs(rank: int) -> dict[str, torch.Tensor]:
    """The tensors rank ``rank`` passes: some the same shape on every rank, some not."""
    gen = torch.Generator().manual_seed(rank)
    return {
        "even": torch.randn(3, 4, generator=gen),
        "labels": torch.randint(0, 9, (3,), generator=gen),
        "loss": torch.randn((), generator=gen),
        "uneven": torch.randn(2 + rank, 4, generator=gen),  # 2 rows on rank 0, 3 on rank 1
        "sequences": torch.randint(1, 9, (2, 3 + 2 * rank), generator=gen),  # lengths 3, 5
        "mask": torch.ones(2, 3 + 2 * rank, dtype=torch.bool),
    }


def _plain(value: Any) -> Any:
    """Tensors as (dtype, nested lists), containers kept."""
    if isinstance(value, torch.Tensor):
        return (str(value.dtype), list(value.shape), value.tolist())
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return type(value)(_plain(v) for v in value)
    return value


def _outcome(fn: Callable[[], Any]) -> dict[str, Any]:
    try:
        return {"value": _plain(fn())}
    except fprep.PrepError as e:
        return {"error": type(e).__name__, "message": str(e), "subject": e.subject}


def two_ranks(root: str) -> dict[str, Any]:
    warnings.simplefilter("ignore")  # Accelerate's notes on OMP_NUM_THREADS
    from accelerate import Accelerator
    from accelerate.utils import gather, pad_across_processes

    rank = int(os.environ["RANK"])
    state, _ = fprep.prepare(nn.Linear(2, 2), fprep.PrepConfig(strategy="ddp", timeout_s=60))
    accelerator = Accelerator(cpu=True)  # joins the process group prepare created
    x = rank_inputs(rank)
    out: dict[str, Any] = {
        "index": (fprep.process_index(state), accelerator.process_index),
        "count": (fprep.num_processes(state), accelerator.num_processes),
    }

    # split_between_processes: lists, tuples, tensors, dicts; with and without padding
    split: dict[str, Any] = {}
    for n in SPLIT_LENGTHS:
        for pad in (False, True) if n else (False,):  # Accelerate pads with inputs[-1]
            items = [f"s{i}" for i in range(n)]
            rows = torch.arange(2 * n).reshape(n, 2)
            for kind, value in (("list", items), ("tuple", tuple(items)), ("tensor", rows)):
                # (Accelerate pads a tuple by adding a list to it, a TypeError: pad the list)
                given = items if kind == "tuple" and pad else value
                with accelerator.split_between_processes(given, apply_padding=pad) as theirs:
                    ours = fprep.split_between_processes(state, value, apply_padding=pad)
                theirs = tuple(theirs) if kind == "tuple" else theirs
                split[f"{kind}/{n}/{pad}"] = (_plain(ours), _plain(theirs))
            both = {"a": items, "b": rows}
            ours = fprep.split_between_processes(state, both, apply_padding=pad)
            with accelerator.split_between_processes(dict(both), apply_padding=pad) as theirs:
                split[f"dict/{n}/{pad}"] = (_plain(ours), _plain(theirs))
    out["split"] = split

    # pad_across_processes: the first dimension, a later one (also negative), at the start
    pads: dict[str, Any] = {}
    for name, kwargs in {
        "rows": {"dim": 0},
        "columns": {"dim": 1, "pad_index": -100},
        "negative": {"dim": -1, "pad_index": 7},
        "first": {"dim": 1, "pad_first": True},
    }.items():
        value = x["uneven"] if name == "rows" else x["sequences"]
        pads[name] = (
            _plain(fprep.pad_across_processes(state, value, **kwargs)),
            _plain(pad_across_processes(value, **kwargs)),
        )
    nested = {"ids": x["sequences"], "more": (x["mask"], x["loss"])}
    pads["nested"] = (
        _plain(fprep.pad_across_processes(state, nested, dim=1)),
        _plain(pad_across_processes(nested, dim=1)),
    )
    out["pad"] = pads

    # gather: what Accelerate gathers the same way; uneven rows, which it cannot
    same = (x["even"], {"labels": x["labels"], "loss": x["loss"]})
    out["gather"] = (_plain(fprep.gather(state, same)), _plain(gather(same)))
    many = {f"t{i}": x["even"] * i for i in range(6)}  # more than go with the first exchange
    out["gather_many"] = (_plain(fprep.gather(state, many)), _plain(gather(many)))
    out["gather_uneven"] = _plain(fprep.gather(state, x["uneven"]))
    padded = fprep.pad_across_processes(state, x["sequences"], dim=1)
    out["pad_then_gather"] = (
        _plain(fprep.gather(state, padded)),
        _plain(gather(pad_across_processes(x["sequences"], dim=1))),
    )

    # inputs that do not fit the other rank's: every rank raises the same ConfigError
    out["gather_dtype"] = _outcome(
        lambda: fprep.gather(state, x["labels"] if rank else x["labels"].float())
    )
    out["gather_columns"] = _outcome(lambda: fprep.gather(state, x["sequences"]))
    out["gather_structure"] = _outcome(
        lambda: fprep.gather(state, (x["even"],) if rank else (x["even"], x["labels"]))
    )
    out["pad_ndim"] = _outcome(
        lambda: fprep.pad_across_processes(state, x["even"] if rank else x["labels"])
    )
    out["after_refusals"] = fprep.reduce(state, 1, "sum")  # nobody was left waiting

    # gather_for_metrics over whole epochs, next to Accelerate's with its own loader
    epochs: dict[str, Any] = {}
    for n, batch in EPOCHS:
        theirs_loader = accelerator.prepare(DataLoader(torch.arange(n), batch_size=batch))
        ours_loader = fprep.prepare_data_loader(
            state, DataLoader(torch.arange(n), batch_size=batch)
        )
        theirs = [accelerator.gather_for_metrics(b).tolist() for b in theirs_loader]
        ours = [fprep.gather_for_metrics(state, b, ours_loader).tolist() for b in ours_loader]
        pairs = [
            _plain(fprep.gather_for_metrics(state, (b, b * 10), ours_loader)) for b in ours_loader
        ]
        epochs[f"{n}/{batch}"] = {"ours": ours, "theirs": theirs, "pairs": pairs}
    out["epochs"] = epochs

    out["first"] = _main_first_in_order(state, Path(root))
    out["first_raises"] = _main_first_raises(state, rank)
    out["after_first"] = fprep.reduce(state, 1, "sum")
    return out


def _main_first_in_order(state: fprep.PrepState, root: Path) -> dict[str, Any]:
    """The main process writes a file in its block; the other finds it there in its own."""
    cache = root / "cache.txt"
    with fprep.main_process_first(state):
        found = cache.exists()
        if not found:
            cache.write_text("prepared")
    return {"found": found}


def _main_first_raises(state: fprep.PrepState, rank: int) -> dict[str, Any]:
    ran = []

    def block() -> None:
        with fprep.main_process_first(state):
            ran.append(rank)
            if rank == 0:
                raise OSError("disk full while writing the cache")

    try:
        block()
    except OSError as e:
        return {"raised": "OSError", "message": str(e), "ran": ran}
    except fprep.CollectiveError as e:
        return {"raised": "CollectiveError", "message": str(e), "ran": ran}
    return {"raised": None, "ran": ran}


def tp_alone(root: str) -> dict[str, Any]:
    """Tensor parallelism over both ranks (the strategy resolves to "none"): both read the same
    data, the main process still goes first, and after ``end_training`` main_process_first is
    a PrepareError naming the ended group."""
    warnings.simplefilter("ignore")
    model = nn.Sequential(nn.Linear(4, 8), nn.Linear(8, 4))
    cfg = fprep.PrepConfig(tp=2, tp_plan={"0": "colwise", "1": "rowwise"}, timeout_s=60)
    state, _ = fprep.prepare(model, cfg)
    out: dict[str, Any] = {
        "strategy": state.core.strategy if state.core else None,
        "position": (fprep.process_index(state), fprep.num_processes(state)),
        "part": fprep.split_between_processes(state, list(range(6))),
        "in_order": _main_first_in_order(state, Path(root)),
    }
    fprep.end_training(state)

    def after_end() -> None:
        with fprep.main_process_first(state):
            pass

    out["after_end"] = _outcome(after_end)
    return out
