"""Plan versus reality: what ``fprep.plan`` predicts each rank holds, against FSDP2 itself.

Each case plans a real ``nn.Module`` for a world size and rank, then, in this one process, joins a
*fake* process group of that size and rank (``FakeProcessGroup``: collectives are no-ops, so any
world size fits in one process), applies ``fully_shard`` to every unit of the plan in the plan's
order (inner units first, the root last), with the mesh and the plan's ``reshard_after_forward``
and precision, and compares every parameter with the plan's ``ShardSpec``:

* the local shard (``param.to_local().shape``) equals ``local_shape``;
* FSDP2's padded allocation (``FSDPParam.padded_sharded_param_size`` and the size of its flat
  buffer) equals ``padded_shape``;
* the global shape, the storage dtype and the device are the planned ones, and the placements
  are ``Shard(0)`` (``Replicate(), Shard(0)`` for hsdp);
* the parameters each unit's FSDP parameter group manages are exactly the unit's planned ones;
* tied parameters stay one object under every name; ignored parameters stay whole, plain tensors;
* the mesh coordinate and groups torch builds are the plan's.

``fully_shard`` is called here directly (not through fprep's own shard step) so that the check is
against torch, not against fprep.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor, Replicate, Shard

import fprep
from fprep.state import PrepState, ShardSpec
from fprep.testing.distributed import fake_world
from fprep.testing.models import (
    GPTBlock,
    LlamaBlock,
    llama_tiny,
    lm_loss,
    synthetic_batches,
    tiny_gpt,
)

pytestmark = pytest.mark.skipif(not dist.is_available(), reason="torch.distributed unavailable")


# -- models with awkward shapes ------------------------------------------------------------------
class OddLeaf(nn.Module):
    """Rows smaller than most worlds, rows that do not divide, and zero-size dimensions."""

    def __init__(self) -> None:
        super().__init__()
        self.small = nn.Parameter(torch.randn(3, 5))
        self.one = nn.Parameter(torch.randn(1))
        self.odd = nn.Parameter(torch.randn(130, 2))
        self.empty_cols = nn.Parameter(torch.randn(7, 0))  # 7 rows of width 0
        self.empty_rows = nn.Parameter(torch.randn(0, 4))
        self.empty = nn.Parameter(torch.randn(0))
        self.frozen = nn.Parameter(torch.randn(5, 3), requires_grad=False)

    def reset_parameters(self) -> None:
        for p in self.parameters():
            nn.init.normal_(p)


class OddModel(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inner = nn.ModuleList([OddLeaf(), OddLeaf()])
        self.head = nn.Linear(9, 11)  # weight (11, 9), bias (11,)
        self.emb = nn.Embedding(65, 3)


def odd_model() -> OddModel:
    torch.manual_seed(0)
    return OddModel()


def gpt() -> nn.Module:
    return tiny_gpt(seed=0)


def llama() -> nn.Module:
    return llama_tiny(seed=0)


def llama_tied() -> nn.Module:
    return llama_tiny(seed=0, tie_embeddings=True)


def llama_bf16() -> nn.Module:
    return llama_tiny(seed=0, dtype=torch.bfloat16)


# -- the check -----------------------------------------------------------------------------------
@pytest.fixture
def one_thread() -> Iterator[None]:
    """Tiny models run fastest on one intra-op thread; on a loaded 2-core machine two threads
    spin against each other and a few training steps take seconds instead of milliseconds."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def _dtype(name: str | None) -> torch.dtype | None:
    return None if name is None else getattr(torch, name)


