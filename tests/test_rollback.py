"""A failure after the first effect rolls the model back (fprep.apply.rollback).

The plan rejects bad input before any effect (test_prepare_single's transactional tests); these
failures are the ones it cannot foresee: a custom step raising after the default ones changed the
model, a user's initializer raising halfway through materialize after FSDP2 sharded the model.
After each, the model is exactly as before (same objects, classes, values, hooks, attributes)
and can be prepared again.
"""

from __future__ import annotations

import warnings
import weakref

import pytest
import torch
from test_prepare_single import assert_unchanged, first_batch, snapshot
from torch import nn

import fprep
from fprep import PrepConfig, Topology
from fprep.apply.rollback import Rollback
from fprep.testing.distributed import fake_world
from fprep.testing.models import GPT, GPTBlock, GPTConfig, lm_loss, tiny_gpt

SEED = 5


class Boom(RuntimeError):
    pass


@fprep.step("boom")
def boom(state: fprep.PrepState, model: nn.Module) -> tuple[fprep.PrepState, nn.Module]:
    raise Boom("a custom step failed")


def steps_failing_before(name: str) -> list[fprep.Step]:
    steps = list(fprep.default_steps())
    names = [getattr(s, "step_name", getattr(s, "__name__", "")) for s in steps]
    at = next(i for i, s in enumerate(names) if name in s)
    return [*steps[:at], boom, *steps[at:]]


def structure(model: nn.Module) -> list[object]:
    """What snapshot() records except values (meta tensors have none): objects, classes,
    shapes, dtypes, devices, hooks and attribute names."""
    return [
        [(n, m, type(m), sorted(vars(m))) for n, m in model.named_modules(remove_duplicate=False)],
        [
            (n, p, type(p), p.shape, p.dtype, p.device, p.requires_grad)
            for n, p in model.named_parameters(remove_duplicate=False)
        ],
        [(n, b, b.shape, b.dtype) for n, b in model.named_buffers(remove_duplicate=False)],
        [
            (n, list(m._forward_pre_hooks.items()), list(m._forward_hooks.items()))
            for n, m in model.named_modules(remove_duplicate=False)
        ],
    ]


@pytest.mark.parametrize("compile_mode", ["none", "regional"])
def test_a_step_failing_after_others_rolls_the_model_back(compile_mode: str) -> None:
    model = tiny_gpt(seed=SEED)
    cfg = PrepConfig(
        precision="bf16",
        activation_checkpointing=True,
        wrap=GPTBlock,
        compile=compile_mode,
        compile_backend="eager",
    )
    before = snapshot(model)
    with pytest.raises(Boom):
        fprep.prepare(model, cfg, steps=steps_failing_before("mark_prepared"))
    assert_unchanged(model, before)
    assert "forward" not in vars(model) and not hasattr(model, "_fprep_prepared")
    assert not any("forward" in vars(b) for b in model.blocks)  # checkpointing's too

    state, prepared = fprep.prepare(model, cfg)  # and it can be prepared again
    assert state.applied[-1] == "mark_prepared"
    x, y = first_batch()
    lm_loss(prepared(x), y).backward()
    assert all(p.grad is not None for p in prepared.parameters())


def test_a_failing_initializer_after_fsdp_sharding_leaves_the_meta_model_as_it_was() -> None:
    """FSDP2 swapped classes, replaced parameters with DTensors and registered its state; the
    initializer of one module then raised: everything is undone, and torch's own record of
    the sharded modules too (else fully_shard would refuse them next time)."""
    with torch.device("meta"):
        model = GPT(GPTConfig(vocab_size=32, block_size=8, n_layer=2, n_head=2, n_embd=16))
    before = structure(model)
    seen: list[nn.Module] = []

    def init(module: nn.Module) -> None:
        # (a module may be initialized twice: a try on row windows, then in full)
        if module not in seen:
            seen.append(module)
        if module is seen[3]:
            raise ValueError("this initializer fails on its fourth module")
        for p in module.parameters(recurse=False):
            nn.init.normal_(p)

    topology = Topology(world_size=2, rank=0)
    with fake_world(2, 0):
        with pytest.raises(fprep.PrepareError) as info:
            fprep.prepare(
                model,
                PrepConfig(strategy="fsdp", wrap=GPTBlock, param_init_fn=init),
                topology=topology,
            )
        assert "fourth module" in str(info.value)
        assert info.value.subject == dict((m, n) for n, m in model.named_modules())[seen[3]]
        assert structure(model) == before
        assert all(p.is_meta for p in model.parameters())
        assert not any(type(m).__name__.startswith("FSDP") for m in model.modules())

        def good(module: nn.Module) -> None:
            for p in module.parameters(recurse=False):
                nn.init.normal_(p)

        state, prepared = fprep.prepare(
            model, PrepConfig(strategy="fsdp", wrap=GPTBlock, param_init_fn=good), topology=topology
        )
        assert state.applied[-1] == "mark_prepared"
        assert not any(p.is_meta for p in prepared.parameters())


