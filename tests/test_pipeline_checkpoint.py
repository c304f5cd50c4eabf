"""Checkpoints across pipeline layouts (gloo, CPU): AdamW state saved at pp 2 x dp 2 loads at
dp 4, at pp 2 x tp 2, at pp 2 x dp 2 and in one process, and a dp 4 checkpoint loads at
pp 2 x dp 2, every parameter and optimizer tensor bitwise; a step after loading continues the
run; ``export_full`` and ``save_pretrained`` at pp 2 write one process's bytes. One spawned job
per world size (tests/_pipeline_checkpoint_workers.py). The merging of the stages' optimizer
records and its inverse, the restriction to one rank's parameters, are property-tested in one
process first."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import _pipeline_checkpoint_workers as C
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from fprep.checkpoint import pipeline
from fprep.checkpoint.format.manifest import OptimizerRecord
from fprep.errors import CheckpointError
from fprep.layout.mesh import MeshPlan
from fprep.state import PipelineState
from fprep.testing.distributed import run_ranks

TOL = 1e-5  # another layout sums in another order: a step after loading equals within this


def _plan(num_stages: int, pp: int) -> PipelineState:
    """Stage ``s`` holds the module ``layers.s``; pp rank ``r`` runs stages r, r + pp, ..."""
    return PipelineState(
        mesh=MeshPlan(world_size=pp, rank=0, pp=pp),
        schedule="Interleaved1F1B" if num_stages > pp else "1F1B",
        microbatches=num_stages,
        split=tuple((f"layers.{s}",) for s in range(num_stages)),
        stages=tuple(range(0, num_stages, pp)),
        source="config",
    )


@st.composite
def _stage_optimizers(draw: st.DrawFn) -> tuple[PipelineState, list[pipeline.StageRecords]]:
    """A pipeline's plan and every pp rank's record of one optimizer: each parameter in one of
    the groups (the same hyperparameters on every rank), state for some of them."""
    pp = draw(st.integers(1, 3))
    plan = _plan(pp * draw(st.integers(1, 2)), pp)
    n_groups = draw(st.integers(1, 3))
    hyper = [{"lr": draw(st.floats(1e-4, 1.0)), "betas": {"$tuple": [0.9, 0.99]}}] * n_groups
    per_rank = []
    for r in range(pp):
        stages = tuple(range(r, plan.num_stages, pp))
        groups: list[list[str]] = [[] for _ in range(n_groups)]
        state = {}
        for s in stages:
            for k in range(draw(st.integers(1, 3))):
                name = f"layers.{s}.w{k}"
                groups[draw(st.integers(0, n_groups - 1))].append(name)
                if draw(st.booleans()):
                    state[name] = {"exp_avg": {"$tensor": f"optimizer/0/state/{name}/exp_avg"}}
        skeleton = {
            "state": state,
            "param_groups": [{**h, "params": g} for h, g in zip(hyper, groups, strict=True)],
        }
        per_rank.append((stages, [OptimizerRecord(cls="torch.optim.adamw.AdamW", state=skeleton)]))
    return plan, per_rank


@settings(max_examples=60, deadline=None)
@given(_stage_optimizers())
def test_merged_records_restrict_to_each_ranks_own(
    drawn: tuple[PipelineState, list[pipeline.StageRecords]],
) -> None:
    """Merged over the stages, then restricted to what a rank holds: that rank's record."""
    plan, per_rank = drawn
    (merged,) = pipeline.merge(plan, per_rank)
    held = {
        r: {n for g in rec[0].state["param_groups"] for n in g["params"]}
        for r, (_, rec) in enumerate(per_rank)
    }
    for r, (_, records) in enumerate(per_rank):
        others = {n: () for q, ns in held.items() if q != r for n in ns}
        assert pipeline.restrict(merged.state, others) == records[0].state
    for g, group in enumerate(merged.state["param_groups"]):  # in stage order
        stages = [pipeline.stage_of(plan, n) for n in group["params"]]
        assert stages == sorted(stages), g
    assert sum(len(g["params"]) for g in merged.state["param_groups"]) == sum(
        map(len, held.values())
    )


def test_stages_that_disagree_are_refused_by_group() -> None:
    plan = _plan(2, 2)
    per_rank: list[pipeline.StageRecords] = [
        (
            (s,),
            [
                OptimizerRecord(
                    cls="torch.optim.sgd.SGD",
                    state={
                        "state": {},
                        "param_groups": [
                            {"lr": 0.1, "params": [f"layers.{s}.w"]},
                            {"lr": 0.1 * (1 + s), "params": [f"layers.{s}.b"]},
                        ],
                    },
                )
            ],
        )
        for s in range(2)
    ]
    with pytest.raises(CheckpointError) as error:
        pipeline.merge(plan, per_rank)
    assert error.value.subject == "optimizers[0].param_groups[1]"
    assert "'lr' different on stage 1" in str(error.value)


@pytest.fixture(scope="module")
def layouts(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[dict[str, Any]]]:
    root = tmp_path_factory.mktemp("pp_layouts")
    return root, run_ranks(C.run, 4, "layouts", str(root), timeout_s=1500)


@pytest.fixture(scope="module")
def exports(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[dict[str, Any]]]:
    root = tmp_path_factory.mktemp("pp_exports")
    return root, run_ranks(C.run, 2, "exports", str(root), timeout_s=900)


def whole(per_rank: list[Any]) -> C.Values:
    """The ranks' values as one model's: ranks of one stage hold the same values, bitwise.
    (A case that failed holds the error every rank raised.)"""
    out: C.Values = {}
    for values in per_rank:
        assert isinstance(values, dict), values
        for name, value in values.items():
            if name in out:
                assert np.array_equal(out[name], value), name
            out[name] = value
    return out


