"""Everything fprep prepares, on top of tensor parallelism (precision, checkpointing,
compilation, offload, prefetching, ignored modules, loss parallel), and sequence parallelism:
planned layouts, refusals, and training equal to one process at tp 2 and dp 2 x tp 2."""

from __future__ import annotations

import json
from typing import Any

import _tp_compose_workers as C
import _tp_sequence_workers as S
import _tp_workers as W
import pytest
from torch import nn

import fprep
from fprep import ConfigError, PrepConfig, Topology
from fprep.layout.placements import Replicate, Shard
from fprep.state import PrepState
from fprep.testing.distributed import run_ranks
from fprep.testing.models import llama_tiny


def plan(model: Any, cfg: PrepConfig, world: int = 4, rank: int = 0) -> PrepState:
    return fprep.plan(model, cfg, Topology(world_size=world, rank=rank)).unwrap()


def refusal(model: Any, cfg: PrepConfig, world: int = 4) -> fprep.PrepError:
    error = fprep.plan(model, cfg, Topology(world_size=world, rank=0)).failure()
    assert isinstance(error, fprep.PrepError)
    return error


# -- sequence parallelism: the plan -----------------------------------------------------------
SP = PrepConfig(strategy="fsdp", tp=2, sequence_parallel=True)


def test_fprep_llama_sequence_parallel_layout() -> None:
    state = plan(llama_tiny("meta"), SP, rank=1)
    tps = state.extension.tensor_parallel  # type: ignore[union-attr]
    assert tps is not None
    mods = dict(tps.modules)
    assert mods["tok_embeddings"] == "embedding_rowwise_sequence"  # output Shard(1)
    assert mods["layers.0.attention_norm"] == mods["norm"] == "sequence_parallel"
    assert mods["layers.0.attention"] == mods["layers.1.feed_forward"] == "sequence_gather"
    assert mods["layers.0.attention.wq"] == "colwise"  # inside a region: unchanged
    assert mods["layers.0.attention.wo"] == "rowwise_sequence"  # reduce-scatter, Shard(1)
    assert mods["output"] == "colwise_gather_output_sequence"  # input Shard(1)
    specs = {s.fqn: s for s in state.param_handles.specs}  # type: ignore[union-attr]
    norm = specs["layers.0.ffn_norm.weight"]  # replicated over tp: a tp DTensor all the same
    assert norm.mesh_dims == ("dp", "tp") and norm.placements == (Shard(0), Replicate())


def test_transformers_sequence_parallel_layout() -> None:
    state = plan(W.build("hf_qwen2"), SP)
    mods = dict(state.extension.tensor_parallel.modules)  # type: ignore[union-attr]
    # transformers' resolved plan cuts the embedding's vocabulary: its output Shard(1)
    assert mods["model.embed_tokens"] == "embedding_rowwise_sequence"
    assert mods["model.layers.1.input_layernorm"] == "sequence_parallel"
    assert mods["model.layers.1.post_attention_layernorm"] == "sequence_parallel"
    assert mods["model.norm"] == "sequence_parallel"
    assert mods["model.layers.0.self_attn"] == mods["model.layers.0.mlp"] == "sequence_gather"
    assert mods["model.layers.0.mlp.down_proj"] == "rowwise_sequence"
    assert mods["lm_head"] == "colwise_gather_output_sequence"
    assert "model.rotary_emb" not in mods


