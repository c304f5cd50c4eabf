"""The tensor-parallel styles of transformers' plans beyond colwise and rowwise, as torch
``ParallelStyle``s.

A style is told two things about one module: the placement on the tp mesh of each of its own
(direct) parameters, and one behaviour, what its forward does around the sharded parameters.
``parallelize_module`` applies it: each listed parameter becomes a DTensor made from its current
values (``distribute_tensor``), and hooks give the forward the behaviour. The parameters stay
DTensors between forwards, so FSDP2 (``fully_shard`` over the data-parallel dims), DCP,
``full_tensor()`` and activation checkpointing see what they see under torch's own styles.

The behaviours are transformers' style names (``transformers.distributed.tensor_parallel``):

- ``none``: the parameters are placed; the forward is left alone.
- ``packed_colwise``: a Linear whose output packs two halves (gate | up), its weight
  ``_StridedShard(0, split_factor=2)``: it runs on its local block, from the whole input
  (whose gradient is summed over tp), and gives this rank's block of each half.
- ``local_params``: the forward runs on its parameters' local blocks (attention sinks).
- ``replicated_with_grad_allreduce``: a replicated weight used on this rank's heads only
  (Qwen3's per-head ``q_norm`` / ``k_norm``); its gradient is summed over the tp ranks.
- ``all_reduce``: the forward computes, from whole (replicated) inputs, a partial output on
  its parameters' local blocks (Inkling's shared experts): the output is summed, and so are
  the floating-point inputs' gradients.
- ``mla_kv_a_proj``: multi-head latent attention's ``kv_a_proj_with_mqa``; the rope part of its
  output skips the colwise ``kv_b_proj`` and meets this rank's heads only, so its gradient is
  summed over the tp ranks (the width of that part, ``qk_rope_head_dim``, is given).
- ``moe_tp_experts``: every rank runs every expert on its block of the expert weights
  (``packed_colwise`` gate/up, ``rowwise`` down): the floating-point inputs (hidden states,
  routing weights) have their gradients summed, the output is summed.
- ``moe_identity_expert``: an identity expert inside ``moe_tp_experts``, whose output would be
  summed tp times: its input is divided by the tp size.

All communication goes through DTensor: ``from_local(x, [Partial()]).redistribute([Replicate()])``
sums a tensor over the tp ranks, ``from_local(x, [Replicate()]).to_local(grad_placements=
[Partial()])`` sums its gradient in backward.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Literal, get_args

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial, Placement, Replicate, distribute_tensor
from torch.distributed.tensor.parallel import ParallelStyle
from torch.distributed.tensor.placement_types import Shard, _StridedShard

from fprep.errors import ConfigError, ModelError

Behaviour = Literal[
    "none",
    "packed_colwise",
    "local_params",
    "replicated_with_grad_allreduce",
    "all_reduce",
    "mla_kv_a_proj",
    "moe_tp_experts",
    "moe_identity_expert",
]
BEHAVIOURS: tuple[str, ...] = get_args(Behaviour)

#: behaviours whose forward runs on the local blocks of the module's DTensor parameters
_LOCAL_FORWARD = frozenset(
    {
        "packed_colwise",
        "local_params",
        "replicated_with_grad_allreduce",
        "all_reduce",
        "mla_kv_a_proj",
        "moe_tp_experts",
    }
)


def sum_over(x: torch.Tensor, mesh: DeviceMesh) -> torch.Tensor:
    """``x`` (each rank's partial value) summed over the mesh, as a local tensor; its gradient
    passes through unchanged."""
    whole = DTensor.from_local(x, mesh, [Partial()], run_check=False)
    return whole.redistribute(mesh, [Replicate()]).to_local()


def sum_grad_over(x: torch.Tensor, mesh: DeviceMesh) -> torch.Tensor:
    """``x`` unchanged, whose gradient (each rank's partial value) is summed over the mesh."""
    if isinstance(x, DTensor):
        return x.redistribute(mesh, [Replicate()]).to_local(grad_placements=[Partial()])
    whole = DTensor.from_local(x, mesh, [Replicate()], run_check=False)
    return whole.to_local(grad_placements=[Partial()])


class ModuleStyle(ParallelStyle):
    """Places a module's own parameters on the tp mesh (``params``: name -> torch placement)
    and gives its forward one ``behaviour``. ``rope_dim``: ``mla_kv_a_proj``'s
    ``qk_rope_head_dim`` (the last ``rope_dim`` output features are the rope part)."""

    def __init__(
        self,
        behaviour: Behaviour,
        params: Mapping[str, Placement] | None = None,
        *,
        rope_dim: int | None = None,
    ) -> None:
        super().__init__()
        if behaviour not in BEHAVIOURS:
            raise ConfigError(
                f"Unknown tensor-parallel module behaviour {behaviour!r}.",
                subject="tp_plan",
                hint=f"Behaviours: {', '.join(BEHAVIOURS)}.",
            )
        self.behaviour = behaviour
        self.params = dict(params or {})
        if behaviour == "mla_kv_a_proj" and (rope_dim is None or rope_dim <= 0):
            raise ConfigError(
                f"'mla_kv_a_proj' needs the width of the rope part of the output, got "
                f"rope_dim={rope_dim!r}.",
                subject="tp_plan",
                hint="Pass rope_dim=config.qk_rope_head_dim (the model config's).",
            )
        self.rope_dim = rope_dim
        if behaviour == "replicated_with_grad_allreduce":
            sharded = sorted(n for n, p in self.params.items() if not p.is_replicate())
            if sharded:
                raise ConfigError(
                    f"'replicated_with_grad_allreduce' keeps its parameters whole on every tp "
                    f"rank, but {', '.join(sharded)} are given sharded placements.",
                    subject="tp_plan",
                    hint="Give them Replicate(), or use 'local_params' for sharded parameters.",
                )

    def __repr__(self) -> str:
        return f"ModuleStyle({self.behaviour!r}, {self.params!r})"

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        if device_mesh.ndim != 1:
            raise ConfigError(
                f"ModuleStyle applies on the tp mesh alone, got a {device_mesh.ndim}-D mesh.",
                subject="tp_plan",
                hint="Pass the tp sub-mesh (mesh['tp']) to parallelize_module.",
            )
        tp = device_mesh.size()
        for name, placement in self.params.items():  # every check before any change
            param = module._parameters.get(name)
            if param is None:
                owned = ", ".join(n for n, _ in module.named_parameters(recurse=False))
                raise ModelError(
                    f"{type(module).__name__} has no parameter {name!r} of its own to place "
                    f"on the tp mesh (it has: {owned or 'none'}).",
                    subject=name,
                    hint="Name the module's direct parameters in the plan.",
                )
            _check_divisible(module, name, param, placement, tp)
        for name, placement in self.params.items():
            param = module._parameters[name]
            assert param is not None
            dist = distribute_tensor(
                param.detach(), device_mesh, [placement], src_data_rank=self.src_data_rank
            )
            module._parameters[name] = nn.Parameter(dist, requires_grad=param.requires_grad)
        _install(module, self, device_mesh)
        return module


def _check_divisible(
    module: nn.Module, name: str, param: torch.Tensor, placement: Placement, tp: int
) -> None:
    """Sharded dims must split evenly: the local forwards assume equal blocks (a packed
    gate/up block must still halve into this rank's gate and up columns)."""
    if isinstance(placement, _StridedShard):
        dim, parts = placement.dim, tp * int(placement.split_factor)
    elif isinstance(placement, Shard):
        dim, parts = placement.dim, tp
    else:
        return
    if param.ndim == 0 or param.shape[dim] % parts:
        raise ModelError(
            f"{type(module).__name__}.{name} of shape {tuple(param.shape)} cannot take "
            f"{placement}: its dim {dim} does not split into {parts} equal blocks at tp {tp}.",
            subject=name,
            hint="Choose a tp size that divides it, or leave this module out of the tp plan.",
        )


def _install(module: nn.Module, style: ModuleStyle, mesh: DeviceMesh) -> None:
    """The forward pre-hook and hook that give ``module`` its behaviour."""
    behaviour = style.behaviour
    swapped: list[dict[str, nn.Parameter]] = []  # a stack: a forward may be re-entered

    def before(_: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        if behaviour in ("moe_tp_experts", "all_reduce", "packed_colwise"):
            args = tuple(_grad_summed(a, mesh) for a in args)
            kwargs = {k: _grad_summed(v, mesh) for k, v in kwargs.items()}
        elif behaviour == "moe_identity_expert" and args:
            args = (args[0] / mesh.size(), *args[1:])
        if behaviour in _LOCAL_FORWARD:
            swapped.append(_use_local_views(module, mesh, behaviour))
        return args, kwargs

    def after(_: nn.Module, args: Any, kwargs: Any, output: Any) -> Any:
        if behaviour in _LOCAL_FORWARD and swapped:
            module._parameters.update(swapped.pop())
        if behaviour in ("all_reduce", "moe_tp_experts"):
            return sum_over(_one_tensor(module, output, behaviour), mesh)
        if behaviour == "mla_kv_a_proj":
            assert style.rope_dim is not None
            out = _one_tensor(module, output, behaviour)
            width = out.shape[-1] - style.rope_dim
            kept, rope = out.narrow(-1, 0, width), out.narrow(-1, width, style.rope_dim)
            return torch.cat([kept, sum_grad_over(rope, mesh)], dim=-1)
        return None

    if behaviour == "none":
        return
    module.register_forward_pre_hook(before, with_kwargs=True)
    # always_call: the DTensor parameters come back even when the forward raises
    module.register_forward_hook(after, with_kwargs=True, always_call=True)


def _use_local_views(module: nn.Module, mesh: DeviceMesh, behaviour: str) -> dict[str, Any]:
    """Swap the module's DTensor parameters for their local blocks; returns the originals."""
    originals = {n: p for n, p in module.named_parameters(recurse=False) if isinstance(p, DTensor)}
    for name, param in originals.items():
        local = param.to_local()
        if behaviour == "replicated_with_grad_allreduce":
            # Each rank's gradient covers its own heads only: summed over tp by DTensor's
            # autograd, so the parameter's .grad is the whole (Replicate) gradient, also
            # without FSDP (whose reduce-scatter would redistribute a Partial one, plain
            # optimizers and clipping would not). Hooks on the gradient would not fire
            # under FSDP2, which accumulates into its own sharded gradients.
            local = sum_grad_over(local, mesh)
        module._parameters[name] = local  # type: ignore[assignment]
    return originals


def _grad_summed(value: Any, mesh: DeviceMesh) -> Any:
    """A floating-point tensor input, its gradient summed over tp (each rank back-propagates
    through its own block of the weights only); other values unchanged."""
    if isinstance(value, torch.Tensor) and value.is_floating_point():
        return sum_grad_over(value, mesh)
    return value


def _one_tensor(module: nn.Module, output: Any, behaviour: str) -> torch.Tensor:
    if isinstance(output, DTensor):
        raise ModelError(
            f"{type(module).__name__}'s forward returned a DTensor under {behaviour!r}, "
            "which expects a local tensor.",
            subject=behaviour,
            hint="Run this module on local tensors (no DTensor parameters of other styles).",
        )
    if not isinstance(output, torch.Tensor):
        raise ModelError(
            f"{type(module).__name__}'s forward returned {type(output).__name__}; "
            f"{behaviour!r} needs one tensor.",
            subject=behaviour,
            hint="Give the style to the submodule whose output is one tensor.",
        )
    return output
