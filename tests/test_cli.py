"""The fprep command line: plan a model from MODULE:BUILDER; errors are one line."""

from __future__ import annotations

import argparse
import json
import re
import textwrap
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

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
    for what in (
        "units gathered during forward and backward",
        "activations",
        "temporary",
    ):
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


# -- --version ---------------------------------------------------------------------------------
def test_version_is_the_package_metadata_and_what_env_prints(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    import importlib.metadata

    from _cli import run_fprep

    done = run_fprep(tmp_path, "--version")
    assert done.returncode == 0 and done.stderr == ""
    assert done.stdout == f"fprep {importlib.metadata.version('fprep')}\n"
    assert main(["env", "--json"]) == 0
    assert done.stdout.split() == ["fprep", json.loads(capsys.readouterr().out)["fprep"]]


def test_version_without_package_metadata_is_the_source_tree_s(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """fprep run from a source tree that was never installed has no metadata: the version in
    fprep/__init__.py stands in."""
    import importlib.metadata

    import fprep

    real = importlib.metadata.version

    def version(name: str) -> str:
        if name == "fprep":
            raise importlib.metadata.PackageNotFoundError(name)
        return real(name)

    monkeypatch.setattr(importlib.metadata, "version", version)
    monkeypatch.setattr(fprep, "__version__", "9.8.7")  # tells it from the metadata's
    with pytest.raises(SystemExit) as done:
        main(["--version"])
    assert done.value.code == 0
    assert capsys.readouterr().out == "fprep 9.8.7\n"
    assert main(["env", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["fprep"] == "9.8.7"


# -- --json carries what the summary prints ----------------------------------------------------
def _expected_line(label: str, value: str, data: dict[str, Any]) -> str | bool:
    """What the summary line ``label`` should say, rendered from the JSON (or, for lines one of
    many, whether the JSON holds ``value``)."""
    from fprep.summary import human_bytes, human_count

    model, precision, mesh = data["model"], data["precision"], data["mesh"]
    tp, memory = data["tensor_parallel"], data["memory_bytes"]
    if label == "model":
        return (
            f"{model['class']}: {human_count(model['parameters'])} parameters in "
            f"{model['tensors']} tensors, {model['modules']} modules"
            + (" (meta)" if model["meta"] else "")
        )
    if label == "strategy":
        requested = data["requested_strategy"]
        extra = f" (requested {requested})" if requested != data["strategy"] else ""
        return f"{data['strategy']}{extra}"
    if label == "precision":
        roles = (
            ("params", "param_dtype"),
            ("reduce", "reduce_dtype"),
            ("autocast", "autocast_dtype"),
        )
        return (
            precision["name"]
            + "".join(f", {word} {precision[key]}" for word, key in roles if precision[key])
            + (", grad scaling" if precision["grad_scaling"] else "")
        )
    if label == "fp8":
        fp8 = precision["fp8"]
        gather = ", float8 all-gather" if fp8["float8_all_gather"] else ""
        return (
            f"{fp8['recipe']}: {len(fp8['modules'])} Linear layers in float8{gather}, "
            f"{len(fp8['kept'])} kept in bf16"
        )
    if label == "kept":  # one line per layer kept in bf16: "<fqn>: <why>"
        fqn, why = value.split(": ", 1)
        return precision["fp8"]["kept"].get(fqn) == why
    if label == "...":  # "... and N more (...)"
        return int(value.split()[1]) == len(precision["fp8"]["kept"]) - 8
    if label == "mesh":
        dims = "x".join(f"{n}={s}" for n, s in zip(mesh["dim_names"], mesh["shape"], strict=True))
        return f"{dims}, shard group of {mesh['shard_group_size']}"
    if label == "tensor par.":
        return (
            f"tp={tp['size']} ({tp['plan_source']} plan): {len(tp['modules'])} modules, "
            f"{len(tp['params'])} parameters split; tp group {tp['group'][0]}..{tp['group'][-1]}"
            + (", loss parallel" if tp["loss_parallel"] else "")
        )
    if label == "fp8 x tp":
        counts = Counter(tp["float8"].values())
        return ", ".join(f"{n} float8 Linear under {c}" for c, n in counts.items())
    if label == "device":
        device = data["device"]
        return f"{device['compute_device']} (from {device['source']}), backend {device['backend']}"
    if label == "ignored":
        return f"{len(data['ignored_params'])} parameter names"
    if label == "units":
        return f"{len(data['units'])} (root + {len(data['units']) - 1}); init: {data['init']}"
    if label == "this rank":
        b = {k: human_bytes(v) for k, v in memory.items() if isinstance(v, int)}
        where = "host" if data["memory_on_host"] else "device"
        return (
            f"params {b['params']}, grads {b['grads']}, Adam {b['adam']} ({where}); "
            f"largest unit gathered {b['largest_unit_unsharded']}"
        )
    if label == "note":
        return value in data["notes"] or (tp is not None and value in tp["notes"])
    raise AssertionError(f"the summary prints a {label!r} line that --json does not carry")


AGREEMENT_CASES = {
    "one process": ["fprep.testing.models:llama_tiny"],
    "hsdp": [
        "fprep.testing.models:llama_tiny",
        "--world-size",
        "16",
        "--nproc-per-node",
        "4",
        "--strategy",
        "hsdp",
        "--rank",
        "13",
        "--precision",
        "fp16",
        "--device-type",
        "cpu",
    ],
    "tp and sequence parallel": [
        "fprep.testing.models:llama_tiny",
        "--world-size",
        "8",
        "--nproc-per-node",
        "8",
        "--tp",
        "2",
        "--sequence-parallel",
        "--rank",
        "5",
    ],
    "fp8 and tp": [
        "fprep.testing.models:llama_8b",
        "--world-size",
        "8",
        "--nproc-per-node",
        "8",
        "--tp",
        "2",
        "--precision",
        "fp8",
    ],
}


@pytest.mark.parametrize("argv", AGREEMENT_CASES.values(), ids=AGREEMENT_CASES.keys())
def test_json_and_the_summary_agree(argv: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    """Every line of the summary is rendered again from --json's data and compared: a fact the
    summary prints and the JSON leaves out (or says otherwise) fails here."""
    assert main(["plan", *argv]) == 0
    text = capsys.readouterr().out
    summary = text[: text.index("per-rank memory")].splitlines()
    assert main(["plan", *argv, "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert summary[0] == (
        f"fprep plan — rank {data['rank']} of {data['world_size']} "
        f"({data['nodes']} node(s) x {data['nproc_per_node']})"
    )
    for line in summary[1:]:
        if line.startswith(
            "    "
        ):  # fp8's kept layers: "    kept <fqn>: <why>", "    ... and N more"
            label, _, value = line.strip().partition(" ")
        else:
            label, value = line[2:14].strip(), line[14:]
        expected = _expected_line(label, value, data)
        assert expected is True or expected == value, (label, value, expected)


def test_json_carries_the_mesh_tp_and_precision(capsys: pytest.CaptureFixture[str]) -> None:
    """The issue's three: Llama 405B over 1024 GPUs, FSDP x TP8, bf16."""
    argv = ["plan", "fprep.testing.models:llama_405b", "--world-size", "1024"]
    assert main([*argv, "--nproc-per-node", "8", "--tp", "8", "--sequence-parallel", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["mesh"]["shape"] == [128, 8] and data["mesh"]["dim_names"][-1] == "tp"
    assert data["tp"] == 8 and data["tensor_parallel"]["size"] == 8
    assert data["sequence_parallel"] is True
    assert data["precision"]["name"] == "bf16"
    assert data["precision"]["param_dtype"] == "bfloat16"


# -- fprep env warns about a launch missing what several nodes need ----------------------------
def _launch(monkeypatch: pytest.MonkeyPatch, **env: str) -> None:
    from _cli import LAUNCHER_VARS

    for name in LAUNCHER_VARS:
        monkeypatch.delenv(name, raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)


def test_env_warns_when_the_local_size_and_address_are_missing(tmp_path: Path) -> None:
    """WORLD_SIZE without LOCAL_WORLD_SIZE plans one node of every process (rank 9 on cuda:9),
    the mis-launch docs/multinode.md has users check with `fprep env`; without MASTER_ADDR the
    ranks cannot meet. Both warned on stderr, exit status still 0."""
    from _cli import run_fprep

    done = run_fprep(
        tmp_path,
        "env",
        env={"WORLD_SIZE": "16", "RANK": "9", "LOCAL_RANK": "1", "MASTER_PORT": "29500"},
    )
    assert done.returncode == 0 and "topology" in done.stdout
    warnings = done.stderr.splitlines()
    assert len(warnings) == 2 and all(w.startswith("fprep: warning: ") for w in warnings)
    assert "WORLD_SIZE=16 but LOCAL_WORLD_SIZE is not set" in warnings[0]
    assert "Set LOCAL_WORLD_SIZE to the processes per node" in warnings[0]
    assert "MASTER_ADDR is not set" in warnings[1] and "Set MASTER_ADDR" in warnings[1]


def test_env_json_lists_the_warnings_and_a_full_launch_has_none(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    _launch(
        monkeypatch,
        OMPI_COMM_WORLD_SIZE="16",
        OMPI_COMM_WORLD_RANK="3",
        MASTER_ADDR="node0",
        MASTER_PORT="29500",
    )
    assert main(["env", "--json"]) == 0
    captured = capsys.readouterr()
    data = json.loads(captured.out)
    assert len(data["warnings"]) == 1 and "OMPI_COMM_WORLD_LOCAL_SIZE" in data["warnings"][0]
    assert captured.err == f"fprep: warning: {data['warnings'][0]}\n"
    monkeypatch.setenv("OMPI_COMM_WORLD_LOCAL_SIZE", "8")
    assert main(["env", "--json"]) == 0
    captured = capsys.readouterr()
    assert json.loads(captured.out)["warnings"] == [] and captured.err == ""


LAUNCHERS = [
    ("WORLD_SIZE", "RANK", "LOCAL_WORLD_SIZE"),
    ("OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_LOCAL_SIZE"),
    ("PMI_SIZE", "PMI_RANK", "MPI_LOCALNRANKS"),
]


@given(
    launcher=st.sampled_from(LAUNCHERS),
    world=st.integers(1, 64),
    present=st.sets(st.sampled_from(["local", "MASTER_ADDR", "MASTER_PORT"])),
)
def test_launch_warnings_name_exactly_what_is_missing(
    launcher: tuple[str, str, str], world: int, present: set[str]
) -> None:
    from fprep.cli import launch_warnings

    world_var, rank_var, local_var = launcher
    env = {world_var: str(world), rank_var: "0"}
    env |= {local_var: "1"} if "local" in present else {}
    env |= {name: "x" for name in present if name.startswith("MASTER")}
    warnings = launch_warnings(env)
    distributed = world > 1
    local = [w for w in warnings if f"but {local_var} is not set" in w]
    assert len(local) == (distributed and "local" not in present)
    address = [w for w in warnings if w not in local]
    # "MASTER_ADDR and MASTER_PORT are not set, ...": the names before "is/are not set"
    named = re.split(r" (?:is|are) not set", address[0])[0].split(" and ") if address else []
    missing = {"MASTER_ADDR", "MASTER_PORT"} - present
    assert set(named) == (missing if distributed else set()), warnings


# -- pipeline parallelism: one line per pipeline rank -------------------------------------------
PP_ARGV = [
    "plan",
    "fprep.testing.models:llama_tiny",
    "--world-size",
    "4",
    "--pp",
    "2",
    "--pp-schedule",
    "1F1B",
    "--pp-microbatches",
    "2",
    "--precision",
    "no",
]
PP_BATCH = ["--batch", "4", "--seq-len", "16"]


def _pp_plans() -> list[Any]:
    """What the command plans: the first rank of each pipeline rank (0 and 2 of 4)."""
    import fprep
    from fprep.testing.models import llama_tiny

    cfg = fprep.PrepConfig(
        pp=2, pp_schedule="1F1B", pp_microbatches=2, precision="no", wrap=("LlamaBlock",)
    )
    return [
        fprep.plan(llama_tiny(), cfg, fprep.Topology(world_size=4, rank=rank)).unwrap()
        for rank in (0, 2)
    ]


def test_plan_prints_each_pipeline_ranks_stages_and_bytes(
    capsys: pytest.CaptureFixture[str],
) -> None:
    import fprep
    from fprep.summary import human_bytes

    assert main([*PP_ARGV, *PP_BATCH]) == 0
    out = capsys.readouterr().out
    table = out[out.index("per pipeline rank") :].splitlines()
    assert "2 ranks, 2 stages, 1F1B, 2 micro-batches of 2 x 16 tokens" in table[0]
    assert len(table) == 4  # title, header, one line per pipeline rank
    for line, state in zip(table[2:], _pp_plans(), strict=True):
        pipe = state.pipeline
        mem = fprep.estimate_memory(state, batch=(4, 16))
        (stage,) = pipe.stages
        assert line.split()[:2] == [str(pipe.rank), str(state.topology.rank)]
        assert f"{stage}: {pipe.split[stage][0]} .. {pipe.split[stage][-1]}" in line
        figures = [
            mem.params,
            mem.grads + mem.adam,
            mem.kept_gathered,
            mem.activations,
            mem.total("adam"),
        ]
        assert re.findall(r"\d+(?:\.\d+)? [KMG]?i?B", line) == [human_bytes(n) for n in figures]
        assert mem.activations > 0


def test_plan_json_carries_the_pipeline_ranks(capsys: pytest.CaptureFixture[str]) -> None:
    import fprep

    assert main([*PP_ARGV, *PP_BATCH, "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    pipeline = data["pipeline"]
    assert data["batch"] == {"rows": 4, "seq_len": 16}
    assert (pipeline["size"], pipeline["schedule"], pipeline["microbatches"]) == (2, "1F1B", 2)
    for entry, state in zip(pipeline["ranks"], _pp_plans(), strict=True):
        mem = fprep.estimate_memory(state, batch=(4, 16))
        assert entry["rank"] == state.topology.rank and entry["pp_rank"] == state.pipeline.rank
        assert entry["bytes"] == {
            "params": mem.params,
            "grads_and_adam": mem.grads + mem.adam,
            "activations": mem.activations,
            "gathered": mem.kept_gathered,
            "total_adam": mem.total("adam"),
        }
        assert mem.kept_gathered > 0  # fsdp over 2 ranks keeps each stage's blocks gathered
        (stage,) = entry["stages"]
        assert [stage["first"], stage["last"]] == [
            state.pipeline.split[stage["index"]][0],
            state.pipeline.split[stage["index"]][-1],
        ]
    assert data["memory_bytes"]["activations"] == pipeline["ranks"][0]["bytes"]["activations"]


def test_plan_without_a_batch_says_how_to_count_activations(
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert main(PP_ARGV) == 0
    out = capsys.readouterr().out
    assert "activations (they grow with batch size" in out.replace("\n  ", " ")
    assert "(activations: pass --batch ROWS --seq-len N)" in out


@pytest.mark.parametrize(
    ("extra", "needle"),
    [
        (["--batch", "4"], "--batch without --seq-len"),
        (["--seq-len", "16"], "--seq-len without --batch"),
        (["--batch", "0", "--seq-len", "16"], "--batch 0"),
        (["--batch", "1", "--seq-len", "16"], "1 rows cannot make 2 micro-batches"),
        (["--pp-schedule", "Interleaved"], "pp_schedule"),
    ],
)
def test_pipeline_options_fail_in_one_line(
    capsys: pytest.CaptureFixture[str], extra: list[str], needle: str
) -> None:
    assert main([*PP_ARGV, *extra]) == 2
    err = capsys.readouterr().err
    assert err.startswith("fprep: error:") and needle in err, err
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1
