"""``PrepConfig.weights`` under tensor parallelism: each rank reads its block straight from the
safetensors files (colwise: contiguous rows; rowwise: one run of columns per row; replicated
and data-parallel tensors as without tp), bitwise what transformers loads, at dp 2 x tp 2 and
tp 4 (4 gloo ranks), from fp32 and bf16 files."""

from __future__ import annotations

import io
from pathlib import Path
from typing import Any

import _tp_weights_workers as W
import pytest
import torch
from _weights_workers import reference

from fprep.weights.blocks import StridedRead, pieces, tp_weights
from fprep.weights.records import TensorRead, WeightsPlan, WeightsSnapshot, WeightsTensor


@pytest.mark.parametrize("tp", [2, 4])
@pytest.mark.parametrize("dp", [1, 2, 3])
@pytest.mark.parametrize("dim", [0, 1])
def test_blocks_read_the_ranks_elements(tp: int, dp: int, dim: int) -> None:
    """Following the planned byte ranges through a fake file gives torch's block: the tp
    chunk (torch.chunk), then FSDP2's rows of it (uneven: 5 rows per tp chunk)."""
    shape = (5 * tp, 3 * tp)
    full = torch.arange(shape[0] * shape[1], dtype=torch.int32).view(shape)
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
            assert isinstance(read, StridedRead) == (dim == 1 and want.shape[0] > 1)
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
