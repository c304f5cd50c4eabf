"""Rank functions for tests/test_loop_distributed.py, and their single-process references.

Module level throughout, so ``fprep.testing.distributed.run_ranks`` can pickle them into spawned
ranks. A rank function returns plain data (tensors as ``torch.save`` bytes); the tests assert in
the parent process. One rank function per world size covers every case: starting ranks costs
seconds on two cores.

The training cases all follow one loop: ``STEPS`` optimizer steps, each over one global batch of
``GLOBAL_BATCH`` sequences; each rank takes its slice and splits it into ``MICRO`` micro-steps
under ``fprep.accumulate``, with the loss scaled by ``1 / MICRO``; then ``fprep.clip_grad_norm``
and ``fprep.optimizer_step`` with a scheduler. The reference is plain PyTorch in one process on
the whole global batch (``loss.backward()``, ``clip_grad_norm_``, ``opt.step()``,
``scheduler.step()``).
"""

from __future__ import annotations

import io
import os
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from _checks import timed
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import fprep
from fprep.testing.models import GPT, GPTBlock, GPTConfig, lm_loss, synthetic_batches, tiny_gpt

SEED = 1  # model initialization
DATA_SEED = 3
GLOBAL_BATCH = 8  # divisible by 1, 2 and 4 ranks times MICRO
MICRO = 2  # micro-steps per optimizer step
STEPS = 3
CLIP = 1.0  # below the gradient norm (about 3-6): clipping really scales
OVERFLOW_STEP = 1  # fp16 cases: this step's first micro-step overflows on rank 0
#: AdamW gets no biases: the attention's key bias has an exactly-zero gradient in exact
#: arithmetic, which AdamW's normalized update turns into steps of ~lr (see _prepare_workers).
ADAMW_CONFIG = GPTConfig(bias=False)

Params = dict[str, torch.Tensor]


# -- helpers -------------------------------------------------------------------------------------
def rank_world() -> tuple[int, int]:
    return int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))


def dump(tensors: Params) -> bytes:
    buffer = io.BytesIO()
    torch.save({k: v.detach().cpu().clone() for k, v in tensors.items()}, buffer)
    return buffer.getvalue()


def load(data: bytes) -> Params:
    loaded: Params = torch.load(io.BytesIO(data))
    return loaded


def plain_name(name: str) -> str:
    """A state-dict key without torch.compile's and checkpoint_wrapper's parts."""
    parts = name.split(".")
    return ".".join(p for p in parts if p not in ("_orig_mod", "_checkpoint_wrapped_module"))


def full_params(model: nn.Module) -> Params:
    """Full parameters and buffers by their plain names, on every rank (DCP's gathering, not
    fprep's)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    if not dist.is_initialized():
        return {plain_name(k): v.detach().clone() for k, v in model.state_dict().items()}
    sd = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True))
    return {plain_name(k): v.detach().cpu().clone() for k, v in sd.items()}


def global_batches(steps: int = STEPS) -> list[tuple[torch.Tensor, torch.Tensor]]:
    return list(synthetic_batches(steps, batch_size=GLOBAL_BATCH, seed=DATA_SEED))


def micro_batches(
    x: torch.Tensor, y: torch.Tensor, rank: int, world: int, micro: int = MICRO
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """This rank's slice of a global batch, split into ``micro`` micro-batches."""
    n = x.shape[0] // world
    xs, ys = x[rank * n : (rank + 1) * n], y[rank * n : (rank + 1) * n]
    return list(zip(xs.chunk(micro), ys.chunk(micro), strict=True))


def decay(step: int) -> float:
    return 0.5**step


def make_sgd(model: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)


def adamw_groups(model: nn.Module) -> list[dict[str, Any]]:
    """Two param groups with their own hyperparameters (and a key torch does not know)."""
    matrices = [p for p in model.parameters() if p.dim() >= 2]
    vectors = [p for p in model.parameters() if p.dim() < 2]
    return [
        {"params": matrices, "weight_decay": 0.1},
        {"params": vectors, "weight_decay": 0.0, "lr": 5e-3, "name": "vectors"},
    ]


