"""How ``fprep plan`` is told which model to plan: MODULE:BUILDER, FILE.py:BUILDER, or a
transformers config.json (or its directory), built on meta. Every name that cannot be built is
one line on stderr and exit status 2, through a real ``python -m fprep``."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
import transformers as tf
from _cli import ROOT, assert_one_line_error, run_fprep
from _tiny_transformers import TINY_LLAMA

from fprep.cli import main

MODELS = textwrap.dedent(
    """
    from torch import nn

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(8, 8)

    class NeedsWidth(nn.Module):
        def __init__(self, width):
            super().__init__()
            self.fc = nn.Linear(width, width)

    def build():
        print("building the model")  # a builder that talks must not break --json
        return nn.Sequential(nn.Embedding(16, 8), nn.ModuleList([Block() for _ in range(3)]))

    def not_a_model():
        return 3

    def raises():
        raise RuntimeError("the model's\\nsecond line")

    def calls_badly():
        return NeedsWidth()

    def exits():
        raise SystemExit(4)
    """
)

#: A file given by path, importing a module beside it (as `python model.py` could).
FILE_MODEL = textwrap.dedent(
    """
    from torch import nn
    from sibling import WIDTH

    def build():
        return nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.Linear(WIDTH, WIDTH))
    """
)


@pytest.fixture(scope="module")
def workdir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A directory with builders, broken modules and files, and bad configs."""
    root = tmp_path_factory.mktemp("cli_model")
    (root / "named_models.py").write_text(MODELS)
    (root / "raising_module.py").write_text("raise ValueError('no cluster here')\n")
    (root / "broken_import.py").write_text("import a_package_not_installed\n")
    (root / "exiting.py").write_text("import sys\nsys.exit(3)\n")
    (root / "models").mkdir()
    (root / "models" / "model.py").write_text(FILE_MODEL)
    (root / "models" / "sibling.py").write_text("WIDTH = 12\n")
    (root / "notes.txt").write_text("not a model\n")
    lazy = "def __getattr__(name):\n    raise ImportError('needs a_backend')\n"
    (root / "lazy_module.py").write_text(lazy)  # as transformers' lazy attributes can fail
    (root / "shadow").mkdir()
    (root / "shadow" / "json.py").write_text(
        FILE_MODEL.replace("from sibling import WIDTH", "WIDTH = 3")
    )
    configs: dict[str, str] = {
        "not_json": "{model_type: llama",
        "a_list": "[1, 2]",
        "no_model_type": json.dumps({"hidden_size": 64}),
        "unknown_type": json.dumps({"model_type": "no_such_model_type"}),
        "invalid_llama": json.dumps({**TINY_LLAMA, "model_type": "llama", "hidden_size": 10}),
        "unknown_class": json.dumps({"model_type": "llama", "architectures": ["NoSuchForLM"]}),
        "remote_code": json.dumps(
            {"model_type": "custom_thing", "auto_map": {"AutoConfig": "configuration_x.XConfig"}}
        ),
    }
    for name, text in configs.items():
        (root / name).mkdir()
        (root / name / "config.json").write_text(text)
    (root / "empty_dir").mkdir()
    return root


