"""precision="fp8": the Fp8Options config, the plan (which Linear layers run in float8, and why
the others do not), and the conversion itself (torchao's emulation on the CPU, when installed)."""

from __future__ import annotations

import dataclasses
import importlib.util

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

import fprep
from fprep.apply.fp8 import check_fp8_available, fp8_modules
from fprep.config import Fp8Options
from fprep.errors import ConfigError
from fprep.snapshot import ModuleTree
from fprep.state import PrepState
from fprep.testing.models import llama_tiny, lm_loss, synthetic_batches, tiny_gpt
from fprep.transitions.fp8 import LINEAR, plan_fp8, too_small_for_float8

HAS_TORCHAO = importlib.util.find_spec("torchao") is not None
CUDA = fprep.Topology(world_size=1, rank=0, device_type="cuda")
LLAMA_LINEARS = ("attention.wq", "attention.wk", "attention.wv", "attention.wo")
LLAMA_FFN = ("feed_forward.w1", "feed_forward.w2", "feed_forward.w3")


def _cuda_plan(model: nn.Module, **fp8: object) -> PrepState:
    """The plan on CUDA; tiny models' layers are below the size where float8 pays, so these
    tests convert them anyway unless they say otherwise (``skip_small`` has its own tests)."""
    fp8.setdefault("skip_small", False)
    cfg = fprep.PrepConfig(precision="fp8", fp8=fp8)
    return fprep.plan(model, cfg, CUDA).unwrap()


def _fp8_plan(state: PrepState) -> fprep.state.Fp8Plan:
    assert state.core is not None and state.core.precision.fp8_plan is not None
    return state.core.precision.fp8_plan


# -- config -----------------------------------------------------------------------------------
def test_options_defaults_and_round_trip() -> None:
    cfg = fprep.PrepConfig(precision="fp8", fp8={"recipe": "rowwise", "skip": ["layers.0"]})
    assert cfg.fp8 == Fp8Options(recipe="rowwise", skip=("layers.0",))
    assert cfg.to_dict()["fp8"] == {
        "recipe": "rowwise",
        "skip": ["layers.0"],
        "skip_output": True,
        "skip_small": True,
        "fsdp_float8_all_gather": None,
    }
    assert fprep.PrepConfig.from_dict(cfg.to_dict()) == cfg


@pytest.mark.parametrize(
    ("kwargs", "subject", "words"),
    [
        ({"recipe": "rowwize"}, "fp8.recipe", "Did you mean 'rowwise'"),
        ({"skip": "lm_head"}, "fp8.skip", "not a single string"),
        ({"skip": ("",)}, "fp8.skip", "empty pattern"),
        ({"skip_output": 1}, "fp8.skip_output", "True or False"),
        ({"skip_small": "yes"}, "fp8.skip_small", "True or False"),
        (
            {"recipe": "rowwise", "fsdp_float8_all_gather": True},
            "fp8.fsdp_float8_all_gather",
            "needs recipe='tensorwise'",
        ),
    ],
)
def test_bad_options_are_config_errors(kwargs: dict[str, object], subject: str, words: str) -> None:
    with pytest.raises(ConfigError) as info:
        fprep.PrepConfig(precision="fp8", fp8=kwargs)
    assert info.value.subject == subject
    assert words in str(info.value) + info.value.hint


def test_fp8_options_without_fp8_precision_are_refused() -> None:
    with pytest.raises(ConfigError, match="is set but precision is 'bf16'"):
        fprep.PrepConfig(precision="bf16", fp8=Fp8Options(recipe="rowwise"))
    with pytest.raises(ConfigError, match="has no field 'recipes'"):
        fprep.PrepConfig(precision="fp8", fp8={"recipes": "rowwise"})


# -- the plan ---------------------------------------------------------------------------------
def test_llama_plan_keeps_the_output_projection_in_bf16() -> None:
    plan = _fp8_plan(_cuda_plan(llama_tiny(device="meta")))
    expected = tuple(
        f"layers.{i}.{name}" for i in range(2) for name in (*LLAMA_LINEARS, *LLAMA_FFN)
    )
    assert sorted(plan.modules) == sorted(expected)
    assert plan.kept == (("output", "output projection (out_features 256 is the vocabulary)"),)
    assert plan.recipe == "tensorwise" and plan.fsdp_float8_all_gather is False  # one process


