"""experts: each rank keeps its experts and sends every routed token to the rank holding its
expert (expert parallelism, ``PrepState.expert_parallel``).

The step builds the expert mesh ``(dp_replicate, efsdp, ep)`` over the world (ep innermost, as
the mesh record lays it out), then, for every experts module of the plan, keeps this rank's
experts of each parameter (the values one process holds for them) and gives the module a
forward that

1. sorts the ``(token, expert)`` pairs of this rank's batch by expert, hence by the rank that
   holds the expert;
2. exchanges the counts, then the tokens, with the ep group (``all_to_all_single_autograd``:
   backward sends the gradients back the same way);
3. runs the local experts on what it received, grouped by expert: one grouped GEMM per
   projection where this torch has one on this device (``fprep.compat.grouped_mm``), a loop over
   the local experts otherwise;
4. sends the results back and sums each token's results weighted by its routing weights, as
   the model's own forward does.

Every local expert runs, also on no rows, so that each expert parameter gets a gradient (zero
when no token chose it) and the FSDP reduction over efsdp sees the same parameters everywhere.
The ``shard`` step then shards the experts over efsdp before their block (``shard_experts``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from fprep.apply.steps import handles_of, skipped, step, with_handles
from fprep.compat import grouped_mm
from fprep.errors import ConfigError, PrepareError
from fprep.state import ExpertModule, ExpertParallelState, PrepState

#: What the experts' forward needs of their layout (transformers' ``use_experts_implementation``
#: attributes): concatenated gate and up projections, not transposed, no biases.
_LAYOUT = (("is_transposed", False), ("is_concatenated", True), ("has_bias", False))


def _check_layout(module: nn.Module, fqn: str) -> None:
    for name, want in _LAYOUT:
        if getattr(module, name, want) != want:
            raise ConfigError(
                f"expert parallelism over {fqn!r} ({type(module).__name__}): its {name} is "
                f"{getattr(module, name)!r}; fprep dispatches experts stored as transformers' "
                "default layout only (gate and up projections concatenated, not transposed, "
                "no biases).",
                subject=fqn,
                hint="Leave this module out of the expert-parallel plan, or set ep=1.",
            )
    if getattr(module, "has_gate", True) is not True or not callable(
        getattr(module, "act_fn", None)
    ):
        raise ConfigError(
            f"expert parallelism over {fqn!r} ({type(module).__name__}): it has no gated "
            "activation act_fn.",
            subject=fqn,
            hint="Leave this module out of the expert-parallel plan, or set ep=1.",
        )


def _wait(t: torch.Tensor) -> torch.Tensor:
    from torch.distributed import _functional_collectives as funcol

    if isinstance(t, funcol.AsyncCollectiveTensor):
        waited: torch.Tensor = funcol.wait_tensor(t)  # type: ignore[no-untyped-call]
        return waited
    return t


def run_local_experts(
    module: nn.Module, rows: torch.Tensor, sizes: list[int], use_grouped: bool
) -> torch.Tensor:
    """The local experts on ``rows``, grouped by expert (``sizes[j]`` rows for expert ``j``)."""
    gate_up, down = _weights(module)
    act: Callable[[torch.Tensor], torch.Tensor] = getattr(module, "act_fn")  # noqa: B009
    if use_grouped:
        ends = torch.tensor(sizes, device=rows.device).cumsum(0).to(torch.int32)
        projected = torch._grouped_mm(rows, gate_up.transpose(-2, -1), offs=ends)
        gate, up = projected.chunk(2, dim=-1)
        return torch._grouped_mm(act(gate) * up, down.transpose(-2, -1), offs=ends)
    outs = []
    for j, part in enumerate(torch.split(rows, sizes)):
        gate, up = nn.functional.linear(part, gate_up[j]).chunk(2, dim=-1)
        outs.append(nn.functional.linear(act(gate) * up, down[j]))
    return torch.cat(outs)


def _weights(module: nn.Module) -> tuple[torch.Tensor, torch.Tensor]:
    """The experts' ``gate_up_proj`` and ``down_proj`` as the forward sees them (gathered)."""
    gate_up, down = getattr(module, "gate_up_proj"), getattr(module, "down_proj")  # noqa: B009
    assert isinstance(gate_up, torch.Tensor) and isinstance(down, torch.Tensor)
    return gate_up, down


def _aligned(module: nn.Module, rows: torch.Tensor) -> bool:
    """``torch._grouped_mm`` needs every row stride a multiple of 16 bytes."""
    size = rows.element_size()
    gate_up, down = _weights(module)
    dims = (gate_up.shape[-1], gate_up.shape[-2], down.shape[-1])
    return all(d * size % 16 == 0 for d in dims)