def test_a_step_failing_after_ddp_returns_the_unwrapped_model_to_its_state() -> None:
    model = tiny_gpt(seed=SEED)
    before = snapshot(model)
    with fake_world(2, 0), pytest.raises(Boom):
        fprep.prepare(
            model,
            PrepConfig(strategy="ddp", precision="bf16"),
            topology=Topology(world_size=2, rank=0),
            steps=steps_failing_before("mark_prepared"),
        )
    assert_unchanged(model, before)


def test_restore_puts_moved_tensors_back_without_copying_them() -> None:
    """``Module.to`` swaps ``param.data`` under the same Parameter object; the record holds
    aliases, not copies, and puts them back."""
    model = nn.Sequential(nn.Linear(3, 3), nn.BatchNorm1d(3))
    weight, data_ptr = model[0].weight, model[0].weight.data_ptr()
    running_mean = model[1].running_mean
    undo = Rollback.of(model)
    model.to(torch.float64)
    model[0].weight.requires_grad_(False)
    model.register_forward_hook(lambda *_: None)
    assert model[0].weight.dtype == torch.float64
    undo.restore()
    assert model[0].weight is weight and weight.dtype == torch.float32
    assert weight.data_ptr() == data_ptr and weight.requires_grad
    assert model[1].running_mean is running_mean
    assert not model._forward_hooks


def test_a_registered_non_persistent_buffer_is_rolled_back() -> None:
    """The set of non-persistent buffer names is restored too, not only the buffer table."""
    model = nn.Linear(2, 2)
    undo = Rollback.of(model)
    model.register_buffer("scratch", torch.ones(2), persistent=False)
    undo.restore()
    assert "scratch" not in model._buffers
    assert "scratch" not in model._non_persistent_buffers_set
    assert "scratch" not in model.state_dict()


def test_the_record_keeps_the_originals_without_copies_and_prepare_drops_it() -> None:
    """The record aliases each tensor's data (no copy); once ``prepare`` returns, nothing of
    fprep's holds the parameters a step replaced."""
    model = tiny_gpt(seed=SEED)
    undo = Rollback.of(model)
    assert {id(r.tensor) for r in undo.tensors} == {id(p) for p in model.parameters()} | {
        id(b) for b in model.buffers()
    }
    assert all(r.data.data_ptr() == r.tensor.data_ptr() for r in undo.tensors)
    del undo

    @fprep.step("replace")
    def replace(state: fprep.PrepState, m: nn.Module) -> tuple[fprep.PrepState, nn.Module]:
        for module in m.modules():
            for name, p in list(module._parameters.items()):
                if p is not None:
                    module._parameters[name] = nn.Parameter(p.detach().clone())
        return state, m

    originals = [weakref.ref(p) for p in model.parameters()]
    fprep.prepare(model, PrepConfig(), steps=[*fprep.default_steps(), replace])
    assert [r for r in originals if r() is not None] == []


def test_shard_holds_no_replaced_tp_block_until_its_last_unit(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Under TP every parameter is a TP block (a copy torch makes) when ``shard`` starts;
    each ``fully_shard`` replaces its unit's. While the record keeps the original weights,
    a block the shard step itself kept alive until the root unit would add to prepare's peak
    (benchmarks/tp.py): when the root is sharded, the inner units' blocks are gone."""
    import torch.distributed.fsdp as fsdp

    from fprep.testing.models import LlamaBlock, LlamaConfig, llama

    blocks: list[tuple[str, weakref.ref[nn.Parameter]]] = []
    alive_at_root: list[str] = []
    torch_fully_shard = fsdp.fully_shard

    @fprep.step("probe")
    def probe(state: fprep.PrepState, m: nn.Module) -> tuple[fprep.PrepState, nn.Module]:
        blocks.extend(  # the TP blocks (the originals of the rest are the record's)
            (n, weakref.ref(p)) for n, p in m.named_parameters() if hasattr(p, "placements")
        )
        return state, m

    def fully_shard(module: nn.Module, **kwargs: object) -> object:
        if module is model:  # the root, last: every block unit is sharded
            alive_at_root.extend(n for n, r in blocks if r() is not None)
        return torch_fully_shard(module, **kwargs)  # type: ignore[call-overload]

    monkeypatch.setattr(fsdp, "fully_shard", fully_shard)
    cfg = LlamaConfig(dim=16, n_layers=2, n_heads=2, n_kv_heads=2, ffn_dim=32, vocab_size=32)
    model = llama(cfg, "cpu", seed=SEED)
    steps = list(fprep.default_steps())
    names = [getattr(s, "step_name", getattr(s, "__name__", "")) for s in steps]
    steps.insert(names.index("parallelize") + 1, probe)
    with fake_world(4, 0), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        topology = Topology(world_size=4, rank=0, local_world_size=4)
        fprep.prepare(
            model,
            PrepConfig(strategy="fsdp", tp=2, wrap=LlamaBlock),
            topology=topology,
            steps=steps,
        )
    assert any(n.startswith("layers.") for n, _ in blocks)
    assert [n for n in alive_at_root if n.startswith("layers.")] == []
