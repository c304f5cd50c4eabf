"""What ``fprep plan`` prints about a plan: the per-rank memory table, or everything as JSON.

The JSON carries every fact ``state.summary()`` prints (``tests/test_cli.py`` checks that the
two agree), in numbers and lists rather than text, plus the memory table's bytes. Under
pipeline parallelism, also one line per pipeline rank (``pipeline_table``, ``pipeline_json``):
its stages, their first and last modules and its bytes, from the plan of that pipeline rank's
first rank.
"""

from __future__ import annotations

import dataclasses
import textwrap
from typing import Any

from fprep.memory import MemoryEstimate, estimate_memory, per_stage_activations
from fprep.state import Fp8Plan, PrepState
from fprep.summary import human_bytes

#: What the per-rank total leaves out: a plan knows no batch, sequence length or allocator.
NOT_COUNTED = (
    "the units gathered during forward and backward (up to two the size of the largest at "
    "once, with prefetching)",
    "activations (they grow with batch size and sequence length)",
    "temporary buffers (collectives, allocator fragmentation, the CUDA context)",
)
#: What it leaves out when given a batch (``--batch`` and ``--seq-len``): activations counted.
NOT_COUNTED_WITH_BATCH = (NOT_COUNTED[0], NOT_COUNTED[2])

Batch = tuple[int, int]


def _not_counted(batch: Batch | None) -> tuple[str, ...]:
    return NOT_COUNTED if batch is None else NOT_COUNTED_WITH_BATCH


def memory_table(
    state: PrepState, async_checkpoint: bool = False, batch: Batch | None = None
) -> str:
    mem = estimate_memory(state, async_checkpoint=async_checkpoint, batch=batch)
    rows = [
        ("parameters", mem.params),
        ("gradients", mem.grads),
        ("Adam state", mem.adam),
        ("SGD momentum", mem.sgd_momentum),
    ]
    if mem.kept_gathered:
        rows.append(("kept gathered", mem.kept_gathered))
    if batch is not None:
        rows.append(("activations (peak)", mem.activations))
    rows += [
        ("total (Adam)", mem.total("adam")),
        ("largest unit gathered", mem.largest_unit_unsharded),
    ]
    where = "host (offload)" if mem.on_host else "device"
    lines = [f"per-rank memory ({where}):"]
    if async_checkpoint:  # fprep.save(wait=False): a staged copy, always in host memory
        rows.append(("host: async staging max", mem.checkpoint_staging("adam")))
    lines += [f"  {name:<24}{human_bytes(value):>14}" for name, value in rows]
    lines += textwrap.wrap(
        "the total leaves out: " + "; ".join(_not_counted(batch)) + ".",
        width=96,
        initial_indent="  ",
        subsequent_indent="  ",
    )
    return "\n".join(lines)


def plan_json(
    state: PrepState, async_checkpoint: bool = False, batch: Batch | None = None
) -> dict[str, Any]:
    """The plan as plain data: what ``state.summary()`` and the memory table print."""
    topo, tree, core, handles = state.topology, state.tree, state.core, state.param_handles
    mem = estimate_memory(state, async_checkpoint=async_checkpoint, batch=batch)
    memory: dict[str, Any] = {**dataclasses.asdict(mem), "total_adam": mem.total("adam")}
    if async_checkpoint:
        memory["async_staging_max"] = mem.checkpoint_staging("adam")
    return {
        "world_size": topo.world_size,
        "rank": topo.rank,
        "nodes": topo.num_nodes,
        "nproc_per_node": topo.local_world_size,
        "model": {
            "class": tree.root.class_name,
            "parameters": tree.numel,
            "tensors": len(tree.params),
            "modules": len(tree.modules),
            "meta": tree.is_meta,
        },
        "strategy": core.strategy if core else None,
        "requested_strategy": core.requested_strategy if core else None,
        "precision": _precision(state),
        "mesh": _mesh(state),
        "tp": state.config.tp,
        "sequence_parallel": state.config.sequence_parallel,
        "tensor_parallel": _tensor_parallel(state),
        "device": (
            {
                "compute_device": state.device.compute_device,
                "source": state.device.source,
                "backend": state.device.backend,
            }
            if state.device
            else None
        ),
        "ignored_params": sorted(state.ignored.params) if state.ignored else [],
        "units": [u.fqn for u in handles.units] if handles else [],
        "init": handles.materialize.method if handles else None,
        "memory_bytes": memory,
        "memory_on_host": mem.on_host,
        "notes": _notes(state),
        "batch": {"rows": batch[0], "seq_len": batch[1]} if batch else None,
        "total_leaves_out": list(_not_counted(batch)),
    }


def _stage_spans(state: PrepState) -> list[tuple[int, str, str]]:
    """(stage index, first module, last module) of this rank's stages."""
    pipe = state.pipeline
    assert pipe is not None
    return [(k, pipe.split[k][0], pipe.split[k][-1]) for k in pipe.stages]


def _rank_bytes(mem: MemoryEstimate) -> dict[str, int]:
    return {
        "params": mem.params,
        "grads_and_adam": mem.grads + mem.adam,
        "activations": mem.activations,
        "gathered": mem.kept_gathered,
        "total_adam": mem.total("adam"),
    }


