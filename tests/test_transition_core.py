"""init_core: the resolved strategy, precision, offload and reshard-after-forward, and the model
checks that depend on them (already prepared, Hugging Face device maps and 8/4-bit models)."""

from __future__ import annotations

import dataclasses

from _checks import (
    check_plan_order,
    failure,
    replace_modules,
    replicated,
    run_pure,
    run_until,
    sharded,
    success,
)
from hypothesis import assume, given
from hypothesis import strategies as st

from fprep import (
    ConfigError,
    DeviceError,
    ModelError,
    ModuleInfo,
    ModuleTree,
    PrepareError,
    PrepConfig,
    PrepState,
    Topology,
    TopologyError,
)
from fprep.state import PrecisionPolicy
from fprep.testing import strategies as fst
from fprep.topology import DEVICE_TYPES
from fprep.transitions import init_core
from fprep.transitions.fp8 import plan_fp8

SMALL = fst.module_trees(max_depth=2)
ROOT = ModuleInfo(fqn="", cls="m.Model")
ANY_DEVICE = fst.topologies(device_type=st.sampled_from(DEVICE_TYPES))


def check_core(state: PrepState) -> None:
    core = success(run_pure(init_core, state)).core
    pg, dev, cfg = state.process_group, state.device, state.config
    assert core is not None and pg is not None and dev is not None
    world, requested = pg.world_size, cfg.strategy

    # Strategy resolution: world 1 is always 'none', recorded unless nothing was asked for.
    if requested == "auto":
        expected = "none" if world == 1 else ("fast_ddp" if dev.device_type == "hpu" else "ddp")
    else:
        expected = "none" if world == 1 else requested
    assert core.strategy == expected and core.requested_strategy == requested
    world_note = any("world size is 1" in n for n in core.notes)
    assert world_note == (world == 1 and requested not in ("auto", "none"))
    assert core.is_sharded == (expected in ("fsdp", "hsdp"))
    assert core.is_distributed == (expected != "none")

    # Reshard after forward: False unless sharded; ints divide the shard group; trivial ints
    # become the bool they mean, with a note that agrees with the value.
    raf = cfg.effective_reshard_after_forward
    if not core.is_sharded:
        assert core.reshard_after_forward is False
    elif isinstance(raf, bool):
        assert core.reshard_after_forward is raf
    else:
        assert pg.shard_size % raf == 0
        if raf in (1, pg.shard_size):
            assert isinstance(core.reshard_after_forward, bool)
            assert core.reshard_after_forward == (raf == pg.shard_size)
            assert any(f"equals {core.reshard_after_forward} " in n for n in core.notes)
        else:
            assert core.reshard_after_forward == raf and 1 < raf < pg.shard_size

    # Precision by role.
    p = core.precision
    if cfg.precision == "no":
        assert p == PrecisionPolicy()
    else:
        low = "float16" if cfg.precision == "fp16" else "bfloat16"
        if core.is_sharded:
            assert (p.param_dtype, p.autocast_dtype) == (low, low)  # same numerics as ddp
            assert p.reduce_dtype == (cfg.reduce_dtype or "float32")
        else:
            assert (p.param_dtype, p.reduce_dtype, p.autocast_dtype) == (None, None, low)
        assert p.output_dtype == "float32"
        assert p.grad_scaling == (cfg.precision == "fp16")
        assert p.fp8 == (cfg.precision == "fp8")
        if p.fp8:
            assert dev.device_type in ("cuda", "hpu")

    assert core.offload == cfg.offload
    assert core.offload == "none" or core.is_sharded
    assert core.pin_memory == (cfg.offload == "cpu" and dev.device_type != "cpu")
    assert core.training_state == "idle"
    assert any("checkpoint" in n for n in core.notes) == (
        cfg.activation_checkpointing and cfg.wrap is None
    )


@given(fst.prep_states(before="init_core", inputs=fst.plan_inputs(topos=ANY_DEVICE)))
def test_pure_and_invariants(state: PrepState) -> None:
    check_core(state)


@given(
    fst.prep_states(
        before="init_core",
        inputs=fst.plan_inputs(
            trees=SMALL, strategy=st.sampled_from(("fsdp", "hsdp")), sharding="full"
        ),
    )
)
def test_pure_and_invariants_sharded(state: PrepState) -> None:
    check_core(state)


@given(
    fst.prep_states(
        before="init_core",
        inputs=fst.plan_inputs(topos=fst.topologies(nodes=1, local_world_size=1)),
    )
)
def test_world_size_one_is_not_distributed(state: PrepState) -> None:
    core = success(run_pure(init_core, state)).core
    assert core is not None and core.strategy == "none" and not core.is_distributed
    if state.config.strategy not in ("auto", "none"):
        assert any(repr(state.config.strategy) in n for n in core.notes)


