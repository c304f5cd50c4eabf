"""The model ``fprep plan`` plans, from the way the command line names it, built on meta.

Three ways to name a model:

* ``MODULE:BUILDER``: a function (or class) importable from the current directory or
  ``PYTHONPATH`` that takes no arguments and returns an ``nn.Module``;
* ``FILE.py:BUILDER``: the same, from a Python file given by its path;
* a transformers ``config.json``, or a directory holding one: the model transformers builds
  from it (the class its ``architectures`` names, else ``AutoModelForCausalLM``), so a model can
  be sized before it is downloaded. transformers is imported only then.

Whatever goes wrong (no such module, file or attribute, a builder that needs arguments or
raises, a result that is not a module, a config transformers cannot read) is a one-line
``ConfigError`` naming the culprit and what to do, never a traceback. The builder runs with
its standard output sent to standard error, so that ``fprep plan --json`` stays parseable.
"""

from __future__ import annotations

import contextlib
import importlib
import importlib.util
import inspect
import json
import os
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

import torch

from fprep.errors import ConfigError

#: How the command line names a model: the hint of every error about it.
FORMS = (
    "Name a model as MODULE:BUILDER (e.g. mypkg.models:build_model), FILE.py:BUILDER "
    "(e.g. ./model.py:build), where BUILDER takes no arguments and returns an nn.Module, or as "
    "a transformers config.json (or a directory holding one)."
)


def build_model(spec: str, *, notes: list[str] | None = None) -> torch.nn.Module:
    """The model ``spec`` names, built on the meta device; a ``ConfigError`` if it cannot be.

    ``notes`` collects what the caller should tell the user about how the model was built.
    """
    path = Path(spec)
    if path.is_dir() or (path.is_file() and not spec.endswith(".py")):
        return _from_config(path, notes if notes is not None else [])
    source, sep, attr = spec.rpartition(":")
    if not sep or not source or not attr:
        raise ConfigError(
            f"expected MODULE:BUILDER, FILE.py:BUILDER or a config.json, got {spec!r}"
            + _why_not_a_model(spec, path)
            + ".",
            subject="builder",
            hint="For example: fprep plan mypkg.models:build_model --world-size 64, or "
            "fprep plan path/to/config.json (fprep downloads nothing: fetch a Hub model's "
            "config.json first).",
        )
    module = _load_file(source) if _looks_like_path(source) else _import(source)
    builder = _attribute(module, source, attr)
    return _call_on_meta(builder, spec)


def _why_not_a_model(spec: str, path: Path) -> str:
    if spec.endswith(".py"):
        return " (a Python file: add the name of its builder, FILE.py:BUILDER)"
    if _looks_like_path(spec) and not path.exists():
        return " (no such file or directory)"
    return ""


def _looks_like_path(text: str) -> bool:
    return "/" in text or os.sep in text or text.endswith((".py", ".json"))


def _one_line(error: BaseException) -> str:
    """``error`` as ``Type: message`` on one line (messages may span several)."""
    text = " ".join(str(error).split())
    if len(text) > 300:
        text = text[:297] + "..."
    return f"{type(error).__name__}: {text}" if text else type(error).__name__


@contextlib.contextmanager
def _stdout_to_stderr() -> Iterator[None]:
    """The user's code may print; ``--json``'s standard output must stay JSON."""
    with contextlib.redirect_stdout(sys.stderr):
        yield


def _import(name: str) -> ModuleType:
    if os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())
    try:
        with _stdout_to_stderr():
            return importlib.import_module(name)
    except ModuleNotFoundError as e:
        missing = e.name or ""
        if missing and (name == missing or name.startswith(missing + ".")):
            raise ConfigError(
                f"cannot import {name!r}: no module named {missing!r}.",
                subject="builder",
                hint="Check the name; the current directory and PYTHONPATH are searched. " + FORMS,
            ) from None
        raise _import_raised(name, e) from None
    except (Exception, SystemExit) as e:  # the module's own code failed
        raise _import_raised(name, e) from None


