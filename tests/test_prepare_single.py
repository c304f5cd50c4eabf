"""``fprep.prepare`` in one process: transactional failures, precision, activation checkpointing,
compilation, custom pipelines, and connecting without a launcher.

The multi-process behaviour (DDP, fast_ddp, FSDP2, HSDP on gloo) is in
tests/test_prepare_distributed.py.
"""

from __future__ import annotations

import copy
import io
import os
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import pytest
import torch
import torch.distributed as dist
from _prepare_workers import SEED, batches
from hypothesis import given
from hypothesis import strategies as st
from torch import nn

import fprep
from fprep import PrepConfig, Topology
from fprep.testing.models import GPT, GPTBlock, GPTConfig, lm_loss, tiny_gpt

LAUNCHER_VARS = (
    "WORLD_SIZE",
    "RANK",
    "LOCAL_RANK",
    "LOCAL_WORLD_SIZE",
    "MASTER_ADDR",
    "MASTER_PORT",
)
HOOK_DICTS = (
    "_forward_hooks",
    "_forward_pre_hooks",
    "_backward_hooks",
    "_backward_pre_hooks",
    "_forward_hooks_with_kwargs",
    "_forward_pre_hooks_with_kwargs",
    "_state_dict_hooks",
    "_state_dict_pre_hooks",
    "_load_state_dict_pre_hooks",
    "_load_state_dict_post_hooks",
)


