"""``weights=`` reads the mixture-of-experts checkpoints people download: one tensor per expert
(``mlp.experts.E.gate_proj.weight``), which transformers 5 fuses into one parameter per layer
(``mlp.experts.gate_up_proj``) with its conversion mapping as it loads.

Tiny Qwen3-MoE, Mixtral, GPT-OSS (fused in its checkpoints too), Qwen2-MoE and DeepSeek V3
models, saved by ``save_pretrained`` over several files, load bit for bit as
``from_pretrained`` loads them: in one process, and at 2 and 4 gloo ranks (fsdp, ddp, hsdp 2x2;
5 experts, so shards are uneven and one rank of four holds none), each rank reading only its
experts' bytes. ``save_pretrained`` / ``export_full`` from 4 ranks write the per-expert layout
``from_pretrained`` reads back. A checkpoint missing an expert, or with an expert of another
shape, is refused by name before the model is touched; so is an operation fprep does not read.
The byte ranges are a property test against torch.stack / torch.cat.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import _weights_moe_workers as W
import pytest
import torch
from _weights_workers import full_state, mismatches
from hypothesis import given
from hypothesis import strategies as st
from safetensors import safe_open
from safetensors.torch import load_file, save_file

import fprep
from fprep.errors import CheckpointError
from fprep.sharding import chunk_rows, local_rows
from fprep.weights.blocks import pieces, tp_weights
from fprep.weights.converted import converted_read, tree
from fprep.weights.records import (
    Conversion,
    ConvertedRead,
    ConvertedSource,
    WeightsPlan,
    WeightsSnapshot,
    WeightsTensor,
)

FUSED = "model.layers.1.mlp.experts.gate_up_proj"


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("moe")
    return {f: str(W.save(f, root / f)) for f in W.FAMILIES}


def test_checkpoints_hold_one_tensor_per_expert(saved: dict[str, str]) -> None:
    """What the other tests load is the hub's layout, not the model's (GPT-OSS: both fused)."""
    keys: set[str] = set()
    for path in Path(saved["qwen3_moe"]).glob("*.safetensors"):
        with safe_open(str(path), "pt") as f:
            keys.update(f.keys())
    assert FUSED not in keys
    assert {f"model.layers.1.mlp.experts.{e}.up_proj.weight" for e in range(W.EXPERTS)} <= keys
    assert len(list(Path(saved["qwen3_moe"]).glob("*.safetensors"))) > 1  # several files


@pytest.mark.parametrize("family", W.FAMILIES)
def test_one_process_loads_what_from_pretrained_loads(family: str, saved: dict[str, str]) -> None:
    want = W.reference(Path(saved[family]))
    experts = want[FUSED]
    assert not torch.equal(experts[0], experts[1])  # the experts differ: their order counts
    state, model = fprep.prepare(W.on_meta(family), fprep.PrepConfig(weights=saved[family]))
    assert mismatches(full_state(model), want) == []
    notes = state.state_dict.weights.notes  # type: ignore[union-attr]
    converted = family != "gpt_oss"  # GPT-OSS's checkpoints hold its fused layout
    assert any("parameters assembled from" in n for n in notes) == converted
    if converted:
        assert "parameters assembled from" in state.summary()


def test_a_peft_model_reads_its_base_models_experts(saved: dict[str, str]) -> None:
    """LoRA on the attention of a Qwen3-MoE model: the base reads its experts as without peft
    (names as the base model's checkpoint has them), the adapters are left to peft's init."""
    from peft import LoraConfig, get_peft_model

    model = get_peft_model(W.on_meta("qwen3_moe"), LoraConfig(r=2, target_modules=["q_proj"]))
    _, model = fprep.prepare(model, fprep.PrepConfig(weights=saved["qwen3_moe"]))
    base = {
        k.replace(".base_layer", ""): v
        for k, v in model.get_base_model().state_dict().items()
        if "lora_" not in k
    }
    want = W.reference(Path(saved["qwen3_moe"]))
    assert FUSED in base and mismatches(base, want) == []


@pytest.mark.parametrize("world", [2, 4])
def test_ranks_load_what_from_pretrained_loads(world: int, saved: dict[str, str]) -> None:
    from fprep.testing.distributed import run_ranks

    outs = run_ranks(W.rank_load, world, saved, timeout_s=600)
    for rank, out in enumerate(outs):
        for layout, bad in out["mismatches"].items():
            assert bad == [], f"rank {rank}, {layout}: {bad}"
        # under fsdp a rank reads its experts' tensors only, and exactly its shard's bytes
        want = [
            f"model.layers.1.mlp.experts.{e}.{p}_proj.weight"
            for e in range(chunk_rows(W.EXPERTS, world) * rank, W.EXPERTS)
            if e < chunk_rows(W.EXPERTS, world) * (rank + 1)
            for p in ("gate", "up")
        ]
        assert out["keys"] == want, f"rank {rank}"
        rows = local_rows(W.EXPERTS, world, rank)
        assert out["nbytes"] == rows * math.prod(out["shape"][1:]) * 4


def test_pipeline_stages_read_their_own_experts(saved: dict[str, str]) -> None:
    """At pp 2 each stage reads its layer's experts; the other stage's per-expert tensors are
    neither read nor unexpected."""
    from fprep.testing.distributed import run_ranks

    outs = run_ranks(W.rank_pipeline, 2, saved["qwen3_moe"], timeout_s=600)
    for stage, out in enumerate(outs):
        assert out["mismatches"] == [], f"stage {stage}"
        assert f"model.layers.{stage}.mlp.experts.gate_up_proj" in out["names"]
        assert f"model.layers.{1 - stage}.mlp.experts.gate_up_proj" not in out["names"]


def test_save_pretrained_from_four_ranks_reads_back(saved: dict[str, str], tmp_path: Path) -> None:
    from fprep.testing.distributed import run_ranks

    run_ranks(W.rank_export, 4, saved, str(tmp_path), timeout_s=600)
    for family, directory in saved.items():
        out = tmp_path / family
        assert mismatches(W.reference(out), W.reference(Path(directory))) == [], family
        with safe_open(str(out / "model.safetensors"), "pt") as f:
            written = set(f.keys())
        with safe_open(str(tmp_path / f"{family}.safetensors"), "pt") as f:
            assert set(f.keys()) == written  # export_full: the same layout
        if family != "gpt_oss":
            assert FUSED not in written
        # and fprep reads its own export back
        got = W.loaded(family, tmp_path / f"{family}.safetensors")
        assert mismatches(got, W.reference(Path(directory))) == [], family


def _rewritten(saved: str, tmp_path: Path, change: Any) -> Path:
    """``saved`` (several files) as one file, changed by ``change(tensors)``."""
    tensors: dict[str, torch.Tensor] = {}
    for path in Path(saved).glob("*.safetensors"):
        tensors.update(load_file(str(path)))
    change(tensors)
    out = tmp_path / "changed"
    out.mkdir()
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    return out


def _refused(family: str, directory: Path, strategy: str = "none") -> CheckpointError:
    """prepare of a model with its own values refuses ``directory``; the values are kept."""
    torch.manual_seed(1)
    import transformers as tf

    model = tf.AutoModelForCausalLM.from_config(W.config(family))
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(CheckpointError) as info:
        fprep.prepare(model, fprep.PrepConfig(strategy=strategy, weights=str(directory)))
    assert mismatches(model.state_dict(), before) == []
    return info.value


@pytest.mark.parametrize("family", ["qwen3_moe", "mixtral"])
def test_a_missing_expert_is_refused_by_name(
    family: str, saved: dict[str, str], tmp_path: Path
) -> None:
    key = {
        "qwen3_moe": "model.layers.1.mlp.experts.3.up_proj.weight",
        "mixtral": "model.layers.0.block_sparse_moe.experts.3.w3.weight",
    }[family]
    error = _refused(family, _rewritten(saved[family], tmp_path, lambda t: t.pop(key)))
    assert repr(key) in str(error) and error.subject == key
    assert family in str(error) and "5 experts" in str(error)


def test_an_expert_of_another_shape_is_refused_by_name(
    saved: dict[str, str], tmp_path: Path
) -> None:
    key = "model.layers.0.mlp.experts.2.gate_proj.weight"

    def shrink(tensors: dict[str, torch.Tensor]) -> None:
        tensors[key] = tensors[key][:-1].clone()

    error = _refused("qwen3_moe", _rewritten(saved["qwen3_moe"], tmp_path, shrink), "fsdp")
    assert error.subject == key and "[7, 16]" in str(error) and "[8, 16]" in str(error)
    assert "model.layers.0.mlp.experts.gate_up_proj" in str(error)


def test_an_extra_expert_is_refused_by_name(saved: dict[str, str], tmp_path: Path) -> None:
    key = "model.layers.1.mlp.experts.5.down_proj.weight"

    def add(tensors: dict[str, torch.Tensor]) -> None:
        tensors[key] = tensors["model.layers.1.mlp.experts.4.down_proj.weight"].clone()

    error = _refused("qwen3_moe", _rewritten(saved["qwen3_moe"], tmp_path, add))
    assert error.subject == key and "5 experts" in str(error)


def test_an_expert_held_twice_is_refused_by_name(saved: dict[str, str], tmp_path: Path) -> None:
    key = "model.layers.1.mlp.experts.03.up_proj.weight"

    def add(tensors: dict[str, torch.Tensor]) -> None:
        tensors[key] = tensors["model.layers.1.mlp.experts.3.up_proj.weight"].clone()

    error = _refused("qwen3_moe", _rewritten(saved["qwen3_moe"], tmp_path, add))
    both = {key, "model.layers.1.mlp.experts.3.up_proj.weight"}
    assert error.subject in both and all(repr(k) in str(error) for k in both)
    assert "for expert 3" in str(error)


def test_qwen3_vl_moe_reads_its_experts_and_refuses_transposed_ones(tmp_path: Path) -> None:
    """Qwen3-VL-MoE's mapping transposes a fused expert tensor only when its shape is not the
    model's: one of the model's shape loads as from_pretrained loads it; a transposed one (which
    fprep does not read) is refused naming the family, the parameter and the operation."""
    import transformers as tf

    torch.manual_seed(0)
    tf.Qwen3VLMoeForConditionalGeneration(W.qwen3_vl_moe()).save_pretrained(tmp_path / "vl")
    with torch.device("meta"):
        meta = tf.Qwen3VLMoeForConditionalGeneration(W.qwen3_vl_moe())
    _, meta = fprep.prepare(meta, fprep.PrepConfig(weights=str(tmp_path / "vl")))
    want = tf.Qwen3VLMoeForConditionalGeneration.from_pretrained(tmp_path / "vl").state_dict()
    assert mismatches(meta.state_dict(), want) == []
    key = "model.language_model.layers.1.mlp.experts.gate_up_proj"

    def transpose(tensors: dict[str, torch.Tensor]) -> None:
        tensors[key] = tensors[key].transpose(1, 2).contiguous()  # (5, 24, 16): as on the hub

    torch.manual_seed(1)
    model = tf.Qwen3VLMoeForConditionalGeneration(W.qwen3_vl_moe())
    before = {k: v.clone() for k, v in model.state_dict().items()}
    changed = _rewritten(str(tmp_path / "vl"), tmp_path, transpose)
    with pytest.raises(CheckpointError) as info:
        fprep.prepare(model, fprep.PrepConfig(weights=str(changed)))
    assert "qwen3_vl_moe" in str(info.value) and repr(key) in str(info.value)
    assert "Transpose" in str(info.value) and info.value.subject == key
    assert mismatches(model.state_dict(), before) == []


def _tensors(keys: list[str], shape: tuple[int, ...]) -> dict[str, WeightsTensor]:
    n = math.prod(shape) * 4
    return {k: WeightsTensor(k, "f", "float32", shape, i * n, n) for i, k in enumerate(keys)}


def test_an_operation_fprep_does_not_read_is_refused_naming_it() -> None:
    keys = ["experts.0.w.weight", "experts.1.w.weight"]
    conv = Conversion(
        target="layers.0.experts.w",
        family="somemoe",
        sources=(ConvertedSource("experts.*.w.weight", tuple(keys), (0, 1), "experts.{}.w"),),
        operations=(("MergeModulelist", 0), ("Transpose", 1)),
    )
    with pytest.raises(CheckpointError) as info:
        tree(conv, (2, 3, 4), _tensors(keys, (4, 3)))
    message = str(info.value)
    assert "somemoe" in message and "'layers.0.experts.w'" in message
    assert "Transpose" in message and info.value.subject == "layers.0.experts.w"


def test_tensor_parallelism_over_a_converted_parameter_is_refused() -> None:
    keys = ["experts.0.w.weight", "experts.1.w.weight"]
    tensors = _tensors(keys, (4, 3))
    conv = Conversion(
        "experts.w", "somemoe", (ConvertedSource("experts.*.w.weight", tuple(keys), (0, 1)),),
        (("MergeModulelist", 0),),
    )  # fmt: skip
    read = converted_read(
        conv, tree(conv, (2, 4, 3), tensors), tensors, name="experts.w", dtype="float32",
        rows=None, keep=False,
    )  # fmt: skip
    plan = WeightsPlan(source="ckpt", reads=(read,), files=(), loaded_modules=())
    snap = WeightsSnapshot(source="ckpt", tensors=tuple(tensors.values()), files=())
    with pytest.raises(CheckpointError, match="one tensor per expert") as info:
        tp_weights(plan, snap, {"experts.w": 1}, 2, 0, None)
    assert info.value.subject == "experts.w"


@st.composite
def _layouts(draw: st.DrawFn) -> tuple[Any, ...]:
    leaf = tuple(draw(st.lists(st.integers(1, 4), min_size=1, max_size=3)))
    experts = draw(st.integers(1, 9))
    k = draw(st.integers(0, len(leaf)))  # where the experts are stacked
    sources = draw(st.integers(1, 3))
    concat = draw(st.integers(0, len(leaf))) if sources > 1 or draw(st.booleans()) else None
    world = draw(st.integers(1, 6))
    rank = draw(st.integers(0, world - 1))
    return leaf, experts, k, sources, concat, world, rank


@given(_layouts())
def test_planned_reads_reassemble_the_ranks_shard(layout: tuple[Any, ...]) -> None:
    """For any expert count, shapes, stack and concat dims, world and rank: following the
    planned byte ranges through the file gives exactly this rank's FSDP2 rows of
    torch.cat(torch.stack(...)), and reads nothing else."""
    leaf, experts, k, sources, concat, world, rank = layout
    numel = math.prod(leaf)
    keys = [[f"l.experts.{e}.s{s}" for e in range(experts)] for s in range(sources)]
    flat = [key for group in keys for key in group]
    tensors = _tensors(flat, leaf)
    values = {
        key: torch.arange(numel, dtype=torch.float32).view(leaf) + 1000 * i
        for i, key in enumerate(flat)
    }
    data = torch.cat([values[key].reshape(-1) for key in flat]).numpy().tobytes()
    groups = [torch.stack([values[key] for key in group], k) for group in keys]
    full = torch.cat(groups, concat) if concat is not None else groups[0]
    ops = (("MergeModulelist", k),) + ((("Concatenate", concat),) if concat is not None else ())
    conv = Conversion(
        target="l.experts.fused",
        family="test",
        sources=tuple(
            ConvertedSource(f"experts.*.s{s}", tuple(g), tuple(range(experts)))
            for s, g in enumerate(keys)
        ),
        operations=ops,
    )
    node = tree(conv, tuple(full.shape), tensors)
    assert node.shape == tuple(full.shape)
    c = chunk_rows(full.shape[0], world)
    want = full[c * rank : c * (rank + 1)]
    rows = (c * rank if want.shape[0] else 0, want.shape[0])
    read = converted_read(conv, node, tensors, name="f", dtype="float32", rows=rows, keep=False)
    assert isinstance(read, ConvertedRead)
    assert read.nbytes == want.numel() * 4  # nothing more than the rank's bytes
    got = torch.full(want.shape, -1.0)
    for part, into in pieces(read, got):
        chunk = data[part.offset : part.offset + part.nbytes]
        into.copy_(torch.frombuffer(bytearray(chunk), dtype=torch.float32))
    assert torch.equal(got, want)
