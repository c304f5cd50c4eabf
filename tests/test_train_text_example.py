"""``examples/train_text.py``: a tokenizer trained on the shipped text, a tiny Llama prepared by
fprep, evaluation between epochs. Run as users run it (``python`` and ``torchrun``, small
settings): the evaluation loss falls, and 1 and 2 ranks agree on it (the same global batches;
the evaluation windows repeated to even out the ranks' batches are not counted twice)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "examples" / "train_text.py"
SMALL = ["--epochs", "2", "--max-steps", "6", "--hidden", "64", "--vocab-size", "384"]


def _run(tmp_path: Path, nproc: int) -> dict[str, Any]:
    results = tmp_path / f"results_{nproc}.json"
    torchrun = ["-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(nproc)]
    launcher = [sys.executable] if nproc == 1 else [sys.executable, *torchrun]
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(
        [*launcher, str(SCRIPT), *SMALL, "--results", str(results)],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=540,
        check=False,
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    assert proc.stdout.count("before training: eval loss") == 1  # rank 0 prints
    assert "epoch 2: train loss" in proc.stdout and "perplexity" in proc.stdout
    out: dict[str, Any] = json.loads(results.read_text())
    return out


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_train_text_at_1_and_2_ranks(tmp_path: Path) -> None:
    one = _run(tmp_path, 1)
    two = _run(tmp_path, 2)
    for run in (one, two):
        evals = run["eval"]
        assert len(evals) == 3  # before training, then after each epoch
        assert evals[2] < evals[1] < evals[0]
    # the same initial weights and evaluation tokens: the same mean, counted once each
    assert two["eval"][0] == pytest.approx(one["eval"][0], abs=1e-5)
    assert two["train"] == pytest.approx(one["train"], abs=1e-3)
    assert two["eval"] == pytest.approx(one["eval"], abs=1e-3)
