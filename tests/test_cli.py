"""The fprep command line: plan a model from MODULE:BUILDER; errors are one line."""

from __future__ import annotations

import json
import textwrap
from pathlib import Path

import pytest

from fprep.cli import main

BUILDER = textwrap.dedent(
    """
    from torch import nn

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(64, 64)

    def build():
        return nn.Sequential(nn.Embedding(100, 64), nn.ModuleList([Block() for _ in range(4)]))

    def not_a_model():
        return 3
    """
)


@pytest.fixture()
def builder_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    (tmp_path / "cli_models.py").write_text(BUILDER)
    monkeypatch.chdir(tmp_path)
    return tmp_path


def test_plan_prints_summary_and_memory(
    builder_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["plan", "cli_models:build", "--world-size", "4", "--rank", "1"]) == 0
    out = capsys.readouterr().out
    assert "strategy    fsdp" in out and "per-rank memory" in out
    assert "units       5 (root + 4)" in out  # the repeated Blocks are the default units


def test_plan_json_has_bytes(builder_dir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["plan", "cli_models:build", "--world-size", "4", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    # 100x64 embedding over 4 ranks: 25 rows each; blocks: 16 rows + 16 bias each, fp32.
    assert data["memory_bytes"]["params"] == (25 * 64 + 4 * (16 * 64 + 16)) * 4
    assert data["units"][-1] == ""


@pytest.mark.parametrize(
    ("argv", "needle"),
    [
        (["plan", "cli_models"], "MODULE:BUILDER"),
        (["plan", "no_such_module:x"], "cannot import"),
        (["plan", "cli_models:not_a_model"], "not an nn.Module"),
        (["plan", "cli_models:build", "--strategy", "fdsp"], "Did you mean 'fsdp'"),
        (["plan", "cli_models:build", "--world-size", "4", "--rank", "9"], "rank"),
    ],
)
def test_errors_are_one_line(
    builder_dir: Path, capsys: pytest.CaptureFixture[str], argv: list[str], needle: str
) -> None:
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("fprep: error:") and needle in err
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1


def test_env_json(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["env", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["torch"].startswith("2.13") and data["backends"]["gloo"] is True
