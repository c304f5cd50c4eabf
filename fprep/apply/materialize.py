"""materialize: turn meta-device parameters into real ones, as the plan says.

Runs after sharding, so a sharded rank only ever allocates its own shards plus, in reproducible
mode, one module's full parameters at a time.

Reproducible mode (``PrepConfig.reproducible_init=True``, the default) seeds each module from
``(seed, module FQN)``, computes its full parameters once on the compute device and keeps this
rank's slice. The result is the same for any world size — 1, 2 or 3 ranks give bitwise the same
full parameters — which raw FSDP2 (each rank running ``reset_parameters`` on its shard) does not
give. It costs each rank the compute of a full initialization, so for very large models
initialized from scratch set ``reproducible_init=False`` (each rank initializes only its shard).
The global RNG state is restored afterwards.
"""

from __future__ import annotations

import zlib
from collections.abc import Callable

import torch
from torch import nn

from fprep.apply.steps import handles_of, step
from fprep.errors import PrepareError
from fprep.progress import Progress
from fprep.state import PrepState, ShardSpec, need


def module_seed(base: int, fqn: str) -> int:
    """A stable per-module seed: the same on every rank and every run."""
    return (base * 1_000_003 + zlib.crc32(fqn.encode())) % (2**63 - 1)


def _initializer(state: PrepState) -> Callable[[nn.Module], None]:
    fn = state.config.param_init_fn
    if fn is not None:
        return fn

    def reset(module: nn.Module) -> None:
        module.reset_parameters()  # type: ignore[operator]

    return reset


def _copy_local_slice(target: nn.Parameter, full: torch.Tensor, spec: ShardSpec, rank: int) -> None:
    local = target.to_local() if hasattr(target, "to_local") else target
    if tuple(local.shape) != spec.local_shape:
        raise PrepareError(
            f"parameter {spec.fqn!r} holds a shard of shape {tuple(local.shape)} but the plan "
            f"predicted {spec.local_shape}.",
            subject=spec.fqn,
        )
    rows = spec.local_shape[0]
    start = spec.padded_shape[0] * rank
    local.copy_(full[start : start + rows])


def _init_reproducibly(
    fqn: str,
    module: nn.Module,
    init: Callable[[nn.Module], None],
    device: torch.device,
    seed: int,
    specs: dict[str, ShardSpec],
    shard_rank: int,
) -> None:
    """Seeded init of one module. Shards get their slice of the full tensor; a tied parameter
    keeps the values its canonical (first-registered) owner gives it, as in eager construction."""
    prefix = f"{fqn}." if fqn else ""
    stand_ins: dict[str, tuple[nn.Parameter, bool]] = {}
    for name, p in module._parameters.items():
        if p is None:
            continue
        spec = specs.get(prefix + name)
        canonical = spec is None or spec.fqn == prefix + name
        sharded = hasattr(p, "to_local")
        if sharded or not canonical:
            stand_ins[name] = (p, canonical and sharded)
            module._parameters[name] = nn.Parameter(
                torch.empty(p.shape, dtype=p.dtype, device=device if sharded else p.device),
                requires_grad=p.requires_grad,
            )
    devices = [device] if device.type != "cpu" else []
    with torch.random.fork_rng(devices=devices, device_type=device.type):
        torch.manual_seed(module_seed(seed, fqn))
        init(module)
    for name, (original, copy_slice) in stand_ins.items():
        full = module._parameters[name]
        module._parameters[name] = original
        if copy_slice and full is not None:
            _copy_local_slice(original, full.detach(), specs[prefix + name], shard_rank)


def _retie(model: nn.Module, specs: dict[str, ShardSpec]) -> None:
    """Point every name of a tied parameter at its canonical object again.

    ``to_empty`` gives a meta parameter a new ``Parameter`` object per module, which silently
    unties weights the model tied (e.g. input and output embeddings).
    """
    for name, spec in specs.items():
        if name == spec.fqn:
            continue
        canonical = model.get_parameter(spec.fqn)
        owner, _, local = name.rpartition(".")
        module = model.get_submodule(owner)
        if module._parameters[local] is not canonical:
            module._parameters[local] = canonical


@step("materialize")
def materialize(state: PrepState, model: nn.Module) -> tuple[PrepState, nn.Module]:
    handles = need(state.param_handles, "init_param_handles", "materialize")
    plan = handles.materialize
    if plan.method == "none":
        return state, model
    core = need(state.core, "init_core", "materialize")
    pg = need(state.process_group, "init_process_group", "materialize")
    device = handles_of(state).device
    storage = torch.device("cpu") if core.offload == "cpu" else device
    init = _initializer(state)
    cfg = state.config
    seed = cfg.seed if cfg.seed is not None else torch.initial_seed()
    specs = {name: s for s in (*handles.specs, *handles.ignored) for name in s.names}
    modules = [(fqn, model.get_submodule(fqn)) for fqn in plan.modules]
    with torch.no_grad():
        # Allocate everything first: a tied parameter is reachable from several modules, and
        # allocating it again after one of them initialized it would lose those values.
        for _, module in modules:
            module.to_empty(device=storage, recurse=False)
        _retie(model, specs)
        progress = Progress(
            "fprep: materialize", len(modules), enabled=None if state.topology.rank == 0 else False
        )
        with progress:
            for fqn, module in modules:
                _materialize_one(state, fqn, module, init, device, seed, specs, pg.shard_rank)
                progress.advance()
    return state, model


def _materialize_one(
    state: PrepState,
    fqn: str,
    module: nn.Module,
    init: Callable[[nn.Module], None],
    device: torch.device,
    seed: int,
    specs: dict[str, ShardSpec],
    shard_rank: int,
) -> None:
    try:
        if state.config.reproducible_init:
            _init_reproducibly(fqn, module, init, device, seed, specs, shard_rank)
        else:
            init(module)
    except PrepareError:
        raise
    except Exception as e:
        raise PrepareError(
            f"initializing module {fqn or '<root>'!r} ({type(module).__name__}) from the "
            f"meta device failed: {type(e).__name__}: {e}",
            subject=fqn,
            hint="Check its reset_parameters() (or your param_init_fn): it must "
            "initialize the module's own parameters and buffers in place.",
        ) from e