def test_reshard_after_forward_on_shard_groups_of_one() -> None:
    # hsdp over shard groups of 1 rank: reshard_after_forward=1 is the whole shard group (True),
    # and the note says the value the plan uses.
    tree = ModuleTree(modules=(ROOT,))
    cfg = PrepConfig(strategy="hsdp", hsdp_shard_size=1, reshard_after_forward=1)
    core = success(run_pure(init_core, before_core(tree, cfg, Topology(world_size=2)))).core
    assert core is not None and core.reshard_after_forward is True
    assert core.notes == ("reshard_after_forward=1 equals True for shard groups of 1.",)


# -- failures as values -------------------------------------------------------------------------
def before_core(tree: ModuleTree, cfg: PrepConfig, topology: Topology) -> PrepState:
    return success(run_until("init_core", PrepState.initial(tree, cfg, topology)))


def with_tree(state: PrepState, tree: ModuleTree) -> PrepState:
    return state.replace(inputs=dataclasses.replace(state.inputs, tree=tree))


@given(fst.prep_states(before="init_core", inputs=fst.plan_inputs(trees=SMALL)), st.data())
def test_already_prepared(state: PrepState, data: st.DataObject) -> None:
    tree = state.tree
    how = data.draw(st.sampled_from(("flag", "fsdp", "ddp")))
    if how == "flag":
        tree = dataclasses.replace(tree, prepared=True)
    else:
        wrap = sharded if how == "fsdp" else replicated
        tree = replace_modules(tree, {"": wrap(tree.root)})
    error = failure(run_pure(init_core, with_tree(state, tree)), PrepareError, "model")
    assert "already prepared" in error.message


@given(fst.prep_states(before="init_core", inputs=fst.plan_inputs(trees=SMALL)), st.data())
def test_already_sharded_submodule(state: PrepState, data: st.DataObject) -> None:
    assume(len(state.tree.modules) > 1)
    module = data.draw(st.sampled_from(state.tree.modules[1:]))
    tree = replace_modules(state.tree, {module.fqn: sharded(module)})
    result = run_pure(init_core, with_tree(state, tree))
    assert state.ignored is not None
    if module.fqn in state.ignored.modules:  # fprep leaves ignored modules alone
        success(result)
    else:
        error = failure(result, ModelError, module.fqn)
        assert "already sharded" in error.message


@given(
    SMALL, fst.topologies(nodes=st.integers(1, 2), local_world_size=st.integers(2, 4)), st.data()
)
def test_device_map_over_several_devices(
    tree: ModuleTree, topology: Topology, data: st.DataObject
) -> None:
    devices = data.draw(
        st.lists(st.sampled_from(("0", "1", "cpu", "disk")), min_size=2, unique=True)
    )
    device_map = tuple((f"layer{i}", d) for i, d in enumerate(devices))
    tree = dataclasses.replace(tree, hf_device_map=device_map)
    strategy = data.draw(st.sampled_from(("auto", "ddp", "fsdp", "hsdp", "fast_ddp")))
    failure(
        run_pure(init_core, before_core(tree, PrepConfig(strategy=strategy), topology)),
        ModelError,
        "hf_device_map",
    )
    # One process (naive pipeline parallelism over the map) is fine.
    success(run_pure(init_core, before_core(tree, PrepConfig(strategy="none"), topology)))


@given(SMALL, fst.topologies(), st.data())
def test_quantized_model_checks(tree: ModuleTree, topology: Topology, data: st.DataObject) -> None:
    bits = data.draw(st.sampled_from(("8bit", "4bit")))
    case = data.draw(st.sampled_from(("several", "offload", "elsewhere")))
    topology = Topology(
        world_size=topology.world_size,
        rank=topology.rank,
        local_world_size=topology.local_world_size,
        device_type="cuda",
    )
    strategy = "none"
    kind: type[ModelError] | type[DeviceError] = ModelError
    if case == "several":
        assume(topology.world_size > 1)
        devices = ("0", "1")
        strategy = data.draw(st.sampled_from(("ddp", "auto", "fsdp")))
    elif case == "offload":
        devices = data.draw(st.sampled_from((("cpu",), ("0", "disk"), ("cpu", "disk"))))
    else:  # on one device, but not this rank's
        other = data.draw(st.integers(0, 7).filter(lambda i: i != topology.local_rank))
        devices = data.draw(st.sampled_from(((str(other),), (f"cuda:{other}",))))
        kind = DeviceError
    tree = dataclasses.replace(
        tree, quantization=bits, hf_device_map=tuple((f"m{i}", d) for i, d in enumerate(devices))
    )
    state = before_core(tree, PrepConfig(strategy=strategy), topology)  # type: ignore[arg-type]
    failure(run_pure(init_core, state), kind, "hf_device_map")
    # On this rank's own device it is fine.
    ok = dataclasses.replace(tree, hf_device_map=(("", str(topology.local_rank)),))
    success(run_pure(init_core, before_core(ok, PrepConfig(strategy=strategy), topology)))  # type: ignore[arg-type]


