"""``PrepConfig.weights`` under tensor parallelism: each rank reads its block straight from the
safetensors files (colwise: contiguous rows; rowwise: one run of columns per row; replicated
and data-parallel tensors as without tp), bitwise what transformers loads, at dp 2 x tp 2 and
tp 4 (4 gloo ranks), from fp32 and bf16 files; biased models (Qwen2's q/k/v biases, the docs'
nn.Sequential) at tp 2, tp 4 and dp 2 x tp 2, block for block, and trained as one process."""

from __future__ import annotations

import io
import math
from pathlib import Path
from typing import Any

import _tp_weights_workers as W
import pytest
import torch
from _weights_workers import reference
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from returns.result import Success

import fprep
from fprep.errors import ConfigError
from fprep.weights.blocks import StridedRead, block_read, pieces, tp_weights
from fprep.weights.records import TensorRead, WeightsPlan, WeightsSnapshot, WeightsTensor

#: (shape per tp, cut dim): a bias (colwise: Shard(0)), Linear weights cut on rows and columns,
#: and a 3-D tensor cut on each dim (runs inside rows).
CUTS = [((5,), 0), ((5, 3), 0), ((5, 3), 1), ((5, 2, 3), 0), ((5, 2, 3), 1), ((5, 2, 3), 2)]


