"""Matching pretrained weights against the model, from the headers alone (pure).

Property: for any shapes, file dtypes and world sizes, the byte range a rank reads is exactly
its FSDP2 dim-0 shard (``torch.chunk``), and the ranks together read every byte of every tensor
exactly once. Refusals: missing and unexpected keys (unless allowed), shapes and dtypes the
parameter cannot take — all found by ``fprep.plan``, before ``prepare`` touches the model.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from _weights_files import write_safetensors
from hypothesis import given, settings
from hypothesis import strategies as st
from returns.result import Failure
from torch import nn

import fprep
from fprep import ModuleInfo, ModuleTree, ParamInfo
from fprep.errors import CheckpointError, ConfigError
from fprep.weights.plan import plan_weights
from fprep.weights.records import WeightsSnapshot, WeightsTensor

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@settings(max_examples=60, deadline=None)
@given(
    st.lists(
        st.tuples(
            st.lists(st.integers(0, 9), min_size=1, max_size=3).map(tuple),
            st.sampled_from(sorted(_DTYPES)),
        ),
        min_size=1,
        max_size=4,
    ),
    st.integers(1, 8),
    st.data(),
)
def test_each_rank_reads_exactly_its_shard_and_ranks_cover_each_tensor_once(
    specs: list[tuple[tuple[int, ...], str]], world: int, data: st.DataObject
) -> None:
    values = [
        torch.randn(shape).to(_DTYPES[dtype])
        if all(shape)
        else torch.empty(shape).to(_DTYPES[dtype])
        for shape, dtype in specs
    ]
    blob = b""
    tensors = []
    for i, v in enumerate(values):
        raw = v.reshape(-1).view(torch.uint8).numpy().tobytes()
        gap = data.draw(st.integers(0, 3))  # files may leave unused bytes between tensors
        blob += bytes(gap)
        tensors.append(
            WeightsTensor(
                f"p{i}",
                "f",
                str(v.dtype).removeprefix("torch."),
                tuple(v.shape),
                len(blob),
                len(raw),
            )
        )
        blob += raw
    names = tuple(f"p{i}" for i in range(len(values)))
    tree = ModuleTree(
        modules=(ModuleInfo(fqn="", cls="my.Net", param_names=names),),
        params=tuple(
            ParamInfo(names=(n,), shape=tuple(v.shape)) for n, v in zip(names, values, strict=True)
        ),
    )
    snap = WeightsSnapshot(source="f", tensors=tuple(tensors), files=())
    read_by: dict[str, list[tuple[int, int]]] = {n: [] for n in names}
    for rank in range(world):
        plan = plan_weights(tree, snap, shard=(world, rank))
        assert plan.loaded_modules == ("",)
        for read, value in zip(plan.reads, values, strict=True):
            chunks = torch.chunk(value, world) if value.shape[0] else ()
            mine = chunks[rank] if rank < len(chunks) and all(value.shape[1:]) else value[:0]
            got = blob[read.offset : read.offset + read.nbytes]
            assert got == mine.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()
            if read.nbytes:
                read_by[read.name].append((read.offset, read.offset + read.nbytes))
    for t in tensors:
        spans = sorted(read_by[t.key])
        covered = t.offset
        for begin, end in spans:
            assert begin == covered  # no gap, no overlap
            covered = end
        assert covered == t.offset + t.nbytes


# -- against a real model ------------------------------------------------------------------------
class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(10, 4)
        self.lin = nn.Linear(4, 3)
        self.norm = nn.BatchNorm1d(3)
        self.head = nn.Linear(4, 10, bias=False)
        self.head.weight = self.emb.weight  # tied


def _file(tmp_path: Path, model: nn.Module, **changes: torch.Tensor | None) -> Path:
    sd = {
        k: v.to(torch.bfloat16) if v.is_floating_point() else v
        for k, v in model.state_dict().items()
    }
    sd.pop("head.weight")  # a tied parameter saved once, as save_pretrained does
    for k, v in changes.items():
        if v is None:
            sd.pop(k)
        else:
            sd[k] = v
    return write_safetensors(tmp_path / "model.safetensors", sd)


def _fails(model: nn.Module, **cfg: object) -> CheckpointError | ConfigError:
    result = fprep.plan(
        model, fprep.PrepConfig(strategy="fsdp", **cfg), fprep.Topology(world_size=2)
    )  # type: ignore[arg-type]
    assert isinstance(result, Failure)
    error = result.failure()
    assert isinstance(error, CheckpointError | ConfigError)
    return error


def test_a_fitting_file_plans_reads_of_this_ranks_rows(tmp_path: Path) -> None:
    model = Net()
    path = _file(tmp_path, model)
    state = fprep.plan(
        model,
        fprep.PrepConfig(strategy="fsdp", weights=str(tmp_path)),
        fprep.Topology(world_size=2, rank=1),
    ).unwrap()
    plan = state.state_dict.weights
    assert plan is not None
    reads = {r.name: r for r in plan.reads}
    assert reads["emb.weight"].nbytes == 5 * 4 * 2  # rows 5..9 of 10, bf16
    assert reads["norm.running_mean"].kind == "buffer" and reads["norm.running_mean"].nbytes == 6
    assert reads["norm.num_batches_tracked"].target_dtype == "int64"
    assert set(plan.loaded_modules) == {"emb", "lin", "norm", "head"}
    assert state.param_handles.materialize.method == "none"  # not on meta: nothing to initialize
    assert all(r.file == str(path) for r in plan.reads)


def test_missing_unexpected_shape_and_dtype_are_refused_by_the_plan(tmp_path: Path) -> None:
    model = Net()
    _file(tmp_path, model, **{"lin.bias": None})
    e = _fails(model, weights=str(tmp_path))
    assert e.subject == "lin.bias" and "1 missing" in str(e)
    _file(tmp_path, model, **{"extra.weight": torch.ones(2)})
    e = _fails(model, weights=str(tmp_path))
    assert e.subject == "extra.weight" and "model.safetensors" in str(e)
    _file(tmp_path, model, **{"lin.weight": torch.ones(4, 3)})
    e = _fails(model, weights=str(tmp_path))
    assert e.subject == "lin.weight" and "shape [4, 3]" in str(e)
    _file(tmp_path, model, **{"lin.weight": torch.ones(3, 4, dtype=torch.int32)})
    e = _fails(model, weights=str(tmp_path))
    assert e.subject == "lin.weight" and "int32" in str(e)
    _file(tmp_path, model, **{"norm.num_batches_tracked": torch.tensor(1.0)})
    e = _fails(model, weights=str(tmp_path))
    assert e.subject == "norm.num_batches_tracked"
    _file(tmp_path, model, **{"head.weight": torch.ones(9, 4)})  # a tied name that does not fit
    assert _fails(model, weights=str(tmp_path)).subject == "head.weight"


def test_allowed_extra_and_missing_keys(tmp_path: Path) -> None:
    model = Net()
    _file(tmp_path, model, **{"lin.bias": None, "lin.weight": None, "extra.w": torch.ones(1)})
    cfg = fprep.PrepConfig(
        strategy="fsdp",
        weights=str(tmp_path),
        weights_extra_keys=("extra.*",),
        weights_missing_keys=("lin.*",),
    )
    with torch.device("meta"):
        meta = Net()
    state = fprep.plan(meta, cfg, fprep.Topology(world_size=2)).unwrap()
    plan = state.state_dict.weights
    assert plan is not None
    assert plan.skipped_keys == ("extra.w",)
    assert set(plan.missing_keys) == {"lin.weight", "lin.bias"}
    materialize = state.param_handles.materialize
    assert "lin" in materialize.modules and "lin" not in materialize.loaded
    assert set(materialize.loaded) == {"emb", "norm", "head"}


def test_a_refused_file_leaves_the_model_as_it_was(tmp_path: Path) -> None:
    model = Net()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    _file(tmp_path, model, **{"lin.bias": None})
    with pytest.raises(CheckpointError, match=r"lin\.bias"):
        fprep.prepare(model, fprep.PrepConfig(weights=str(tmp_path)))
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())
    assert not hasattr(model, "_fprep_prepared")


def test_config_fields_validate_and_round_trip(tmp_path: Path) -> None:
    cfg = fprep.PrepConfig(
        weights=tmp_path, weights_extra_keys=["a.*"], weights_missing_keys=("b",)
    )
    assert cfg.weights == str(tmp_path) and cfg.weights_extra_keys == ("a.*",)
    assert fprep.PrepConfig.from_dict(cfg.to_dict()) == cfg
    with pytest.raises(ConfigError, match="weights_extra_keys") as info:
        fprep.PrepConfig(weights_extra_keys=("x",))
    assert info.value.subject == "weights_extra_keys"
    with pytest.raises(ConfigError, match="weights must be a path"):
        fprep.PrepConfig(weights=3)  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="single string"):
        fprep.PrepConfig(weights="w", weights_missing_keys="lm_head.*")  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="empty pattern"):
        fprep.PrepConfig(weights="w", weights_missing_keys=("",))
    assert _fails(nn.Linear(2, 2), weights=str(tmp_path / "nope")).subject == "weights"