def apply_plan(state: PrepState, model: nn.Module, mesh: DeviceMesh) -> None:
    """``fully_shard`` every unit of the plan, in the plan's order, as the plan says."""
    core, handles = state.core, state.param_handles
    assert core is not None and handles is not None
    named = dict(model.named_parameters(remove_duplicate=False))
    kept_whole = {n for spec in handles.ignored for n in spec.names}
    done: set[str] = set()
    for unit in handles.units:
        module = model.get_submodule(unit.fqn)
        mine = {n for spec in unit.params for n in spec.names}
        prefix = unit.fqn + "." if unit.fqn else ""
        # Parameters under this module that the plan gives to no unit (ignored) or to an
        # enclosing unit (a tied parameter shared with a module outside this one).
        others = {
            id(p): p
            for name, p in module.named_parameters(remove_duplicate=False)
            if (prefix + name) not in mine and (prefix + name) not in done
        }
        others.update({id(named[n]): named[n] for n in kept_whole})
        policy = core.precision
        fully_shard(
            module,
            mesh=mesh,
            reshard_after_forward=unit.reshard_after_forward,
            mp_policy=MixedPrecisionPolicy(
                param_dtype=_dtype(policy.param_dtype),
                reduce_dtype=_dtype(policy.reduce_dtype),
                # Outputs are cast back on the root only; blocks hand on low precision.
                output_dtype=_dtype(policy.output_dtype)
                if unit.fqn == "" and policy.param_dtype
                else None,
            ),
            ignored_params=set(others.values()) or None,
        )
        done |= mine


def check_mesh(state: PrepState, mesh: DeviceMesh) -> None:
    pg = state.process_group
    assert pg is not None
    assert tuple(mesh.shape) == pg.mesh_shape
    assert tuple(mesh.get_coordinate() or ()) == pg.coordinate
    if mesh.ndim == 1:
        assert tuple(dist.get_process_group_ranks(mesh.get_group())) == pg.shard_group
    else:
        shard = dist.get_process_group_ranks(mesh.get_group("shard"))
        replicate = dist.get_process_group_ranks(mesh.get_group("replicate"))
        assert tuple(shard) == pg.shard_group
        assert tuple(replicate) == pg.replicate_group


def check_against_plan(state: PrepState, model: nn.Module, mesh: DeviceMesh) -> int:
    """Compare the sharded ``model`` with the plan; returns how many specs were checked."""
    handles = state.param_handles
    assert handles is not None
    named = dict(model.named_parameters(remove_duplicate=False))
    placements = (Shard(0),) if mesh.ndim == 1 else (Replicate(), Shard(0))

    def check_spec(spec: ShardSpec) -> DTensor:
        params = {id(named[n]) for n in spec.names}
        assert len(params) == 1, f"{spec.names} are no longer one tied parameter"
        param = named[spec.fqn]
        assert isinstance(param, DTensor), f"{spec.fqn} was not sharded"
        local = param.to_local()
        assert tuple(param.shape) == spec.shape, spec.fqn
        assert tuple(local.shape) == spec.local_shape, (spec.fqn, tuple(local.shape), spec)
        assert param.dtype == _dtype(spec.dtype), spec.fqn
        assert local.device.type == "cpu"
        assert tuple(param.placements) == placements, spec.fqn
        assert param.requires_grad == spec.requires_grad, spec.fqn
        return param

    checked = 0
    for unit in handles.units:
        module = model.get_submodule(unit.fqn)
        assert isinstance(module, FSDPModule), f"unit {unit.fqn!r} was not sharded"
        group = module._get_fsdp_state()._fsdp_param_group
        fsdp_params = (
            {} if group is None else {id(fp.sharded_param): fp for fp in group.fsdp_params}
        )
        planned = {id(check_spec(spec)): spec for spec in unit.params}
        assert planned.keys() == fsdp_params.keys(), f"unit {unit.fqn!r} manages other params"
        for key, spec in planned.items():
            fp = fsdp_params[key]
            assert tuple(fp.padded_sharded_param_size) == spec.padded_shape, (spec.fqn, spec)
            assert fp._sharded_param_data.numel() == math.prod(spec.padded_shape), spec.fqn
            checked += 1
    for spec in handles.ignored:
        param = named[spec.fqn]
        assert not isinstance(param, DTensor), f"ignored {spec.fqn} was sharded"
        assert tuple(param.shape) == spec.local_shape == spec.padded_shape == spec.shape
        checked += 1
    # Every parameter of the model is accounted for by exactly one spec.
    specs = [*handles.specs, *handles.ignored]
    assert {n for s in specs for n in s.names} == set(named)
    assert len(specs) == len({id(p) for p in named.values()})
    return checked


