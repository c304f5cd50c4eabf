"""``fprep demo``: prepare a small GPT and train it on synthetic data, end to end.

The model (``DEMO_MODEL``: 4 blocks, width 128, about 0.8M parameters) is built on the meta
device and materialized by ``fprep.prepare`` with a GPT-2-style ``param_init_fn`` seeded per
module, so its initial weights depend only on ``--seed`` — not on the number of processes. The
optimizer (AdamW) is created after ``prepare``, as with FSDP it must see the sharded parameters;
``fprep.backward`` does the backward pass (fp16 loss scaling, fast_ddp's all-reduce).

One process on the CPU by default. ``--nproc N`` relaunches the command through
``torch.distributed.run`` with N ranks: each rank trains on its slice of the global batch and only
rank 0 prints. The printed loss is the global batch's mean over all ranks, so for the same seed
the curves of 1, 2 or 4 ranks agree up to float rounding.
"""

from __future__ import annotations

import argparse
import io
import math
import os
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TextIO, get_args

import torch
import torch.distributed as dist
from torch import nn

from fprep.apply.steps import handles_of
from fprep.cli_run import run_command
from fprep.config import Precision, PrepConfig, Strategy
from fprep.errors import ConfigError
from fprep.loop import optimizer_step
from fprep.prepare import backward, prepare
from fprep.state import PrepState
from fprep.summary import human_count
from fprep.testing.models import GPTBlock, GPTConfig, lm_loss, synthetic_batches, tiny_gpt

#: The demo's model: big enough that the loss curve means something, small enough to train for
#: 200 steps in about 10-30 s on two CPU cores.
DEMO_MODEL = GPTConfig(vocab_size=64, block_size=64, n_layer=4, n_head=4, n_embd=128)

#: The loss "fell" when the mean of the last steps is at least this much below the first step's
#: (relative): batch-to-batch noise without learning (learning rate 0) stays well below it.
MIN_DROP = 0.05

DESCRIPTION = (
    "Prepare a small GPT with fprep and train it on synthetic data, on the CPU: one process, or "
    "N ranks with --nproc N. Exit status 0 when the loss fell by at least "
    f"{MIN_DROP:.0%}, 1 when it did not, 2 for a bad option."
)

__all__ = [
    "DEMO_MODEL",
    "DESCRIPTION",
    "MIN_DROP",
    "DemoResult",
    "add_arguments",
    "gpt_init",
    "run_demo",
    "run_from_args",
]


def gpt_init(module: nn.Module) -> None:
    """GPT-2's initialization for one module's own parameters: N(0, 0.02) weights, zero biases.

    (PyTorch's default N(0, 1) embedding, tied to the output projection, starts the loss near 80
    instead of ln(vocab).)
    """
    if isinstance(module, nn.Linear | nn.Embedding):
        nn.init.normal_(module.weight, mean=0.0, std=0.02)
        bias = getattr(module, "bias", None)
        if isinstance(bias, torch.Tensor):
            nn.init.zeros_(bias)
    else:
        reset = getattr(module, "reset_parameters", None)
        if callable(reset):
            reset()