@pytest.fixture(autouse=True)
def _single_process(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """No launcher variables, and no process group before or after any test here."""
    for name in LAUNCHER_VARS:
        monkeypatch.delenv(name, raising=False)
    assert not dist.is_initialized()
    yield
    assert not dist.is_initialized(), "a single-process prepare created a process group"


def first_batch() -> tuple[torch.Tensor, torch.Tensor]:
    x, y = next(batches(steps=1))
    return x, y


# -- transactional failures ----------------------------------------------------------------------
def bits(t: torch.Tensor) -> torch.Tensor:
    """The raw bytes of a tensor (bitwise comparison; distinguishes -0.0 and NaN payloads)."""
    return t.detach().reshape(-1).contiguous().view(torch.uint8).clone()


def snapshot(model: nn.Module) -> dict[str, Any]:
    return {
        "classes": [(n, m, type(m)) for n, m in model.named_modules(remove_duplicate=False)],
        "params": [
            (n, p, type(p), p.dtype, p.device, p.requires_grad, bits(p))
            for n, p in model.named_parameters(remove_duplicate=False)
        ],
        "buffers": [
            (n, b, b.dtype, b.device, bits(b))
            for n, b in model.named_buffers(remove_duplicate=False)
        ],
        "hooks": [
            (n, {h: list(getattr(m, h).items()) for h in HOOK_DICTS})
            for n, m in model.named_modules(remove_duplicate=False)
        ],
        "attrs": [(n, sorted(vars(m))) for n, m in model.named_modules(remove_duplicate=False)],
        "global_hooks": (
            list(nn.modules.module._global_forward_hooks.items()),
            list(nn.modules.module._global_forward_pre_hooks.items()),
        ),
        "rng": torch.get_rng_state(),
    }


def assert_unchanged(model: nn.Module, before: dict[str, Any]) -> None:
    after = snapshot(model)
    assert [(n, type(m)) for n, m, _ in before["classes"]] == [
        (n, type(m)) for n, m, _ in after["classes"]
    ]
    for (n, m, cls), (n2, m2, cls2) in zip(before["classes"], after["classes"], strict=True):
        assert n == n2 and m is m2 and cls is cls2, f"module {n!r} was replaced or re-classed"
    assert len(before["params"]) == len(after["params"])
    for old, new in zip(before["params"], after["params"], strict=True):
        name, p, cls, dtype, device, requires_grad, data = old
        assert new[0] == name
        assert new[1] is p, f"parameter {name!r} is a new object"
        assert new[2:6] == (cls, dtype, device, requires_grad), f"parameter {name!r} changed"
        assert torch.equal(new[6], data), f"parameter {name!r} changed value"
    assert len(before["buffers"]) == len(after["buffers"])
    for old, new in zip(before["buffers"], after["buffers"], strict=True):
        assert new[0] == old[0] and new[1] is old[1] and new[2:4] == old[2:4]
        assert torch.equal(new[4], old[4]), f"buffer {old[0]!r} changed value"
    assert after["hooks"] == before["hooks"], "hooks were added or removed"
    assert after["attrs"] == before["attrs"], "attributes were added or removed"
    assert after["global_hooks"] == before["global_hooks"]
    assert torch.equal(after["rng"], before["rng"]), "the global RNG was consumed"


@st.composite
def small_models(draw: st.DrawFn) -> GPT:
    """Tiny GPTs of drawn shapes, with a buffer and a frozen parameter somewhere."""
    n_head = draw(st.sampled_from([1, 2]))
    config = GPTConfig(
        vocab_size=draw(st.integers(3, 40)),
        block_size=draw(st.integers(2, 8)),
        n_layer=draw(st.integers(1, 2)),
        n_head=n_head,
        n_embd=n_head * draw(st.sampled_from([2, 4, 8])),
        bias=draw(st.booleans()),
    )
    model = tiny_gpt(config, seed=draw(st.integers(0, 2**16)))
    modules = [m for _, m in model.named_modules()]
    owner = draw(st.sampled_from(modules))
    owner.register_buffer("steps", torch.arange(draw(st.integers(0, 4)), dtype=torch.float64))
    params = list(model.parameters())
    params[draw(st.integers(0, len(params) - 1))].requires_grad_(False)
    return model


def distributed_topology(draw: st.DrawFn) -> Topology:
    world = draw(st.integers(2, 16))
    return Topology(world_size=world, rank=draw(st.integers(0, world - 1)))


KINDS = (
    "unknown_ignored_module",
    "param_as_ignored_module",
    "unknown_ignored_param",
    "scalar_param",
    "hf_device_map",
    "quantized",
    "already_prepared",
    "device_placement",
    "second_model",
    "foreign_optimizer_param",
)


@pytest.mark.parametrize("kind", KINDS)
@given(model=small_models(), data=st.data())
def test_a_rejected_prepare_leaves_the_model_untouched(
    kind: str, model: GPT, data: st.DataObject
) -> None:
    """Every input the plan rejects raises the right ``PrepError`` subclass naming the culprit,
    before any effect: parameters and buffers bitwise equal and the same objects, the same
    classes, no hooks or attributes added, no process group, the global RNG untouched."""
    draw = data.draw
    module_names = [n for n, _ in model.named_modules()]
    param_names = [n for n, _ in model.named_parameters(remove_duplicate=False)]
    cfg = PrepConfig()
    topology: Topology | None = Topology()
    objects: tuple[Any, ...] = ()
    placement: list[bool] | None = None
    expected: type[fprep.PrepError]
    mentions: str

    if kind in ("unknown_ignored_module", "unknown_ignored_param"):
        name = draw(
            st.text("abwxz._0123", min_size=1, max_size=12).filter(
                lambda s: s not in module_names and s not in param_names
            )
        )
        field = "ignored_modules" if kind == "unknown_ignored_module" else "ignored_params"
        cfg = PrepConfig(
            strategy=draw(st.sampled_from(["auto", "ddp", "fsdp"])), **{field: (name,)}
        )
        topology = draw(st.sampled_from([Topology(), distributed_topology(draw)]))
        expected, subject, mentions = fprep.IgnoredStateError, name, name
    elif kind == "param_as_ignored_module":
        name = draw(st.sampled_from(param_names))
        cfg = PrepConfig(strategy="fsdp", ignored_modules=(name,))
        topology = distributed_topology(draw)
        expected, subject, mentions = fprep.IgnoredStateError, name, name
    elif kind == "scalar_param":
        owner = draw(st.sampled_from(module_names))
        model.get_submodule(owner).register_parameter(
            "scale", nn.Parameter(torch.tensor(draw(st.floats(-2, 2))))
        )
        subject = f"{owner}.scale" if owner else "scale"
        cfg = PrepConfig(strategy="fsdp", wrap=draw(st.sampled_from([None, GPTBlock])))
        topology = distributed_topology(draw)
        expected, mentions = fprep.ModelError, subject
    elif kind == "hf_device_map":
        devices = draw(
            st.lists(st.sampled_from([0, 1, 2, "cpu", "disk"]), min_size=2, max_size=5, unique=True)
        )
        owners = ["wte", "blocks", "ln_f", "lm_head", "wpe"][: len(devices)]
        model.hf_device_map = dict(zip(owners, devices, strict=True))  # type: ignore[assignment]
        cfg = PrepConfig(strategy=draw(st.sampled_from(["auto", "ddp", "fast_ddp", "fsdp"])))
        topology = distributed_topology(draw)
        expected, subject, mentions = fprep.ModelError, "hf_device_map", "device_map"
    elif kind == "quantized":
        bits_attr = draw(st.sampled_from(["is_loaded_in_8bit", "is_loaded_in_4bit"]))
        setattr(model, bits_attr, True)
        if draw(st.booleans()):  # offloaded to the CPU: refused at any world size
            model.hf_device_map = {"": "cpu"}  # type: ignore[assignment]
            topology = draw(st.sampled_from([Topology(), distributed_topology(draw)]))
        else:  # several devices in a distributed mode
            model.hf_device_map = {"wte": 0, "blocks": 1}  # type: ignore[assignment]
            topology = distributed_topology(draw)
            cfg = PrepConfig(strategy=draw(st.sampled_from(["ddp", "fsdp"])))
        expected, subject = fprep.ModelError, "hf_device_map"
        mentions = "8bit" if "8bit" in bits_attr else "4bit"
    elif kind == "already_prepared":
        first = PrepConfig(precision=draw(st.sampled_from(["no", "bf16"])))
        _, prepared = fprep.prepare(model, first)
        assert prepared is model
        cfg = PrepConfig(strategy=draw(st.sampled_from(["auto", "none", "ddp", "fsdp"])))
        topology = draw(st.sampled_from([Topology(), distributed_topology(draw)]))
        expected, subject, mentions = fprep.PrepareError, "model", "already prepared"
    elif kind == "device_placement":
        objects = tuple(draw(st.lists(st.sampled_from([object(), {"lr": 1}, [1, 2]]), max_size=3)))
        length = draw(st.integers(0, 5).filter(lambda n: n != len(objects) + 1))
        placement = [True] * length
        expected, subject, mentions = fprep.ConfigError, "device_placement", "device_placement"
    elif kind == "foreign_optimizer_param":
        params = list(model.parameters())
        at = draw(st.integers(0, len(params)))
        foreign = nn.Parameter(torch.zeros(draw(st.integers(1, 3))))
        groups: list[dict[str, Any]] = [{"params": [*params[:at], foreign, *params[at:]]}]
        if draw(st.booleans()):  # the foreign parameter in a second param group
            groups = [{"params": params}, {"params": [foreign], "lr": 0.5}]
            at, group = 0, 1
        else:
            group = 0
        optimizer = torch.optim.SGD(groups, lr=0.1)
        objects = (optimizer,)
        cfg = PrepConfig(precision=draw(st.sampled_from(["no", "bf16"])))
        expected, mentions = fprep.PrepareError, "not a parameter of the model"
        subject = f"optimizer[0].param_groups[{group}].params[{at}]"
    else:  # second_model
        other = draw(st.sampled_from([nn.Linear(2, 2), nn.Sequential(), tiny_gpt()]))
        objects = tuple(draw(st.lists(st.just(object()), max_size=2)))
        at = draw(st.integers(0, len(objects)))
        objects = (*objects[:at], other, *objects[at:])
        expected, subject = fprep.ConfigError, "objects"
        # prepare(model, cfg, *objects): objects[at] is positional argument at + 3
        mentions = f"argument {at + 3} is a second model ({type(other).__name__})"

    before = snapshot(model)
    with pytest.raises(fprep.PrepError) as info:
        fprep.prepare(model, cfg, *objects, topology=topology, device_placement=placement)
    error = info.value
    assert type(error) is expected, f"{kind}: expected {expected.__name__}, got {error!r}"
    assert error.subject == subject, f"{kind}: subject {error.subject!r}, expected {subject!r}"
    assert mentions in str(error), f"{kind}: {mentions!r} not in {str(error)!r}"
    if not kind.startswith("unknown"):  # an unknown name gets a hint only when one is close
        assert error.hint
    assert_unchanged(model, before)
    if kind != "already_prepared":
        assert all(not h for _, hooks in before["hooks"] for h in hooks.values())
        assert not hasattr(model, "_fprep_prepared")
    if kind == "foreign_optimizer_param":  # the optimizer is left alone too
        assert optimizer.param_groups[group]["params"][at] is foreign


def test_an_optimizer_built_on_the_meta_device_is_rebound_to_the_real_parameters() -> None:
    with torch.device("meta"):
        model = GPT(GPTConfig())
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    _state, model, returned = fprep.prepare(model, PrepConfig(seed=3), opt)
    assert returned is opt
    params = opt.param_groups[0]["params"]
    assert [id(p) for p in params] == [id(p) for p in model.parameters()]
    assert not any(p.is_meta for p in params)
    x, y = first_batch()
    before = model.wte.weight.detach().clone()
    lm_loss(model(x), y).backward()
    opt.step()
    assert not torch.equal(model.wte.weight, before)
    assert model.lm_head.weight is model.wte.weight


@pytest.mark.parametrize("precision", ["no", "bf16", "fp16"])
def test_preparing_twice_is_refused_and_never_double_wraps(precision: str) -> None:
    cfg = PrepConfig(precision=precision, activation_checkpointing=True, wrap=GPTBlock)
    state, model = fprep.prepare(tiny_gpt(seed=SEED), cfg)
    assert state.applied[-1] == "mark_prepared"
    before = snapshot(model)
    for again in (cfg, PrepConfig()):
        with pytest.raises(fprep.PrepareError) as info:
            fprep.prepare(model, again)
        assert info.value.subject == "model"
    assert_unchanged(model, before)
    wrapper = model.__dict__.get("forward")
    assert (type(wrapper).__name__ == "AutocastForward") == (precision != "no")
    assert getattr(wrapper, "inner", None) is None  # wrapped once, not a wrapper of a wrapper


# -- connect -------------------------------------------------------------------------------------
def test_single_process_needs_no_process_group() -> None:
    state, model = fprep.prepare(tiny_gpt(seed=SEED), PrepConfig(strategy="auto"))
    assert state.core is not None and state.core.strategy == "none"
    assert not dist.is_initialized()
    handles = state.handles
    assert isinstance(handles, fprep.Handles)
    assert handles.process_group is None and handles.mesh is None
    assert handles.owns_process_group is False
    assert handles.device == torch.device("cpu")
    x, y = first_batch()
    lm_loss(model(x), y).backward()  # trains as a plain module


def test_a_distributed_plan_without_a_launcher_fails_in_connect_without_effects() -> None:
    model = tiny_gpt(seed=SEED)
    before = snapshot(model)
    with pytest.raises(fprep.TopologyError) as info:
        fprep.prepare(model, PrepConfig(strategy="fsdp"), topology=Topology(world_size=2))
    assert "MASTER_ADDR" in str(info.value)
    assert_unchanged(model, before)


# -- custom pipelines ----------------------------------------------------------------------------
def test_a_user_step_runs_in_order_and_is_recorded() -> None:
    defaults = fprep.default_steps()
    names = [s.step_name for s in defaults]  # type: ignore[attr-defined]
    assert names[0] == "connect" and names[-1] == "mark_prepared"
    seen: list[tuple[str, ...]] = []

    @fprep.step("audit")
    def audit(state: fprep.PrepState, model: nn.Module) -> tuple[fprep.PrepState, nn.Module]:
        seen.append(state.applied)
        model.audited = True  # type: ignore[assignment]
        return state, model

    for k in range(len(defaults) + 1):
        seen.clear()

        cfg = PrepConfig(precision="bf16", activation_checkpointing=True, wrap=GPTBlock)
        state, model = fprep.prepare(
            tiny_gpt(seed=SEED), cfg, steps=(*defaults[:k], audit, *defaults[k:])
        )
        assert seen == [tuple(names[:k])], f"audit at {k} saw {seen}"
        assert state.applied == (*names[:k], "audit", *names[k:])
        assert model.audited is True
    x, _ = first_batch()
    assert model(x).dtype == torch.float32  # the last one still works (autocast and all)


def test_a_step_that_needs_connect_refuses_to_run_before_it() -> None:
    from fprep.apply import place

    model = tiny_gpt(seed=SEED)
    with pytest.raises(fprep.PlanOrderError) as info:
        fprep.prepare(model, PrepConfig(), steps=(place, *fprep.default_steps()))
    assert info.value.subject == "connect"


# -- precision -----------------------------------------------------------------------------------
@contextmanager
def dtype_probe(model: nn.Module) -> Iterator[list[torch.dtype]]:
    """Record the output dtype of an inner Linear on every forward (hook removed afterwards)."""
    seen: list[torch.dtype] = []
    handle = model.get_submodule("blocks.0.mlp.c_fc").register_forward_hook(
        lambda m, a, out: seen.append(out.dtype)
    )
    try:
        yield seen
    finally:
        handle.remove()


def test_bf16_autocast_survives_save_load_deepcopy_and_exceptions() -> None:
    reference = tiny_gpt(seed=SEED)
    state, model = fprep.prepare(tiny_gpt(seed=SEED), PrepConfig(precision="bf16"))
    assert state.core is not None and state.core.precision.autocast_dtype == "bfloat16"
    assert all(p.dtype == torch.float32 for p in model.parameters())
    x, _ = first_batch()
    with dtype_probe(model) as seen:
        out = model(x)
    assert out.dtype == torch.float32
    assert seen == [torch.bfloat16]
    assert not torch.is_autocast_enabled("cpu")
    with torch.no_grad():
        exact = reference(x)
    assert not torch.equal(out, exact)  # bf16 really ran
    torch.testing.assert_close(out, exact, atol=0.15, rtol=0.05)

    buffer = io.BytesIO()
    torch.save(model, buffer)
    buffer.seek(0)
    loaded = torch.load(buffer, weights_only=False)
    for twin in (loaded, copy.deepcopy(model)):
        assert twin.forward.module is twin  # the copy's wrapper runs the copy, not the original
        with dtype_probe(twin) as twin_seen:
            twin_out = twin(x)
        assert twin_out.dtype == torch.float32
        assert twin_seen == [torch.bfloat16]
        assert torch.equal(twin_out, out)
        assert not torch.is_autocast_enabled("cpu")

    too_long = torch.zeros(1, model.config.block_size + 1, dtype=torch.long)
    with pytest.raises(ValueError, match="exceeds block_size"):
        model(too_long)
    assert not torch.is_autocast_enabled("cpu"), "an exception in forward left autocast on"
    with dtype_probe(model) as seen:
        assert torch.equal(model(x), out)  # and the model still autocasts
    assert seen == [torch.bfloat16]


def test_autocast_wraps_a_forward_the_instance_already_had() -> None:
    model = tiny_gpt(seed=SEED)
    calls: list[torch.dtype] = []
    plain_forward = model.forward

    def patched(x: torch.Tensor) -> torch.Tensor:
        calls.append(torch.get_autocast_dtype("cpu") if torch.is_autocast_enabled("cpu") else None)
        return plain_forward(x)

    model.forward = patched
    state, model = fprep.prepare(model, PrepConfig(precision="bf16"))
    x, _ = first_batch()
    assert model(x).dtype == torch.float32
    assert calls == [torch.bfloat16]  # the user's patch ran, inside the autocast region
    plain = fprep.unwrap(state, model, keep_autocast=False)
    plain(x)
    assert calls == [torch.bfloat16, None]  # the patch stays, autocast is gone


def test_fp16_scales_the_loss() -> None:
    state, model = fprep.prepare(tiny_gpt(seed=SEED), PrepConfig(precision="fp16"))
    assert isinstance(state.handles, fprep.Handles)
    scaler = state.handles.grad_scaler
    assert isinstance(scaler, torch.amp.GradScaler) and scaler.is_enabled()
    x, y = first_batch()
    with dtype_probe(model) as seen:
        loss = lm_loss(model(x), y)
    assert seen == [torch.float16] and loss.dtype == torch.float32
    loss.backward(retain_graph=True)
    plain = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    fprep.backward(state, model, loss)
    scale = scaler.get_scale()
    assert scale > 1
    # Elementwise the two differ (unscaled fp16 gradients underflow: the reason to scale), so
    # compare the overall size: the gradients are the plain ones times the scale.
    scaled = torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None])
    unscaled = torch.cat([plain[n].flatten() for n, _ in model.named_parameters()])
    assert float(scaled.norm() / unscaled.norm()) == pytest.approx(scale, rel=0.01)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    before = model.wte.weight.detach().clone()
    scaler.step(opt)
    scaler.update()
    assert not torch.equal(model.wte.weight, before)