@dataclass(frozen=True)
class Case:
    name: str
    build: Callable[[], nn.Module]
    cfg: fprep.PrepConfig
    world: int
    rank: int
    hsdp: tuple[int, int] | None = None  # (replicate, shard) mesh shape

    def __str__(self) -> str:
        return f"{self.name}-w{self.world}-r{self.rank}"


FSDP_GPT = fprep.PrepConfig(strategy="fsdp", wrap=GPTBlock, precision="bf16")
FSDP_LLAMA = fprep.PrepConfig(strategy="fsdp", wrap=LlamaBlock, precision="bf16")

CASES = [
    # tiny GPT, tied wte / lm_head in the root unit
    *(Case("gpt", gpt, FSDP_GPT, w, r) for w, r in [(2, 1), (3, 2), (8, 0), (8, 5), (64, 63)]),
    # the tied weight's two owners in two units: wte (a unit) and lm_head (in the root)
    Case(
        "gpt-embedding-unit",
        gpt,
        fprep.PrepConfig(strategy="fsdp", wrap=(GPTBlock, nn.Embedding)),
        4,
        3,
    ),
    Case("gpt-grad-op", gpt, FSDP_GPT.replace(sharding="grad_op"), 8, 2),
    Case("gpt-raf-int", gpt, FSDP_GPT.replace(reshard_after_forward=2), 8, 3),
    Case("gpt-no-wrap", gpt, fprep.PrepConfig(strategy="fsdp"), 5, 4),
    # llama_tiny: 256-row vocab, 32-row wk/wv, 160-row w1/w3
    *(Case("llama", llama, FSDP_LLAMA, w, r) for w, r in [(8, 3), (24, 23), (64, 0), (64, 41)]),
    Case("llama-tied", llama_tied, FSDP_LLAMA, 6, 5),
    Case("llama-bf16-storage", llama_bf16, FSDP_LLAMA.replace(precision="no"), 8, 7),
    Case("llama-size-wrap", llama, fprep.PrepConfig(strategy="fsdp", wrap=20_000), 16, 9),
    Case(
        "llama-ignored-module",
        llama,
        FSDP_LLAMA.replace(ignored_modules=("layers.1.feed_forward",)),
        8,
        7,
    ),
    Case(
        "llama-ignored-params",
        llama,
        FSDP_LLAMA.replace(ignored_params=("norm.weight", "layers.0.attention.wq.weight")),
        4,
        1,
    ),
    # shapes smaller than the world, uneven, zero-size
    *(
        Case("odd", odd_model, fprep.PrepConfig(strategy="fsdp", wrap=OddLeaf), w, r)
        for w, r in [(2, 0), (2, 1), (4, 3), (7, 2), (8, 6), (64, 2), (64, 63)]
    ),
]

HSDP_CASES = [
    Case("gpt-hsdp", gpt, FSDP_GPT.replace(strategy="hsdp", hsdp_shard_size=4), 8, 6, (2, 4)),
    Case(
        "llama-hsdp", llama, FSDP_LLAMA.replace(strategy="hsdp", hsdp_shard_size=8), 32, 13, (4, 8)
    ),
    Case(
        "odd-hsdp",
        odd_model,
        fprep.PrepConfig(strategy="hsdp", wrap=OddLeaf, hsdp_shard_size=16),
        64,
        47,
        (4, 16),
    ),
    Case(
        "odd-hsdp-shard-1",
        odd_model,
        fprep.PrepConfig(strategy="hsdp", wrap=OddLeaf, hsdp_shard_size=1),
        4,
        2,
        (4, 1),
    ),
]


def run_case(case: Case) -> tuple[PrepState, int]:
    model = case.build()
    state = fprep.plan(
        model, case.cfg, fprep.Topology(world_size=case.world, rank=case.rank)
    ).unwrap()
    core = state.core
    assert core is not None
    assert core.strategy == ("hsdp" if case.hsdp else "fsdp")
    with fake_world(case.world, case.rank):
        if case.hsdp is None:
            mesh = init_device_mesh("cpu", (case.world,))
        else:
            mesh = init_device_mesh("cpu", case.hsdp, mesh_dim_names=("replicate", "shard"))
        check_mesh(state, mesh)
        apply_plan(state, model, mesh)
        checked = check_against_plan(state, model, mesh)
    return state, checked


