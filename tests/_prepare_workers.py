"""Rank functions for tests/test_prepare_distributed.py, and the single-process references.

Everything here is module level, so ``fprep.testing.distributed.run_ranks`` can pickle it into
spawned ranks. A rank function returns plain data (tensors as ``torch.save`` bytes, mismatches as
strings); the tests assert in the parent process, where failures print well.

Spawning a process group costs seconds on two cores, so one rank function covers many cases:
several models are prepared in the same process (which is itself a property under test: two
preparations in one process must not interfere).
"""

from __future__ import annotations

import contextlib
import importlib
import io
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.distributed as dist
from _checks import timed
from torch import nn

import fprep
from fprep.compat import ddp_syncs_buffers
from fprep.testing.models import (
    GPT,
    GPTBlock,
    GPTConfig,
    LlamaBlock,
    llama_tiny,
    lm_loss,
    synthetic_batches,
    tiny_gpt,
)

SEED = 1  # model initialization
DATA_SEED = 3
GLOBAL_BATCH = 8  # divisible by 1, 2 and 4 ranks
STEPS = 3
INIT_SEED = 7  # reproducible (meta-device) initialization

Params = dict[str, torch.Tensor]

#: The model each optimizer trains. AdamW gets no biases: the attention's key bias has a
#: gradient that is exactly zero in exact arithmetic (softmax ignores a per-row constant), so
#: AdamW's normalized update turns summation-order noise of ~1e-9 into steps of ~lr there.
MODEL_CONFIGS = {"sgd": GPTConfig(), "adamw": GPTConfig(bias=False)}


def build(optimizer: str = "sgd") -> nn.Module:
    return tiny_gpt(MODEL_CONFIGS[optimizer], seed=SEED)


# -- data helpers ------------------------------------------------------------------------------
def dump(tensors: Params) -> bytes:
    buffer = io.BytesIO()
    torch.save({k: v.detach().cpu().clone() for k, v in tensors.items()}, buffer)
    return buffer.getvalue()


def load(data: bytes) -> Params:
    loaded: Params = torch.load(io.BytesIO(data))
    return loaded


def batches(
    rank: int = 0, world: int = 1, steps: int = STEPS
) -> Iterator[tuple[torch.Tensor, ...]]:
    """This rank's slice of each global batch (the global batch when ``world == 1``)."""
    n = GLOBAL_BATCH // world
    for x, y in synthetic_batches(steps, batch_size=GLOBAL_BATCH, seed=DATA_SEED):
        yield x[rank * n : (rank + 1) * n], y[rank * n : (rank + 1) * n]


def make_optimizer(name: str, params: Any) -> torch.optim.Optimizer:
    if name == "sgd":
        return torch.optim.SGD(params, lr=0.1)
    if name == "adamw":
        return torch.optim.AdamW(params, lr=1e-2, weight_decay=0.01)
    raise ValueError(name)


def local_shards(model: nn.Module) -> Params:
    """Every parameter's local tensor (its shard where sharded), as a copy."""
    return {
        name: (p.to_local() if hasattr(p, "to_local") else p).detach().clone()
        for name, p in model.named_parameters()
    }


@contextlib.contextmanager
def every_rank_computes_everything() -> Iterator[None]:
    """Materialize as on other backends than gloo: no rows sent, every rank computes the
    modules whose init is not row-local (a rank process, or a fake world, which moves no rows)."""
    schedule: Any = importlib.import_module("fprep.apply.init_schedule")
    saved = schedule.SHARING_BACKENDS
    schedule.SHARING_BACKENDS = frozenset()
    try:
        yield
    finally:
        schedule.SHARING_BACKENDS = saved


def full_params(model: nn.Module, *, rank0_only: bool = True) -> Params:
    """Full (unsharded) parameters and buffers by their original names.

    ``rank0_only``: gathered to rank 0 (CPU), other ranks get ``{}``; otherwise every rank.
    """
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    sd = get_model_state_dict(
        model, options=StateDictOptions(full_state_dict=True, cpu_offload=rank0_only)
    )
    return {k: v.detach().cpu().clone() for k, v in sd.items()}