@pytest.mark.parametrize("tp", [2, 4])
@pytest.mark.parametrize("dp", [1, 2, 3])
@pytest.mark.parametrize(("per_tp", "dim"), CUTS, ids=str)
def test_blocks_read_the_ranks_elements(
    tp: int, dp: int, per_tp: tuple[int, ...], dim: int
) -> None:
    """Following the planned byte ranges through a fake file gives torch's block: the tp
    chunk (torch.chunk), then FSDP2's rows of it (uneven: 5 rows per tp chunk)."""
    shape = tuple(n * tp for n in per_tp)
    full = torch.arange(math.prod(shape), dtype=torch.int32).view(shape)
    data = full.numpy().tobytes()
    t = WeightsTensor(key="w", file="f", dtype="int32", shape=shape, offset=0, nbytes=len(data))
    whole = TensorRead(
        name="w", key="w", kind="param", file="f", dtype="int32", target_dtype="int32",
        offset=0, nbytes=len(data),
    )  # fmt: skip
    plan = WeightsPlan(source="s", reads=(whole,), files=(), loaded_modules=())
    snap = WeightsSnapshot(source="s", tensors=(t,), files=())
    for tp_rank in range(tp):
        for rank in range(dp):
            block = full.chunk(tp, dim)[tp_rank]
            c = -(-block.shape[0] // dp)
            want = block[c * rank : c * (rank + 1)]
            (read,) = tp_weights(plan, snap, {"w": dim}, tp, tp_rank, (dp, rank)).reads
            assert read.nbytes == want.numel() * 4
            runs = want.shape[0] * math.prod(shape[1:dim]) if dim else 1
            assert isinstance(read, StridedRead) == (runs > 1)
            got = torch.empty(want.shape, dtype=torch.int32)
            for part, into in pieces(read, got):
                chunk = data[part.offset : part.offset + part.nbytes]
                into.view(-1).copy_(torch.frombuffer(bytearray(chunk), dtype=torch.int32))
            assert torch.equal(got, want)


@pytest.fixture(scope="module", params=[torch.float32, torch.bfloat16], ids=str)
def runs(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Any:
    from fprep.testing.distributed import run_ranks

    directory = W.save(Path(tmp_path_factory.mktemp("tp_weights")), request.param)
    ref = {k: v for k, v in reference(directory).items() if "inv_freq" not in k}
    itemsize = torch.empty((), dtype=request.param).element_size()
    return ref, itemsize, run_ranks(W.loaded, 4, str(directory), timeout_s=600)


@pytest.mark.parametrize("layout", tuple(W.LAYOUTS))
def test_weights_load_into_tp_blocks(runs: Any, layout: str) -> None:
    """Bitwise transformers' weights; each rank reads a quarter of a tp-cut tensor's bytes,
    rowwise ones as runs of columns."""
    ref, itemsize, outs = runs
    for rank, out in enumerate(outs):
        got = torch.load(io.BytesIO(out[layout]["full"]), weights_only=True)
        bad = [k for k in ref if not torch.equal(ref[k], got[k])]
        assert bad == [], f"rank {rank}: {bad}"
        reads = out[layout]["reads"]
        for name, kind in (
            ("model.layers.0.mlp.down_proj.weight", "StridedRead"),
            ("model.layers.0.self_attn.q_proj.weight", "TensorRead"),
        ):
            assert reads[name] == (ref[name].numel() * itemsize // 4, kind)


def test_an_impossible_cut_is_a_config_error() -> None:
    """A cut the tensor has no dim for (or that tp does not divide) names the parameter."""
    t = WeightsTensor(key="b", file="f", dtype="float32", shape=(6,), offset=0, nbytes=24)
    read = TensorRead(
        name="0.bias", key="b", kind="param", file="f", dtype="float32",
        target_dtype="float32", offset=0, nbytes=24,
    )  # fmt: skip
    for dim, tp in ((1, 2), (0, 4)):
        with pytest.raises(ConfigError, match=r"'0\.bias'") as e:
            block_read(read, t, dim, tp, 0, None)
        assert e.value.subject == "0.bias"


# -- biased models: Qwen2 (q/k/v biases) and the docs' nn.Sequential --------------------------
@pytest.fixture(scope="module")
def biased(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """Both checkpoints, and each world's rank results (tp 2 at 2 ranks; tp 4 and dp 2 x tp 2
    at 4 ranks)."""
    from fprep.testing.distributed import run_ranks

    root = Path(tmp_path_factory.mktemp("tp_biased"))
    qwen2 = str(W.save_qwen2(root / "qwen2"))
    seq = str(W.save_sequential(root / "sequential.safetensors"))
    outs = {world: run_ranks(W.biased_loaded, world, qwen2, seq, timeout_s=600) for world in (2, 4)}
    return {"qwen2": qwen2, "seq": seq, "outs": outs}


BIASED_LAYOUTS = [(world, name) for world, layouts in W.QWEN2_LAYOUTS.items() for name in layouts]


@pytest.mark.parametrize(("world", "layout"), BIASED_LAYOUTS, ids=lambda v: str(v))
def test_biased_weights_load_into_tp_blocks(
    biased: dict[str, Any], world: int, layout: str
) -> None:
    """Every parameter's local tensor is bitwise torch's block (distribute_tensor) of
    from_pretrained's tensor (Qwen2) or of the file's (nn.Sequential), colwise biases cut on
    dim 0 and rowwise ones replicated; gathered back, everything is bitwise the original."""
    from safetensors.torch import load_file

    qwen2 = {k: v for k, v in reference(Path(biased["qwen2"])).items() if "inv_freq" not in k}
    seq = load_file(biased["seq"])
    assert any(k.endswith("q_proj.bias") and bool(v.abs().sum() > 0) for k, v in qwen2.items())
    for rank, out in enumerate(biased["outs"][world]):
        result = out[layout]
        assert result["blocks"] == [], f"rank {rank}"
        checks = [("full", qwen2)]
        if "sequential" in result:
            assert result["sequential"] == [], f"rank {rank}"
            checks.append(("sequential_full", seq))
        for key, want in checks:
            got = torch.load(io.BytesIO(result[key]), weights_only=True)
            assert sorted(got) == sorted(want)
            assert [k for k in want if not torch.equal(got[k], want[k])] == [], f"rank {rank}"


@pytest.mark.parametrize(("world", "layout"), BIASED_LAYOUTS, ids=lambda v: str(v))
def test_biased_weights_train_as_one_process(
    biased: dict[str, Any], world: int, layout: str
) -> None:
    """Loaded with weights=, Qwen2 trains as from_pretrained does in one process: losses (mean
    over dp ranks) and clipped gradient norms within 1e-5 in fp32, tp ranks agreeing."""
    ref = W.qwen2_reference(biased["qwen2"])
    by_dp: dict[int, list[float]] = {}
    for out in (out[layout] for out in biased["outs"][world]):
        assert out["norms"] == pytest.approx(ref["norms"], abs=1e-5)
        by_dp.setdefault(out["dp_rank"], out["losses"])
        assert out["losses"] == pytest.approx(by_dp[out["dp_rank"]], abs=1e-6)  # tp ranks agree
    assert len(by_dp) == (2 if layout.startswith("dp2") else 1)
    mean = [sum(v[i] for v in by_dp.values()) / len(by_dp) for i in range(len(ref["losses"]))]
    assert mean == pytest.approx(ref["losses"], abs=1e-5)


# -- any plan of a biased model: the reads are the planned shards ------------------------------
@pytest.fixture(scope="module")
def sequential_file(tmp_path_factory: pytest.TempPathFactory) -> str:
    return str(W.save_sequential(Path(tmp_path_factory.mktemp("seq")) / "seq.safetensors"))


#: (world, PrepConfig fields)
PLAN_LAYOUTS = [
    (2, {"strategy": "auto", "tp": 2}),
    (4, {"strategy": "fsdp", "tp": 2}),
    (4, {"strategy": "auto", "tp": 4}),
    (8, {"strategy": "hsdp", "tp": 2, "hsdp_shard_size": 2}),
    (8, {"strategy": "fsdp", "tp": 4}),
    (6, {"strategy": "fsdp", "tp": 2}),  # 3 dp ranks: uneven FSDP2 rows
]
STYLE = st.sampled_from(["colwise", "rowwise", "colwise_rep", "rowwise_rep", "replicate", None])


@settings(
    max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(st.sampled_from(PLAN_LAYOUTS), st.integers(0, 7), STYLE, STYLE)
def test_any_tp_plan_of_a_biased_model_reads_its_planned_shards(
    sequential_file: str, layout: tuple[int, dict[str, Any]], rank: int, first: Any, second: Any
) -> None:
    """fprep.plan with weights= never raises (a Failure is a PrepError), and every read of a
    successful plan is this rank's planned shard (the bytes of its local shape) inside its
    tensor's bytes in the file: what load_weights checks, for every style of each Linear."""
    world, fields = layout
    tp_plan = {k: v for k, v in (("0", first), ("2", second)) if v is not None}
    cfg = fprep.PrepConfig(weights=sequential_file, tp_plan=tp_plan or None, **fields)
    topology = fprep.Topology(world_size=world, rank=rank % world, local_world_size=world)
    result = fprep.plan(W.sequential("meta"), cfg, topology)
    if not isinstance(result, Success):
        assert isinstance(result.failure(), fprep.PrepError)
        return
    state = result.unwrap()
    assert state.state_dict is not None and state.state_dict.weights is not None
    assert state.param_handles is not None and state.inputs.weights is not None
    specs = {s.fqn: s for s in state.param_handles.specs}
    tensors = {t.key: t for t in state.inputs.weights.tensors}
    for read in state.state_dict.weights.reads:
        assert read.nbytes == math.prod(specs[read.name].local_shape) * 4, read
        t = tensors[read.key]
        if isinstance(read, StridedRead):
            end = read.offset + (read.runs - 1) * read.stride + read.nbytes // read.runs
        else:
            end = read.offset + read.nbytes
        assert t.offset <= read.offset and end <= t.offset + t.nbytes, read
