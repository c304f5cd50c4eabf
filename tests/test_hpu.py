"""Intel Gaudi through a fake habana_frameworks that records every call: what fprep imports
and calls, and in which order. (No Gaudi hardware is available here; docs/hpu.md says what has
and has not run on real Gaudi.)"""

from __future__ import annotations

import sys

import pytest
import torch
from fake_habana import install
from torch import nn

import fprep
from fprep.apply.fp8 import convert_fp8
from fprep.devices import device_handle
from fprep.state import Fp8Plan


def _hpu_prepare(
    cfg: fprep.PrepConfig, model: nn.Module | None = None
) -> tuple[fprep.PrepState, nn.Module]:
    model = model or nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2))
    topo = fprep.Topology(device_type="hpu")
    # the model stays on the CPU (device_placement=False): the fake has no real hpu tensors
    return fprep.prepare(model, cfg.replace(device_placement=False), topology=topo)


def test_single_process_imports_the_device_only(monkeypatch: pytest.MonkeyPatch) -> None:
    log = install(monkeypatch)
    state, _ = _hpu_prepare(fprep.PrepConfig())
    assert log == ["import habana_frameworks.torch.core"]
    assert state.device is not None and state.device.compute_device == "hpu:0"
    assert state.device.backend == "hccl"


def test_auto_strategy_on_gaudi_is_fast_ddp() -> None:
    tree = fprep.ModuleTree.of(nn.Linear(4, 4))
    topo = fprep.Topology(world_size=8, rank=0, device_type="hpu")
    state = fprep.plan(tree, fprep.PrepConfig(), topo).unwrap()
    assert state.core is not None and state.core.strategy == "fast_ddp"


def test_hccl_is_registered_before_the_process_group(monkeypatch: pytest.MonkeyPatch) -> None:
    log = install(monkeypatch)
    order: list[str] = []
    connect_module = sys.modules["fprep.apply.connect"]  # the step function shadows the name
    monkeypatch.setattr(
        connect_module, "_ensure_default_group", lambda state: order.extend(log) or False
    )
    topo = fprep.Topology(world_size=2, rank=0, device_type="hpu")
    state = fprep.plan(nn.Linear(4, 4), fprep.PrepConfig(strategy="fast_ddp"), topo).unwrap()
    connect = fprep.default_steps()[0]
    connect(state, nn.Linear(4, 4))
    assert order == [
        "import habana_frameworks.torch.core",
        "import habana_frameworks.torch.distributed.hccl",
    ]


def test_lazy_mode_refuses_compile_before_touching_the_model(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    install(monkeypatch, lazy=True)
    model = nn.Sequential(nn.Linear(4, 4))
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(fprep.PrepareError) as info:
        _hpu_prepare(fprep.PrepConfig(compile="whole"), model)
    assert info.value.subject == "compile" and "PT_HPU_LAZY_MODE=0" in str(info.value)
    assert not hasattr(model, "_fprep_compiled")
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())


def test_eager_mode_compiles_with_hpu_backend(monkeypatch: pytest.MonkeyPatch) -> None:
    install(monkeypatch, lazy=False)
    calls: list[dict[str, object]] = []
    monkeypatch.setattr(nn.Module, "compile", lambda self, **kw: calls.append(kw))
    _hpu_prepare(fprep.PrepConfig(compile="whole"))
    assert calls == [{"backend": "hpu_backend"}]


def test_step_marks_only_in_lazy_mode(monkeypatch: pytest.MonkeyPatch) -> None:
    for lazy, expected in ((True, ["mark_step()"]), (False, [])):
        log = install(monkeypatch, lazy=lazy)
        state, model = _hpu_prepare(fprep.PrepConfig())
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        log.clear()
        fprep.backward(state, model, model(torch.ones(1, 4)).sum())
        assert [e for e in log if not e.startswith("import")] == expected
        log.clear()
        fprep.optimizer_step(state, opt)
        assert [e for e in log if not e.startswith("import")] == expected


def test_device_handle_on_gaudi(monkeypatch: pytest.MonkeyPatch) -> None:
    log = install(monkeypatch)
    handle = device_handle("hpu")
    assert handle.available() and handle.count() == 1 and handle.current_device() == 0
    handle.synchronize()
    assert "synchronize()" in log
    assert handle.default_backend == "hccl" and handle.compile_backend == "hpu_backend"


def test_fp8_uses_the_transformer_engine(monkeypatch: pytest.MonkeyPatch) -> None:
    log = install(monkeypatch)
    model = nn.Sequential(nn.Linear(4, 4), nn.Sequential(nn.Linear(4, 2)))
    weight = model[1][0].weight.detach().clone()
    plan = Fp8Plan(recipe="tensorwise", modules=("1.0",), kept=(), fsdp_float8_all_gather=False)
    convert_fp8(model, plan, "hpu")
    assert log.count("te.Linear") == 1  # only the planned layer
    assert type(model[0]) is nn.Linear
    assert torch.equal(model[1][0].weight, weight)  # weights carried over


def test_missing_stack_is_a_clear_error() -> None:
    with pytest.raises(fprep.PrepareError) as info:
        _hpu_prepare(fprep.PrepConfig())
    assert info.value.subject == "habana_frameworks.torch.core"
    assert "Gaudi software stack" in str(info.value)


def test_cpu_handle_is_trivial() -> None:
    handle = device_handle("cpu")
    assert handle.available() and handle.count() == 1 and handle.default_backend == "gloo"
    handle.step_mark()
    handle.synchronize()