def test_skip_patterns_and_the_output_switch() -> None:
    plan = _fp8_plan(
        _cuda_plan(llama_tiny(device="meta"), skip=("layers.0", "*.w2"), skip_output=False)
    )
    assert sorted(plan.modules) == sorted(
        [
            "output",
            *(f"layers.1.{n}" for n in (*LLAMA_LINEARS, "feed_forward.w1", "feed_forward.w3")),
        ]
    )
    reasons = dict(plan.kept)
    assert reasons["layers.0.attention.wq"] == "fp8.skip pattern 'layers.0'"
    assert reasons["layers.1.feed_forward.w2"] == "fp8.skip pattern '*.w2'"


def test_small_tied_and_subclassed_linears_stay_in_bf16() -> None:
    """tiny_gpt: dimensions 32 and 96 are multiples of 16, but lm_head is tied to wte (and is the
    output projection); nn.MultiheadAttention's out_proj is a Linear subclass; 20 x 24 is not
    float8-sized; a model without embeddings keeps its last Linear."""
    gpt = _fp8_plan(_cuda_plan(tiny_gpt(device="meta")))
    assert dict(gpt.kept)["lm_head"].startswith("output projection")
    assert all(".attn." in m or ".mlp." in m for m in gpt.modules) and len(gpt.modules) == 8

    model = nn.Sequential(
        nn.Linear(32, 32), nn.Linear(32, 24), nn.MultiheadAttention(16, 2), nn.Linear(16, 48)
    )
    model[1] = nn.Linear(20, 24)
    plan = _fp8_plan(_cuda_plan(model))
    assert plan.modules == ("0",)
    reasons = dict(plan.kept)
    assert reasons["1"] == "dimensions 24 x 20 are not multiples of 16"
    assert "subclass of nn.Linear" in reasons["2.out_proj"]
    assert reasons["3"] == "output projection (the model's last Linear)"


def test_float8_all_gather_is_planned_for_sharded_tensorwise_only() -> None:
    def plan(world: int, **fp8: object) -> fprep.state.Fp8Plan:
        topo = fprep.Topology(world_size=world, rank=0, device_type="cuda")
        cfg = fprep.PrepConfig(strategy="fsdp", precision="fp8", fp8={"skip_small": False, **fp8})
        return _fp8_plan(fprep.plan(llama_tiny(device="meta"), cfg, topo).unwrap())

    assert plan(8).fsdp_float8_all_gather is True
    assert plan(8, fsdp_float8_all_gather=False).fsdp_float8_all_gather is False
    assert plan(8, recipe="rowwise").fsdp_float8_all_gather is False
    assert plan(1, fsdp_float8_all_gather=True).fsdp_float8_all_gather is False


def test_fprep_plan_shows_the_fp8_decisions() -> None:
    text = _cuda_plan(llama_tiny(device="meta")).summary()
    assert "fp8         tensorwise: 14 Linear layers in float8, 1 kept in bf16" in text
    assert "kept output: output projection" in text


def _linears(*shapes: tuple[int, int]) -> nn.Module:
    """An embedding (so no Linear counts as the output projection) and Linears of
    (in_features, out_features), on the meta device."""
    with torch.device("meta"):
        return nn.ModuleDict(
            {"emb": nn.Embedding(50, 16)}
            | {f"l{i}": nn.Linear(k, n) for i, (k, n) in enumerate(shapes)}
        )