def make_adamw(model: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.AdamW(adamw_groups(model), lr=1e-2, betas=(0.9, 0.95))


def scheduler(opt: torch.optim.Optimizer) -> torch.optim.lr_scheduler.LRScheduler:
    return torch.optim.lr_scheduler.LambdaLR(opt, decay)


def hyperparameters(opt: torch.optim.Optimizer) -> list[dict[str, Any]]:
    return [{k: v for k, v in g.items() if k != "params"} for g in opt.param_groups]


def build_sgd_model() -> GPT:
    return tiny_gpt(seed=SEED)


def build_adamw_model() -> GPT:
    return tiny_gpt(ADAMW_CONFIG, seed=SEED)


def build_wrapped_adamw_model() -> nn.Module:
    """The AdamW model with its first block in ``checkpoint_wrapper`` and the whole model
    ``torch.compile``-d: parameter names gain ``_orig_mod.`` and ``_checkpoint_wrapped_module.``."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

    model = build_adamw_model()
    model.blocks[0] = checkpoint_wrapper(model.blocks[0])
    compiled: nn.Module = torch.compile(model, backend="eager")
    return compiled


# -- the single-process references ---------------------------------------------------------------
def reference_sgd(*, skip: tuple[int, ...] = ()) -> dict[str, Any]:
    """Plain PyTorch on the whole global batch: parameters, norms and learning rates per step.

    ``skip``: steps whose update is skipped entirely (an fp16 overflow elsewhere)."""
    model = build_sgd_model()
    opt = make_sgd(model)
    sched = scheduler(opt)
    norms: list[float] = []
    lrs: list[float] = []
    for k, (x, y) in enumerate(global_batches()):
        if k in skip:
            norms.append(float("nan"))
        else:
            lm_loss(model(x), y).backward()
            norms.append(nn.utils.clip_grad_norm_(model.parameters(), CLIP).item())
            opt.step()
            sched.step()
            opt.zero_grad()
        lrs.append(opt.param_groups[0]["lr"])
    params = {k: v.detach().clone() for k, v in model.state_dict().items()}
    return {"params": params, "norms": norms, "lrs": lrs}


def reference_adamw() -> Params:
    model = build_adamw_model()
    opt = make_adamw(model)
    sched = scheduler(opt)
    for x, y in global_batches():
        lm_loss(model(x), y).backward()
        opt.step()
        sched.step()
        opt.zero_grad()
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


# -- counting collectives ------------------------------------------------------------------------
COUNTS: dict[str, int] = {"ddp_buckets": 0, "all_reduce": 0, "reduce_scatter": 0}


def counting_allreduce_hook(process_group: Any, bucket: Any) -> Any:
    """DDP communication hook: torch's default all-reduce, counted."""
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

    COUNTS["ddp_buckets"] += 1
    return default_hooks.allreduce_hook(process_group, bucket)


# DDP refuses string annotations (``from __future__ import annotations``); it checks none.
counting_allreduce_hook.__annotations__ = {}


class CountCollectives:
    """Counts ``dist.all_reduce`` (fast_ddp, hsdp's replicate reduction) and
    ``dist.reduce_scatter_single`` (FSDP2) calls inside the block, and DDP's bucket hooks."""

    def __enter__(self) -> dict[str, int]:
        for key in COUNTS:
            COUNTS[key] = 0
        self.saved = (dist.all_reduce, dist.reduce_scatter_single)
        all_reduce, reduce_scatter = self.saved

        def counted_all_reduce(*args: Any, **kwargs: Any) -> Any:
            COUNTS["all_reduce"] += 1
            return all_reduce(*args, **kwargs)

        def counted_reduce_scatter(*args: Any, **kwargs: Any) -> Any:
            COUNTS["reduce_scatter"] += 1
            return reduce_scatter(*args, **kwargs)

        dist.all_reduce = counted_all_reduce
        dist.reduce_scatter_single = counted_reduce_scatter
        return COUNTS

    def __exit__(self, *exc: object) -> None:
        dist.all_reduce, dist.reduce_scatter_single = self.saved


def _local(t: torch.Tensor) -> torch.Tensor:
    local: torch.Tensor = t.to_local() if hasattr(t, "to_local") else t
    return local


def grads_differ_across_ranks(model: nn.Module) -> bool | None:
    """Whether this rank's (local, replicated-layout) gradients differ from rank 0's; None when
    no parameter has a gradient yet."""
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    if not grads:
        return None
    flat = torch.cat([_local(g).reshape(-1) for g in grads])
    gathered = [torch.empty_like(flat) for _ in range(dist.get_world_size())]
    dist.all_gather(gathered, flat)
    return any(not torch.equal(gathered[0], g) for g in gathered[1:])


# -- the training loop (every helper at once) ----------------------------------------------------
def train(
    state: fprep.PrepState,
    model: nn.Module,
    opt: torch.optim.Optimizer,
    sched: Any,
    *,
    batches: list[tuple[torch.Tensor, torch.Tensor]] | None = None,
    clip: float | None = CLIP,
    overflow: bool = False,
    observe: bool = False,
) -> dict[str, Any]:
    """STEPS steps of MICRO micro-steps. ``overflow``: rank 0's first micro-step of step
    OVERFLOW_STEP gets its loss multiplied by 1e30 (an fp16 overflow). ``observe``: count the
    collectives of each micro-step and compare gradients across ranks before the final one."""
    rank, world = rank_world()
    out: dict[str, Any] = {"norms": [], "lrs": [], "stepped": [], "micro": []}
    for k, (x, y) in enumerate(batches if batches is not None else global_batches()):
        parts = micro_batches(x, y, rank, world)
        for j, (xm, ym) in enumerate(parts):
            last = j == len(parts) - 1
            with CountCollectives() as counts:
                with fprep.accumulate(state, model, sync=last):
                    loss = lm_loss(model(xm), ym) / len(parts)
                    if overflow and k == OVERFLOW_STEP and j == 0 and rank == 0:
                        loss = loss * 1e30
                    fprep.backward(state, model, loss)
                seen = dict(counts)
            if observe:
                grads = [p.grad for p in model.parameters()]
                seen["grads_none"] = all(g is None for g in grads)
                seen["grads_differ"] = grads_differ_across_ranks(model) if world > 1 else None
                seen["last"] = last
                out["micro"].append(seen)
        if clip is not None:
            norm = fprep.clip_grad_norm(state, model, clip, optimizer=opt)
            out["norms"].append(float(norm))
        out["stepped"].append(fprep.optimizer_step(state, opt, sched))
        opt.zero_grad(set_to_none=True)
        out["lrs"].append(opt.param_groups[0]["lr"])
    return out


def _cfg(strategy: str, **kw: Any) -> fprep.PrepConfig:
    if strategy in ("fsdp", "hsdp"):
        kw.setdefault("wrap", GPTBlock)
    if strategy == "hsdp":
        kw.setdefault("hsdp_shard_size", 2)
    return fprep.PrepConfig(strategy=strategy, **kw)  # type: ignore[arg-type]


#: (strategy, precision) of the loop cases; fp16 ones overflow once.
LOOP_CASES: dict[str, tuple[str, str]] = {
    "ddp": ("ddp", "no"),
    "fsdp": ("fsdp", "no"),
    "fast_ddp": ("fast_ddp", "no"),
    "ddp_fp16": ("ddp", "fp16"),
    "fsdp_fp16": ("fsdp", "fp16"),
}
HSDP_LOOP_CASES: dict[str, tuple[str, str]] = {"hsdp": ("hsdp", "no")}


def loop_case(strategy: str, precision: str) -> dict[str, Any]:
    state, model = fprep.prepare(build_sgd_model(), _cfg(strategy, precision=precision))
    if strategy == "ddp":
        model.register_comm_hook(None, counting_allreduce_hook)
    opt = make_sgd(model)
    sched = scheduler(opt)
    out = train(state, model, opt, sched, overflow=precision == "fp16", observe=True)
    out["params"] = dump(full_params(model))
    out["scheduler_steps"] = sched.last_epoch
    return out


def loop_cases(cases: dict[str, tuple[str, str]]) -> dict[str, Any]:
    return {name: loop_case(*spec) for name, spec in cases.items()}


# -- optimizers ----------------------------------------------------------------------------------
def _state_layout(model: nn.Module, opt: torch.optim.Optimizer) -> list[str]:
    """Mismatches between each optimizer-state tensor and the parameter it belongs to."""
    bad: list[str] = []
    names = {id(p): n for n, p in model.named_parameters()}
    for p, entries in opt.state.items():
        name = names.get(id(p), "<not the model's>")
        for key, value in entries.items():
            if not isinstance(value, torch.Tensor) or value.dim() == 0:
                continue
            if hasattr(p, "placements") != hasattr(value, "placements"):
                bad.append(f"{name}.{key}: sharded {hasattr(value, 'placements')}")
            elif hasattr(p, "placements") and tuple(value.placements) != tuple(p.placements):
                bad.append(f"{name}.{key}: placements {value.placements} vs {p.placements}")
            if _local(value).shape != _local(p).shape:
                bad.append(f"{name}.{key}: local shape {tuple(_local(value).shape)}")
            if value.shape != p.shape:
                bad.append(f"{name}.{key}: shape {tuple(value.shape)}")
    return bad


#: name -> (strategy, model builder, step before prepare, how the optimizer reaches prepare)
OPTIMIZER_CASES: dict[str, tuple[str, Callable[[], nn.Module], bool, str]] = {
    "fsdp/wrapped/stepped/passed": ("fsdp", build_wrapped_adamw_model, True, "prepare"),
    "fsdp/stepped/prepare_optimizer": ("fsdp", build_adamw_model, True, "prepare_optimizer"),
    "ddp/stepped/passed": ("ddp", build_adamw_model, True, "prepare"),
    "fsdp/fresh/passed": ("fsdp", build_adamw_model, False, "prepare"),
    "fsdp/fresh/built_after": ("fsdp", build_adamw_model, False, "after"),
}
HSDP_OPTIMIZER_CASES = {
    "hsdp/wrapped/stepped/passed": ("hsdp", build_wrapped_adamw_model, True, "prepare"),
}


def optimizer_case(
    strategy: str, build: Callable[[], nn.Module], stepped: bool, via: str
) -> dict[str, Any]:
    model = build()
    batches = global_batches()
    out: dict[str, Any] = {}
    opt = make_adamw(model) if via != "after" else None
    sched = scheduler(opt) if opt is not None else None
    if stepped:  # the first step before prepare, identical on every rank: the whole batch
        assert opt is not None and sched is not None
        x, y = batches[0]
        lm_loss(model(x), y).backward()
        opt.step()
        sched.step()
        opt.zero_grad(set_to_none=True)
        batches = batches[1:]
    hyper = hyperparameters(opt) if opt is not None else None
    marker = object()
    cfg = _cfg(strategy)
    if via == "prepare":
        state, model, returned, returned_sched, returned_marker = fprep.prepare(
            model, cfg, opt, sched, marker
        )
        out["returned_in_order"] = (
            returned is opt and returned_sched is sched and returned_marker is marker
        )
    else:
        state, model = fprep.prepare(model, cfg)
        if via == "prepare_optimizer":
            assert opt is not None
            out["returned_in_order"] = fprep.prepare_optimizer(state, model, opt) is opt
        else:
            opt = make_adamw(model)
            sched = scheduler(opt)
            hyper = hyperparameters(opt)
    assert opt is not None
    bound = [id(p) for g in opt.param_groups for p in g["params"]]
    out["bound_to_model"] = sorted(bound) == sorted(id(p) for p in model.parameters())
    out["hyperparameters_kept"] = hyperparameters(opt) == hyper
    out["state_layout"] = _state_layout(model, opt)
    out["state_entries"] = sorted({k for s in opt.state.values() for k in s})
    out["state_count"] = len(opt.state)
    out["sharded_params"] = sum(hasattr(p, "placements") for p in model.parameters())
    train(state, model, opt, sched, batches=batches, clip=None)
    out["params"] = dump(full_params(model))
    out["unwrap"] = unwrap_facts(state, model)
    return out


def optimizer_cases(cases: dict[str, Any]) -> dict[str, Any]:
    return {name: optimizer_case(*spec) for name, spec in cases.items()}


# -- unwrap --------------------------------------------------------------------------------------
def _collectives_during(fn: Callable[[], Any]) -> tuple[Any, int]:
    calls = [0]
    names = ("all_gather_single", "all_gather_into_tensor", "all_reduce", "broadcast")
    saved = {n: getattr(dist, n) for n in names}

    def counted(original: Callable[..., Any]) -> Callable[..., Any]:
        def call(*args: Any, **kwargs: Any) -> Any:
            calls[0] += 1
            return original(*args, **kwargs)

        return call

    for n, f in saved.items():
        setattr(dist, n, counted(f))
    try:
        return fn(), calls[0]
    finally:
        for n, f in saved.items():
            setattr(dist, n, f)


def unwrap_facts(state: fprep.PrepState, model: nn.Module) -> dict[str, Any]:
    """``fprep.unwrap`` of a trained model: classes, names, parameters, hooks, a forward."""
    from torch.distributed.fsdp import FSDPModule, fully_shard

    from fprep.apply.recompute import checkpoint_of

    unwrapped = fprep.unwrap(state, model)
    full = full_params(model)
    sd = unwrapped.state_dict()
    inner = getattr(unwrapped, "_orig_mod", unwrapped)
    fired: list[int] = []
    for m in model.modules():  # the prepared model must not run when the copy does
        m.register_forward_pre_hook(lambda *_: fired.append(1))
    hook_owners = sorted(
        {
            str(getattr(getattr(h, "hook", h), "__module__", ""))
            for m in unwrapped.modules()
            for d in (m._forward_pre_hooks, m._forward_hooks, m._state_dict_pre_hooks)
            for h in d.values()
        }
    )
    x, _ = global_batches(1)[0]
    with torch.no_grad():
        out, collectives = _collectives_during(lambda: unwrapped(x))
        plain = GPT(inner.config)
        plain.load_state_dict({plain_name(k): v for k, v in sd.items()})
        expected = plain(x)
    return {
        "classes": sorted({type(m).__qualname__ for m in unwrapped.modules()}),
        "fsdp_modules": sum(isinstance(m, FSDPModule) for m in unwrapped.modules()),
        "fsdp_state": sum(fully_shard.state(m) is not None for m in unwrapped.modules()),
        "hook_owners": hook_owners,
        "keys": list(sd),
        "values_equal": sorted(map(plain_name, sd)) == sorted(full)
        and all(torch.equal(v, full[plain_name(k)]) for k, v in sd.items()),
        "dtensors": sum(hasattr(p, "placements") for p in unwrapped.parameters()),
        "tied": inner.lm_head.weight is inner.wte.weight,
        "forward_max_diff": (out - expected).abs().max().item(),
        "collectives_in_forward": collectives,
        "prepared_model_ran": len(fired),
        "is_ddp_module": unwrapped is getattr(model, "module", None),
        "checkpointed": sum(checkpoint_of(m) is not None for m in unwrapped.modules()),
    }


def unwrap_cases() -> dict[str, Any]:
    """Unwrapping after preparations the optimizer cases do not cover."""
    rank, world = rank_world()
    out: dict[str, Any] = {}
    x, y = micro_batches(*global_batches(1)[0], rank, world, 1)[0]
    # Regional compile + activation checkpointing: both applied in place by fprep.
    state, model = fprep.prepare(
        build_sgd_model(),
        _cfg("fsdp", compile="regional", compile_backend="eager", activation_checkpointing=True),
    )
    fprep.backward(state, model, lm_loss(model(x), y))
    out["fsdp/regional_compile"] = unwrap_facts(state, model)
    # grad_op keeps parameters unsharded between a forward and the next backward.
    state, model = fprep.prepare(build_sgd_model(), _cfg("fsdp", sharding="grad_op"))
    with torch.no_grad():
        model(x)
    out["fsdp/grad_op_after_forward"] = unwrap_facts(state, model)
    state, model = fprep.prepare(build_sgd_model(), _cfg("ddp"))
    out["ddp"] = unwrap_facts(state, model)
    return out


# -- data loading --------------------------------------------------------------------------------
READS: list[int] = []


class Counting(TensorDataset):
    """Records every index read (in this process)."""

    def __getitem__(self, i: int) -> tuple[torch.Tensor, ...]:
        READS.append(int(i))
        return super().__getitem__(i)


def dataset(n: int) -> Counting:
    return Counting(torch.arange(n))


def epoch(
    state: fprep.PrepState, loader: fprep.PreparedDataLoader, gather: bool = True
) -> dict[str, Any]:
    local: list[list[int]] = []
    gathered: list[int] = []
    for (batch,) in loader:
        local.append(batch.tolist())
        if gather:
            gathered += fprep.gather_for_metrics(state, batch, loader).tolist()
    return {"local": local, "gathered": gathered, "epoch_after": loader.epoch}


N = 11  # not a multiple of 2 ranks, 2 per batch or 4 per global batch: even batches repeat


def data_facts() -> dict[str, Any]:
    out: dict[str, Any] = {}
    cfg = fprep.PrepConfig(strategy="ddp", seed=5)
    model = nn.Linear(2, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    shuffled = DataLoader(dataset(N), batch_size=2, shuffle=True)
    plain = DataLoader(dataset(N), batch_size=2)
    state, model, shuffled_l, opt_r, plain_l = fprep.prepare(model, cfg, shuffled, opt, plain)
    out["types"] = [type(o).__name__ for o in (shuffled_l, opt_r, plain_l)]
    out["optimizer_is_same"] = opt_r is opt
    out["shuffled"] = [epoch(state, shuffled_l) for _ in range(2)]
    out["plain"] = epoch(state, plain_l)
    # even_batches off, through the config of another preparation.
    state_off, *_ = fprep.prepare(nn.Linear(2, 2), cfg.replace(even_batches=False))
    uneven = fprep.prepare_data_loader(state_off, DataLoader(dataset(N), batch_size=2))
    out["uneven"] = epoch(state_off, uneven)  # 3 batches on each rank: gathering is safe
    short = fprep.prepare_data_loader(state_off, DataLoader(dataset(9), batch_size=2))
    out["uneven_short"] = epoch(state_off, short, gather=False)  # 3 batches and 2
    split = fprep.prepare_data_loader(
        state, DataLoader(dataset(12), batch_size=4), split_batches=True
    )
    out["split"] = epoch(state, split)
    wide = fprep.prepare_data_loader(state, DataLoader(dataset(N), batch_size=4, shuffle=True))
    out["wide"] = epoch(state, wide)  # batches of 4 and 2 per rank
    # Workers (this rank is not a daemon process, so it may start them). Forked: a spawned
    # process spawns its children too, and each would import torch again (seconds apiece).
    loader = DataLoader(
        dataset(N), batch_size=2, shuffle=True, num_workers=2, multiprocessing_context="fork"
    )
    workers = fprep.prepare_data_loader(state, loader)
    out["workers"] = [epoch(state, workers) for _ in range(2)]
    # Two loaders coexist: one is paused mid-epoch while the other runs a whole epoch.
    a = fprep.prepare_data_loader(state, DataLoader(dataset(N), batch_size=2, shuffle=True))
    b = fprep.prepare_data_loader(state, DataLoader(dataset(N), batch_size=3), seed=9)
    it = iter(a)
    first = [next(it)[0].tolist()]
    out["coexist_b"] = epoch(state, b)
    out["coexist_a"] = first + [batch.tolist() for (batch,) in it]
    # Resume mid-epoch 1 in a fresh loader, reading only what is left.
    c = fprep.prepare_data_loader(state, DataLoader(dataset(N), batch_size=2, shuffle=True))
    epoch(state, c, gather=False)
    it = iter(c)
    next(it)
    position = c.state_dict()
    del it
    fresh = fprep.prepare_data_loader(state, DataLoader(dataset(N), batch_size=2, shuffle=True))
    fresh.load_state_dict(position)
    READS.clear()
    out["resume_position"] = position
    out["resumed"] = [batch.tolist() for (batch,) in fresh]
    out["resume_reads"] = list(READS)
    out["resumed_epoch_after"] = fresh.epoch
    return out


# -- the rank functions --------------------------------------------------------------------------
def two_ranks() -> dict[str, Any]:
    return timed(
        {
            "data": data_facts,
            "loops": lambda: loop_cases(LOOP_CASES),
            "optimizers": lambda: optimizer_cases(OPTIMIZER_CASES),
            "unwrap": unwrap_cases,
        }
    )


def gather_cases() -> dict[str, Any]:
    """gather_for_metrics over an hsdp 2 x 2 mesh, and over DDP on a 2-rank subgroup (ranks
    {0, 1} and {2, 3} each train their own replica: each pair is its own data-parallel world)."""
    out: dict[str, Any] = {}
    cfg = fprep.PrepConfig(strategy="hsdp", hsdp_shard_size=2, seed=5)
    state, _, loader = fprep.prepare(nn.Linear(2, 2), cfg, DataLoader(dataset(N), batch_size=2))
    out["hsdp"] = epoch(state, loader)
    rank, _ = rank_world()
    pairs = [dist.new_group([0, 1]), dist.new_group([2, 3])]  # every rank creates both
    mine = pairs[rank // 2]
    state, _, loader = fprep.prepare(
        nn.Linear(2, 2),
        fprep.PrepConfig(strategy="ddp", seed=5),
        DataLoader(dataset(N), batch_size=2),
        process_group=mine,
    )
    out["pair"] = epoch(state, loader)
    return out


def four_ranks() -> dict[str, Any]:
    return timed(
        {
            "loops": lambda: loop_cases(HSDP_LOOP_CASES),
            "optimizers": lambda: optimizer_cases(HSDP_OPTIMIZER_CASES),
            "gather": gather_cases,
        }
    )


def single_process_loop(precision: str) -> dict[str, Any]:
    """The loop of the distributed cases in this process (strategy none), through fprep."""
    state, model = fprep.prepare(build_sgd_model(), fprep.PrepConfig(precision=precision))  # type: ignore[arg-type]
    opt = make_sgd(model)
    sched = scheduler(opt)
    return train(state, model, opt, sched, overflow=precision == "fp16")


# -- run_ranks with ranks that start processes ---------------------------------------------------
def misbehave_with_workers(pid_file: str) -> str:
    """Rank 0 starts DataLoader workers, then waits for rank 1 forever; rank 1 raises."""
    import time

    rank, _ = rank_world()
    if rank == 1:
        deadline = time.monotonic() + 60
        while not os.path.exists(pid_file) and time.monotonic() < deadline:
            time.sleep(0.05)  # until rank 0's workers run
        raise ValueError("rank 1 gives up")
    loader = DataLoader(
        dataset(8),
        batch_size=2,
        num_workers=2,
        persistent_workers=True,
        multiprocessing_context="fork",
    )
    it = iter(loader)
    next(it)
    pids = [os.getpid(), *(w.pid for w in it._workers)]  # type: ignore[attr-defined]
    with open(pid_file + ".tmp", "w") as f:
        f.write(" ".join(map(str, pids)))
    os.replace(pid_file + ".tmp", pid_file)
    dist.init_process_group("gloo")
    dist.barrier()  # never completes: rank 1 never joins
    return "rank 0 done"