def pipeline_table(states: list[PrepState], batch: Batch | None = None) -> str:
    """One line per pipeline rank (``states``: the plan of each one's first rank, in pipeline
    order): its stages with their first and last modules, and its bytes with Adam."""
    pipe = states[0].pipeline
    assert pipe is not None
    spans = [
        ", ".join(f"{k}: {first} .. {last}" for k, first, last in _stage_spans(s)) for s in states
    ]
    width = max(len("stages: first .. last module"), *map(len, spans))
    shape = f" of {-(-batch[0] // pipe.microbatches)} x {batch[1]} tokens" if batch else ""
    lines = [
        f"per pipeline rank ({pipe.size} ranks, {pipe.num_stages} stages, {pipe.schedule}, "
        f"{pipe.microbatches} micro-batches{shape}; bytes with Adam):",
        f"  {'pp':>3} {'rank':>6}  {'stages: first .. last module':<{width}}  "
        f"{'params':>10} {'grads+Adam':>11} {'gathered':>10} {'activations':>11} {'total':>10}",
    ]
    for state, span in zip(states, spans, strict=True):
        assert state.pipeline is not None
        mem = _rank_bytes(estimate_memory(state, batch=batch))
        activations = human_bytes(mem["activations"]) if batch else "-"
        lines.append(
            f"  {state.pipeline.rank:>3} {state.topology.rank:>6}  {span:<{width}}  "
            f"{human_bytes(mem['params']):>10} {human_bytes(mem['grads_and_adam']):>11} "
            f"{human_bytes(mem['gathered']):>10} {activations:>11} "
            f"{human_bytes(mem['total_adam']):>10}"
        )
    if batch is None:
        lines.append("  (activations: pass --batch ROWS --seq-len N)")
    return "\n".join(lines)


def pipeline_json(states: list[PrepState], batch: Batch | None = None) -> dict[str, Any]:
    """``pipeline_table`` as data: the split, and per pipeline rank its stages and bytes."""
    pipe = states[0].pipeline
    assert pipe is not None
    ranks = []
    for state in states:
        assert state.pipeline is not None
        per_stage = per_stage_activations(state, batch) if batch else None
        ranks.append(
            {
                "pp_rank": state.pipeline.rank,
                "rank": state.topology.rank,
                "stages": [
                    {
                        "index": k,
                        "first": first,
                        "last": last,
                        "modules": len(state.pipeline.split[k]),
                        "activations_per_microbatch": per_stage[i] if per_stage else None,
                    }
                    for i, (k, first, last) in enumerate(_stage_spans(state))
                ],
                "bytes": _rank_bytes(estimate_memory(state, batch=batch)),
            }
        )
    return {
        "size": pipe.size,
        "schedule": pipe.schedule,
        "microbatches": pipe.microbatches,
        "num_stages": pipe.num_stages,
        "split": [list(stage) for stage in pipe.split],
        "ranks": ranks,
    }


def _precision(state: PrepState) -> dict[str, Any] | None:
    if state.core is None:
        return None
    policy = state.core.precision
    return {
        "name": state.config.precision if state.config.precision != "no" else "fp32",
        "param_dtype": policy.param_dtype,
        "reduce_dtype": policy.reduce_dtype,
        "autocast_dtype": policy.autocast_dtype,
        "output_dtype": policy.output_dtype,
        "grad_scaling": policy.grad_scaling,
        "fp8": _fp8(policy.fp8_plan) if policy.fp8_plan else None,
    }


def _fp8(plan: Fp8Plan) -> dict[str, Any]:
    return {
        "recipe": plan.recipe,
        "modules": list(plan.modules),
        "kept": {fqn: why for fqn, why in plan.kept},
        "float8_all_gather": plan.fsdp_float8_all_gather,
    }


def _mesh(state: PrepState) -> dict[str, Any] | None:
    """The whole mesh (with the tp dim when there is one), as the summary's mesh line shows it."""
    pg, tps = state.process_group, state.tensor_parallel
    if pg is None:
        return None
    names, shape = (
        (tps.mesh_dim_names, tps.mesh_shape) if tps else (pg.mesh_dim_names, pg.mesh_shape)
    )
    return {
        "shape": list(shape),
        "dim_names": list(names),
        "shard_group_size": pg.shard_size,
        "replicate_group_size": pg.replicate_size,
    }


def _tensor_parallel(state: PrepState) -> dict[str, Any] | None:
    tps = state.tensor_parallel
    if tps is None:
        return None
    return {
        "size": tps.size,
        "rank": tps.rank,
        "group": list(tps.group),
        "plan_source": tps.plan_source,
        "modules": {fqn: style for fqn, style in tps.modules},
        "params": {fqn: dim for fqn, dim in tps.params},
        "loss_parallel": tps.loss_parallel,
        "float8": {fqn: style for fqn, style in tps.float8},
        "notes": list(tps.notes),
    }


def _notes(state: PrepState) -> list[str]:
    """The plan's notes, in the order the summary prints them (tensor parallelism's are under
    ``tensor_parallel``)."""
    return [
        *(state.core.notes if state.core else ()),
        *(state.ignored.notes if state.ignored else ()),
        *(state.param_handles.materialize.notes if state.param_handles else ()),
        *(state.state_dict.weights.notes if state.state_dict and state.state_dict.weights else ()),
    ]