def test_layers_too_small_for_float8_stay_in_bf16_by_recipe() -> None:
    """torchao's H100 thresholds: tensorwise keeps in_features <= 4096 and out_features <= 1024;
    rowwise keeps out_features <= 2048, in_features <= 1024, or both <= 4096 x 2048."""
    shapes = ((4096, 1024), (4096, 1040), (4112, 1024), (2048, 2064), (1024, 8192), (2064, 4112))
    tensorwise = _fp8_plan(_cuda_plan(_linears(*shapes), skip_small=True))
    assert tensorwise.modules == ("l1", "l2", "l3", "l4", "l5")
    why = dict(tensorwise.kept)["l0"]
    assert why.startswith("too small for float8 to pay (tensorwise")
    assert "1024 x 4096" in why and "fp8.skip_small=False converts it" in why
    rowwise = _fp8_plan(_cuda_plan(_linears(*shapes), skip_small=True, recipe="rowwise"))
    assert rowwise.modules == ("l5",)  # 4112 > 4096: the last rule no longer applies
    assert "out_features <= 2048" in dict(rowwise.kept)["l1"]
    everything = _fp8_plan(_cuda_plan(_linears(*shapes), skip_small=False))
    assert len(everything.modules) == len(shapes)


def test_skip_small_is_the_default_and_only_on_cuda() -> None:
    llama = fprep.PrepConfig(precision="fp8")
    assert llama.fp8.skip_small is True
    hpu = fprep.Topology(world_size=1, rank=0, device_type="hpu")
    on_gaudi = _fp8_plan(fprep.plan(llama_tiny(device="meta"), llama, hpu).unwrap())
    assert len(on_gaudi.modules) == 14  # no measurements there: nothing kept for its size


def test_fp8_that_would_convert_nothing_is_refused_naming_the_way_out() -> None:
    cfg = fprep.PrepConfig(precision="fp8")  # every tiny Llama layer is below the thresholds
    error = fprep.plan(llama_tiny(device="meta"), cfg, CUDA).failure()
    assert isinstance(error, ConfigError) and error.subject == "fp8"
    assert "runs none of the model's 15 Linear layers in float8" in error.message
    assert "too small for float8 to pay" in error.message
    assert "skip_small" in error.hint and "precision='bf16'" in error.hint
    no_linear = fprep.plan(nn.Sequential(nn.Conv1d(4, 4, 1)), cfg, CUDA).failure()
    assert isinstance(no_linear, ConfigError) and "has none" in no_linear.message


def test_skip_small_agrees_with_torchaos_own_filter() -> None:
    """On a Llama-3.2-1B-shaped transformers model (built on meta) the plan converts exactly
    what torchao's ``_auto_filter_for_recipe`` would, both recipes (the output projection
    aside, which fprep keeps by default and torchao's filter is told by name)."""
    float8_utils = pytest.importorskip("torchao.float8.float8_linear_utils")
    pytest.importorskip("transformers")
    from _tiny_transformers import meta_llama

    model = meta_llama(
        hidden_size=2048,
        intermediate_size=8192,
        num_attention_heads=32,
        num_key_value_heads=8,
        vocab_size=1000,
    )
    for recipe in ("tensorwise", "rowwise"):
        plan = _fp8_plan(_cuda_plan(model, recipe=recipe, skip_small=True))
        keep = float8_utils._auto_filter_for_recipe(recipe, filter_fqns=["lm_head"])
        theirs = [n for n, m in model.named_modules() if keep(m, n)]
        assert sorted(plan.modules) == sorted(theirs), recipe
        assert set(plan.modules) < {n for n, m in model.named_modules() if type(m) is nn.Linear}


def test_fp8_is_still_refused_on_a_cpu() -> None:
    failure = fprep.plan(llama_tiny(device="meta"), fprep.PrepConfig(precision="fp8")).failure()
    assert isinstance(failure, fprep.DeviceError)
    assert "needs a CUDA or Gaudi device" in str(failure)


_dims = st.integers(1, 64) | st.sampled_from((1024, 1040, 2048, 2064, 4096, 4112))
_shapes = st.lists(st.tuples(_dims, _dims), min_size=1, max_size=6)


