"""Checkpoints across pipeline layouts (gloo, CPU): AdamW state saved at pp 2 x dp 2 loads at
dp 4, at pp 2 x tp 2, at pp 2 x dp 2 and in one process, and a dp 4 checkpoint loads at
pp 2 x dp 2, every parameter and optimizer tensor bitwise; a step after loading continues the
run; ``export_full`` and ``save_pretrained`` at pp 2 write one process's bytes. One spawned job
per world size (tests/_pipeline_checkpoint_workers.py)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import _pipeline_checkpoint_workers as C
import numpy as np
import pytest

from fprep.testing.distributed import run_ranks

TOL = 1e-5  # another layout sums in another order: a step after loading equals within this


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