def _import_raised(name: str, error: BaseException) -> ConfigError:
    return ConfigError(
        f"importing {name!r} raised {_one_line(error)}.",
        subject="builder",
        hint=f"Fix the module (python -c 'import {name}' shows the traceback).",
    )


def _load_file(source: str) -> ModuleType:
    """The Python file ``source`` run as a module (named after the file, its folder importable,
    as ``python FILE.py`` would have it)."""
    path = Path(source).expanduser()
    if path.suffix != ".py":
        raise ConfigError(
            f"{source!r} is not a Python file (FILE.py:BUILDER needs a .py file).",
            subject="builder",
            hint=FORMS,
        )
    if not path.is_file():
        raise ConfigError(
            f"no such file: {source!r}.",
            subject="builder",
            hint="Check the path (relative paths start from the current directory). " + FORMS,
        )
    folder = str(path.resolve().parent)
    if folder not in sys.path:
        sys.path.insert(0, folder)
    # Named after the file, unless that would replace a module already imported (json.py).
    name = path.stem if path.stem not in sys.modules else f"_fprep_plan_{path.stem}"
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None  # a .py file always has a loader
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses and pickling look the module up by name
    try:
        with _stdout_to_stderr():
            spec.loader.exec_module(module)
    except (Exception, SystemExit) as e:
        del sys.modules[name]
        raise ConfigError(
            f"running {source!r} raised {_one_line(e)}.",
            subject="builder",
            hint=f"Fix the file (python {source} shows the traceback).",
        ) from None
    return module


def _attribute(module: ModuleType, source: str, attr: str) -> Callable[[], Any]:
    obj: Any = module
    for i, part in enumerate(attr.split(".")):
        where = ".".join([source, *attr.split(".")[:i]])
        try:  # lazy modules (transformers) import on attribute access, and that may fail
            obj = getattr(obj, part)
        except AttributeError:
            raise ConfigError(
                f"{where!r} has no attribute {part!r}.",
                subject="builder",
                hint="Name the function that builds the model, e.g. "
                f"{source}:build_model. " + FORMS,
            ) from None
        except Exception as e:
            raise ConfigError(
                f"looking up {part!r} in {where!r} raised {_one_line(e)}.",
                subject="builder",
                hint="Install what the error names, or name another builder.",
            ) from None
    if not callable(obj):
        raise ConfigError(
            f"'{source}:{attr}' is not callable.",
            subject="builder",
            hint="Name a function that takes no arguments and returns the model.",
        )
    return obj  # type: ignore[no-any-return]


def _required_arguments(builder: Callable[[], Any]) -> list[str]:
    """The parameters ``builder`` cannot be called without (none when it cannot be told)."""
    try:
        signature = inspect.signature(builder)
    except Exception:  # builtins and C classes may have none: the call will tell
        return []
    return [
        p.name
        for p in signature.parameters.values()
        if p.default is inspect.Parameter.empty
        and p.kind not in (inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.VAR_KEYWORD)
    ]


def _needs_arguments_hint(builder: Callable[[], Any]) -> str:
    if isinstance(builder, type) and getattr(builder, "config_class", None) is not None:
        # A transformers model class: its config says what to build.
        return (
            "A transformers model is built from its config: pass its config.json (or the "
            "directory holding it), e.g. fprep plan path/to/config.json."
        )
    return (
        "Name a function that takes no arguments and returns the model, e.g. "
        "def build(): return MyModel(dim=4096), in a module or file of your own."
    )


def _call_on_meta(builder: Callable[[], Any], spec: str) -> torch.nn.Module:
    required = _required_arguments(builder)
    if required:
        raise ConfigError(
            f"{spec!r} needs arguments ({', '.join(required)}); fprep plan calls it with none.",
            subject="builder",
            hint=_needs_arguments_hint(builder),
        )
    try:
        with _stdout_to_stderr(), torch.device("meta"):
            model = builder()
    except (Exception, SystemExit) as e:
        hint = (
            _needs_arguments_hint(builder)
            if isinstance(e, TypeError)
            else "Fix the builder; it runs under torch.device('meta') (no tensor data)."
        )
        raise ConfigError(
            f"calling {spec!r} raised {_one_line(e)}.", subject="builder", hint=hint
        ) from None
    if not isinstance(model, torch.nn.Module):
        raise ConfigError(
            f"the builder returned {type(model).__qualname__}, not an nn.Module.",
            subject="builder",
            hint="Return the model itself from the builder.",
        )
    return model


