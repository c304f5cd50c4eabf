"""Checkpoints under pipeline parallelism: each rank holds its stages' part of the model, a
checkpoint describes the whole model.

Under ``PrepConfig(pp=N)`` the model a rank holds carries its stages' parameters under the
model's own names, so DCP's metadata (merged over every rank) already lists every tensor of the
whole model. What is not a tensor is made whole here:

* saving: each optimizer's skeleton (its param groups and state entries) is merged over the
  pipeline ranks with one all-gather over this rank's pp group (``whole_records``): group ``i``
  holds stage 0's parameters of group ``i``, then stage 1's, and so on; hyperparameters must be
  equal on every stage. A full state dict is gathered onto one rank per stage (``keep_full``).
* loading: the whole model is known without a collective (``PipelineState.whole``), so the
  checkpoint is compared with it; what other stages hold (``elsewhere``) is expected in the
  checkpoint but read by their ranks, and each saved optimizer skeleton is restricted to this
  rank's parameters (``restrict``).
* exporting: the order in which one process writes the whole model's tensors (``whole_order``).

Without pipeline parallelism every function here is the identity (or empty).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch
import torch.distributed as dist

from fprep.checkpoint.format.manifest import OptimizerRecord
from fprep.errors import CheckpointError
from fprep.layout.mesh import DIM_ORDER
from fprep.snapshot import ModuleTree, is_within, join_fqn
from fprep.state import PipelineState, PrepState

#: The manifest's optimizer records of one pipeline rank, and the stages it runs.
StageRecords = tuple[tuple[int, ...], list[OptimizerRecord]]


def plan_of(state: PrepState) -> PipelineState | None:
    """The pipeline plan when this run cuts the model into stages, else None."""
    plan = state.pipeline
    return plan if plan is not None and plan.size > 1 else None


def gather_over_stages(state: PrepState, payload: Any) -> list[Any]:
    """Every pipeline rank's ``payload`` (this rank's pp group, in pp order); a collective over
    that group: every rank calls it, in the same order as its other collectives."""
    plan = plan_of(state)
    mesh = getattr(state.handles, "pp_mesh", None)
    if plan is None or mesh is None or not dist.is_initialized():
        return [payload]
    out: list[Any] = [None] * plan.size
    dist.all_gather_object(out, payload, group=mesh.get_group())
    return out


def stage_of(plan: PipelineState, fqn: str) -> int | None:
    """The stage holding parameter or buffer ``fqn`` (None: a module no stage names)."""
    module = fqn.rpartition(".")[0]
    best: tuple[int, int] | None = None  # (length of the stage module's name, stage)
    for index, names in enumerate(plan.split):
        for name in names:
            if is_within(module, name) and (best is None or len(name) > best[0]):
                best = (len(name), index)
    return None if best is None else best[1]


def whole_records(state: PrepState, records: list[OptimizerRecord] | None) -> Any:
    """The optimizer records of the whole model (see the module docs), from this rank's
    ``records``. A collective over the pp group; ``records=None`` says this rank failed
    already (then nothing is merged and None is returned on every rank of the group, which
    goes on to agree on the failure). Raises ``CheckpointError`` when the stages' optimizers
    do not fit together (every rank of the group raises the same)."""
    plan = plan_of(state)
    if plan is None:
        return records
    gathered: list[StageRecords | None] = gather_over_stages(
        state, None if records is None else (plan.stages, records)
    )
    if any(g is None for g in gathered):
        return None
    return merge(plan, [g for g in gathered if g is not None])


def _mismatch(detail: str, subject: str) -> CheckpointError:
    return CheckpointError(
        f"the pipeline stages' optimizers do not describe one optimizer: {detail}.",
        subject=subject,
        hint="Build each stage's optimizer the same way (the same class, the same param "
        "groups in the same order, the same hyperparameters); nothing was saved.",
    )


def merge(plan: PipelineState, per_rank: Sequence[StageRecords]) -> list[OptimizerRecord]:
    """The records of every pipeline rank merged into the whole model's, by optimizer and
    param-group position (see the module docs)."""
    counts = {len(records) for _, records in per_rank}
    if len(counts) != 1:
        raise _mismatch(
            f"the pipeline ranks pass {sorted(counts)} optimizers", subject="optimizers"
        )
    holder = {stage: records for stages, records in per_rank for stage in stages}
    merged = []
    for i in range(counts.pop()):
        per_stage = [(s, holder[s][i]) for s in range(plan.num_stages) if s in holder]
        classes = {record.cls for _, record in per_stage}
        if len(classes) != 1:
            raise _mismatch(
                f"optimizer {i} is a {' on one stage, a '.join(sorted(classes))} on another",
                subject=f"optimizers[{i}]",
            )
        state = _merge_skeletons(plan, i, [(s, r.state) for s, r in per_stage])
        merged.append(OptimizerRecord(cls=classes.pop(), state=state))
    return merged


def _merge_skeletons(plan: PipelineState, index: int, per_stage: list[tuple[int, Any]]) -> Any:
    first = per_stage[0][1]
    if not all(
        isinstance(s, dict)
        and isinstance(s.get("param_groups"), list)
        and isinstance(s.get("state"), dict)
        for _, s in per_stage
    ):
        return first  # not an optimizer state dict: load refuses it as it is
    group_counts = {len(s["param_groups"]) for _, s in per_stage}
    if len(group_counts) != 1:
        raise _mismatch(
            f"optimizer {index} has {' or '.join(map(str, sorted(group_counts)))} param groups "
            "depending on the stage",
            subject=f"optimizers[{index}]",
        )
    groups: list[dict[str, Any]] = []
    for g, reference in enumerate(first["param_groups"]):
        subject = f"optimizers[{index}].param_groups[{g}]"
        hyper = {k: v for k, v in reference.items() if k != "params"}
        params: list[Any] = []
        seen: set[Any] = set()
        for stage, skeleton in per_stage:
            group = skeleton["param_groups"][g]
            other = {k: v for k, v in group.items() if k != "params"}
            if other != hyper:
                keys = sorted(k for k in set(hyper) | set(other) if hyper.get(k) != other.get(k))
                raise _mismatch(
                    f"optimizer {index}'s param group {g} has {', '.join(map(repr, keys))} "
                    f"different on stage {stage} than on stage {per_stage[0][0]}",
                    subject=subject,
                )
            for name in group.get("params", []):
                # a rank running several stages lists them all: take each stage's own
                owner = stage_of(plan, name) if isinstance(name, str) else None
                if (owner == stage or owner is None) and name not in seen:
                    seen.add(name)
                    params.append(name)
        groups.append({**reference, "params": params})
    state: dict[str, Any] = {}
    for _, skeleton in per_stage:
        state.update(skeleton["state"])
    return {**first, "state": state, "param_groups": groups}


def keep_full(state: PrepState, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A full state dict under pipeline parallelism: each tensor of this rank's (sharded)
    ``tensors`` gathered whole, one at a time, and kept (on the CPU) by one rank of its stage,
    the one at coordinate 0 on every dimension but ``pp``; the others keep nothing. (torch's
    full state dicts keep the tensors on global rank 0 only, which holds one stage.) A
    collective within the stage: every rank of it holds the same keys."""
    if plan_of(state) is None:
        return tensors
    pg = state.process_group
    assert pg is not None  # a pipeline plan is made from the mesh record
    mesh = pg.mesh
    keeper = all(mesh.coordinate(d) == 0 for d in DIM_ORDER if d != "pp")
    out: dict[str, torch.Tensor] = {}
    for key in sorted(tensors):
        value = tensors[key]
        full = value.full_tensor() if hasattr(value, "full_tensor") else value
        if keeper:
            out[key] = full.detach().to("cpu", copy=True)
        del full
    return out