def reference(optimizer: str = "sgd", steps: int = STEPS) -> Params:
    """Plain PyTorch, one process, full batch: what every strategy must reproduce."""
    model = build(optimizer)
    opt = make_optimizer(optimizer, model.parameters())
    for x, y in batches(steps=steps):
        lm_loss(model(x), y).backward()
        opt.step()
        opt.zero_grad()
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def trainer(
    state: fprep.PrepState,
    model: nn.Module,
    optimizer: str | torch.optim.Optimizer,
    rank: int,
    world: int,
) -> Iterator[float]:
    """Train and yield each step's loss. A name builds the optimizer after prepare from
    ``model.parameters()``; an optimizer object is used as it is."""
    opt = make_optimizer(optimizer, model.parameters()) if isinstance(optimizer, str) else optimizer
    assert isinstance(state.handles, fprep.Handles)
    scaler = state.handles.grad_scaler  # fp16 only
    for x, y in batches(rank, world):
        loss = lm_loss(model(x), y)
        fprep.backward(state, model, loss)
        if scaler is not None:
            scaler.step(opt)
            scaler.update()
        else:
            opt.step()
        opt.zero_grad(set_to_none=True)
        yield loss.item()


def rank_world() -> tuple[int, int]:
    """This rank and the world size, from the launcher's variables (before any group exists)."""
    import os

    return int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))


# -- plan versus reality -----------------------------------------------------------------------
def _inner(model: nn.Module) -> nn.Module:
    from torch.nn.parallel import DistributedDataParallel

    return model.module if isinstance(model, DistributedDataParallel) else model


def plan_vs_reality(state: fprep.PrepState, model: nn.Module) -> tuple[int, list[str]]:
    """Compare every parameter of the prepared model with the plan's ``ShardSpec``.

    Returns (number of parameter names checked, mismatches as readable strings).
    """
    from torch.distributed.tensor import DTensor, Replicate, Shard

    assert state.param_handles is not None and state.core is not None
    assert state.device is not None
    handles = state.param_handles
    sharded = state.core.is_sharded
    managed = {n for s in handles.specs for n in s.names}
    specs = {n: s for s in (*handles.specs, *handles.ignored) for n in s.names}
    device = torch.device(state.device.compute_device)
    placements = (Replicate(), Shard(0)) if state.core.strategy == "hsdp" else (Shard(0),)
    params = dict(_inner(model).named_parameters(remove_duplicate=False))
    bad: list[str] = []
    if set(params) != set(specs):
        bad.append(
            f"names: planned {sorted(set(specs) - set(params))} missing, "
            f"unplanned {sorted(set(params) - set(specs))}"
        )
    for name, p in params.items():
        spec = specs.get(name)
        if spec is None:
            continue
        is_dt = isinstance(p, DTensor)
        local = p.to_local() if is_dt else p
        if sharded and name in managed:
            if not is_dt:
                bad.append(f"{name}: planned sharded but is a plain tensor")
            elif tuple(p.placements) != placements:
                bad.append(f"{name}: placements {p.placements}, planned {placements}")
        elif is_dt:
            bad.append(f"{name}: planned whole but is a DTensor")
        if tuple(local.shape) != spec.local_shape:
            bad.append(f"{name}: local shape {tuple(local.shape)}, planned {spec.local_shape}")
        if tuple(p.shape) != spec.shape:
            bad.append(f"{name}: global shape {tuple(p.shape)}, planned {spec.shape}")
        dtype = str(local.dtype).removeprefix("torch.")
        if dtype != spec.dtype:
            bad.append(f"{name}: dtype {dtype}, planned {spec.dtype}")
        if local.device != device or p.device != device:
            bad.append(f"{name}: device {local.device}, planned {device}")
        if p.requires_grad != spec.requires_grad:
            bad.append(f"{name}: requires_grad {p.requires_grad}, planned {spec.requires_grad}")
        if params.get(spec.fqn) is not p:
            bad.append(f"{name}: not the same object as its canonical name {spec.fqn}")
    return len(params), bad


