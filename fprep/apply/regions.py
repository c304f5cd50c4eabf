"""Activation checkpointing and compilation, applied per wrap unit (a "region").

Regions are the outermost non-root units (nested units would be recomputed or compiled twice);
without a wrap policy the root is the one region. Checkpointing runs each region's forward under
torch's non-reentrant ``torch.utils.checkpoint.checkpoint`` (``fprep.apply.recompute`` says why
not the composable API's hooks): an instance attribute, every FQN kept, and the same mechanism
eager and compiled — dynamo compiles the recompute with the region. One exception, a torch
bug: regions compiled under tensor parallelism keep the composable API's hooks
(``_hooks_under_tp``). Compilation uses ``nn.Module.compile`` (in place, FQNs kept); each
repeated block's code is compiled once and reused across instances. Order in the default
pipeline: checkpointing, then regional compile, then sharding — the order torchtitan uses, so
FSDP2's hooks wrap the compiled, checkpointed blocks. Under tensor parallelism, the outputs of
the parallelized modules outside the regions are waited for before they enter one
(``fprep.apply.async_outputs`` says why).
"""

from __future__ import annotations

from typing import Any

from torch import nn

from fprep.apply.async_outputs import wait_outputs_of
from fprep.apply.kv_cache import compile_without_cache
from fprep.apply.recompute import checkpoint_of, install_checkpoint
from fprep.apply.steps import handles_of, skipped, step
from fprep.errors import PrepareError
from fprep.layout.styles import STYLES
from fprep.snapshot import is_within
from fprep.state import PrepState, need

_COMPILED_ATTR = "_fprep_compiled"


def regions(state: PrepState) -> tuple[str, ...]:
    """FQNs of the outermost non-root units, in forward (pre-)order; ``("",)`` if none."""
    handles = need(state.param_handles, "init_param_handles", "regions")
    units = [u.fqn for u in reversed(handles.units) if u.fqn]
    outer = [u for u in units if not any(o != u and o and is_within(u, o) for o in units)]
    return tuple(outer) or ("",)


def _hooks_under_tp(state: PrepState) -> bool:
    """Regions compiled over tensor-parallel DTensors keep torch's composable checkpoint
    (hooks; tested equal to eager there): dynamo's checkpoint op saves the DeviceMesh among the
    tensors for backward (AOTAutograd: "expected all tensors_saved_with_vc_check to be
    Tensors", torch 2.13, fsdp 2 x tp 2)."""
    return state.tensor_parallel is not None and state.config.compile == "regional"


@step("checkpoint")
def checkpoint(state: PrepState, model: nn.Module) -> tuple[PrepState, nn.Module]:
    if not state.config.activation_checkpointing:
        return skipped(state, model)
    if _hooks_under_tp(state):
        from torch.distributed._composable.checkpoint_activation import (
            checkpoint as composable_checkpoint,
        )

        for fqn in regions(state):
            composable_checkpoint(model.get_submodule(fqn))
        return state, model
    for fqn in regions(state):
        module = model.get_submodule(fqn)
        if checkpoint_of(module) is not None:
            raise PrepareError(
                f"module {fqn or '<root>'!r} is already checkpointed by fprep.",
                subject=fqn,
                hint="Prepare once; a custom pipeline should run the checkpoint step once.",
            )
        install_checkpoint(module)
    return state, model


def _compile_kwargs(state: PrepState) -> dict[str, Any]:
    cfg = state.config
    backend = cfg.compile_backend
    handle = handles_of(state).device_handle
    if backend is None and handle is not None:
        backend = handle.compile_backend  # hpu_backend on Gaudi; torch's default elsewhere
    kwargs: dict[str, Any] = {}
    if backend is not None:
        kwargs["backend"] = backend
    if cfg.compile_mode is not None:
        kwargs["mode"] = cfg.compile_mode
    return kwargs


def _compile(module: nn.Module, fqn: str, kwargs: dict[str, Any]) -> None:
    if getattr(module, _COMPILED_ATTR, False):
        raise PrepareError(
            f"module {fqn or '<root>'!r} is already compiled by fprep.",
            subject=fqn,
            hint="Compile once: choose compile='whole' or 'regional', and prepare once.",
        )
    module.compile(**kwargs)
    setattr(module, _COMPILED_ATTR, True)


def _compile_region(module: nn.Module, fqn: str, kwargs: dict[str, Any]) -> None:
    """A region compiled on its own; a transformers layer trains without its write-only KV
    cache (``fprep.apply.kv_cache``: otherwise each layer recompiles, and past dynamo's
    recompile limit the rest run uncompiled)."""
    _compile(module, fqn, kwargs)
    compile_without_cache(module)


def _tp_outside(state: PrepState, compiled: tuple[str, ...]) -> tuple[str, ...]:
    """Tensor-parallel modules outside the compiled regions: their outputs may enter one."""
    tps = state.tensor_parallel
    if tps is None:
        return ()
    return tuple(
        fqn
        for fqn, name in tps.modules
        if STYLES[name].kind != "replicate" and not any(is_within(fqn, r) for r in compiled)
    )


@step("compile_regions")
def compile_regions(state: PrepState, model: nn.Module) -> tuple[PrepState, nn.Module]:
    if state.config.compile != "regional":
        return skipped(state, model)
    kwargs = _compile_kwargs(state)
    compiled = regions(state)
    for fqn in compiled:
        _compile_region(model.get_submodule(fqn), fqn, kwargs)
    wait_outputs_of(model, _tp_outside(state, compiled))  # see fprep.apply.async_outputs
    return state, model


@step("compile_whole")
def compile_whole(state: PrepState, model: nn.Module) -> tuple[PrepState, nn.Module]:
    if state.config.compile != "whole":
        return skipped(state, model)
    _compile(model, "", _compile_kwargs(state))
    return state, model