@pytest.mark.parametrize("case", CASES, ids=str)
def test_fsdp_shards_match_the_plan(case: Case) -> None:
    state, checked = run_case(case)
    assert checked == len(state.tree.params)


@pytest.mark.parametrize("case", HSDP_CASES, ids=str)
def test_hsdp_shards_match_the_plan(case: Case) -> None:
    state, checked = run_case(case)
    pg = state.process_group
    assert pg is not None and case.hsdp is not None
    assert (pg.replicate_size, pg.shard_size) == case.hsdp
    assert checked == len(state.tree.params)


def test_cases_exercise_the_edge_shapes() -> None:
    """The odd model at world 64 really has empty, partial, padded and zero-width shards."""
    model = odd_model()
    state = fprep.plan(
        model,
        fprep.PrepConfig(strategy="fsdp", wrap=OddLeaf),
        fprep.Topology(world_size=64, rank=2),
    ).unwrap()
    assert state.param_handles is not None
    specs = {s.fqn: s for s in state.param_handles.specs}
    assert specs["inner.0.small"].local_shape == (1, 5)  # 3 rows: ranks 0..2 hold one each
    assert specs["inner.0.one"].local_shape == (0,)  # 1 row: only rank 0 holds it
    assert specs["inner.0.one"].padded_shape == (1,)
    assert specs["inner.0.odd"].local_shape == (3, 2)  # ceil(130 / 64) = 3
    assert specs["inner.0.empty_cols"].local_shape == (0, 0)  # no elements: no rows
    assert specs["inner.0.empty_cols"].padded_shape == (1, 0)
    assert specs["inner.0.empty_rows"].padded_shape == (0, 4)
    last = fprep.plan(
        model,
        fprep.PrepConfig(strategy="fsdp", wrap=OddLeaf),
        fprep.Topology(world_size=64, rank=63),
    ).unwrap()
    assert last.param_handles is not None
    assert {s.fqn: s.local_shape for s in last.param_handles.specs}["inner.0.odd"] == (0, 2)


def test_tied_parameter_is_shared_after_sharding() -> None:
    """GPT's tied embedding is one sharded parameter under both names, as planned."""
    case = Case("gpt", gpt, FSDP_GPT, 4, 1)
    model = case.build()
    state = fprep.plan(model, case.cfg, fprep.Topology(world_size=4, rank=1)).unwrap()
    assert state.param_handles is not None
    root = state.param_handles.units[-1]
    assert root.fqn == ""
    tied = next(s for s in root.params if len(s.names) == 2)
    assert set(tied.names) == {"wte.weight", "lm_head.weight"}
    with fake_world(4, 1):
        mesh = init_device_mesh("cpu", (4,))
        apply_plan(state, model, mesh)
        check_against_plan(state, model, mesh)
        assert isinstance(model, nn.Module)
        lm_head = model.get_submodule("lm_head")
        wte = model.get_submodule("wte")
        assert lm_head.weight is wte.weight
        assert isinstance(wte.weight, DTensor)
        assert tuple(wte.weight.to_local().shape) == tied.local_shape == (16, 32)


@pytest.mark.parametrize(
    "case",
    [Case("gpt", gpt, FSDP_GPT, 4, 1), Case("llama", llama, FSDP_LLAMA, 8, 6)],
    ids=str,
)
def test_sharded_model_runs_with_planned_gradients(case: Case, one_thread: None) -> None:
    """On the fake group (whose collectives move no data) forward and backward still run; the
    logits come back in the plan's output dtype and every gradient is sharded like its
    parameter, as the memory estimate assumes."""
    model = case.build()
    state = fprep.plan(
        model, case.cfg, fprep.Topology(world_size=case.world, rank=case.rank)
    ).unwrap()
    assert state.core is not None and state.param_handles is not None
    vocab = model.get_submodule("output" if case.name == "llama" else "lm_head").out_features
    inputs, targets = next(synthetic_batches(1, batch_size=2, seq_len=8, vocab_size=vocab))
    with fake_world(case.world, case.rank):
        apply_plan(state, model, init_device_mesh("cpu", (case.world,)))
        logits = model(inputs)
        assert logits.shape == (2, 8, vocab)
        assert logits.dtype == _dtype(state.core.precision.output_dtype) == torch.float32
        lm_loss(logits, targets).backward()
        named = dict(model.named_parameters())
        for spec in state.param_handles.specs:
            grad = named[spec.fqn].grad
            assert isinstance(grad, DTensor), spec.fqn
            assert tuple(grad.to_local().shape) == spec.local_shape, spec.fqn
            assert grad.dtype == _dtype(spec.dtype)


