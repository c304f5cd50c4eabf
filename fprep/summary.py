"""A human summary of a plan: what will happen, on which devices, and what it costs this rank."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:  # PrepState.summary() calls this module: no import back at run time
    from fprep.state import Fp8Plan, PrepState


def human_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")


def human_count(n: int) -> str:
    for unit, size in (("T", 1e12), ("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if n >= size:
            return f"{n / size:.2f}{unit}"
    return str(n)


def summarize(state: PrepState) -> str:
    from fprep.memory import estimate_memory

    topo, tree = state.topology, state.tree
    lines = [
        f"fprep plan — rank {topo.rank} of {topo.world_size} "
        f"({topo.num_nodes} node(s) x {topo.local_world_size})",
        f"  model       {tree.root.class_name}: {human_count(tree.numel)} parameters in "
        f"{len(tree.params)} tensors, {len(tree.modules)} modules"
        + (" (meta)" if tree.is_meta else "")
        + _part_of(state),
    ]
    if state.core is not None:
        core = state.core
        strategy: str = core.strategy
        if core.requested_strategy != strategy:
            strategy += f" (requested {core.requested_strategy})"
        lines.append(f"  strategy    {strategy}")
        prec = core.precision
        lines.append(
            "  precision   "
            + (state.config.precision if state.config.precision != "no" else "fp32")
            + (f", params {prec.param_dtype}" if prec.param_dtype else "")
            + (f", reduce {prec.reduce_dtype}" if prec.reduce_dtype else "")
            + (f", autocast {prec.autocast_dtype}" if prec.autocast_dtype else "")
            + (", grad scaling" if prec.grad_scaling else "")
        )
        if prec.fp8_plan is not None:
            lines += _fp8_lines(prec.fp8_plan)
    if state.process_group is not None:
        pg = state.process_group
        tps = state.tensor_parallel
        dims = (tps.mesh_dim_names, tps.mesh_shape) if tps else (pg.mesh_dim_names, pg.mesh_shape)
        names = "x".join(f"{n}={s}" for n, s in zip(*dims, strict=True))
        if pg.mesh.pp > 1:
            names = f"pp={pg.mesh.pp}x{names}"
        lines.append(f"  mesh        {names}, shard group of {pg.shard_size}")
        lines += _pipeline_lines(state)
        if tps is not None:
            lines.append(
                f"  tensor par. tp={tps.size} ({tps.plan_source} plan): {len(tps.modules)} "
                f"modules, {len(tps.params)} parameters split; tp group {tps.group[0]}.."
                f"{tps.group[-1]}" + (", loss parallel" if tps.loss_parallel else "")
            )
            if tps.float8:
                counts: dict[str, int] = {}
                for _, cls in tps.float8:
                    counts[cls] = counts.get(cls, 0) + 1
                lines.append(
                    "  fp8 x tp    "
                    + ", ".join(f"{n} float8 Linear under {c}" for c, n in counts.items())
                )
            lines.extend(f"  note        {n}" for n in tps.notes)
    if state.device is not None:
        dev = state.device
        lines.append(
            f"  device      {dev.compute_device} (from {dev.source}), backend {dev.backend}"
        )
    if state.ignored is not None and state.ignored.params:
        lines.append(f"  ignored     {len(state.ignored.params)} parameter names")
    if state.param_handles is not None:
        handles = state.param_handles
        lines.append(
            f"  units       {len(handles.units)} (root + {len(handles.units) - 1}); "
            f"init: {handles.materialize.method}"
        )
        if state.runtime is not None:
            mem = estimate_memory(state)
            where = "host" if mem.on_host else "device"
            lines.append(
                f"  this rank   params {human_bytes(mem.params)}, grads {human_bytes(mem.grads)}, "
                f"Adam {human_bytes(mem.adam)} ({where}); "
                f"largest unit gathered {human_bytes(mem.largest_unit_unsharded)}"
            )
    notes = [
        *(state.core.notes if state.core else ()),
        *(state.ignored.notes if state.ignored else ()),
        *(state.param_handles.materialize.notes if state.param_handles else ()),
        *(state.state_dict.weights.notes if state.state_dict and state.state_dict.weights else ()),
    ]
    lines.extend(f"  note        {n}" for n in notes)
    if state.applied:
        # What acted, in order; the steps that had nothing to do for this plan on a line apart.
        acted = [name for name in state.applied if name not in state.skipped]
        lines.append(f"  applied     {' -> '.join(acted) or '(nothing)'}")
        if state.skipped:
            lines.append(f"  no-op       {', '.join(state.skipped)} (nothing to do in this plan)")
    return "\n".join(lines)


def _part_of(state: PrepState) -> str:
    """Under pp, what the model line counts: this rank's part of the whole model."""
    plan = state.pipeline
    if plan is None or plan.whole is None:
        return ""
    return f"; this rank's part of {human_count(plan.whole.numel)}"


def _pipeline_lines(state: PrepState) -> list[str]:
    plan = state.pipeline
    if plan is None:
        return []
    held = "; ".join(f"stage {i} ({plan.split[i][0]} .. {plan.split[i][-1]})" for i in plan.stages)
    return [
        f"  pipeline    pp={plan.size} ({plan.source} split), {plan.schedule}, "
        f"{plan.microbatches} micro-batches, {plan.num_stages} stages; this rank: {held}"
    ]


def _fp8_lines(plan: Fp8Plan, shown: int = 8) -> list[str]:
    """Which Linear layers run in float8, and the ones kept in bf16 with the reason."""
    gather = ", float8 all-gather" if plan.fsdp_float8_all_gather else ""
    lines = [
        f"  fp8         {plan.recipe}: {len(plan.modules)} Linear layers in float8{gather}, "
        f"{len(plan.kept)} kept in bf16"
    ]
    lines += [f"    kept {fqn or '<root>'}: {why}" for fqn, why in plan.kept[:shown]]
    if len(plan.kept) > shown:
        lines.append(f"    ... and {len(plan.kept) - shown} more (state.core.precision.fp8_plan)")
    return lines
