"""The fprep command line: plan a model from MODULE:BUILDER; errors are one line."""

from __future__ import annotations

import argparse
import json
import re
import textwrap
from pathlib import Path

import pytest

from fprep.cli import build_parser, main

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


def test_hsdp_needs_nproc_per_node(builder_dir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Without --nproc-per-node, hsdp would quietly become one shard group of the whole world."""
    argv = ["plan", "cli_models:build", "--world-size", "16", "--strategy", "hsdp"]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("fprep: error: --strategy hsdp needs --nproc-per-node")
    assert main([*argv, "--nproc-per-node", "4"]) == 0
    assert "replicate=4xshard=4" in capsys.readouterr().out


def _parsers() -> list[tuple[str, argparse.ArgumentParser]]:
    parser = build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return [("fprep", parser), *((f"fprep {n}", p) for n, p in sub.choices.items())]


@pytest.mark.parametrize(("name", "parser"), _parsers(), ids=[n for n, _ in _parsers()])
def test_every_option_has_help_and_no_markup(name: str, parser: argparse.ArgumentParser) -> None:
    undocumented = [
        a.dest
        for a in parser._actions
        if not isinstance(a, argparse._SubParsersAction) and not (a.help or "").strip()
    ]
    assert not undocumented, f"{name}: options without help text: {undocumented}"
    text = parser.format_help()
    assert parser.description, f"{name} has no description"
    assert not re.search(r"``|:class:|:func:|\*\*", text), f"{name} --help shows markup:\n{text}"


def test_cli_and_demo_do_not_import_each_other() -> None:
    """fprep.cli -> fprep.demo -> fprep.cli_run: no cycle (a fresh interpreter imports the demo
    alone without pulling in the command line)."""
    import subprocess
    import sys

    code = "import sys, fprep.demo; print('fprep.cli' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def test_plan_total_says_what_it_leaves_out(
    builder_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The total is a steady state: the gathered units, activations and temporary buffers come
    on top, and both the table and --json say so."""
    assert main(["plan", "cli_models:build", "--world-size", "4", "--nproc-per-node", "4"]) == 0
    out = " ".join(capsys.readouterr().out.split())  # the note is wrapped over lines
    leaves_out = out[out.index("the total leaves out:") :]
    for what in ("units gathered during forward and backward", "activations", "temporary"):
        assert what in leaves_out
    assert main(["plan", "cli_models:build", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert any("activations" in item for item in data["total_leaves_out"])


def test_plan_warns_when_it_assumes_one_node(
    builder_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A world size without --nproc-per-node plans one node of all the processes: a note on
    stderr says so (stdout stays valid JSON); with the layout given, or one process, no note."""
    assert main(["plan", "cli_models:build", "--world-size", "16", "--rank", "9", "--json"]) == 0
    captured = capsys.readouterr()
    assert json.loads(captured.out)["nodes"] == 1
    assert captured.err.startswith("fprep: note: no --nproc-per-node")
    assert "one node running all 16 processes" in captured.err
    assert "rank 9 as local rank 9" in captured.err
    argv = ["plan", "cli_models:build", "--world-size", "16", "--nproc-per-node", "4", "--json"]
    assert main(argv) == 0
    captured = capsys.readouterr()
    assert captured.err == "" and json.loads(captured.out)["nodes"] == 4
    assert main(["plan", "cli_models:build"]) == 0
    assert capsys.readouterr().err == ""


def test_env_prints_versions(capsys: pytest.CaptureFixture[str]) -> None:
    """What a bug report needs first: fprep's, Python's, torch's and transformers' versions."""
    import platform

    import transformers

    import fprep

    assert main(["env", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["fprep"] == fprep.__version__
    assert data["python"] == platform.python_version()
    assert data["transformers"] == transformers.__version__
    assert main(["env"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].split() == ["fprep", fprep.__version__]
    assert any(line.split()[:1] == ["transformers"] for line in lines)


def test_env_leaves_out_transformers_when_it_is_not_installed(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util,
        "find_spec",
        lambda name, *a: None if name == "transformers" else real(name, *a),
    )
    assert main(["env", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert "transformers" not in data and data["torch"].startswith("2.13")


def test_python_dash_m_fprep_is_the_command_line(tmp_path: Path) -> None:
    """`python -m fprep` works where the `fprep` script is not on PATH: same parser, same
    one-line errors and exit statuses."""
    import os
    import subprocess
    import sys

    root = Path(__file__).resolve().parents[1]
    env = {**os.environ, "PYTHONPATH": f"{root}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}

    def fprep(*argv: str) -> subprocess.CompletedProcess[str]:
        command = [sys.executable, "-m", "fprep", *argv]
        return subprocess.run(command, capture_output=True, text=True, env=env, cwd=tmp_path)

    ok = fprep("env", "--json")
    assert ok.returncode == 0 and json.loads(ok.stdout)["torch"].startswith("2.13")
    bad = fprep("plan", "nothing")
    assert bad.returncode == 2 and bad.stderr.startswith("fprep: error: expected MODULE:BUILDER")
    assert "Traceback" not in bad.stderr
    assert "usage: fprep" in fprep("--help").stdout
