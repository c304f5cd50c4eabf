"""The loop helpers under tensor parallelism (transformers' Qwen2, gloo): clipping equal to one
process with one all-reduce per distinct mesh, the check that a tp group's ranks were given the
same inputs, and the refusals that name the fix (a tp script started as one process, a
forward with ``labels=`` outside ``fprep.loss_parallel``)."""

from __future__ import annotations

from typing import Any

import _tp_loop_workers as L
import _tp_workers as W
import pytest
import torch

import fprep
from fprep import ConfigError, PrepareError, PrepConfig, Topology
from fprep.testing.distributed import run_ranks
from fprep.testing.models import llama_tiny
from fprep.tp_inputs import input_digest

WORLDS = (2, 4)  # tp 2; dp 2 x tp 2


@pytest.fixture(scope="module", params=WORLDS, ids=lambda w: f"world{w}")
def ranks(request: pytest.FixtureRequest) -> list[dict[str, Any]]:
    cases = ("clip", "inputs", "labels") if request.param == 2 else ("clip", "inputs")
    return run_ranks(L.run, request.param, cases, timeout_s=900)


# -- clipping ---------------------------------------------------------------------------------
def test_clipping_equals_one_process(ranks: list[dict[str, Any]]) -> None:
    """The norm before clipping and every clipped gradient equal torch's clip_grad_norm_ in one
    process (fp32), on every rank."""
    ref = L.reference_clip()
    assert ref["norm"] > W.MAX_NORM  # clipping acts
    for out in ranks:
        clip = out["clip"]
        assert clip["norm"] == pytest.approx(ref["norm"], rel=1e-5)
        assert clip["grads"].keys() == ref["grads"].keys()
        for name, grad in ref["grads"].items():
            whole = torch.from_numpy(clip["grads"][name])
            torch.testing.assert_close(whole, grad, rtol=1e-5, atol=1e-7)


def test_one_all_reduce_per_distinct_mesh(ranks: list[dict[str, Any]]) -> None:
    for out in ranks:
        clip = out["clip"]
        assert clip["dtensor_grads"] > 0
        assert clip["collectives"] == clip["meshes"]
        if len(ranks) == 4:  # FSDP2 slices the dp mesh anew per module: objects, not meshes
            assert clip["meshes"] == 2 and clip["mesh_objects"] > clip["meshes"]


def test_clipping_prints_no_inconsistency_warning(ranks: list[dict[str, Any]]) -> None:
    """torch's "may give inconsistent results between ranks" (DTensor reducing one norm mesh
    dimension after another) is not printed by fprep's clipping; the control, DTensor's own
    reduction of the (dp, tp) gradients' norm, prints it, so the capture sees it."""
    for out in ranks:
        clip = out["clip"]
        assert clip["clip_warnings"] == []
        if clip["two_d"]:
            assert any("inconsistent results between ranks" in m for m in clip["control_warnings"])


def test_norm_type_must_be_positive() -> None:
    state, model = fprep.prepare(llama_tiny(), PrepConfig())
    model(torch.randint(0, 64, (1, 4))).sum().backward()
    with pytest.raises(PrepareError, match="norm_type") as info:
        fprep.clip_grad_norm(state, model, 1.0, norm_type=0.0)
    assert "math.inf" in (info.value.hint or "")


# -- the same inputs on every rank of a tp group ----------------------------------------------
def _tp_groups(n: int) -> list[list[int]]:
    return [[r, r + 1] for r in range(0, n, 2)]


def test_equal_inputs_pass(ranks: list[dict[str, Any]]) -> None:
    """The ranks of a tp group agree (the dp ranks may differ): no refusal, first forward or
    helper."""
    for out in ranks:
        assert out["inputs"]["hook_equal"] is None
        assert out["inputs"]["helper_equal"] is None
        assert out["inputs"]["later_forward"] is None  # checked once, at the first forward


@pytest.mark.parametrize(
    "case",
    [
        "hook_different",
        "hook_permuted",
        "helper_different",
        "helper_permuted",
        "helper_mask_differs",
    ],
)
def test_different_inputs_fail_on_every_rank_alike(ranks: list[dict[str, Any]], case: str) -> None:
    for group in _tp_groups(len(ranks)):
        messages = [ranks[r]["inputs"][case] for r in group]
        assert messages[0] is not None, f"rank {group[0]} trained on: {case}"
        assert messages == [messages[0]] * len(group)  # the same on every rank of the group
        assert f"tensor-parallel ranks {group} were given different inputs" in messages[0]
        where = "the first forward" if case.startswith("hook") else "fprep.check_tp_inputs"
        assert messages[0].startswith(where)
        assert "fprep.prepare_data_loader" in messages[0]


def test_digest_sees_order_names_and_dtypes() -> None:
    x = torch.arange(12).reshape(4, 3)
    assert input_digest(((x,), {})) == input_digest(((x.clone(),), {}))
    assert input_digest(((x,), {})) != input_digest(((x[[1, 0, 2, 3]],), {}))
    assert input_digest(((x,), {})) != input_digest(((), {"input_ids": x}))
    assert input_digest(((x,), {})) != input_digest(((x.int(),), {}))
    assert input_digest(((x.float(),), {})) != input_digest(((x.float() + 1e-6,), {}))


def test_check_tp_inputs_without_tp_does_nothing() -> None:
    state, _ = fprep.prepare(llama_tiny(), PrepConfig())
    fprep.check_tp_inputs(state, torch.zeros(2, 3))


# -- refusals that name the fix ---------------------------------------------------------------
def test_tp_in_one_process_says_launch_with_torchrun() -> None:
    topo = Topology(world_size=1, rank=0, local_world_size=1)
    error = fprep.plan(llama_tiny("meta"), PrepConfig(strategy="fsdp", tp=2), topo).failure()
    assert isinstance(error, ConfigError)
    assert "started with plain python" in str(error)
    assert "torchrun --nproc-per-node 2" in (error.hint or "")


def test_labels_outside_loss_parallel_is_refused(ranks: list[dict[str, Any]]) -> None:
    if len(ranks) != 2:
        pytest.skip("run at tp 2 only")
    for out in ranks:
        outside = out["labels"]["outside"]
        assert outside is not None and "fprep.loss_parallel(state)" in outside
        assert "mixed torch.Tensor and DTensor" in outside
    # inside loss_parallel the same forward computes the single-process loss
    assert ranks[0]["labels"]["inside"] == pytest.approx(L.reference_labels(), abs=1e-5)