@given(fst.prep_states(before="init_core", inputs=fst.plan_inputs(trees=SMALL, topos=ANY_DEVICE)))
def test_offload_without_sharding(state: PrepState) -> None:
    cfg = state.config
    sharded_now = state.topology.world_size > 1 and cfg.strategy in ("fsdp", "hsdp")
    assume(not sharded_now)
    state = state.replace(
        inputs=dataclasses.replace(state.inputs, config=cfg.replace(offload="cpu"))
    )
    result = run_pure(init_core, state)
    if cfg.strategy in ("fsdp", "hsdp"):  # world size 1: nothing is sharded, so just a note
        core = success(result).core
        assert core is not None and core.strategy == "none"
        assert any("offload='cpu' has no effect" in n for n in core.notes)
    else:
        error = failure(result, ConfigError, "offload")
        assert "sharded strategy" in error.message


@given(fst.prep_states(before="init_core", inputs=fst.plan_inputs(trees=SMALL, device=None)))
def test_fp8_on_cpu(state: PrepState) -> None:
    assert state.device is not None and state.device.device_type == "cpu"
    cfg = state.config.replace(precision="fp8")
    state = state.replace(inputs=dataclasses.replace(state.inputs, config=cfg))
    failure(run_pure(init_core, state), DeviceError, "precision")


@given(SMALL, fst.topologies(device_type=st.sampled_from(("cuda", "hpu"))), st.booleans())
def test_fp8_on_an_accelerator(tree: ModuleTree, topology: Topology, small: bool) -> None:
    """fp8 is planned when a Linear runs in float8; with none it is refused (it would train in
    bf16 while saying fp8), naming the layers' reasons or their absence."""
    cfg = PrepConfig(precision="fp8", fp8={"skip_small": small})
    result = run_pure(init_core, before_core(tree, cfg, topology))
    planned = plan_fp8(
        tree, cfg.fp8, ignored_modules=(), sharded=False, device_type=topology.device_type
    )
    if planned.modules:
        core = success(result).core
        assert core is not None and core.precision.fp8
        assert core.precision.fp8_plan is not None
        assert core.precision.fp8_plan.modules == planned.modules
    elif planned.kept:
        error = failure(result, ConfigError, "fp8")
        assert f"none of the model's {len(planned.kept)} Linear layers" in error.message
    else:
        failure(result, ConfigError, "precision")


@given(
    SMALL,
    fst.topologies(nodes=st.integers(1, 3), local_world_size=st.integers(2, 4)),
    st.integers(2, 16),
    st.data(),
)
def test_reshard_after_forward_not_dividing(
    tree: ModuleTree, topology: Topology, raf: int, data: st.DataObject
) -> None:
    strategy = data.draw(st.sampled_from(("fsdp", "hsdp")))
    shard = topology.world_size if strategy == "fsdp" else topology.local_world_size
    assume(shard % raf != 0)
    cfg = PrepConfig(strategy=strategy, reshard_after_forward=raf)  # type: ignore[arg-type]
    error = failure(
        run_pure(init_core, before_core(tree, cfg, topology)),
        TopologyError,
        "reshard_after_forward",
    )
    assert str(shard) in error.message


@given(fst.prep_states(inputs=fst.plan_inputs(trees=SMALL)))
def test_plan_order(complete: PrepState) -> None:
    check_plan_order("init_core", complete)


# -- options with no effect are noted, not silently dropped ---------------------------------
def _linear_tree() -> ModuleTree:
    import torch

    return ModuleTree.of(torch.nn.Linear(4, 4))


def test_options_without_effect_are_noted() -> None:
    import fprep

    cfg = PrepConfig(
        strategy="ddp", reduce_dtype="bfloat16", hsdp_shard_size=2, compile_mode="max-autotune"
    )
    state = fprep.plan(_linear_tree(), cfg, Topology(world_size=2)).unwrap()
    assert state.core is not None
    notes = " ".join(state.core.notes)
    assert "reduce_dtype has no effect" in notes
    assert "hsdp_shard_size has no effect" in notes
    assert "compile_mode have no effect" in notes


def test_offload_with_fsdp_at_world_one_is_a_note() -> None:
    import fprep

    state = fprep.plan(
        _linear_tree(), PrepConfig(strategy="fsdp", offload="cpu"), Topology()
    ).unwrap()
    assert state.core is not None and state.core.strategy == "none"
    assert any("offload='cpu' has no effect" in n for n in state.core.notes)


def test_quantized_device_map_without_index_means_this_ranks_device() -> None:
    import dataclasses

    import fprep

    tree = dataclasses.replace(_linear_tree(), hf_device_map=(("", "cuda"),), quantization="8bit")
    topo = Topology(device_type="cuda")
    assert fprep.plan(tree, PrepConfig(device="cuda"), topo).unwrap().core is not None
    moved = dataclasses.replace(tree, hf_device_map=(("", "cuda:1"),))
    error = fprep.plan(moved, PrepConfig(device="cuda"), topo).failure()
    assert error.subject == "hf_device_map" and "cuda:1" in error.message
