"""``fprep.save_pretrained`` of a peft model: its adapters, as ``PeftModel.save_pretrained``
writes them, which ``PeftModel.from_pretrained(base, path)`` reads.

A directory per adapter (``default`` at ``path``, any other under ``path/<name>``, as peft lays
them out) holding ``adapter_model.safetensors`` and ``adapter_config.json``. peft decides which
tensors belong to the adapter and under which names (``get_peft_model_state_dict``: LoRA
factors, trainable biases, ``modules_to_save`` copies, with the adapter name taken out); fprep
gathers them as ``export_full`` gathers the whole model (every rank takes part, rank 0
writes). The base model is not written: it is the checkpoint the adapters were trained on. To
serve one model, load the adapters onto the base anywhere and merge them with peft's
``merge_and_unload()`` (docs/finetune.md).
"""

from __future__ import annotations

import copy
import os
import tempfile
from pathlib import Path
from typing import Any

from torch import nn

from fprep.checkpoint.collective import Group
from fprep.checkpoint.export import _discard, _failed, _join, export_selected
from fprep.checkpoint.stores.backend import is_url
from fprep.checkpoint.stores.sink import Sink, open_sink
from fprep.errors import CheckpointError
from fprep.state import PrepState
from fprep.unwrap import _original_class as original_class  # FSDP<Class> -> Class

ADAPTER_WEIGHTS = "adapter_model.safetensors"
ADAPTER_CONFIG = "adapter_config.json"


def peft_model_of(model: nn.Module) -> nn.Module | None:
    """The peft model (``PeftModel``, or a tuner such as ``LoraModel``): the model itself, or
    what DDP or ``torch.compile`` wrap; None for any other model."""
    for candidate in (model, getattr(model, "module", None), getattr(model, "_orig_mod", None)):
        if isinstance(candidate, nn.Module) and isinstance(
            getattr(candidate, "peft_config", None), dict
        ):
            return candidate
    return None


def save_adapters(
    path: str | os.PathLike[str], state: PrepState, model: nn.Module, peft_model: nn.Module
) -> Path | str:
    """Write every adapter of ``peft_model`` (``model`` or inside it) under ``path``."""
    group = Group.of(state)
    directory: Path | str = str(path).rstrip("/") if is_url(path) else Path(path)
    configs: dict[str, Any] = getattr(peft_model, "peft_config")  # noqa: B009
    error: BaseException | None = None
    files: list[tuple[str, Path | str, bytes]] = []
    try:
        for name, config in configs.items():
            _refuse_unsupported(name, config)
            where = directory if name == "default" else _join(directory, name)
            weights = state.config.weights
            source = str(weights) if weights is not None else None
            files.append((name, where, _config_bytes(config, peft_model, source)))
    except Exception as e:
        error = _failed(e, directory)
    group.agree(error)
    for name, where, _ in files:
        export_selected(_join(where, ADAPTER_WEIGHTS), state, model, _selector(peft_model, name))
    error = None
    if group.rank == 0:
        for _, where, data in files:
            config_path = _join(where, ADAPTER_CONFIG)
            sink: Sink | None = None
            try:
                sink = open_sink(config_path)
                sink.write(data)
                sink.commit()
                sink = None
            except Exception as e:
                error = _failed(e, config_path)
                break
            finally:
                _discard(sink)
    group.agree(error)
    return directory


def _refuse_unsupported(name: str, config: Any) -> None:
    if getattr(config, "is_prompt_learning", False):
        raise CheckpointError(
            f"adapter {name!r} is a prompt-learning adapter ({config.peft_type}): its weights "
            "are not parameters of the model's layers, and fprep.save_pretrained writes "
            "layer adapters (LoRA and the like) only.",
            subject=name,
            hint="Gather the model with fprep.unwrap on one process and call peft's "
            "save_pretrained there.",
        )


def _config_bytes(config: Any, peft_model: nn.Module, weights: str | None) -> bytes:
    """``adapter_config.json`` as ``PeftModel.save_pretrained`` writes it: peft's own
    serialization of a copy (the caller's config is not changed) in inference mode, naming the
    base model (its ``name_or_path``, else the ``weights=`` it was prepared from) and, without
    a task type, its class (the original one, not FSDP's)."""
    saved = copy.deepcopy(config)
    saved.inference_mode = True
    inner = _base_model(peft_model)
    if saved.base_model_name_or_path is None:
        known = inner.__dict__.get("name_or_path", None) if inner is not None else None
        saved.base_model_name_or_path = known or weights or None
    mapping = None
    if saved.task_type is None and inner is not None:
        cls = original_class(inner)
        mapping = {"base_model_class": cls.__name__, "parent_library": cls.__module__}
    with tempfile.TemporaryDirectory() as scratch:
        saved.save_pretrained(scratch, auto_mapping_dict=mapping)
        return (Path(scratch) / ADAPTER_CONFIG).read_bytes()


def _base_model(peft_model: nn.Module) -> nn.Module | None:
    """The model peft wraps (``base_model.model`` of a ``PeftModel``, ``model`` of a tuner)."""
    for at in ("base_model.model", "model"):
        try:
            return peft_model.get_submodule(at)
        except AttributeError:
            continue
    return None


def _selector(peft_model: nn.Module, adapter: str) -> Any:
    """The adapter's tensors under peft's names, picked by peft from fprep's state dict."""

    def select(state_dict: dict[str, Any]) -> dict[str, Any]:
        from peft import get_peft_model_state_dict

        picked: dict[str, Any] = get_peft_model_state_dict(
            peft_model, state_dict=dict(state_dict), adapter_name=adapter
        )
        known = {id(v) for v in state_dict.values()}
        foreign = [k for k, v in picked.items() if id(v) not in known]
        if foreign:
            raise CheckpointError(
                f"peft's state dict of adapter {adapter!r} holds {foreign[0]!r}, which is not "
                "one of the model's parameters or buffers (peft computed it), so fprep cannot "
                "gather it.",
                subject=foreign[0],
                hint="Gather the model with fprep.unwrap on one process and call peft's "
                "save_pretrained there.",
            )
        return picked

    return select