# -- activation checkpointing --------------------------------------------------------------------
def test_activation_checkpointing_per_block_keeps_names_and_gradients() -> None:
    from fprep.apply.recompute import checkpoint_of

    plain = tiny_gpt(seed=SEED)
    names = [n for n, _ in plain.named_parameters(remove_duplicate=False)]
    keys = list(plain.state_dict())
    cfg = PrepConfig(activation_checkpointing=True, wrap=GPTBlock)
    _state, model = fprep.prepare(tiny_gpt(seed=SEED), cfg)
    assert [n for n, _ in model.named_parameters(remove_duplicate=False)] == names
    assert list(model.state_dict()) == keys
    assert type(model) is GPT and model.lm_head.weight is model.wte.weight
    for fqn, module in model.named_modules():
        expected = isinstance(module, GPTBlock)  # per unit, not the root, not inner modules
        assert (checkpoint_of(module) is not None) == expected, fqn
        assert not module._forward_hooks and not module._forward_pre_hooks, fqn

    calls = {"plain": 0, "checkpointed": 0}

    def count(key: str) -> Any:
        def hook(m: nn.Module, args: Any, out: Any) -> None:
            calls[key] += 1

        return hook

    plain.blocks[0].mlp.c_fc.register_forward_hook(count("plain"))
    model.blocks[0].mlp.c_fc.register_forward_hook(count("checkpointed"))
    x, y = first_batch()
    lm_loss(plain(x), y).backward()
    lm_loss(model(x), y).backward()
    assert calls == {"plain": 1, "checkpointed": 2}  # recomputed once in backward
    for (name, p), q in zip(plain.named_parameters(), model.parameters(), strict=True):
        assert p.grad is not None and q.grad is not None
        torch.testing.assert_close(q.grad, p.grad, rtol=0, atol=0, msg=name)