@settings(max_examples=60, deadline=None)
@given(_shapes, st.booleans(), st.booleans(), st.sampled_from(("tensorwise", "rowwise")))
def test_every_linear_is_planned_exactly_once(
    shapes: list[tuple[int, int]], skip_out: bool, skip_small: bool, recipe: str
) -> None:
    with torch.device("meta"):
        model = nn.Sequential(*(nn.Linear(i, o) for i, o in shapes))
    tree = ModuleTree.of(model)
    options = Fp8Options(skip_output=skip_out, skip_small=skip_small, recipe=recipe)  # type: ignore[arg-type]
    plan = plan_fp8(tree, options, ignored_modules=(), sharded=False, device_type="cuda")
    kept = [fqn for fqn, _ in plan.kept]
    assert sorted(plan.modules + tuple(kept)) == sorted(
        m.fqn for m in tree.modules if m.is_a(LINEAR)
    )
    for fqn in plan.modules:
        i, o = shapes[int(fqn)]
        assert i % 16 == 0 and o % 16 == 0
        assert not skip_small or too_small_for_float8(recipe, o, i) == ""
    for fqn, why in plan.kept:  # a float8-sized layer is kept for a reason that applies
        i, o = shapes[int(fqn)]
        if i % 16 == 0 and o % 16 == 0 and not why.startswith("output projection"):
            assert skip_small and why == too_small_for_float8(recipe, o, i)
    outputs = [fqn for fqn, why in plan.kept if why.startswith("output projection")]
    assert outputs == ([str(len(shapes) - 1)] if skip_out else [])


# -- the conversion (torchao on the CPU, emulated float8 matmuls) ------------------------------
def _with_fp8(state: PrepState, model: nn.Module) -> PrepState:
    """A bf16 CPU plan with the fp8 plan a CUDA rank would get (the plan refuses fp8 on CPU)."""
    assert state.core is not None
    options = Fp8Options(skip_small=False)  # a tiny Llama: every layer below the thresholds
    fp8 = plan_fp8(state.tree, options, ignored_modules=(), sharded=False, device_type="cuda")
    precision = dataclasses.replace(state.core.precision, fp8=True, fp8_plan=fp8)
    return state.replace(core=dataclasses.replace(state.core, precision=precision))


@pytest.mark.skipif(not HAS_TORCHAO, reason="torchao is not installed")
def test_prepare_converts_exactly_the_planned_modules_and_trains() -> None:
    from fprep.planning import plan as plan_of

    model = llama_tiny(device="meta")
    reference = llama_tiny(device="meta")
    cfg = fprep.PrepConfig(precision="bf16", seed=0)
    state = _with_fp8(plan_of(model, cfg, fprep.Topology()).unwrap(), model)
    run = fprep.pipeline(*fprep.default_steps())
    state, prepared = run(state, model)
    _, bf16 = fprep.prepare(reference, cfg)
    assert "fp8" in state.applied and "fp8" not in state.skipped
    assert sorted(fp8_modules(prepared)) == sorted(_fp8_plan(state).modules)
    assert type(prepared.output) is nn.Linear  # the output projection stays in bf16
    for a, b in zip(prepared.parameters(), bf16.parameters(), strict=True):
        assert torch.equal(a, b)  # same reproducible init, float8 layers or not
    batches = synthetic_batches(1, batch_size=2, seq_len=8, vocab_size=256, seed=0)
    x, y = next(iter(batches))
    loss = lm_loss(prepared(x), y)
    loss.backward()
    ref = lm_loss(bf16(x), y)
    assert torch.isfinite(loss) and abs(loss.item() - ref.item()) < 0.05
    assert all(p.grad is not None for p in prepared.parameters())


@pytest.mark.skipif(not HAS_TORCHAO, reason="torchao is not installed")
def test_rowwise_recipe_reaches_torchao() -> None:
    from fprep.apply.fp8 import convert_fp8

    model = llama_tiny(device="cpu")
    plan = plan_fp8(
        ModuleTree.of(model),
        Fp8Options(recipe="rowwise", skip_small=False),
        ignored_modules=(),
        sharded=False,
        device_type="cuda",
    )
    convert_fp8(model, plan, "cpu", emulate=True)
    layer = model.get_submodule(plan.modules[0])
    assert type(layer).__name__ == "Float8Linear"
    assert "AXISWISE" in str(layer.config.cast_config_weight.scaling_granularity)


@pytest.mark.skipif(HAS_TORCHAO, reason="torchao is installed")
def test_missing_torchao_is_refused_before_any_effect() -> None:
    state = _cuda_plan(llama_tiny(device="meta"))
    with pytest.raises(ConfigError, match=r"needs torchao >= 0\.10"):
        check_fp8_available(state)
