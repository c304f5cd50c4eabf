"""``fprep demo``: the model trains (the loss falls), the plan is printed, runs are reproducible,
bad options fail as one line, and ``--nproc 2`` trains the same curve over two ranks."""

from __future__ import annotations

import io
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from fprep.cli import main
from fprep.demo import MIN_DROP, run_demo
from fprep.testing.models import GPTConfig

ROOT = Path(__file__).resolve().parents[1]
SMALL = GPTConfig(vocab_size=64, block_size=32, n_layer=2, n_head=2, n_embd=32)
FINAL = re.compile(r"loss fell: ([0-9.]+) \(step 1\) -> ([0-9.]+) ")


def test_demo_trains_and_prints_the_plan() -> None:
    out = io.StringIO()
    result = run_demo(steps=12, batch_size=8, seed=0, threads=1, out=out)
    text = out.getvalue()
    assert result.fell and len(result.losses) == 12
    assert result.last < 0.8 * result.first  # from ln(64) = 4.16 down, not a rounding wobble
    assert "fprep plan — rank 0 of 1" in text and "init: param_init_fn" in text
    assert "step 12/12" in text and "[########################]" in text
    assert text.strip().splitlines()[-1].startswith("loss fell: ")


def test_demo_is_deterministic_for_a_seed() -> None:
    def losses(seed: int) -> tuple[float, ...]:
        out = io.StringIO()
        return run_demo(
            steps=4, batch_size=4, seed=seed, threads=1, model_config=SMALL, out=out
        ).losses

    assert losses(1) == losses(1)
    assert losses(1) != losses(2)


def test_demo_restores_thread_count() -> None:
    import torch

    before = torch.get_num_threads()
    run_demo(steps=1, batch_size=2, threads=1, model_config=SMALL, out=io.StringIO())
    assert torch.get_num_threads() == before


@pytest.mark.parametrize(
    ("argv", "needle"),
    [
        (["demo", "--strategy", "fdsp"], "Did you mean 'fsdp'"),
        (["demo", "--precision", "bf61"], "PrepConfig.precision"),
        (["demo", "--compile", "wole"], "Did you mean 'whole'"),
        (["demo", "--steps", "0"], "--steps"),
        (["demo", "--nproc", "2", "--batch-size", "3"], "cannot be split evenly over 2"),
        (["demo", "--nproc", "0"], "--nproc"),
    ],
)
def test_demo_errors_are_one_line(
    capsys: pytest.CaptureFixture[str], argv: list[str], needle: str
) -> None:
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("fprep: error:") and needle in err
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_demo_nproc_2_through_the_cli_matches_one_process() -> None:
    steps = "16"
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.run(
        [sys.executable, "-m", "fprep.cli", "demo", "--nproc", "2", "--steps", steps],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=280,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    out = proc.stdout
    assert out.count("fprep plan — rank 0 of 2") == 1  # rank 0 prints, rank 1 does not
    assert "rank 1 of 2" not in out and "strategy    ddp (requested auto)" in out
    match = FINAL.search(out)
    assert match, out
    # Each rank trains on its half of the global batch; DDP averages the gradients, so the
    # global loss follows the single-process curve (same seed, same initial weights).
    single = run_demo(steps=int(steps), threads=1, out=io.StringIO())
    assert float(match.group(1)) == pytest.approx(single.first, abs=1e-3)
    assert float(match.group(2)) == pytest.approx(single.last, rel=1e-2)


def test_demo_at_learning_rate_0_says_the_loss_did_not_fall(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """Batch-to-batch noise is not learning: at lr 0 the weights never change, the loss only
    wobbles, and the demo says so and exits 1."""
    out = io.StringIO()
    result = run_demo(steps=20, batch_size=4, lr=0.0, threads=1, model_config=SMALL, out=out)
    assert not result.fell and abs(result.drop) < MIN_DROP
    assert out.getvalue().strip().splitlines()[-1].startswith("loss did NOT fall (by less than 5%)")
    assert main(["demo", "--lr", "0", "--steps", "4", "--batch-size", "4"]) == 1
    assert "did NOT fall" in capsys.readouterr().out


def test_demo_summary_separates_no_op_steps() -> None:
    """One process, no sharding: shard, replicate and fast_ddp had nothing to do, and the
    summary says so on their own line instead of listing them as applied."""
    out = io.StringIO()
    run_demo(steps=1, batch_size=2, threads=1, model_config=SMALL, out=out)
    lines = out.getvalue().splitlines()
    applied = next(line for line in lines if line.startswith("  applied "))
    no_op = next(line for line in lines if line.startswith("  no-op "))
    assert applied.split()[1:] == [
        "connect",
        "->",
        "materialize",
        "->",
        "place",
        "->",
        "mark_prepared",
    ]
    for name in ("shard", "replicate", "fast_ddp", "precision", "sync_module_states"):
        assert name in no_op and name not in applied