# -- transformers config.json -----------------------------------------------------------------
def _from_config(path: Path, notes: list[str]) -> torch.nn.Module:
    """The model transformers builds from ``path`` (a config.json or a directory holding one),
    in float32 (mixed-precision training's master weights) on the meta device."""
    file = path / "config.json" if path.is_dir() else path
    if not file.is_file():
        raise ConfigError(
            f"the directory {str(path)!r} holds no config.json.",
            subject="builder",
            hint="Pass a directory written by save_pretrained, or the config.json itself.",
        )
    try:
        raw = json.loads(file.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise _bad_config(file, f"it is not readable JSON ({_one_line(e)})") from None
    if not isinstance(raw, dict) or "model_type" not in raw:
        raise _bad_config(file, "it has no model_type, so it is not a transformers config")
    if importlib.util.find_spec("transformers") is None:
        raise ConfigError(
            f"{str(file)!r} is a transformers config, and transformers is not installed.",
            subject="builder",
            hint="pip install transformers, or name a builder function (MODULE:BUILDER).",
        )
    import transformers  # here only: it takes seconds to import and is optional

    try:  # trust_remote_code=False: refuse, rather than ask on stdin, to run a repository's code
        config = transformers.AutoConfig.from_pretrained(str(file), trust_remote_code=False)
    except Exception as e:
        if "auto_map" in raw:
            why = "its model needs code from the model's repository (auto_map), which fprep does "
            raise _bad_config(file, why + "not run") from None
        raise _bad_config(file, f"transformers cannot read it ({_one_line(e)})") from None
    stored = str(getattr(config, "dtype", None) or "float32").removeprefix("torch.")
    if stored != "float32":  # a torch.dtype, or its name in older transformers
        notes.append(
            f"{file} stores {stored} weights; the plan is for "
            "float32 ones (mixed precision's master weights). For 16-bit parameters, build "
            "the model in a builder function of your own."
        )
    try:
        with _stdout_to_stderr(), torch.device("meta"):
            model = _build(transformers, config, file)
    except ConfigError:
        raise
    except Exception as e:
        raise _bad_config(file, f"transformers cannot build it ({_one_line(e)})") from None
    if not isinstance(model, torch.nn.Module):  # pragma: no cover - transformers builds modules
        raise _bad_config(file, f"transformers built a {type(model).__qualname__}")
    return model


def _bad_config(file: Path, why: str) -> ConfigError:
    return ConfigError(
        f"cannot build a model from {str(file)!r}: {why}.",
        subject="builder",
        hint="Pass a config.json written by transformers' save_pretrained (fprep runs no code "
        "from a model's repository), or name a builder function: MODULE:BUILDER.",
    )


def _build(transformers: Any, config: Any, file: Path) -> Any:
    """The class named first in ``architectures`` when this transformers has it (built as the
    Auto classes build theirs: ``_from_config`` applies ``dtype`` and the attention
    implementation), else ``AutoModelForCausalLM`` (configs written from a config object name
    no architecture). Always in float32, on the meta device the caller set."""
    names = getattr(config, "architectures", None) or []
    if not names:
        auto = transformers.AutoModelForCausalLM
        return auto.from_config(config, dtype=torch.float32, trust_remote_code=False)
    cls = getattr(transformers, names[0], None)
    if cls is None or not hasattr(cls, "_from_config"):
        raise _bad_config(
            file,
            f"transformers {transformers.__version__} has no model class {names[0]!r} "
            "(its architectures)",
        )
    return cls._from_config(config, dtype=torch.float32)