def elsewhere(state: PrepState) -> dict[str, tuple[int, ...]]:
    """The parameter and persistent-buffer FQNs of the whole model that other stages hold
    (their ranks load them), with their shapes; empty without pipeline parallelism."""
    plan = plan_of(state)
    return {} if plan is None else plan.elsewhere(state.tree)


def restrict(skeleton: Any, others: Mapping[str, object]) -> Any:
    """An encoded optimizer skeleton without what ``others`` (FQNs of other stages) hold: their
    state entries and their names in each param group. Anything else is returned as it is."""
    if not others or not isinstance(skeleton, dict):
        return skeleton
    out = dict(skeleton)
    state = skeleton.get("state")
    if isinstance(state, dict):
        out["state"] = {k: v for k, v in state.items() if k not in others}
    groups = skeleton.get("param_groups")
    if isinstance(groups, list):
        out["param_groups"] = [
            {**g, "params": [n for n in g["params"] if not (isinstance(n, str) and n in others)]}
            if isinstance(g, dict) and isinstance(g.get("params"), list)
            else g
            for g in groups
        ]
    return out


def optimizer_key_elsewhere(key: str, others: Mapping[str, object]) -> bool:
    """Whether an optimizer tensor key (``optimizer/<i>/state/<FQN>/<name>``) is state of a
    parameter another stage holds."""
    parts = key.split("/", 4)
    return len(parts) > 3 and parts[2] == "state" and parts[3] in others


def whole_order(tree: ModuleTree) -> dict[str, int]:
    """Each state-dict key of the whole model ``tree`` -> its position in the whole model's
    state dict (modules in pre-order, each one's parameters, then its persistent buffers)."""
    persistent = {b.fqn for b in tree.buffers if b.persistent}
    order: dict[str, int] = {}
    for module in tree.modules:
        names = [join_fqn(module.fqn, n) for n in module.param_names]
        names += [
            fqn for n in module.buffer_names if (fqn := join_fqn(module.fqn, n)) in persistent
        ]
        for fqn in names:
            order.setdefault(fqn, len(order))
    return order
