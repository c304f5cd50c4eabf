"""Issue 12.4: a prepared loader over an iterable dataset resumes where it stopped.

Before, ``load_state_dict`` moved the batch counter but the next pass read from batch 0 again,
silently. Now the first ``k`` batches' items are read and dropped (an iterable cannot seek),
with and without workers, and through ``fprep.save`` / ``fprep.load``. One process here; 2 ranks
in tests/test_ops_distributed.py.
"""

from __future__ import annotations

from pathlib import Path

import _ops_workers as W
import pytest
from torch import nn
from torch.utils.data import DataLoader

import fprep


@pytest.fixture(scope="module")
def state() -> fprep.PrepState:
    prepared, _ = fprep.prepare(nn.Linear(2, 2), fprep.PrepConfig())
    return prepared


@pytest.mark.parametrize("n, consumed", [(11, 1), (11, 2), (11, 5), (11, 6), (12, 3)])
def test_resume_reads_the_rest_of_the_epoch(state: fprep.PrepState, n: int, consumed: int) -> None:
    result = W.resume_case(state, n, consumed)
    assert result["head"] == result["epoch0"][:consumed]
    assert result["rest"] == result["epoch0"][consumed:]
    assert result["next_epoch"] == result["epoch0"]  # the skip held for one pass
    assert result["epoch_after"] == 2


@pytest.mark.slow
@pytest.mark.parametrize("persistent", [False, True])
def test_resume_with_workers(state: fprep.PrepState, persistent: bool) -> None:
    kw = {"num_workers": 2, "multiprocessing_context": "fork", "persistent_workers": persistent}
    result = W.resume_case(state, 11, 3, **kw)
    assert result["rest"] == result["epoch0"][3:]
    assert result["next_epoch"] == result["epoch0"]


def test_a_loader_with_running_persistent_workers_resumes_too(state: fprep.PrepState) -> None:
    """load_state_dict on a loader whose persistent workers already iterate their own copy of
    the dataset: they are replaced by workers that skip."""
    loader = fprep.prepare_data_loader(
        state,
        DataLoader(
            W.Stream(11),
            batch_size=2,
            num_workers=1,
            persistent_workers=True,
            multiprocessing_context="fork",
        ),
    )
    epoch = W.batches(loader)
    loader.load_state_dict({"epoch": 1, "batches": 4})
    assert W.batches(loader) == epoch[4:]
    assert W.batches(loader) == epoch


def test_resume_through_a_checkpoint(state: fprep.PrepState, tmp_path: Path) -> None:
    model = nn.Linear(2, 2)
    state, model = fprep.prepare(model, fprep.PrepConfig())
    loader = fprep.prepare_data_loader(state, DataLoader(W.Stream(9), batch_size=2))
    epoch = W.batches(loader)
    head = W.batches(loader, 2)
    assert head == epoch[:2]
    fprep.save(tmp_path, state, model, loader=loader, step=2)
    fresh = fprep.prepare_data_loader(state, DataLoader(W.Stream(9), batch_size=2))
    fprep.load(tmp_path, state, model, loader=fresh)
    assert fresh.epoch == 1 and W.batches(fresh) == epoch[2:]