def make_dispatch(
    module: nn.Module, plan: ExpertModule, ep_rank: int, group: Any
) -> Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]:
    """The forward of an experts module under expert parallelism (see the module docstring)."""
    from torch.distributed._functional_collectives import all_to_all_single_autograd

    layout = plan.layout
    ep, local = layout.ep, layout.local_count
    mine = layout.experts_of(ep_rank)

    def forward(
        hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor
    ) -> torch.Tensor:
        tokens, top_k = top_k_index.shape
        choices = top_k_index.reshape(-1)
        order = torch.argsort(choices, stable=True)
        send = hidden_states[order // top_k]
        per_expert = torch.bincount(choices, minlength=layout.num_experts)
        recv_counts = torch.empty_like(per_expert)
        dist.all_to_all_single(recv_counts, per_expert, group=group)
        send_sizes = per_expert.view(ep, local).sum(1).tolist()
        received = recv_counts.view(ep, local)  # [source rank, local expert]
        recv_sizes = received.sum(1).tolist()
        rows = _wait(all_to_all_single_autograd(send, recv_sizes, send_sizes, group))
        # rows come by source rank, then by expert: regroup them by expert
        expert_of_row = torch.arange(local, device=rows.device).repeat(ep)
        expert_of_row = expert_of_row.repeat_interleave(received.reshape(-1))
        by_expert = torch.argsort(expert_of_row, stable=True)
        sizes = received.sum(0).tolist()
        use_grouped = grouped_mm(rows.device.type, rows.dtype) and _aligned(module, rows)
        out = run_local_experts(module, rows[by_expert], sizes, use_grouped)
        out = out[torch.argsort(by_expert)]
        back = _wait(all_to_all_single_autograd(out, send_sizes, recv_sizes, group))
        per_choice = back[torch.argsort(order)].view(tokens, top_k, -1)
        weighted = per_choice * top_k_weights.unsqueeze(-1).to(per_choice.dtype)
        return weighted.sum(1).to(hidden_states.dtype)

    forward.__qualname__ = f"ep_dispatch[{plan.fqn}: experts {mine.start}..{mine.stop - 1}]"
    return forward


def _keep_local(module: nn.Module, plan: ExpertModule, ep_rank: int) -> None:
    """Replace each expert parameter by this rank's experts of it (a copy, so the whole
    tensor can be freed)."""
    mine = plan.layout.experts_of(ep_rank)
    for p in plan.params:
        name = p.fqn.rpartition(".")[2]
        whole = module._parameters[name]
        assert whole is not None
        kept = nn.Parameter(
            whole.detach()[mine.start : mine.stop].clone(), requires_grad=whole.requires_grad
        )
        kept.__dict__.update({k: v for k, v in vars(whole).items() if not k.startswith("_")})
        module._parameters[name] = kept


def expert_mesh(state: PrepState, plan: ExpertParallelState) -> Any:
    """The ``(dp_replicate, efsdp, ep)`` DeviceMesh over the world (ep innermost, as the mesh
    record lays the ranks out)."""
    from torch.distributed.device_mesh import init_device_mesh

    device = handles_of(state).device
    shape = (plan.mesh.dp_replicate, plan.efsdp, plan.ep)
    return init_device_mesh(device.type, shape, mesh_dim_names=EXPERT_MESH_NAMES)


#: The expert mesh's dimensions: the data-parallel replicas, the copies of each expert inside
#: one (which FSDP shards them over), the ranks holding different experts.
EXPERT_MESH_NAMES = ("dp_replicate", "efsdp", "ep")


@step("experts")
def experts(state: PrepState, model: nn.Module) -> tuple[PrepState, nn.Module]:
    plan = state.expert_parallel
    if plan is None:
        return skipped(state, model)
    modules = [(m, model.get_submodule(m.fqn)) for m in plan.modules]
    for spec, module in modules:  # every module checked before any is changed
        _check_layout(module, spec.fqn)
    mesh = expert_mesh(state, plan)
    group = mesh.get_group("ep")
    ranks = tuple(dist.get_process_group_ranks(group))
    if ranks != plan.mesh.ep_group:
        raise PrepareError(
            f"the expert-parallel group torch built is {ranks}, but the plan's is "
            f"{plan.mesh.ep_group}.",
            subject="ep",
        )
    for spec, module in modules:
        _keep_local(module, spec, plan.ep_rank)
        module.forward = make_dispatch(module, spec, plan.ep_rank, group)
    return with_handles(state, expert_mesh=mesh), model


def shard_experts(state: PrepState, model: nn.Module, mp: Any, offload: Any) -> None:
    """FSDP2 over efsdp (HSDP over the replicas and efsdp) on every experts module, before their
    blocks, their gradients divided by the data-parallel size: every expert sees tokens of all
    the data-parallel batches."""
    plan = state.expert_parallel
    if plan is None:
        return
    from torch.distributed.fsdp import FSDPModule, fully_shard
    from torch.distributed.tensor import Shard

    mesh = handles_of(state).expert_mesh
    core = state.core
    assert core is not None and mesh is not None
    # FSDP over efsdp; HSDP over (replicas, efsdp) when the data-parallel ranks replicate
    fsdp_mesh = mesh[("dp_replicate", "efsdp")] if plan.mesh.dp_replicate > 1 else mesh["efsdp"]
    for spec in plan.modules:
        module = model.get_submodule(spec.fqn)
        dims = {p.fqn.rpartition(".")[2]: p.fsdp_dim for p in spec.params}
        fully_shard(
            module,
            mesh=fsdp_mesh,
            reshard_after_forward=core.reshard_after_forward is not False,
            mp_policy=mp,
            offload_policy=offload,
            shard_placement_fn=_placement(module, dims, Shard),
        )
        assert isinstance(module, FSDPModule)
        module.set_gradient_divide_factor(plan.gradient_divide_factor)
        if plan.efsdp > 1:
            # FSDP2 applies another factor than the group size with PREMUL_SUM, which gloo
            # refuses: sum over efsdp, then divide locally
            module.set_force_sum_reduction_for_comms(True)


def _placement(module: nn.Module, dims: dict[str, int], shard: Any) -> Callable[[Any], Any]:
    names = {id(p): n for n, p in module.named_parameters()}

    def place(param: nn.Parameter) -> Any:
        return shard(dims.get(names.get(id(param), ""), 0))

    return place