# -- the models these cases use --------------------------------------------------------------
def test_tiny_gpt_is_deterministic_tied_and_leaves_the_global_rng_alone() -> None:
    rng = torch.random.get_rng_state()
    a, b, c = tiny_gpt(seed=0), tiny_gpt(seed=0), tiny_gpt(seed=1)
    assert torch.equal(torch.random.get_rng_state(), rng)
    assert a.lm_head.weight is a.wte.weight
    sa, sb, sc = a.state_dict(), b.state_dict(), c.state_dict()
    assert all(torch.equal(sa[k], sb[k]) for k in sa)
    assert not torch.equal(sa["blocks.0.attn.c_attn.weight"], sc["blocks.0.attn.c_attn.weight"])
    assert sum(p.numel() for p in a.parameters()) == a.config.num_params


def test_tiny_gpt_trains_on_synthetic_batches(one_thread: None) -> None:
    batches = list(synthetic_batches(30, batch_size=8, seq_len=16, seed=3))
    again = list(synthetic_batches(30, batch_size=8, seq_len=16, seed=3))
    assert all(torch.equal(x, y) for (x, _), (y, _) in zip(batches, again, strict=True))
    inputs, targets = batches[0]
    assert inputs.shape == targets.shape == (8, 16) and inputs.dtype == torch.int64
    assert torch.equal(inputs[:, 1:], targets[:, :-1])  # targets are the next tokens
    model = tiny_gpt(seed=0)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    losses = []
    for x, y in batches:
        loss = lm_loss(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert sum(losses[-5:]) / 5 < 0.5 * sum(losses[:5]) / 5


def test_llama_tiny_is_causal_and_materializes_from_meta(one_thread: None) -> None:
    model = llama_tiny(seed=0)
    tokens = torch.randint(0, 256, (2, 12), generator=torch.Generator().manual_seed(0))
    changed = tokens.clone()
    changed[:, 8:] = (changed[:, 8:] + 1) % 256
    out, out_changed = model(tokens), model(changed)
    assert out.shape == (2, 12, 256)
    assert torch.allclose(out[:, :8], out_changed[:, :8])  # the future does not leak back
    assert not torch.allclose(out[:, 8:], out_changed[:, 8:])
    meta = llama_tiny("meta")
    assert all(p.is_meta for p in meta.parameters())
    meta.to_empty(device="cpu")
    for module in meta.modules():
        if any(True for _ in module.parameters(recurse=False)):
            reset = getattr(module, "reset_parameters", None)
            assert callable(reset), type(module).__name__
            reset()
    assert torch.isfinite(meta(tokens)).all()


def test_plan_refuses_units_fully_shard_refuses() -> None:
    """A ModuleList has no forward: fully_shard refuses it, so the plan never makes it a unit.

    The size policy carries its count on to the parent (like FSDP1's size policy); a class
    policy that names it is a ConfigError before any effect.
    """
    model = llama()
    with fake_world(2, 0), pytest.raises(ValueError, match="containers"):
        fully_shard(model.get_submodule("layers"), mesh=init_device_mesh("cpu", (2,)))
    topo = fprep.Topology(world_size=2, rank=0)
    by_class = fprep.plan(model, fprep.PrepConfig(strategy="fsdp", wrap=nn.ModuleList), topo)
    error = by_class.failure()
    assert isinstance(error, fprep.ConfigError)
    assert error.subject == "wrap" and "'layers'" in error.message
    # Both blocks together exceed the size but neither alone does: the root takes them.
    block = sum(p.numel() for p in model.get_submodule("layers.0").parameters())
    by_size = fprep.plan(model, fprep.PrepConfig(strategy="fsdp", wrap=block + 1), topo).unwrap()
    assert by_size.param_handles is not None
    assert [u.fqn for u in by_size.param_handles.units] == [""]
