"""init_device: the device this rank computes on, from config, parameters or the accelerator."""

from __future__ import annotations

import dataclasses

from _checks import check_plan_order, failure, replace_params, run_pure, run_until, success
from hypothesis import assume, given
from hypothesis import strategies as st

from fprep import DeviceError, ModuleInfo, ModuleTree, ParamInfo, PrepConfig, PrepState, Topology
from fprep.testing import strategies as fst
from fprep.topology import DEFAULT_BACKEND, DEVICE_TYPES
from fprep.transitions import init_device

ACCELERATORS = ("cuda", "xpu", "hpu", "mps")
SMALL = fst.module_trees(max_depth=2)


def expected_index(kind: str, local_rank: int) -> int:
    # One device per CUDA/XPU process, by local rank; Gaudi and MPS processes see device 0.
    return local_rank if kind in ("cuda", "xpu") else 0


def normalized(device: str, local_rank: int) -> str:
    kind, _, index = device.partition(":")
    if kind in ("cpu", "meta"):
        return kind
    return f"{kind}:{int(index) if index else expected_index(kind, local_rank)}"


def check_device(state: PrepState) -> None:
    dev = success(run_pure(init_device, state)).device
    ignored = state.ignored
    assert dev is not None and ignored is not None
    topo, cfg = state.topology, state.config
    managed = [p for p in state.tree.params if p.fqn not in ignored.params]
    devices = list(dict.fromkeys(normalized(p.device, topo.local_rank) for p in managed))
    placed = [d for d in devices if d not in ("cpu", "meta")]
    assert dev.param_devices == tuple(devices)
    assert dev.device_type == dev.compute_device.partition(":")[0]
    assert dev.backend == (topo.backend or DEFAULT_BACKEND[dev.device_type])
    if cfg.device is not None:
        assert dev.source == "config"
        assert dev.compute_device == normalized(cfg.device, topo.local_rank)
    elif placed:
        assert dev.source == "parameters" and [dev.compute_device] == placed
    elif topo.device_type != "cpu":
        assert dev.source == "accelerator"
        assert dev.compute_device == normalized(topo.device_type, topo.local_rank)
    else:
        assert dev.source == "cpu" and dev.compute_device == "cpu"


@given(
    fst.prep_states(
        before="init_device",
        inputs=fst.plan_inputs(topos=fst.topologies(device_type=st.sampled_from(DEVICE_TYPES))),
    )
)
def test_pure_and_invariants_cpu_models(state: PrepState) -> None:
    check_device(state)


@st.composite
def accelerator_inputs(draw: st.DrawFn) -> fst.PlanCase:
    kind = draw(st.sampled_from(ACCELERATORS))
    topology = draw(fst.topologies(device_type=kind))
    # Written with or without an index, as torch prints them ("cuda" or "cuda:1").
    device = draw(st.sampled_from((kind, f"{kind}:{topology.local_rank}", f"{kind}:0")))
    trees = fst.module_trees(max_depth=2, device=device, allow_meta=st.booleans())
    return draw(fst.plan_inputs(trees=trees, topos=st.just(topology)))


@given(fst.prep_states(before="init_device", inputs=accelerator_inputs()))
def test_pure_and_invariants_accelerator_models(state: PrepState) -> None:
    check_device(state)


@given(fst.prep_states(before="init_device", inputs=fst.plan_inputs(trees=SMALL)), st.data())
def test_ignored_parameters_do_not_count(state: PrepState, data: st.DataObject) -> None:
    ignored = state.ignored
    assert ignored is not None
    assume(ignored.params)
    # Move the ignored parameters anywhere: the plan's device does not change.
    where = data.draw(st.sampled_from(("cuda:5", "hpu:0", "meta")))
    moved = replace_params(
        state.tree, {p.fqn: {"device": where} for p in state.tree.params if p.fqn in ignored.params}
    )
    before = success(init_device(state)).device
    after = success(run_pure(init_device, state.replace(inputs=_with_tree(state, moved)))).device
    assert before == after


def _with_tree(state: PrepState, tree: ModuleTree) -> object:
    return dataclasses.replace(state.inputs, tree=tree)


# -- failures as values -------------------------------------------------------------------------
def _before_device(tree: ModuleTree, cfg: PrepConfig, topology: Topology) -> PrepState:
    return success(run_until("init_device", PrepState.initial(tree, cfg, topology)))


def _two_params(tree: ModuleTree) -> list[str]:
    return [p.fqn for p in tree.params][:2]