@dataclass(frozen=True)
class DemoResult:
    """What a demo run did: the global loss after every step, the plan, and the time spent."""

    losses: tuple[float, ...]
    state: PrepState
    seconds: float

    @property
    def window(self) -> int:
        """Steps averaged at the end of the curve: a tenth of the run, at least one."""
        return max(1, len(self.losses) // 10)

    @property
    def first(self) -> float:
        """The loss of the first step (before any update)."""
        return self.losses[0] if self.losses else math.nan

    @property
    def last(self) -> float:
        """The mean loss of the last ``window`` steps."""
        return math.fsum(self.losses[-self.window :]) / self.window

    @property
    def drop(self) -> float:
        """How much the loss fell, relative to the first step (negative: it rose)."""
        return (self.first - self.last) / self.first if self.first else math.nan

    @property
    def fell(self) -> bool:
        """The loss fell by at least ``MIN_DROP``: learning, not noise."""
        return bool(self.losses) and math.isfinite(self.last) and self.drop >= MIN_DROP


def _bar(step: int, total: int, width: int = 24) -> str:
    filled = round(width * step / total) if total else width
    return "[" + "#" * filled + "." * (width - filled) + "]"


class _Progress:
    """A dependency-free progress bar: a permanent line every ``every`` steps (and the last); on
    a terminal the current line is also redrawn after every step. The time per step is that of
    the steps since the previous permanent line (so compilation shows up once, then goes)."""

    def __init__(self, out: TextIO, total: int) -> None:
        self.out = out
        self.total = total
        self.every = max(1, total // 10)
        self.live = bool(getattr(out, "isatty", lambda: False)())
        self.width = len(str(total))
        self.mark = (0, 0.0)  # (step, seconds) at the previous permanent line

    def update(self, step: int, loss: float, seconds: float) -> None:
        done, since = self.mark
        per_step = (seconds - since) / max(1, step - done)
        line = (
            f"{_bar(step, self.total)} step {step:>{self.width}}/{self.total}  "
            f"loss {loss:7.4f}  {per_step * 1e3:6.1f} ms/step"
        )
        if step % self.every == 0 or step == self.total:
            self.out.write(("\r" if self.live else "") + line + "\n")
            self.mark = (step, seconds)
        elif self.live:
            self.out.write("\r" + line)
        self.out.flush()


def _world() -> tuple[int, int]:
    """(rank, world size) from the launcher's environment (torchrun) or a live process group."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))


def demo_config(
    *,
    strategy: str = "auto",
    precision: str = "no",
    seed: int = 0,
    compile: str = "none",
) -> PrepConfig:
    """The ``PrepConfig`` the demo prepares with (validated: a bad value is a ``ConfigError``)."""
    return PrepConfig(
        strategy=strategy,  # type: ignore[arg-type]  # validated by PrepConfig
        precision=precision,  # type: ignore[arg-type]
        compile=compile,  # type: ignore[arg-type]
        wrap=GPTBlock,
        param_init_fn=gpt_init,
        seed=seed,
    )


def _check_batch(batch_size: int, world: int) -> None:
    if batch_size < 1 or batch_size % world:
        raise ConfigError(
            f"--batch-size {batch_size} cannot be split evenly over {world} ranks.",
            subject="batch_size",
            hint=f"Use a positive multiple of {world}.",
        )


def run_demo(
    *,
    steps: int = 200,
    strategy: str = "auto",
    precision: str = "no",
    batch_size: int = 16,
    seed: int = 0,
    compile: str = "none",
    lr: float = 3e-3,
    threads: int | None = None,
    model_config: GPTConfig = DEMO_MODEL,
    out: TextIO | None = None,
) -> DemoResult:
    """Prepare ``model_config`` with fprep and train it for ``steps`` steps; return the losses.

    ``batch_size`` is the global batch: under a launcher each of the N ranks trains on its
    ``batch_size / N`` rows. ``out`` receives the plan summary, the progress bar and the final
    line (rank 0 only; ``sys.stdout`` by default). ``threads`` sets torch's intra-op threads for
    the run (restored afterwards; None leaves them). Deterministic for a given ``seed`` (and
    number of threads).
    """
    previous_threads = torch.get_num_threads()
    if threads is not None:
        if threads < 1:
            raise ConfigError(f"--threads must be >= 1; got {threads}.", subject="threads")
        torch.set_num_threads(threads)
    try:
        return _run(steps, strategy, precision, batch_size, seed, compile, lr, model_config, out)
    finally:
        torch.set_num_threads(previous_threads)


def _run(
    steps: int,
    strategy: str,
    precision: str,
    batch_size: int,
    seed: int,
    compile: str,
    lr: float,
    model_config: GPTConfig,
    out: TextIO | None,
) -> DemoResult:
    if steps < 1:
        raise ConfigError(f"--steps must be >= 1; got {steps}.", subject="steps")
    rank, world = _world()
    _check_batch(batch_size, world)
    cfg = demo_config(strategy=strategy, precision=precision, seed=seed, compile=compile)
    printer: TextIO = (out or sys.stdout) if rank == 0 else io.StringIO()
    torch.manual_seed(seed)

    model = tiny_gpt(model_config, device="meta")  # no memory until prepare materializes it
    state, prepared = prepare(model, cfg)
    handles = handles_of(state)
    optimizer = torch.optim.AdamW(prepared.parameters(), lr=lr, weight_decay=0.0)

    local = batch_size // world
    print(
        f"fprep demo: GPT with {human_count(model_config.num_params)} parameters, {steps} steps "
        f"of {batch_size} x {model_config.block_size} tokens ({local} per rank x {world}), "
        f"seed {seed}",
        file=printer,
    )
    print(state.summary(), file=printer)
    progress = _Progress(printer, steps)
    batches = synthetic_batches(
        steps,
        batch_size=batch_size,
        seq_len=model_config.block_size,
        vocab_size=model_config.vocab_size,
        seed=seed,
    )
    losses: list[float] = []
    start = time.perf_counter()
    try:
        for i, (inputs, targets) in enumerate(batches, start=1):
            rows = slice(rank * local, (rank + 1) * local)
            x, y = inputs[rows].to(handles.device), targets[rows].to(handles.device)
            loss = lm_loss(prepared(x), y)
            backward(state, prepared, loss)  # fp16 loss scaling, fast_ddp's all-reduce
            optimizer_step(state, optimizer)  # through the fp16 grad scaler when there is one
            optimizer.zero_grad(set_to_none=True)
            logged = loss.detach().float()
            if world > 1:
                logged = logged / world
                dist.all_reduce(logged)
            losses.append(float(logged))
            progress.update(i, losses[-1], time.perf_counter() - start)
    finally:
        if handles.owns_process_group and dist.is_initialized():
            dist.destroy_process_group()
    result = DemoResult(tuple(losses), state, time.perf_counter() - start)
    change = -result.drop * 100 if result.first else 0.0
    what = "fell" if result.fell else f"did NOT fall (by less than {MIN_DROP:.0%})"
    k = result.window
    last = f"mean of the last {k} steps" if k > 1 else f"step {steps}"
    print(
        f"loss {what}: {result.first:.4f} (step 1) -> {result.last:.4f} ({last}), "
        f"{change:+.1f}% in {steps} steps, {result.seconds:.1f} s",
        file=printer,
    )
    printer.flush()
    return result


# -- command line -----------------------------------------------------------------------------
def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--steps", type=int, default=200, help="training steps (default 200)")
    parser.add_argument(
        "--strategy",
        default="auto",
        help=f"one of {', '.join(get_args(Strategy))} (default auto: none for one process, ddp "
        "for several)",
    )
    parser.add_argument(
        "--precision",
        default="no",
        help=f"one of {', '.join(get_args(Precision))} (default no; fp16 is slow on a CPU)",
    )
    parser.add_argument(
        "--batch-size", type=int, default=16, help="global batch, split over the ranks"
    )
    parser.add_argument(
        "--seed", type=int, default=0, help="seed of the weights and the data (default 0)"
    )
    parser.add_argument(
        "--lr", type=float, default=3e-3, help="AdamW learning rate (default 0.003)"
    )
    parser.add_argument(
        "--threads",
        type=int,
        default=1,
        help="torch intra-op threads per rank (default 1: the demo's matrices are small, and "
        "one thread stays fast on a busy machine)",
    )
    parser.add_argument(
        "--nproc",
        type=int,
        default=1,
        help="ranks to launch on this machine through torch.distributed.run (gloo on CPU)",
    )
    parser.add_argument(
        "--compile",
        nargs="?",
        const="regional",
        default="none",
        metavar="{regional,whole}",
        help="torch.compile the blocks (regional, the default) or the whole model",
    )


def _child_argv(args: argparse.Namespace) -> list[str]:
    argv = [
        "demo",
        f"--steps={args.steps}",
        f"--strategy={args.strategy}",
        f"--precision={args.precision}",
        f"--batch-size={args.batch_size}",
        f"--seed={args.seed}",
        f"--lr={args.lr!r}",
        f"--threads={args.threads}",
    ]
    if args.compile != "none":
        argv.append(f"--compile={args.compile}")
    return argv


def _launch(args: argparse.Namespace) -> int:
    """Run the demo on ``args.nproc`` local ranks under ``torch.distributed.run``.

    Rank 0's output streams through; the launcher's and the ranks' stderr is kept back and, if a
    rank fails, boiled down to one line.
    """
    nproc: int = args.nproc
    env = dict(os.environ)
    env["OMP_NUM_THREADS"] = str(args.threads)
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc-per-node={nproc}",
        "-m",
        "fprep.cli",
        *_child_argv(args),
    ]
    proc = subprocess.run(cmd, env=env, stderr=subprocess.PIPE, text=True, check=False)
    if proc.returncode == 0:
        return 0
    lines = [line.strip() for line in proc.stderr.splitlines() if line.strip()]
    ours = [line for line in lines if line.startswith("fprep: error:")]
    if ours:
        print(ours[0], file=sys.stderr)
        return 2
    failures = [line for line in lines if "Error" in line and not line.startswith(("File", "["))]
    detail = failures[-1] if failures else (lines[-1] if lines else "no output")
    print(
        f"fprep: error: the demo's {nproc} ranks exited with status {proc.returncode}: {detail}",
        file=sys.stderr,
    )
    return proc.returncode if proc.returncode in (1, 2) else 2


def run_from_args(args: argparse.Namespace) -> int:
    """``fprep demo``: 0 when the loss fell (by ``MIN_DROP``), 1 when it did not, 2 for a usage
    error."""
    if args.nproc < 1:
        raise ConfigError(f"--nproc must be >= 1; got {args.nproc}.", subject="nproc")
    if args.nproc > 1 and "WORLD_SIZE" not in os.environ:
        # Validate here, so a bad option fails as one line before any rank starts.
        demo_config(strategy=args.strategy, precision=args.precision, compile=args.compile)
        _check_batch(args.batch_size, args.nproc)
        if args.steps < 1:
            raise ConfigError(f"--steps must be >= 1; got {args.steps}.", subject="steps")
        return _launch(args)
    result = run_demo(
        steps=args.steps,
        strategy=args.strategy,
        precision=args.precision,
        batch_size=args.batch_size,
        seed=args.seed,
        compile=args.compile,
        lr=args.lr,
        threads=args.threads,
    )
    return 0 if result.fell else 1


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m fprep.demo``: the same as ``fprep demo``."""
    parser = argparse.ArgumentParser(prog="python -m fprep.demo", description=DESCRIPTION)
    add_arguments(parser)
    return run_command(run_from_args, parser.parse_args(argv))


if __name__ == "__main__":
    raise SystemExit(main())