#: One name of each kind that cannot be built, run through a real `python -m fprep` each.
SUBPROCESS_CASES = [
    # a class needing constructor arguments; transformers' classes point to config.json
    ("torch.nn:Linear", ["needs arguments (in_features, out_features)", "def build()"]),
    ("transformers:LlamaForCausalLM", ["needs arguments (config)", "config.json"]),
    ("no_such_module:build", ["no module named 'no_such_module'", "PYTHONPATH"]),
    ("named_models:no_such", ["'named_models' has no attribute 'no_such'"]),
    ("./models/missing.py:build", ["no such file: './models/missing.py'"]),
    ("./exiting.py:build", ["running './exiting.py' raised SystemExit: 3"]),
    ("named_models:raises", ["raised RuntimeError: the model's second line"]),
    ("named_models:not_a_model", ["the builder returned int, not an nn.Module"]),
    ("invalid_llama", ["transformers cannot read it", "hidden size"]),
    ("remote_code", ["code from the model's repository (auto_map)"]),
]
#: More of each kind, through the same main() in this process (a subprocess each is slow).
IN_PROCESS_CASES = [
    ("named_models:NeedsWidth", ["needs arguments (width)"]),
    ("named_models:calls_badly", ["raised TypeError", "takes no arguments"]),
    ("named_models:exits", ["calling 'named_models:exits' raised SystemExit: 4"]),
    ("lazy_module:Model", ["looking up 'Model' in 'lazy_module' raised ImportError: needs a_"]),
    ("named_models.sub:build", ["no module named 'named_models.sub'"]),
    ("torch.nn.Nope:x", ["no module named 'torch.nn.Nope'"]),
    ("torch:nn.Nope", ["'torch.nn' has no attribute 'Nope'"]),
    ("raising_module:build", ["importing 'raising_module' raised ValueError: no cluster"]),
    ("broken_import:build", ["raised ModuleNotFoundError", "a_package_not_installed"]),
    ("exiting:build", ["importing 'exiting' raised SystemExit: 3"]),
    ("./models/model.py", ["add the name of its builder"]),
    ("./notes.txt:build", ["'./notes.txt' is not a Python file"]),
    ("meta-llama/Llama-3.1-8B", ["(no such file or directory)", "downloads nothing"]),
    ("./models/model.py:nothing", ["has no attribute 'nothing'"]),
    ("json:dumps", ["needs arguments (obj)"]),
    ("fprep:__version__", ["is not callable"]),
    ("not_json", ["'not_json/config.json'", "not readable JSON"]),
    ("a_list/config.json", ["no model_type"]),
    ("no_model_type", ["no model_type"]),
    ("unknown_type", ["transformers cannot read it", "no_such_model_type"]),
    ("unknown_class", ["has no model class 'NoSuchForLM'"]),
    ("empty_dir", ["holds no config.json"]),
    ("notes.txt", ["not readable JSON"]),
]


@pytest.mark.parametrize(("spec", "needles"), SUBPROCESS_CASES)
def test_a_model_that_cannot_be_built_is_one_line_and_exit_2(
    workdir: Path, spec: str, needles: list[str]
) -> None:
    assert_one_line_error(run_fprep(workdir, "plan", spec, "--json"), *needles)


@pytest.fixture()
def in_workdir(workdir: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """``workdir`` as the current directory; the modules imported from it forgotten after."""
    monkeypatch.chdir(workdir)
    monkeypatch.setattr(sys, "path", list(sys.path))
    before = set(sys.modules)
    yield workdir
    for name in set(sys.modules) - before:
        if getattr(sys.modules[name], "__file__", "") and str(workdir) in str(
            sys.modules[name].__file__
        ):
            del sys.modules[name]


@pytest.mark.parametrize(("spec", "needles"), IN_PROCESS_CASES)
def test_more_models_that_cannot_be_built(
    in_workdir: Path, capsys: pytest.CaptureFixture[str], spec: str, needles: list[str]
) -> None:
    assert main(["plan", spec, "--json"]) == 2
    captured = capsys.readouterr()
    assert_one_line_error(subprocess.CompletedProcess([], 2, captured.out, captured.err), *needles)


def test_a_builder_in_a_file_given_by_its_path(workdir: Path) -> None:
    """FILE.py:BUILDER runs the file (its folder importable) and plans what the builder returns."""
    done = run_fprep(workdir, "plan", "./models/model.py:build", "--json")
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)["model"]["parameters"] == 2 * (12 * 12 + 12)