def _ok(result: Any) -> Any:
    """A case's result; a failed case holds the error its ranks raised."""
    assert not isinstance(result, str), result
    return result


def assert_bitwise(got: C.Values, want: C.Values) -> None:
    assert sorted(got) == sorted(want)
    assert any(name.endswith("/exp_avg") for name in want)  # optimizer state was compared
    for name, value in want.items():
        assert got[name].dtype == value.dtype and np.array_equal(got[name], value), name


def assert_close(got: C.Values, want: C.Values) -> None:
    assert sorted(got) == sorted(want)
    for name, value in want.items():
        assert float(np.abs(got[name] - value).max()) <= TOL * max(1.0, float(np.abs(value).max()))


@pytest.mark.parametrize("layout", ["dp", "pp_tp", "pp_dp"])
def test_pp_checkpoint_loads_at_another_layout_bitwise(
    layouts: tuple[Path, list[dict[str, Any]]], layout: str
) -> None:
    _, results = layouts
    saved = whole([_ok(r["pp_sharded"])["saved"] for r in results])
    assert_bitwise(whole([_ok(r[f"load_{layout}"])[0] for r in results]), saved)


def test_full_state_dict_at_pp_keeps_every_stage(
    layouts: tuple[Path, list[dict[str, Any]]],
) -> None:
    """A full state dict is gathered per stage (torch's would keep rank 0's stage only)."""
    _, results = layouts
    saved = whole([_ok(r["pp_full"])["saved"] for r in results])
    assert_bitwise(whole([_ok(r["load_full_dp"])[0] for r in results]), saved)


@pytest.mark.parametrize("kind", ["sharded", "full"])
def test_one_process_loads_a_pp_checkpoint(
    layouts: tuple[Path, list[dict[str, Any]]], kind: str
) -> None:
    root, results = layouts
    got, after = C.loaded(str(root / f"pp_{kind}"), {})
    assert_bitwise(got, whole([_ok(r[f"pp_{kind}"])["saved"] for r in results]))
    if kind == "sharded":
        assert_close(after, whole([_ok(r["pp_sharded"])["continued"] for r in results]))


def test_dp_checkpoint_loads_under_pp(layouts: tuple[Path, list[dict[str, Any]]]) -> None:
    _, results = layouts
    assert_bitwise(
        whole([_ok(r["reverse"])[0] for r in results]), whole([r["saved_dp"] for r in results])
    )


def test_an_optimizer_that_never_stepped_loads_fresh(
    layouts: tuple[Path, list[dict[str, Any]]],
) -> None:
    _, results = layouts
    for r in results:
        assert _ok(r["fresh"]) == (C.FRESH_LR, 0)  # the saved learning rate, no state


def test_a_step_after_loading_continues_the_run(
    layouts: tuple[Path, list[dict[str, Any]]],
) -> None:
    _, results = layouts
    continued = whole([_ok(r["pp_sharded"])["continued"] for r in results])
    same_layout = whole([_ok(r["load_pp_dp"])[1] for r in results])
    assert_bitwise(same_layout, continued)
    for layout in ("dp", "pp_tp"):
        assert_close(whole([_ok(r[f"load_{layout}"])[1] for r in results]), continued)


def test_refusals_under_pp(layouts: tuple[Path, list[dict[str, Any]]]) -> None:
    _, results = layouts
    for r in results:  # every rank raises the same error
        assert "looks like another model's checkpoint" in r["other_model"]
        assert r["stages_disagree"].startswith("optimizers[0].param_groups[0]: ")
        assert "'lr' different on stage 1" in r["stages_disagree"]
    assert "disagree" not in results[0]["disagree_left"]  # nothing was published


def test_export_full_at_pp_dp_equals_one_process(
    layouts: tuple[Path, list[dict[str, Any]]], tmp_path: Path
) -> None:
    """The values the pp 2 x dp 2 run exported, loaded and exported by one process."""
    root, _ = layouts
    state, model, opt = C.prepared({})
    C.fprep.load(str(root / "pp_sharded"), state, model, optimizers=opt)
    C.fprep.export_full(tmp_path / "one.safetensors", state, model)
    assert (root / "pp_dp.safetensors").read_bytes() == (tmp_path / "one.safetensors").read_bytes()


def test_two_stages_per_rank_load_in_one_process(
    exports: tuple[Path, list[dict[str, Any]]],
) -> None:
    root, results = exports
    got, _ = C.loaded(str(root / "interleaved"), {})
    assert_bitwise(got, whole([_ok(r["interleaved"]) for r in results]))


def test_export_and_save_pretrained_at_pp_equal_one_process(
    exports: tuple[Path, list[dict[str, Any]]], tmp_path: Path
) -> None:
    root, results = exports
    held = [set(r["held"]) for r in results]
    assert held[0] and held[1] and not held[0] & held[1]  # each stage held its part only
    C.one_process("hf_llama", tmp_path)
    assert (root / "pp.safetensors").read_bytes() == (tmp_path / "one.safetensors").read_bytes()
    pp_dir, one_dir = root / "pp_pretrained", tmp_path / "one_pretrained"
    names = sorted(p.name for p in one_dir.iterdir())
    assert names == sorted(p.name for p in pp_dir.iterdir())
    assert "model.safetensors" in names and "config.json" in names
    for name in names:
        assert (pp_dir / name).read_bytes() == (one_dir / name).read_bytes(), name