class OddLeaf(nn.Module):
    """Rows fewer than ranks, rows that do not divide, zero-size dims, a frozen parameter."""

    def __init__(self) -> None:
        super().__init__()
        self.small = nn.Parameter(torch.randn(3, 5))
        self.one = nn.Parameter(torch.randn(1))
        self.odd = nn.Parameter(torch.randn(131, 2))
        self.empty_cols = nn.Parameter(torch.randn(7, 0))
        self.empty_rows = nn.Parameter(torch.randn(0, 4))
        self.frozen = nn.Parameter(torch.randn(5, 3), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.one

    def reset_parameters(self) -> None:
        for p in self._parameters.values():
            if p is not None:
                nn.init.normal_(p)


class OddNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.leaves = nn.ModuleList([OddLeaf(), OddLeaf()])
        self.head = nn.Linear(9, 11)
        self.emb = nn.Embedding(65, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for leaf in self.leaves:
            x = leaf(x)
        return self.head(x)


def odd_net() -> OddNet:
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        return OddNet()


#: (name, model builder, config) prepared only to compare with the plan.
def shape_cases(world: int) -> list[tuple[str, Callable[[], nn.Module], fprep.PrepConfig]]:
    F = fprep.PrepConfig
    cases: list[tuple[str, Callable[[], nn.Module], fprep.PrepConfig]] = [
        ("odd/fsdp", odd_net, F(strategy="fsdp", wrap=OddLeaf, ignored_params=("head.bias",))),
        (
            "llama/grad_op/bf16",
            llama_tiny,
            F(strategy="fsdp", sharding="grad_op", wrap=LlamaBlock, precision="bf16"),
        ),
        ("gpt_bf16_storage/fsdp_by_size", _gpt_bf16, F(strategy="fsdp", wrap=2000)),
        ("odd/ddp", odd_net, F(strategy="ddp")),
    ]
    if world % 2 == 0 and world > 2:
        cases += [
            ("odd/hsdp", odd_net, F(strategy="hsdp", hsdp_shard_size=2, wrap=OddLeaf)),
            ("llama/hsdp", llama_tiny, F(strategy="hsdp", hsdp_shard_size=2, wrap=LlamaBlock)),
        ]
    return cases


def _gpt_bf16() -> nn.Module:
    return tiny_gpt(seed=SEED, dtype=torch.bfloat16)


def check_shapes(world: int) -> dict[str, tuple[int, list[str]]]:
    out: dict[str, tuple[int, list[str]]] = {}
    for name, build, cfg in shape_cases(world):
        state, model = fprep.prepare(build(), cfg)
        out[name] = plan_vs_reality(state, model)
    return out


# -- numerics ----------------------------------------------------------------------------------
def _gpt_cfg(strategy: str, **kw: Any) -> fprep.PrepConfig:
    if strategy in ("fsdp", "hsdp"):
        kw.setdefault("wrap", GPTBlock)
    return fprep.PrepConfig(strategy=strategy, **kw)  # type: ignore[arg-type]


#: fp32 cases trained together, interleaved step by step, in one process.
FP32_CASES: dict[str, tuple[fprep.PrepConfig, str]] = {
    "ddp/sgd": (_gpt_cfg("ddp"), "sgd"),
    "ddp/adamw": (_gpt_cfg("ddp"), "adamw"),
    "fast_ddp/sgd": (_gpt_cfg("fast_ddp"), "sgd"),
    "fsdp_full/sgd": (_gpt_cfg("fsdp"), "sgd"),
    "fsdp_full/adamw": (_gpt_cfg("fsdp"), "adamw"),
    "fsdp_grad_op/sgd": (_gpt_cfg("fsdp", sharding="grad_op"), "sgd"),
    "fsdp_checkpointed/sgd": (_gpt_cfg("fsdp", activation_checkpointing=True), "sgd"),
    "fsdp_checkpointed_compiled/adamw": (
        _gpt_cfg(
            "fsdp", activation_checkpointing=True, compile="regional", compile_backend="eager"
        ),
        "adamw",
    ),
}
#: Cases trained one after another: lower precision or compressed communication.
LOOSE_CASES: dict[str, tuple[fprep.PrepConfig, str]] = {
    "ddp_bf16/sgd": (_gpt_cfg("ddp", precision="bf16"), "sgd"),
    "fsdp_bf16/sgd": (_gpt_cfg("fsdp", precision="bf16"), "sgd"),
    "ddp_fp16/sgd": (_gpt_cfg("ddp", precision="fp16"), "sgd"),
    "fast_ddp_fp16/sgd": (_gpt_cfg("fast_ddp", precision="fp16"), "sgd"),
    "fast_ddp_bf16_buffer/sgd": (_gpt_cfg("fast_ddp", fast_ddp_dtype="bfloat16"), "sgd"),
    "hook_fp16/sgd": (_gpt_cfg("ddp", ddp=fprep.DDPOptions(comm_hook="fp16")), "sgd"),
    "hook_bf16/sgd": (_gpt_cfg("ddp", ddp=fprep.DDPOptions(comm_hook="bf16")), "sgd"),
    "hook_powersgd/sgd": (
        _gpt_cfg("ddp", ddp=fprep.DDPOptions(comm_hook="powersgd", powersgd_start_iter=2)),
        "sgd",
    ),
}
PREBUILT_CASES: dict[str, tuple[fprep.PrepConfig, str]] = {
    "fsdp_full/sgd": (_gpt_cfg("fsdp"), "sgd"),
    "fsdp_grad_op/adamw": (_gpt_cfg("fsdp", sharding="grad_op"), "adamw"),
    "ddp/sgd": (_gpt_cfg("ddp"), "sgd"),
}
HSDP_CASES: dict[str, tuple[fprep.PrepConfig, str]] = {
    "hsdp/sgd": (_gpt_cfg("hsdp", hsdp_shard_size=2), "sgd"),
    "hsdp/adamw": (_gpt_cfg("hsdp", hsdp_shard_size=2), "adamw"),
    "fsdp4/sgd": (_gpt_cfg("fsdp"), "sgd"),
}


def _case_result(state: fprep.PrepState, model: nn.Module, losses: list[float]) -> dict[str, Any]:
    rank, _ = rank_world()
    assert state.core is not None
    replicated = not state.core.is_sharded
    params = full_params(model, rank0_only=not replicated)
    return {
        "params": dump(params) if (rank == 0 or replicated) else b"",
        "losses": losses,
        "strategy": state.core.strategy,
        "applied": state.applied,
        "shapes": plan_vs_reality(state, model),
        "compiled": [n for n, m in model.named_modules() if m._compiled_call_impl is not None],
        "checkpointed": [n for n, m in model.named_modules() if _is_checkpointed(m)],
    }


def _is_checkpointed(module: nn.Module) -> bool:
    from fprep.apply.recompute import checkpoint_of

    return checkpoint_of(module) is not None


def train_interleaved(cases: dict[str, tuple[fprep.PrepConfig, str]]) -> dict[str, Any]:
    """Prepare every case first, then train them all one step at a time, interleaved."""
    rank, world = rank_world()
    prepared = {}
    for name, (cfg, optimizer) in cases.items():
        prepared[name] = fprep.prepare(build(optimizer), cfg)
    loops = {
        name: trainer(state, model, cases[name][1], rank, world)
        for name, (state, model) in prepared.items()
    }
    losses: dict[str, list[float]] = {name: [] for name in cases}
    for _ in range(STEPS):
        for name, loop in loops.items():
            losses[name].append(next(loop))
    return {
        name: _case_result(state, model, losses[name]) for name, (state, model) in prepared.items()
    }


def train_each(cases: dict[str, tuple[fprep.PrepConfig, str]]) -> dict[str, Any]:
    rank, world = rank_world()
    out = {}
    for name, (cfg, optimizer) in cases.items():
        state, model = fprep.prepare(build(optimizer), cfg)
        losses = list(trainer(state, model, optimizer, rank, world))
        out[name] = _case_result(state, model, losses)
        out[name]["hooks"] = _comm_hooks(model)
    return out


def train_prebuilt(cases: dict[str, tuple[fprep.PrepConfig, str]]) -> dict[str, Any]:
    """The optimizer is built before prepare (on the unsharded model) and passed through it."""
    rank, world = rank_world()
    out = {}
    for name, (cfg, optimizer) in cases.items():
        model = build(optimizer)
        opt = make_optimizer(optimizer, model.parameters())
        state, model, returned = fprep.prepare(model, cfg, opt)
        rebound = returned is opt and [id(p) for g in opt.param_groups for p in g["params"]] == [
            id(p) for p in model.parameters()
        ]
        losses = list(trainer(state, model, opt, rank, world))
        out[name] = _case_result(state, model, losses)
        out[name]["rebound"] = rebound
    return out


def _comm_hooks(model: nn.Module) -> list[tuple[str, dict[str, Any]]]:
    hooks = getattr(model, "_comm_hooks", [])
    out = []
    for hook, hook_state in hooks:
        info: dict[str, Any] = {}
        for attr in ("matrix_approximation_rank", "start_powerSGD_iter"):
            if hasattr(hook_state, attr):
                info[attr] = getattr(hook_state, attr)
        out.append((f"{hook.__module__}.{hook.__qualname__}", info))
    return out


# -- individual properties ---------------------------------------------------------------------
def connect_facts() -> dict[str, Any]:
    """Run first in a rank: the default group does not exist yet, so fprep creates it."""
    before = dist.is_initialized()
    state, _model = fprep.prepare(tiny_gpt(seed=SEED), _gpt_cfg("fsdp"))
    handles = state.handles
    assert isinstance(handles, fprep.Handles)
    second, _ = fprep.prepare(tiny_gpt(seed=SEED), _gpt_cfg("ddp"))
    assert isinstance(second.handles, fprep.Handles)
    return {
        "initialized_before": before,
        "initialized_after": dist.is_initialized(),
        "backend": dist.get_backend(),
        "world": dist.get_world_size(),
        "owns": handles.owns_process_group,
        "owns_second": second.handles.owns_process_group,
        "mesh_shape": tuple(handles.mesh.shape),
        "mesh_dim_names": tuple(handles.mesh.mesh_dim_names),
        "ddp_group_is_world": second.handles.process_group is dist.group.WORLD,
    }


def precision_facts() -> dict[str, Any]:
    """fsdp bf16: inner matmuls in bf16, parameters stored in fp32, float32 outputs."""
    rank, world = rank_world()
    _state, model = fprep.prepare(tiny_gpt(seed=SEED), _gpt_cfg("fsdp", precision="bf16"))
    seen: dict[str, torch.dtype] = {}
    model.blocks[0].mlp.c_fc.register_forward_hook(
        lambda m, a, out: seen.__setitem__("inner", out.dtype)
    )
    x, y = next(batches(rank, world, 1))
    out = model(x)
    lm_loss(out, y).backward()
    local_dtypes = {str(p.to_local().dtype) for p in model.parameters()}
    grad_dtypes = {str(p.grad.dtype) for p in model.parameters() if p.grad is not None}
    return {
        "inner": str(seen["inner"]),
        "output": str(out.dtype),
        "param_dtypes": local_dtypes,
        "grad_dtypes": grad_dtypes,
    }


def resharding_facts() -> dict[str, Any]:
    """Whether block parameters are resharded after forward (full) or kept (grad_op)."""
    from torch.distributed.tensor import DTensor

    rank, world = rank_world()
    out = {}
    for sharding in ("full", "grad_op"):
        _state, model = fprep.prepare(tiny_gpt(seed=SEED), _gpt_cfg("fsdp", sharding=sharding))
        x, y = next(batches(rank, world, 1))
        loss = lm_loss(model(x), y)
        weight = model.blocks[0].attn.c_attn.weight
        out[sharding] = isinstance(weight, DTensor)
        loss.backward()
        out[sharding + "_after_backward"] = isinstance(model.blocks[0].attn.c_attn.weight, DTensor)
    return out


def ddp_option_facts() -> dict[str, Any]:
    rank, world = rank_world()
    out: dict[str, Any] = {}

    def attrs(ddp: Any) -> dict[str, Any]:
        return {
            "bucket_bytes_cap": ddp.bucket_bytes_cap,
            "find_unused_parameters": ddp.find_unused_parameters,
            "static_graph": ddp.static_graph,
            "gradient_as_bucket_view": ddp.gradient_as_bucket_view,
            "forward_sync_buffers": ddp_syncs_buffers(ddp),
            "type": type(ddp).__name__,
        }

    _, default = fprep.prepare(tiny_gpt(seed=SEED), _gpt_cfg("ddp"))
    out["default"] = attrs(default)

    # find_unused_parameters: a parameter no forward uses would make DDP fail without it.
    model = tiny_gpt(seed=SEED)
    model.unused = nn.Linear(4, 4)
    options = fprep.DDPOptions(
        bucket_cap_mb=2.5,
        find_unused_parameters=True,
        gradient_as_bucket_view=True,
        broadcast_buffers=False,
    )
    state, ddp = fprep.prepare(model, _gpt_cfg("ddp", ddp=options))
    out["custom"] = attrs(ddp)
    out["custom_losses"] = list(trainer(state, ddp, "sgd", rank, world))
    grads_are_views = []
    x, y = next(batches(rank, world, 1))
    lm_loss(ddp(x), y).backward()
    for bucket_param in [ddp.module.wte.weight, ddp.module.blocks[0].attn.c_attn.weight]:
        grads_are_views.append(bucket_param.grad._base is not None)
    out["grads_are_views"] = grads_are_views

    state, static = fprep.prepare(
        tiny_gpt(seed=SEED), _gpt_cfg("ddp", ddp=fprep.DDPOptions(static_graph=True))
    )
    out["static"] = attrs(static)
    out["static_losses"] = list(trainer(state, static, "sgd", rank, world))
    return out


def fast_ddp_facts() -> dict[str, Any]:
    """fprep.all_reduce_gradients against DDP on the same local batch."""
    rank, world = rank_world()
    fast_model = tiny_gpt(seed=SEED)
    fast_model.extra = nn.Parameter(torch.ones(3))  # unused in forward: gets zeros
    fast_state, fast = fprep.prepare(fast_model, _gpt_cfg("fast_ddp"))
    ddp_state, ddp = fprep.prepare(tiny_gpt(seed=SEED), _gpt_cfg("ddp"))
    local = tiny_gpt(seed=SEED)
    x, y = next(batches(rank, world, 1))
    fprep.backward(fast_state, fast, lm_loss(fast(x), y))
    fprep.backward(ddp_state, ddp, lm_loss(ddp(x), y))
    lm_loss(local(x), y).backward()
    names = [n for n, _ in local.named_parameters()]
    fast_grads = {n: p.grad for n, p in fast.named_parameters()}
    ddp_grads = {n: p.grad for n, p in ddp.module.named_parameters()}
    local_grads = {n: p.grad for n, p in local.named_parameters()}
    # The mean of every rank's local gradients, computed independently of both engines.
    mean = {}
    for n in names:
        g = local_grads[n].clone()
        dist.all_reduce(g)
        mean[n] = g / world
    return {
        "max_fast_vs_ddp": max((fast_grads[n] - ddp_grads[n]).abs().max().item() for n in names),
        "equal_fast_vs_ddp": all(torch.equal(fast_grads[n], ddp_grads[n]) for n in names),
        "max_fast_vs_mean": max((fast_grads[n] - mean[n]).abs().max().item() for n in names),
        "max_local_vs_mean": max((local_grads[n] - mean[n]).abs().max().item() for n in names),
        "extra_grad": fast.extra.grad.tolist() if fast.extra.grad is not None else None,
        "not_fast_ddp_error": _error_of(lambda: fprep.all_reduce_gradients(ddp_state, ddp)),
    }


def _error_of(fn: Callable[[], Any]) -> tuple[str, str] | None:
    try:
        fn()
    except fprep.PrepError as e:
        return type(e).__name__, e.subject
    return None


def broadcast_facts() -> dict[str, Any]:
    """Each rank builds different weights; DDP, fast_ddp and fsdp with sync_module_states end
    with rank 0's (fsdp: other ranks start on the meta device)."""
    rank, _ = rank_world()
    out: dict[str, Any] = {}
    for name, cfg in [
        ("ddp", _gpt_cfg("ddp")),
        ("fast_ddp", _gpt_cfg("fast_ddp")),
    ]:
        _, model = fprep.prepare(tiny_gpt(seed=5 + rank), cfg)
        out[name] = dump(full_params(model, rank0_only=False))
    model = tiny_gpt(seed=5) if rank == 0 else tiny_gpt(device="meta")
    _, model = fprep.prepare(model, _gpt_cfg("fsdp", sync_module_states=True))
    out["fsdp_sync"] = dump(full_params(model, rank0_only=False))
    out["fsdp_sync_tied"] = model.lm_head.weight is model.wte.weight
    return out


def already_prepared_facts() -> dict[str, Any]:
    out: dict[str, Any] = {}
    for strategy in ("ddp", "fsdp", "fast_ddp"):
        _state, model = fprep.prepare(tiny_gpt(seed=SEED), _gpt_cfg(strategy))
        out[strategy] = _error_of(lambda m=model, s=strategy: fprep.prepare(m, _gpt_cfg(s)))
        inner = getattr(model, "module", None)
        if isinstance(inner, nn.Module):
            out[strategy + "_inner"] = _error_of(
                lambda m=inner, s=strategy: fprep.prepare(m, _gpt_cfg(s))
            )
            out[strategy + "_wrapped_once"] = not isinstance(inner, type(model))
    return out


def reproducible_init(
    reproducible: bool = True, seed: int = INIT_SEED, strategy: str = "fsdp"
) -> dict[str, Any]:
    """A tiny_gpt built on the meta device, prepared with ``strategy`` (at any world size)."""
    with torch.device("meta"):
        model = GPT(GPTConfig())
    assert all(p.is_meta for p in model.parameters())
    rng = torch.get_rng_state()
    extra: dict[str, Any] = {"hsdp_shard_size": 2} if strategy == "hsdp" else {}
    state, model = fprep.prepare(
        model, _gpt_cfg(strategy, seed=seed, reproducible_init=reproducible, **extra)
    )
    assert state.core is not None
    rank, _ = rank_world()
    params = full_params(model)
    inner = _inner(model)
    return {
        "strategy": state.core.strategy,
        "params": dump(params) if rank == 0 else b"",
        "tied": inner.lm_head.weight is inner.wte.weight,
        "rng_restored": torch.equal(rng, torch.get_rng_state()),
        "on_meta": any(p.is_meta for p in model.parameters()),
        "shapes": plan_vs_reality(state, model),
    }


def hsdp_sync_facts() -> bytes:
    """hsdp with sync_module_states: rank 0 real weights, ranks 1-3 on the meta device."""
    rank, _ = rank_world()
    model = tiny_gpt(seed=5) if rank == 0 else tiny_gpt(device="meta")
    _, model = fprep.prepare(model, _gpt_cfg("hsdp", hsdp_shard_size=2, sync_module_states=True))
    return dump(full_params(model, rank0_only=False))


def subgroup_facts() -> dict[str, Any]:
    """DDP and fast_ddp over a user's process group that is not the whole job: ranks {0, 1}
    and {2, 3} each train their own replica (each rank starts from different weights)."""
    rank, world = rank_world()
    groups = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    group = groups[rank // 2]
    first = (rank // 2) * 2  # the group's first rank, whose weights everyone must get
    x, y = next(batches(rank, world, 1))
    expected = tiny_gpt(seed=10 + first)
    lm_loss(expected(x), y).backward()
    mean = {n: p.grad.clone() for n, p in expected.named_parameters() if p.grad is not None}
    for g in mean.values():  # the group's mean gradient at the group's first rank's weights
        dist.all_reduce(g, group=group)
        g /= group.size()
    out: dict[str, Any] = {}
    for strategy in ("ddp", "fast_ddp"):
        state, model = fprep.prepare(
            tiny_gpt(seed=10 + rank), _gpt_cfg(strategy), process_group=group
        )
        inner = _inner(model)
        same = all(
            torch.equal(p, q)
            for p, q in zip(inner.parameters(), expected.parameters(), strict=True)
        )
        fprep.backward(state, model, lm_loss(model(x), y))
        grads = dict(inner.named_parameters())
        out[strategy] = {
            "weights_from_group_first_rank": same,
            "max_grad_diff": max((grads[n].grad - g).abs().max().item() for n, g in mean.items()),
        }
    return out


# -- the rank functions ------------------------------------------------------------------------
def two_ranks() -> dict[str, Any]:
    return timed(
        {
            "connect": connect_facts,  # first: no process group exists yet
            "fp32": lambda: train_interleaved(FP32_CASES),
            "loose": lambda: train_each(LOOSE_CASES),
            "prebuilt": lambda: train_prebuilt(PREBUILT_CASES),
            "precision": precision_facts,
            "resharding": resharding_facts,
            "ddp_options": ddp_option_facts,
            "fast_ddp": fast_ddp_facts,
            "broadcast": broadcast_facts,
            "already_prepared": already_prepared_facts,
            "init": reproducible_init,
            "init_unseeded": lambda: reproducible_init(reproducible=False),
            "init_ddp": lambda: reproducible_init(strategy="ddp"),
            "shapes": lambda: check_shapes(2),
        }
    )


def three_ranks() -> dict[str, Any]:
    return {"init": reproducible_init(), "shapes": check_shapes(3)}


def hsdp_replicas_that_differ() -> tuple[str, str] | None:
    """hsdp 2 x 2: replica 0 (ranks 0, 1) built on the meta device, replica 1 (ranks 2, 3) with
    real weights. Each shard group agrees with itself; the replicas would train from different
    weights. Every rank must refuse."""
    rank, _ = rank_world()
    if rank < 2:
        with torch.device("meta"):
            model = GPT(GPTConfig())
    else:
        model = GPT(GPTConfig())
    try:
        fprep.prepare(model, _gpt_cfg("hsdp", seed=INIT_SEED, hsdp_shard_size=2))
    except fprep.PrepareError as e:
        return (e.subject, str(e))
    return None


def four_ranks() -> dict[str, Any]:
    from torch.distributed.tensor import DTensor

    state, model = fprep.prepare(tiny_gpt(seed=SEED), _gpt_cfg("hsdp", hsdp_shard_size=2))
    handles = state.handles
    assert isinstance(handles, fprep.Handles) and state.process_group is not None
    weight = model.wte.weight
    assert isinstance(weight, DTensor)
    mesh = {
        "shape": tuple(handles.mesh.shape),
        "dim_names": tuple(handles.mesh.mesh_dim_names),
        "coordinate": tuple(handles.mesh.get_coordinate()),
        "planned_coordinate": state.process_group.coordinate,
        "shard_group": tuple(dist.get_process_group_ranks(handles.mesh.get_group("shard"))),
        "planned_shard_group": state.process_group.shard_group,
        "replicate_group": tuple(dist.get_process_group_ranks(handles.mesh.get_group("replicate"))),
        "planned_replicate_group": state.process_group.replicate_group,
    }
    return {
        "mesh": mesh,
        "numerics": train_each(HSDP_CASES),
        "shapes": check_shapes(4),
        "init_hsdp": reproducible_init(strategy="hsdp"),
        "init_fsdp": reproducible_init(strategy="fsdp"),
        "hsdp_replicas_differ": hsdp_replicas_that_differ(),
        "hsdp_sync": hsdp_sync_facts(),
        "subgroups": subgroup_facts(),
    }


# -- run_ranks itself ----------------------------------------------------------------------------
def misbehave(kind: str) -> str:
    """Rank 1 fails (``kind``: "raise" or "crash"); rank 0 would wait for it forever."""
    import os

    rank, _ = rank_world()
    if rank == 1:
        if kind == "raise":
            raise ValueError("rank 1 gives up")
        os._exit(3)  # dies without reporting anything
    if kind == "raise":
        dist.init_process_group("gloo")
        dist.barrier()  # never completes: rank 1 never joins
    return "rank 0 done"