def test_a_file_named_like_an_imported_module_does_not_replace_it(
    in_workdir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """./shadow/json.py:build runs that file; the json module fprep prints with stays json."""
    assert main(["plan", "./shadow/json.py:build", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["model"]["parameters"] == 2 * (3 * 3 + 3)
    assert sys.modules["json"] is json


def test_what_a_builder_prints_goes_to_stderr(
    in_workdir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["plan", "named_models:build", "--json"]) == 0
    captured = capsys.readouterr()
    assert sorted(json.loads(captured.out)["units"]) == ["", "1.0", "1.1", "1.2"]
    assert "building the model" in captured.err


# -- transformers config.json ------------------------------------------------------------------
TINY_QWEN2: dict[str, Any] = {**TINY_LLAMA, "num_hidden_layers": 3}


def _save_config(directory: Path, config: tf.PretrainedConfig) -> Path:
    config.save_pretrained(directory)
    return directory


def _reference(config: tf.PretrainedConfig) -> torch.nn.Module:
    """What transformers itself builds from the config, in float32, on meta."""
    with torch.device("meta"):
        return tf.AutoModelForCausalLM.from_config(config, dtype=torch.float32)


@pytest.mark.parametrize("family", ["llama", "qwen2"])
@pytest.mark.parametrize("form", ["directory", "file"])
def test_plan_builds_a_config_json_on_meta(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], family: str, form: str
) -> None:
    """A config written by save_pretrained, nothing downloaded: the model transformers builds
    from it, on meta (no memory), wrapped at its decoder layers and planned."""
    config = tf.LlamaConfig(**TINY_LLAMA) if family == "llama" else tf.Qwen2Config(**TINY_QWEN2)
    directory = _save_config(tmp_path / family, config)
    spec = str(directory if form == "directory" else directory / "config.json")
    assert main(["plan", spec, "--world-size", "2", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    reference = _reference(config)
    assert data["model"]["class"] == type(reference).__name__
    assert data["model"]["parameters"] == sum(p.numel() for p in reference.parameters())
    assert data["model"]["meta"] is True
    layers = [f"model.layers.{i}" for i in range(config.num_hidden_layers)]
    assert sorted(data["units"]) == ["", *layers]
    assert data["strategy"] == "fsdp"


def test_the_class_architectures_names_is_the_one_built(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A config naming its architecture builds that class (not the causal-LM default)."""
    config = tf.LlamaConfig(**TINY_LLAMA)
    config.architectures = ["LlamaModel"]  # the decoder without the LM head
    directory = _save_config(tmp_path / "llama_model", config)
    assert main(["plan", str(directory), "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    with torch.device("meta"):
        reference = tf.LlamaModel(config)
    assert data["model"]["class"] == "LlamaModel"
    assert data["model"]["parameters"] == sum(p.numel() for p in reference.parameters())


def test_a_16_bit_config_is_planned_in_float32_and_says_so(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Real config.json files store bfloat16: the plan is for float32 master weights (what
    mixed precision trains), and a note on stderr says so instead of changing it silently."""
    config = tf.LlamaConfig(**TINY_LLAMA, dtype="bfloat16")
    directory = _save_config(tmp_path / "bf16", config)
    assert main(["plan", str(directory), "--precision", "bf16", "--json"]) == 0
    captured = capsys.readouterr()
    data = json.loads(captured.out)
    assert data["memory_bytes"]["params"] == 4 * data["model"]["parameters"]
    assert "stores bfloat16 weights; the plan is for float32 ones" in captured.err
    config32 = tf.LlamaConfig(**TINY_LLAMA, dtype="float32")
    assert main(["plan", str(_save_config(tmp_path / "fp32", config32)), "--json"]) == 0
    assert capsys.readouterr().err == ""


def test_a_config_without_transformers_installed_says_to_install_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    import importlib.util

    directory = _save_config(tmp_path / "llama", tf.LlamaConfig(**TINY_LLAMA))
    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util,
        "find_spec",
        lambda name, *a: None if name == "transformers" else real(name, *a),
    )
    assert main(["plan", str(directory)]) == 2
    captured = capsys.readouterr()
    assert_one_line_error(
        subprocess.CompletedProcess([], 2, captured.out, captured.err),
        "is a transformers config, and transformers is not installed",
        "pip install transformers",
    )


def test_the_command_line_does_not_import_transformers() -> None:
    """transformers takes seconds to import and is optional: only a config.json loads it."""
    code = "import sys, fprep.cli, fprep.cli_model; print('transformers' in sys.modules)"
    done = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        check=True,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )
    assert done.stdout.strip() == "False"
