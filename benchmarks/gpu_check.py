"""GPU check: fprep's single-device matrix, step-time ratios and pretrained loading on this machine.

One GPU (about 2 minutes on an H100, a 0.25B transformers Llama built from a config; `--size 0.9b`
for issue 19's fp8 shape):

    python benchmarks/gpu_check.py

Several GPUs (NCCL; adds ddp / fsdp / hsdp training, tensor parallelism — tp 2, fsdp over the rest —
and sharded checkpoint round trips):

    torchrun --nproc-per-node 4 benchmarks/gpu_check.py

Without a GPU, a smoke test of the same code paths (what tests/test_gpu_check.py runs parts of;
a minute or two, most of it inductor compiling the regional + AC row once; whole compile skipped):

    python benchmarks/gpu_check.py --device cpu --tiny

Checks (each a row of the summary table; the exit status is 1 if any row FAILs):
training from meta in fp32 / bf16 / fp16 (the loss falls); regional and whole compile with
activation checkpointing (the first loss matches eager bf16); ``weights=`` from a bf16
``save_pretrained`` directory (bit-equal to ``from_pretrained``) and its time against
``from_pretrained(device_map=...)``; a synchronous and a ``wait=False`` checkpoint with a
bit-exact resume; the stall of a ``wait=False`` save against a synchronous one; fp8 against
torchao's hand conversion of the same modules (CUDA with torchao); the bf16 step time against
hand-written torch and against Accelerate (when importable).
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import os
import statistics
import sys
import tempfile
import time
import traceback
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from _timing import interleaved, ratio
from torch import nn

import fprep
from fprep.compat import torch_features


@dataclass
class Row:
    check: str
    status: str  # "ok", "FAIL", "skip"
    detail: str


#: The models ``--size`` picks: (config sizes, attention heads, a batch's shape). ``0.25b``: a
#: step takes tens of milliseconds on one H100; ``0.9b``: the shape issue 19 measured fp8 on
#: (``lm_head`` 32000 x 2048, 4 x 2048 tokens), where float8 matmuls pay.
MODELS: dict[str, tuple[dict[str, int], dict[str, int], tuple[int, int]]] = {
    "tiny": (
        dict(hidden_size=64, intermediate_size=176, num_hidden_layers=2, vocab_size=256),
        dict(num_attention_heads=4, num_key_value_heads=2),
        (2, 32),
    ),
    "0.25b": (
        dict(hidden_size=1024, intermediate_size=2816, num_hidden_layers=16, vocab_size=32000),
        dict(num_attention_heads=16, num_key_value_heads=8),
        (4, 1024),
    ),
    "0.9b": (
        dict(hidden_size=2048, intermediate_size=5632, num_hidden_layers=16, vocab_size=32000),
        dict(num_attention_heads=16, num_key_value_heads=8),
        (4, 2048),
    ),
}


@dataclass(frozen=True)
class Setup:
    device: str  # "cuda" or "cpu"
    size: str  # a key of MODELS
    world: int
    rank: int
    workdir: Path

    @property
    def tiny(self) -> bool:
        return self.size == "tiny"

    @property
    def steps(self) -> int:
        return 6 if self.tiny else 12

    @property
    def rounds(self) -> int:
        return 4 if self.tiny else 30


# -- the model and data ---------------------------------------------------------------------------
def llama_config(size: str) -> Any:
    from transformers import LlamaConfig

    sizes, heads, _ = MODELS[size]
    return LlamaConfig(**sizes, **heads, max_position_embeddings=512, tie_word_embeddings=False)


def build(size: str, device: str = "meta") -> nn.Module:
    from transformers import LlamaForCausalLM

    with torch.device(device):
        return LlamaForCausalLM(llama_config(size))


def block_class() -> type[nn.Module]:
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer

    return LlamaDecoderLayer


def batch(setup: Setup, seed: int = 0, tp: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's batch: one per data-parallel rank (the ranks of a tp group feed the same)."""
    vocab = llama_config(setup.size).vocab_size
    shape = MODELS[setup.size][2]
    g = torch.Generator().manual_seed(seed + setup.rank // tp)
    ids = torch.randint(0, vocab, shape, generator=g)
    return ids.to(setup.device), ids.to(setup.device)


def loss_of(model: nn.Module, data: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    out = model(input_ids=data[0], labels=data[1])
    loss: torch.Tensor = out["loss"] if isinstance(out, dict) else out.loss
    return loss


def cfg(setup: Setup, **kw: Any) -> fprep.PrepConfig:
    base: dict[str, Any] = dict(seed=0, wrap=block_class(), device=setup.device)
    return fprep.PrepConfig(**{**base, **kw})


def run_steps(state: Any, model: nn.Module, opt: Any, data: Any, n: int) -> list[float]:
    """``n`` training steps through fprep's loop helpers; the loss of each."""
    losses = []
    for _ in range(n):
        loss = loss_of(model, data)
        fprep.backward(state, model, loss)
        fprep.optimizer_step(state, opt)
        opt.zero_grad(set_to_none=True)
        losses.append(float(loss))
    return losses


def train(setup: Setup, config: fprep.PrepConfig, steps: int | None = None) -> list[float]:
    """Prepare a meta model with ``config`` and train it; the losses of each step."""
    state, model = fprep.prepare(build(setup.size), config)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    return run_steps(state, model, opt, batch(setup, tp=config.tp), steps or setup.steps)


def falls(losses: list[float]) -> Row | None:
    if not all(map(lambda v: v == v and abs(v) < float("inf"), losses)):
        return Row("", "FAIL", f"non-finite loss {losses}")
    if not losses[-1] < losses[0]:
        return Row("", "FAIL", f"loss did not fall: {losses[0]:.4f} -> {losses[-1]:.4f}")
    return None


# -- the checks ------------------------------------------------------------------------------------
def check_precision(setup: Setup, precision: str) -> Row:
    losses = train(setup, cfg(setup, precision=precision))
    bad = falls(losses)
    return bad or Row("", "ok", f"loss {losses[0]:.3f} -> {losses[-1]:.3f}")


def check_compile(setup: Setup, mode: str) -> Row:
    if setup.device == "cpu" and setup.tiny and mode == "whole":
        # It passes (tests/test_activation_checkpointing.py), but inductor takes 2-3 minutes
        # over the whole bf16 model on a CPU: the smoke test would take minutes, not seconds.
        return Row("", "skip", "inductor takes minutes over the whole model on a CPU")
    from torch._dynamo.utils import counters

    eager = train(setup, cfg(setup, precision="bf16"), steps=2)
    torch._dynamo.reset()
    counters.clear()
    compiled = train(
        setup, cfg(setup, precision="bf16", compile=mode, activation_checkpointing=True)
    )
    graphs = counters["stats"]["unique_graphs"]
    breaks = sum(counters["graph_break"].values())
    bad = falls(compiled)
    diff = abs(compiled[0] - eager[0])
    if bad is None and diff > 0.05:
        bad = Row("", "FAIL", f"first loss {compiled[0]:.4f} vs eager {eager[0]:.4f}")
    if bad is None and (not graphs or counters["unimplemented"]):
        # dynamo gave up on a frame: it ran eagerly, uncompiled
        bad = Row("", "FAIL", f"not compiled: {', '.join(counters['unimplemented']) or 'no graph'}")
    if bad is None and (graphs != 1 or breaks):
        # One graph: every region reuses the first one's code (a graph per layer ends in
        # layers run eagerly past dynamo's recompile limit: a KV cache once did this,
        # fprep.apply.kv_cache); a graph break leaves code between the graphs eager.
        bad = Row("", "FAIL", f"{graphs} graph(s), {breaks} graph break(s); expected 1 and 0")
    return bad or Row(
        "",
        "ok",
        f"loss {compiled[0]:.3f} -> {compiled[-1]:.3f} (eager {eager[0]:.3f}); "
        f"{graphs} graph(s), {breaks} graph break(s)",
    )


def _sync(setup: Setup) -> None:
    if setup.device == "cuda":
        torch.cuda.synchronize()


def _timed(setup: Setup, fn: Callable[[], Any]) -> tuple[Any, float]:
    _sync(setup)
    start = time.perf_counter()
    out = fn()
    _sync(setup)
    return out, time.perf_counter() - start


def check_weights(setup: Setup) -> Row:
    """``weights=`` from a bf16 save_pretrained directory into fp32 parameters: bit-equal to
    ``from_pretrained``, and the time of each (the faster of two tries, page cache warm)."""
    from transformers import LlamaForCausalLM

    directory = setup.workdir / "pretrained"
    if setup.rank == 0 and not directory.exists():
        source = build(setup.size, "cpu").to(torch.bfloat16)
        source.save_pretrained(directory)
        del source
    if setup.world > 1:
        dist.barrier()
    # device_map needs Accelerate; without it, load on the CPU and move (said in the row)
    mapped = importlib.util.find_spec("accelerate") is not None
    fp_times, hf_times = [], []
    for _ in range(2):
        (fp_state, ours), t = _timed(
            setup, lambda: fprep.prepare(build(setup.size), cfg(setup, weights=str(directory)))
        )
        fp_times.append(t)
        theirs, t = _timed(
            setup,
            lambda: (
                LlamaForCausalLM.from_pretrained(
                    directory, dtype=torch.float32, device_map=setup.device
                )
                if mapped
                else LlamaForCausalLM.from_pretrained(directory, dtype=torch.float32).to(
                    setup.device
                )
            ),
        )
        hf_times.append(t)
    mine = dict(fprep.unwrap(fp_state, ours).named_parameters())
    for name, p in theirs.named_parameters():
        if name not in mine or not torch.equal(mine[name].detach().cpu(), p.detach().cpu()):
            return Row("", "FAIL", f"{name} differs from from_pretrained (or is missing)")
    fp, hf = min(fp_times), min(hf_times)
    how = f"device_map={setup.device!r}" if mapped else ".to() (no accelerate)"
    return Row(
        "",
        "ok",
        f"bit-equal; fprep {fp:.2f} s vs from_pretrained({how}) {hf:.2f} s ({fp / hf:.2f}x)",
    )


def _values(model: nn.Module, opt: torch.optim.Optimizer) -> dict[str, torch.Tensor]:
    """Host copies of this rank's parameters, buffers and optimizer state (local shards)."""

    def local(t: torch.Tensor) -> torch.Tensor:
        return (t.to_local() if hasattr(t, "to_local") else t).detach().cpu().clone()

    out = {f"model.{k}": local(v) for k, v in model.state_dict().items()}
    for i, per_param in opt.state_dict()["state"].items():
        out.update({f"opt.{i}.{k}": local(v) for k, v in per_param.items() if torch.is_tensor(v)})
    return out


def _first_difference(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> str | None:
    if got.keys() != want.keys():
        return f"keys differ: {sorted(got.keys() ^ want.keys())[:3]}"
    return next((k for k in want if not torch.equal(got[k], want[k])), None)


def check_checkpoints(setup: Setup, strategy: str = "none", tp: int = 1) -> Row:
    """Train 2 steps, save (sync), 1 step, save (wait=False) and train 2 more while it writes; a
    fresh model loaded from each save holds bit for bit the values of the call (parameters and
    AdamW state), and the first resumed step's loss is the original's exactly. (The later
    steps are compared to 1e-4 relative on a GPU: two identical runs there differ from their
    second step on — seen on an H100, torch 2.11: 1.7e-5 relative after one step, with flash or
    math attention — as the backward's kernels accumulate with atomics; on a CPU, exactly.)"""
    config = cfg(setup, precision="bf16", strategy=strategy, tp=tp)
    root = setup.workdir / f"ckpt-{strategy}-tp{tp}"
    data = batch(setup, tp=tp)

    def run(state: Any, model: nn.Module, opt: Any, n: int) -> list[float]:
        return run_steps(state, model, opt, data, n)

    state, model = fprep.prepare(build(setup.size), config)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    run(state, model, opt, 2)
    at_sync = _values(model, opt)
    fprep.save(root / "sync", state, model, optimizers=opt, step=2)
    run(state, model, opt, 1)
    at_async = _values(model, opt)
    handle = fprep.save(root / "async", state, model, optimizers=opt, step=3, wait=False)
    expected = run(state, model, opt, 2)  # overlaps the background write
    handle.wait()
    state2, model2 = fprep.prepare(build(setup.size), config)
    opt2 = torch.optim.AdamW(model2.parameters(), lr=1e-3)
    fprep.load(root / "async", state2, model2, optimizers=opt2)
    wrong = _first_difference(_values(model2, opt2), at_async)
    if wrong is not None:
        return Row("", "FAIL", f"wait=False save: {wrong} differs from its value at the call")
    resumed = run(state2, model2, opt2, 2)
    tol = 0.0 if setup.device == "cpu" else 1e-4
    pairs = list(zip(resumed, expected, strict=True))
    if resumed[0] != expected[0] or any(abs(r - e) > tol * abs(e) for r, e in pairs):
        return Row("", "FAIL", f"resume {resumed} != {expected}")
    fprep.load(root / "sync", state2, model2, optimizers=opt2)
    wrong = _first_difference(_values(model2, opt2), at_sync)
    if wrong is not None:
        return Row("", "FAIL", f"sync save: {wrong} differs from its value at the call")
    drift = max(abs(r - e) for r, e in pairs)
    return Row(
        "",
        "ok",
        f"sync + wait=False: every value bit-equal at load; first resumed loss exact, "
        f"then within {drift:.1e} ({resumed[-1]:.4f})",
    )


def check_async_stall(setup: Setup) -> Row:
    """How long ``save(wait=False)`` holds the training loop, against a synchronous save of the
    same state: on a GPU the copies to pinned host buffers are enqueued on a side stream, so the
    stall is the time to enqueue; "copy left" is how long the device still copied after the
    call returned (the time a synchronous device-to-host copy would have added to the stall).
    The first asynchronous save also allocates the pinned buffers; the later ones reuse them."""
    state, model = fprep.prepare(build(setup.size), cfg(setup, precision="bf16"))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    data = batch(setup)
    run_steps(state, model, opt, data, 1)  # optimizer state exists
    from checkpoint import tensor_bytes  # benchmarks/checkpoint.py

    root = setup.workdir / "stall"
    nbytes = tensor_bytes(model, opt)
    _, sync_s = _timed(setup, lambda: fprep.save(root / "sync", state, model, optimizers=opt))
    stalls, left = [], []
    for i in range(4):
        run_steps(state, model, opt, data, 1)
        _sync(setup)
        start = time.perf_counter()
        handle = fprep.save(root / f"async{i}", state, model, optimizers=opt, wait=False)
        returned = time.perf_counter()
        stalls.append(returned - start)
        _sync(setup)  # the copies still running on the device
        left.append(time.perf_counter() - returned)
        handle.wait()
    later = statistics.median(stalls[1:])
    return Row(
        "",
        "ok",
        f"{nbytes / 1e9:.2f} GB; sync save {sync_s:.2f} s; wait=False stall {later * 1e3:.0f} ms "
        f"({later / sync_s:.3f}x; first {stalls[0] * 1e3:.0f} ms, allocating pinned buffers), "
        f"copy left after the call {statistics.median(left[1:]) * 1e3:.0f} ms",
    )


def _hand_bf16(setup: Setup) -> Callable[[], None]:
    model = build(setup.size, setup.device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    data = batch(setup)

    def step() -> None:
        with torch.autocast(setup.device, dtype=torch.bfloat16):
            loss = loss_of(model, data)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        _sync(setup)

    return step


def _fprep_loop(setup: Setup, config: fprep.PrepConfig, model: nn.Module | None = None) -> Any:
    state, prepared = fprep.prepare(model if model is not None else build(setup.size), config)
    opt = torch.optim.AdamW(prepared.parameters(), lr=1e-3)
    data = batch(setup)

    def step() -> None:
        fprep.backward(state, prepared, loss_of(prepared, data))
        fprep.optimizer_step(state, opt)
        opt.zero_grad(set_to_none=True)
        _sync(setup)

    return step


def _accelerate_loop(setup: Setup) -> Callable[[], None]:
    from accelerate import Accelerator

    accelerator = Accelerator(mixed_precision="bf16", cpu=setup.device == "cpu")
    model = build(setup.size, "cpu")
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model, opt = accelerator.prepare(model, opt)
    data = batch(setup)

    def step() -> None:
        accelerator.backward(loss_of(model, data))
        opt.step()
        opt.zero_grad(set_to_none=True)
        _sync(setup)

    return step


def _ratios(setup: Setup, loops: dict[str, Callable[[], None]], base: str) -> str:
    times = interleaved(loops, rounds=setup.rounds, warmup=2 if setup.tiny else 5)
    parts = [f"{base} {statistics.median(times[base]) * 1e3:.1f} ms"]
    for name in loops:
        if name != base:
            whole, lo, hi = ratio(times, name, base)
            parts.append(f"{name} {whole:.3f}x [{lo:.3f}-{hi:.3f}]")
    return "; ".join(parts)


def check_step_ratio(setup: Setup) -> Row:
    loops = {
        "torch": _hand_bf16(setup),
        "fprep": _fprep_loop(setup, cfg(setup, precision="bf16")),
        "fprep regional": _fprep_loop(setup, cfg(setup, precision="bf16", compile="regional")),
    }
    if importlib.util.find_spec("accelerate") is not None:
        loops["accelerate"] = _accelerate_loop(setup)
    return Row("", "ok", _ratios(setup, loops, "torch"))


def check_fp8(setup: Setup) -> Row:
    """fprep fp8 against torchao's own conversion of the same modules (regional compile both)."""
    if setup.device != "cuda" or importlib.util.find_spec("torchao") is None:
        return Row("", "skip", "needs CUDA and torchao")
    from torchao.float8 import convert_to_float8_training

    # the tiny model's layers are all below the size where float8 pays: convert them anyway
    small = {"fp8": {"skip_small": False}} if setup.tiny else {}
    fp8_cfg = cfg(setup, precision="fp8", compile="regional", **small)
    state = fprep.plan(build(setup.size), fp8_cfg, fprep.Topology.from_env()).unwrap()
    assert state.core is not None and state.core.precision.fp8_plan is not None
    planned = frozenset(state.core.precision.fp8_plan.modules)
    hand = build(setup.size)
    convert_to_float8_training(hand, module_filter_fn=lambda _m, fqn: fqn in planned)
    hand_cfg = cfg(setup, precision="bf16", compile="regional")
    loops = {
        "bf16": _fprep_loop(setup, hand_cfg),
        "torchao by hand": _fprep_loop(setup, hand_cfg, hand),
        "fprep fp8": _fprep_loop(setup, fp8_cfg),
    }
    kept = len(state.core.precision.fp8_plan.kept)
    return Row(
        "",
        "ok",
        f"{len(planned)} fp8 layers, {kept} kept; " + _ratios(setup, loops, "torchao by hand"),
    )


def check_strategy(setup: Setup, strategy: str) -> Row:
    extra: dict[str, Any] = {}
    if strategy == "hsdp":
        extra["hsdp_shard_size"] = setup.world // 2 if setup.world % 2 == 0 else setup.world
    losses = train(setup, cfg(setup, precision="bf16", strategy=strategy, **extra))
    every: list[Any] = [None] * setup.world
    dist.all_gather_object(every, losses[-1])
    bad = falls(losses)
    return bad or Row("", "ok", f"loss {losses[0]:.3f} -> {losses[-1]:.3f} on {setup.world} ranks")


def check_tensor_parallel(setup: Setup) -> Row:
    """tp 2 innermost, fsdp over the rest (none at 2 ranks): the losses fall, and the ranks of
    each tp group compute the same loss (they feed the same batch; the loss is replicated)."""
    if setup.world % TP:
        return Row("", "skip", f"tp {TP} needs an even number of ranks, not {setup.world}")
    strategy = "fsdp" if setup.world > TP else "none"
    losses = train(setup, cfg(setup, precision="bf16", strategy=strategy, tp=TP))
    every: list[Any] = [None] * setup.world
    dist.all_gather_object(every, losses)
    split = [r for r in range(setup.world) if every[r] != every[r - r % TP]]
    if split:
        return Row("", "FAIL", f"ranks {split} differ from their tp group's first rank")
    bad = falls(losses)
    layout = f"dp {setup.world // TP} x tp {TP}" if strategy == "fsdp" else f"tp {TP}"
    return bad or Row("", "ok", f"{layout}: loss {losses[0]:.3f} -> {losses[-1]:.3f}")


TP = 2  # every config's kv heads are divisible by 2
PRECISIONS = (("fp32", "no"), ("bf16", "bf16"), ("fp16", "fp16"))


def checks(setup: Setup) -> list[tuple[str, Callable[[], Row]]]:
    if setup.world > 1:
        out = [
            (f"train {s} bf16", lambda s=s: check_strategy(setup, s))
            for s in ("ddp", "fsdp", "hsdp")
        ]
        out.append(("checkpoint fsdp", lambda: check_checkpoints(setup, "fsdp")))
        out.append(("train tp bf16", lambda: check_tensor_parallel(setup)))
        if setup.world % TP == 0:
            layout = "fsdp" if setup.world > TP else "none"
            name = "checkpoint fsdp x tp" if layout == "fsdp" else "checkpoint tp"
            out.append((name, lambda: check_checkpoints(setup, layout, TP)))
        return out
    return [
        *((f"train {n}", lambda p=p: check_precision(setup, p)) for n, p in PRECISIONS),
        ("compile regional + AC", lambda: check_compile(setup, "regional")),
        ("compile whole + AC", lambda: check_compile(setup, "whole")),
        ("weights= (bf16 files)", lambda: check_weights(setup)),
        ("checkpoints", lambda: check_checkpoints(setup)),
        ("async save stall", lambda: check_async_stall(setup)),
        ("step vs torch / accelerate", lambda: check_step_ratio(setup)),
        ("fp8 vs torchao by hand", lambda: check_fp8(setup)),
    ]


def run_checks(setup: Setup, only: Sequence[str] = ()) -> list[Row]:
    rows = []
    for name, fn in checks(setup):
        if only and not any(o in name for o in only):
            continue
        start = time.perf_counter()
        try:
            row = fn()
        except Exception as e:  # a failed check is a row, the others still run
            traceback.print_exc()
            row = Row("", "FAIL", f"{type(e).__name__}: {str(e).splitlines()[0][:160]}")
        row.check = name
        row.detail += f"  ({time.perf_counter() - start:.1f} s)"
        rows.append(row)
        if setup.rank == 0:
            print(f"[{row.status:>4}] {name}: {row.detail}", flush=True)
    return rows


def table(rows: list[Row]) -> str:
    width = max(len(r.check) for r in rows)
    lines = [f"{'check':<{width}}  status  detail", f"{'-' * width}  ------  ------"]
    lines += [f"{r.check:<{width}}  {r.status:<6}  {r.detail}" for r in rows]
    return "\n".join(lines)


def environment(setup: Setup) -> str:
    parts = [f"torch {torch.__version__}", f"fprep {fprep.__version__}"]
    for name in ("transformers", "accelerate", "torchao"):
        if importlib.util.find_spec(name) is not None:
            parts.append(f"{name} {getattr(__import__(name), '__version__', '?')}")
    where = torch.cuda.get_device_name() if setup.device == "cuda" else "cpu"
    note = torch_features().support_note()
    return (
        f"{where}, {setup.world} process(es); " + ", ".join(parts) + (f"\n{note}" if note else "")
    )


@contextlib.contextmanager
def process_group(device: str) -> Iterator[tuple[int, int]]:
    """torchrun's process group (NCCL on CUDA), or none for one process."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world == 1:
        yield 0, 1
        return
    if device == "cuda":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    dist.init_process_group("nccl" if device == "cuda" else "gloo")
    try:
        yield dist.get_rank(), world
    finally:
        dist.destroy_process_group()


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--device", choices=("cuda", "cpu"), default=None, help="default: cuda if available"
    )
    parser.add_argument(
        "--tiny", action="store_true", help="a tiny model and few steps (a smoke test)"
    )
    parser.add_argument("--quick", action="store_true", help="the same as --tiny")
    parser.add_argument(
        "--size",
        choices=[k for k in MODELS if k != "tiny"],
        default="0.25b",
        help="the model (default 0.25b; 0.9b: issue 19's fp8 shape)",
    )
    parser.add_argument(
        "--only", nargs="*", default=(), help="run the checks whose names contain these"
    )
    args = parser.parse_args(argv)
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    if device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda, but torch sees no GPU (use --device cpu --tiny)")
    with process_group(device) as (rank, world), tempfile.TemporaryDirectory() as tmp:
        where = [tmp]
        if world > 1:  # rank 0's directory for every rank (torchrun on one machine)
            dist.broadcast_object_list(where, src=0)
        size = "tiny" if args.tiny or args.quick else args.size
        setup = Setup(device, size, world, rank, Path(where[0]))
        if rank == 0:
            print(environment(setup), flush=True)
        names = [name for name, _ in checks(setup)]
        if args.only and not any(o in name for name in names for o in args.only):
            parser.error(f"no check's name contains any of {args.only}; the checks: {names}")
        start = time.perf_counter()
        rows = run_checks(setup, args.only)
        if rank == 0:
            print(f"\nfprep GPU check — {time.perf_counter() - start:.0f} s\n{table(rows)}")
    return 1 if any(r.status == "FAIL" for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