# -- compilation ---------------------------------------------------------------------------------
def test_regional_compile_compiles_each_block_once(dynamo: Any) -> None:
    reference = tiny_gpt(seed=SEED)
    cfg = PrepConfig(compile="regional", compile_backend="eager", wrap=GPTBlock)
    _state, model = fprep.prepare(tiny_gpt(seed=SEED), cfg)
    assert type(model) is GPT  # in place: names and type kept
    assert [n for n, _ in model.named_parameters()] == [n for n, _ in reference.named_parameters()]
    assert model._compiled_call_impl is None
    for block in model.blocks:
        assert block._compiled_call_impl is not None
    x, y = first_batch()
    for _ in range(2):
        out = model(x)
        lm_loss(out, y).backward()
    # Two blocks, two steps: one graph, reused by the second block and the second step.
    assert dynamo["stats"]["unique_graphs"] == 1
    with torch.no_grad():
        torch.testing.assert_close(model(x), reference(x))
    with pytest.raises(fprep.PrepareError):
        fprep.prepare(model, cfg)


def test_whole_compile_and_never_twice(dynamo: Any) -> None:
    from fprep.apply import compile_whole

    reference = tiny_gpt(seed=SEED)
    cfg = PrepConfig(compile="whole", compile_backend="aot_eager")
    state, model = fprep.prepare(tiny_gpt(seed=SEED), cfg)
    assert "compile_whole" in state.applied
    assert model._compiled_call_impl is not None
    assert all(b._compiled_call_impl is None for b in model.blocks)
    x, y = first_batch()
    out = model(x)
    lm_loss(out, y).backward()
    assert dynamo["stats"]["unique_graphs"] == 1
    assert dynamo["aot_autograd"]["ok"] == 1
    with torch.no_grad():
        torch.testing.assert_close(out.detach(), reference(x))

    # A pipeline that would compile the same model twice is refused at the second compile.
    steps = (*fprep.default_steps(), compile_whole)
    with pytest.raises(fprep.PrepareError) as info:
        fprep.prepare(tiny_gpt(seed=SEED), cfg, steps=steps)
    assert "already compiled" in str(info.value)


def test_compile_backend_is_passed_through(dynamo: Any) -> None:
    calls: list[int] = []

    def backend(gm: torch.fx.GraphModule, example_inputs: Any) -> Any:
        calls.append(len(gm.graph.nodes))
        return gm.forward

    name = "fprep_test_counting_backend"
    from torch._dynamo.backends.registry import _BACKENDS, register_backend

    if name not in _BACKENDS:
        register_backend(name=name)(backend)
    else:  # pragma: no cover - re-run in one interpreter
        _BACKENDS[name] = backend
    cfg = PrepConfig(compile="regional", compile_backend=name, wrap=GPTBlock)
    _, model = fprep.prepare(tiny_gpt(seed=SEED), cfg)
    x, _ = first_batch()
    model(x)
    assert len(calls) == 1 and calls[0] > 0


def test_environment_is_left_alone() -> None:
    env = dict(os.environ)
    flags = (torch.are_deterministic_algorithms_enabled(), torch.get_default_dtype())
    fprep.prepare(tiny_gpt(seed=SEED), PrepConfig(precision="bf16", activation_checkpointing=True))
    assert dict(os.environ) == env
    assert (torch.are_deterministic_algorithms_enabled(), torch.get_default_dtype()) == flags