def mlp_blocks() -> nn.Module:
    class Block(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.norm = nn.LayerNorm(8)
            self.up = nn.Linear(8, 16)
            self.down = nn.Linear(16, 8)

    class Net(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.emb = nn.Embedding(32, 8)
            self.block = Block()
            self.head = nn.Linear(8, 32)

    return Net()


@pytest.mark.parametrize(
    ("cfg_plan", "words"),
    [
        ({"head": "colwise", "block.down": "rowwise"}, "directly under the root"),
        ({"block.up": "colwise", "head": "rowwise"}, "outside the regions"),
        ({"block.up": "colwise", "block.down": "rowwise"}, "no output head"),
        ({"block.down": "rowwise", "head": "colwise_gather_output"}, "no 'colwise' layers"),
        (
            {"block": "colwise_rep", "block.up": "colwise", "head": "colwise_gather_output"},
            "holds colwise layers",
        ),
        (
            {"emb": "embedding_colwise", "block.up": "colwise", "head": "colwise_gather_output"},
            "cannot place",
        ),
    ],
)
def test_sequence_parallel_refusals(cfg_plan: dict[str, str], words: str) -> None:
    cfg = PrepConfig(strategy="fsdp", tp=2, tp_plan=cfg_plan, sequence_parallel=True)
    error = refusal(mlp_blocks(), cfg)
    assert isinstance(error, ConfigError) and error.subject == "sequence_parallel", error
    assert words in error.message, error.message


def test_sequence_parallel_config_refusals() -> None:
    with pytest.raises(ConfigError, match="tp=1") as info:
        PrepConfig(sequence_parallel=True)
    assert info.value.subject == "sequence_parallel"
    with pytest.raises(ConfigError, match="sequence_parallel=True") as info:
        PrepConfig(tp=2, tp_plan={"a": "rowwise_sequence"})
    assert info.value.subject == "tp_plan"
    cfg = PrepConfig(
        tp=2, tp_plan={"a": "colwise", "d": "sequence_parallel"}, sequence_parallel=True
    )
    assert PrepConfig.from_dict(cfg.to_dict()) == cfg


def test_whole_compile_with_checkpointing_is_refused_naming_torch() -> None:
    """Whole compile of checkpointed blocks over a vocabulary-parallel embedding mixes fake
    modes inside torch (benchmarks/tp_compile_repro.py): refused, naming torch's version."""
    import torch

    fields: dict[str, Any] = {"compile": "whole", "activation_checkpointing": True}
    fields["wrap"] = "LlamaBlock"
    error = refusal(llama_tiny("meta"), PrepConfig(strategy="fsdp", tp=2, **fields))
    assert isinstance(error, ConfigError) and error.subject == "compile"
    assert f"torch {torch.__version__}" in error.message and "compile=" in error.hint
    fprep.plan(llama_tiny("meta"), PrepConfig(**fields), Topology(world_size=4)).unwrap()  # tp=1


@pytest.mark.parametrize("checkpointing", [False, True])
def test_regional_compile_under_tp_is_planned(checkpointing: bool) -> None:
    cfg = PrepConfig(
        strategy="fsdp",
        tp=2,
        compile="regional",
        wrap="LlamaBlock",
        activation_checkpointing=checkpointing,
    )
    ext = plan(llama_tiny("meta"), cfg).extension
    assert ext is not None and ext.tensor_parallel is not None


@pytest.mark.parametrize(("compile", "hooks"), [("regional", True), ("none", False)])
def test_checkpointing_keeps_the_composable_hooks_only_for_regions_compiled_under_tp(
    compile: str, hooks: bool
) -> None:
    """dynamo's checkpoint op saves the DeviceMesh for backward over TP DTensors (AOTAutograd's
    assertion at dp 2 x tp 2); eager checkpointing under tp and everything without tp use it
    (the 4-rank cases below train both equal to one process)."""
    from fprep.apply.regions import _hooks_under_tp

    cfg = PrepConfig(strategy="fsdp", tp=2, compile=compile, wrap="LlamaBlock")
    assert _hooks_under_tp(plan(llama_tiny("meta"), cfg)) is hooks
    one = fprep.plan(llama_tiny("meta"), PrepConfig(compile="regional", wrap="LlamaBlock")).unwrap()
    assert _hooks_under_tp(one) is False


# -- training at 4 ranks (gloo): every feature on dp 2 x tp 2, sequence parallelism -----------
def _compose_and_sequence() -> dict[str, Any]:
    return {"compose": C.four_ranks(), "sequence": S.run(4), "regional": C.regional(4)}


@pytest.fixture(scope="module")
def four_ranks() -> list[dict[str, Any]]:
    return run_ranks(_compose_and_sequence, 4, timeout_s=2100)


@pytest.mark.parametrize("case", tuple(C.CASES))
def test_feature_on_top_of_tp_equals_one_process(
    four_ranks: list[dict[str, Any]], case: str
) -> None:
    """Losses (mean over the two dp ranks; tp ranks agree) equal the same configuration in one
    process: fp32 within 1e-5, bf16 / fp16 within their rounding."""
    outs = [r["compose"][case] for r in four_ranks]
    assert outs[0] == outs[1] and outs[2] == outs[3]  # ranks of a tp group: one batch
    mean = [(a + b) / 2 for a, b in zip(outs[0], outs[2], strict=True)]
    assert mean == pytest.approx(C.reference(case), abs=C.CASES[case][2])


def _equal_to_reference(
    outs: list[dict[str, Any]], model: str, lengths: tuple[int, ...] = (W.SEQ,) * W.STEPS
) -> None:
    ref = W.reference(model, lengths)
    by_dp: dict[int, list[float]] = {}
    for out in outs:
        assert out["mismatches"] == []  # planned placements are the real DTensors'
        by_dp.setdefault(out["dp_rank"], out["losses"])
        assert out["losses"] == pytest.approx(by_dp[out["dp_rank"]], abs=1e-6)
    mean = [sum(v[i] for v in by_dp.values()) / len(by_dp) for i in range(W.STEPS)]
    assert mean == pytest.approx(ref["losses"], abs=1e-5)
    for out in outs:
        assert out["norms"] == pytest.approx(ref["norms"], abs=1e-5)


@pytest.mark.parametrize("model", W.MODELS)
def test_sequence_parallel_dp2_tp2_equals_one_process(
    four_ranks: list[dict[str, Any]], model: str
) -> None:
    _equal_to_reference([r["sequence"][f"{model}/dp2_tp2"] for r in four_ranks], model)


@pytest.mark.parametrize("model", W.MODELS)
def test_sequence_parallel_dp2_tp2_uneven_lengths_equal_one_process(
    four_ranks: list[dict[str, Any]], model: str
) -> None:
    """7, 1, then 5 tokens at tp 2: DTensor shards the stream unevenly (4 + 3, 1 + 0, 3 + 2)."""
    outs = [r["sequence"][f"{model}/dp2_tp2/uneven"] for r in four_ranks]
    _equal_to_reference(outs, model, S.UNEVEN)


def _sequence_and_regional() -> dict[str, Any]:
    return {"sequence": S.run(2), "regional": C.regional(2)}


@pytest.fixture(scope="module")
def two_ranks() -> list[dict[str, Any]]:
    return run_ranks(_sequence_and_regional, 2, timeout_s=900)


@pytest.mark.parametrize("model", W.MODELS)
def test_sequence_parallel_tp2_equals_one_process(
    two_ranks: list[dict[str, Any]], model: str
) -> None:
    _equal_to_reference([r["sequence"][f"{model}/tp2"] for r in two_ranks], model)


@pytest.mark.parametrize("layout", [n for n, (w, _) in C.REGIONAL.items() if w == 2])
def test_regional_compile_tp2_equals_eager(two_ranks: list[dict[str, Any]], layout: str) -> None:
    """Each block compiled over TP DTensors: losses and gradient norms equal eager (fp32, 1e-5);
    before fprep waited for the embedding's async all-reduce, its gradient was lost."""
    _equal_to_reference([r["regional"][layout] for r in two_ranks], "fprep_llama")


@pytest.mark.parametrize("layout", [n for n, (w, _) in C.REGIONAL.items() if w == 4])
def test_regional_compile_dp2_tp2_equals_eager(
    four_ranks: list[dict[str, Any]], layout: str
) -> None:
    _equal_to_reference([r["regional"][layout] for r in four_ranks], "fprep_llama")


@pytest.mark.parametrize("model", W.MODELS)
def test_sequence_parallel_tp2_uneven_lengths_equal_one_process(
    two_ranks: list[dict[str, Any]], model: str
) -> None:
    _equal_to_reference([r["sequence"][f"{model}/tp2/uneven"] for r in two_ranks], model, S.UNEVEN)


def test_plan_cli_sequence_parallel(capsys: pytest.CaptureFixture[str]) -> None:
    from fprep.cli import main

    argv = ["plan", "fprep.testing.models:llama_tiny", "--world-size", "4", "--tp", "2"]
    assert main([*argv, "--sequence-parallel", "--json"]) == 0
    with_sp = json.loads(capsys.readouterr().out)["memory_bytes"]["params"]
    assert main([*argv, "--json"]) == 0
    assert with_sp == json.loads(capsys.readouterr().out)["memory_bytes"]["params"]
    assert main([*argv[:-1], "1", "--sequence-parallel"]) == 2  # tp=1: a ConfigError
    assert "sequence_parallel" in capsys.readouterr().err
