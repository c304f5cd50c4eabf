"""benchmarks/gpu_check.py runs on a CPU (``--device cpu --tiny``): the smoke test of the script a
maintainer runs on a GPU. A few of its checks only, to stay fast on two loaded cores."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture
def gpu_check(monkeypatch: pytest.MonkeyPatch) -> object:
    pytest.importorskip("transformers")
    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))
    import gpu_check as module

    yield module
    sys.modules.pop("gpu_check", None)


def test_tiny_cpu_run_passes_and_prints_the_table(
    gpu_check: object, capsys: pytest.CaptureFixture[str]
) -> None:
    rc = gpu_check.main(["--device", "cpu", "--tiny", "--only", "train bf16", "weights=", "fp8"])  # type: ignore[attr-defined]
    out = capsys.readouterr().out
    assert rc == 0, out
    table = out[out.index("fprep GPU check") :]
    assert "train bf16" in table and "weights= (bf16 files)" in table
    assert "bit-equal" in table  # fprep's weights= equals from_pretrained, value for value
    assert "skip" in table.split("fp8 vs torchao by hand")[1]  # CUDA only
    assert "FAIL" not in table


def test_a_failing_check_is_a_row_and_exit_status_1(
    gpu_check: object, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    def broken(setup: object, precision: str) -> object:
        raise RuntimeError("boom")

    monkeypatch.setattr(gpu_check, "check_precision", broken)
    rc = gpu_check.main(["--device", "cpu", "--tiny", "--only", "train fp16"])  # type: ignore[attr-defined]
    out = capsys.readouterr().out
    assert rc == 1
    assert "train fp16" in out and "FAIL" in out and "RuntimeError: boom" in out


@pytest.mark.slow
def test_two_ranks_through_torchrun_train_and_checkpoint_tensor_parallel() -> None:
    """The several-GPU path on gloo: tp 2 trains (both ranks of the tp group see one loss) and
    its checkpoint resumes bit-exactly (a tp-only save once ran on each rank alone)."""
    import os
    import subprocess

    pytest.importorskip("transformers")
    from fprep.testing.distributed import free_port

    command = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2"]
    command += ["--master-port", str(free_port()), str(ROOT / "benchmarks" / "gpu_check.py")]
    command += ["--device", "cpu", "--tiny", "--only", "tp"]
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    done = subprocess.run(command, capture_output=True, text=True, env=env, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    table = done.stdout[done.stdout.index("fprep GPU check") :]
    rows = {line.split("  ")[0]: line for line in table.splitlines()[3:]}
    assert set(rows) == {"train tp bf16", "checkpoint tp"}, table
    assert all("  ok  " in row for row in rows.values()), table
    assert "every value bit-equal at load" in rows["checkpoint tp"]


def test_only_matching_no_check_is_an_error_naming_the_checks(
    gpu_check: object, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exit_:
        gpu_check.main(["--device", "cpu", "--tiny", "--only", "no such check"])  # type: ignore[attr-defined]
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert "no check's name contains" in err and "fp8 vs torchao by hand" in err