@given(SMALL, fst.topologies(), st.data())
def test_parameters_on_two_device_types(
    tree: ModuleTree, topology: Topology, data: st.DataObject
) -> None:
    names = _two_params(tree)
    assume(len(names) == 2)
    kinds = data.draw(st.permutations(ACCELERATORS))[:2]
    tree = replace_params(
        tree, {n: {"device": f"{k}:0"} for n, k in zip(names, kinds, strict=True)}
    )
    state = _before_device(tree, PrepConfig(), topology)
    error = failure(run_pure(init_device, state), DeviceError, names[0])
    assert "device types" in error.message


@given(SMALL, fst.topologies(device_type="cuda"), st.data())
def test_parameters_on_two_devices(
    tree: ModuleTree, topology: Topology, data: st.DataObject
) -> None:
    names = _two_params(tree)
    assume(len(names) == 2)
    kind = data.draw(st.sampled_from(("cuda", "xpu")))
    a, b = data.draw(st.lists(st.integers(0, 7), min_size=2, max_size=2, unique=True))
    tree = replace_params(
        tree, {names[0]: {"device": f"{kind}:{a}"}, names[1]: {"device": f"{kind}:{b}"}}
    )
    state = _before_device(tree, PrepConfig(), topology)
    error = failure(run_pure(init_device, state), DeviceError, names[0])
    assert "several devices" in error.message


@given(SMALL, fst.topologies(), st.data())
def test_cpu_and_accelerator_parameters_without_a_device(
    tree: ModuleTree, topology: Topology, data: st.DataObject
) -> None:
    names = _two_params(tree)
    assume(len(names) == 2)
    on_device = data.draw(st.sampled_from(names))
    kind = data.draw(st.sampled_from(ACCELERATORS))
    tree = replace_params(
        tree, {n: {"device": f"{kind}:0" if n == on_device else "cpu"} for n in names}
    )
    first_cpu = next(p.fqn for p in tree.params if p.device == "cpu")
    state = _before_device(tree, PrepConfig(), topology)
    failure(run_pure(init_device, state), DeviceError, first_cpu)
    # Naming the device resolves it: the CPU part is moved there.
    fixed = _before_device(tree, PrepConfig(device=f"{kind}:0"), _on(topology, kind))
    dev = success(run_pure(init_device, fixed)).device
    assert dev is not None and dev.compute_device == f"{kind}:0"


def _on(topology: Topology, kind: str) -> Topology:
    return Topology(
        world_size=topology.world_size,
        rank=topology.rank,
        local_world_size=topology.local_world_size,
        device_type=kind,
    )


@given(
    fst.module_trees(max_depth=2, device="cuda:0"), fst.topologies(device_type="cuda"), st.data()
)
def test_device_inconsistent_with_parameters(
    tree: ModuleTree, topology: Topology, data: st.DataObject
) -> None:
    assume(any(not p.is_meta for p in tree.params))
    device = data.draw(st.sampled_from(("cpu", "cuda:1", "cuda:3")))
    if topology.local_rank != 0:
        device = data.draw(st.sampled_from((device, "cuda")))  # "cuda" is cuda:<local rank>
    state = _before_device(tree, PrepConfig(device=device), topology)
    error = failure(run_pure(init_device, state), DeviceError, "device")
    assert "already on cuda:0" in error.message


@given(SMALL, st.data())
def test_device_type_not_available(tree: ModuleTree, data: st.DataObject) -> None:
    have = data.draw(st.sampled_from(DEVICE_TYPES), label="topology device type")
    want = data.draw(st.sampled_from([k for k in ACCELERATORS if k != have]), label="device")
    # (cpu and mps have one device per process: PrepConfig refuses "mps:1" itself)
    index = data.draw(st.sampled_from(("", ":0") if want in ("cpu", "mps") else ("", ":0", ":1")))
    topology = data.draw(fst.topologies(device_type=have))
    state = _before_device(tree, PrepConfig(device=want + index), topology)
    error = failure(run_pure(init_device, state), DeviceError, "device")
    assert f"no {want} device" in error.message


@given(fst.prep_states(inputs=fst.plan_inputs(trees=SMALL)))
def test_plan_order(complete: PrepState) -> None:
    check_plan_order("init_device", complete)


def test_meta_parameters_do_not_choose_the_device() -> None:
    tree = ModuleTree(
        modules=(
            ModuleInfo(fqn="", cls="m.M", children=("a",)),
            ModuleInfo(fqn="a", cls="m.L", param_names=("w", "b")),
        ),
        params=(
            ParamInfo(names=("a.w",), shape=(3,), device="meta"),
            ParamInfo(names=("a.b",), shape=(3,), device="cpu"),
        ),
    )
    topology = Topology(world_size=2, rank=1, device_type="cuda")
    dev = success(init_device(_before_device(tree, PrepConfig(), topology))).device
    assert dev is not None
    assert (dev.compute_device, dev.source, dev.backend) == ("cuda:1", "accelerator", "nccl")
    assert dev.param_devices == ("meta", "cpu")
