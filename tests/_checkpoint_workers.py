"""Rank functions for tests/test_checkpoint_distributed.py (and helpers the single-process tests
share). Module level throughout, so ``run_ranks`` can pickle them into spawned ranks.

One rank function per spawned group, each running many cases (spawning costs seconds on two
cores). Ranks return plain data: tensors as ``torch.save`` bytes (gathered full state on rank 0),
errors as strings; the tests assert in the parent process.

The model has everything resharding can trip over: rows that do not divide by 2, 3 or 4
(``head`` has 3, ``odd`` has 1), a persistent buffer, dropout (so RNG state matters), wrap units.
"""

from __future__ import annotations

import contextlib
import dataclasses
import io
import os
import random
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import fprep
from fprep.errors import CheckpointError

Params = dict[str, torch.Tensor]
SEED = 5
N_STEPS = 4  # steps before the save (mid-epoch: an epoch is 6 steps at 2 ranks)
M_STEPS = 5  # steps after it (crossing into the next epoch)


class Block(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.up = nn.Linear(d, 2 * d)
        self.drop = nn.Dropout(0.25)
        self.down = nn.Linear(2 * d, d)
        self.norm = nn.LayerNorm(d)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return self.norm(h + self.down(self.drop(F.gelu(self.up(h)))))


class Net(nn.Module):
    def __init__(self, vocab: int = 10, d: int = 8, classes: int = 3) -> None:
        super().__init__()
        self.emb = nn.Embedding(vocab, d)
        self.blocks = nn.ModuleList(Block(d) for _ in range(2))
        self.head = nn.Linear(d, classes)  # 3 rows: uneven at 2 and 4 ranks
        self.odd = nn.Parameter(torch.randn(1, d))  # fewer rows than ranks
        self.register_buffer("scale", torch.ones(classes))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.emb(x) + self.odd
        for block in self.blocks:
            h = block(h)
        out: torch.Tensor = self.head(h) * self.scale
        return out


def build(seed: int = SEED, **kw: Any) -> Net:
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return Net(**kw)


def dataset() -> TensorDataset:
    g = torch.Generator().manual_seed(11)
    x = torch.randint(0, 10, (48,), generator=g)
    y = torch.randint(0, 3, (48,), generator=g)
    return TensorDataset(x, y)


def objects(model: nn.Module) -> tuple[torch.optim.Optimizer, Any, DataLoader[Any]]:
    opt = torch.optim.AdamW(model.parameters(), lr=0.05, weight_decay=0.01)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=3, gamma=0.5)
    loader = DataLoader(dataset(), batch_size=4, shuffle=True)
    return opt, sched, loader


def config(strategy: str, **kw: Any) -> fprep.PrepConfig:
    return fprep.PrepConfig(strategy=strategy, wrap=Block, seed=0, **kw)  # type: ignore[arg-type]


def prepared(strategy: str, seed: int = SEED, **kw: Any) -> tuple[Any, ...]:
    """``(state, model, opt, sched, loader)`` for a fresh model."""
    model = build(seed)
    opt, sched, loader = objects(model)
    return fprep.prepare(model, config(strategy, **kw), opt, sched, loader)


def batches(loader: Any) -> Iterator[Any]:
    """The loader's batches. No RNG guard here: a prepared loader starts a pass without
    drawing from the global RNG, so a resumed run draws exactly what an uninterrupted one does."""
    yield from loader


class Trainer:
    """Steps through epochs; the loader's position survives between calls."""

    def __init__(self, state: Any, model: nn.Module, opt: Any, sched: Any, loader: Any) -> None:
        self.state, self.model, self.opt, self.sched, self.loader = state, model, opt, sched, loader
        self._it: Iterator[Any] | None = None

    def run(self, steps: int) -> None:
        done = 0
        while done < steps:
            if self._it is None:
                self._it = batches(self.loader)
            batch = next(self._it, None)
            if batch is None:
                self._it = None
                continue
            x, y = batch
            loss = F.cross_entropy(self.model(x), y)
            fprep.backward(self.state, self.model, loss)
            self.opt.step()
            self.opt.zero_grad(set_to_none=True)
            self.sched.step()
            done += 1


# -- data helpers --------------------------------------------------------------------------------
def dump(tensors: Any) -> bytes:
    buffer = io.BytesIO()
    torch.save(tensors, buffer)
    return buffer.getvalue()


def undump(data: bytes) -> Any:
    return torch.load(io.BytesIO(data), weights_only=True)


def full_state(model: nn.Module, opt: torch.optim.Optimizer | None = None) -> dict[str, Any]:
    """Full model (and optimizer) state by FQN, on CPU; gathered on every rank (collective)."""
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_model_state_dict,
        get_optimizer_state_dict,
    )

    options = StateDictOptions(full_state_dict=True)
    out: dict[str, Any] = {
        "model": {
            k: v.detach().cpu().clone()
            for k, v in get_model_state_dict(model, options=options).items()
        }
    }
    if opt is not None:
        osd = get_optimizer_state_dict(model, opt, options=options)
        out["optim"] = {
            fqn: {k: v.detach().cpu().clone() for k, v in entry.items()}
            for fqn, entry in osd["state"].items()
        }
        out["groups"] = [{k: v for k, v in g.items() if k != "params"} for g in osd["param_groups"]]
    return out


def local_state(model: nn.Module, opt: torch.optim.Optimizer) -> dict[str, torch.Tensor]:
    """This rank's shards of the model and optimizer state (no collective), for 'unchanged'."""
    out: dict[str, torch.Tensor] = {}
    for k, v in model.state_dict().items():
        out[f"m.{k}"] = (v.to_local() if hasattr(v, "to_local") else v).detach().clone()
    for i, st in enumerate(opt.state.values()):
        for k, v in st.items():
            t = v.to_local() if hasattr(v, "to_local") else v
            out[f"o.{i}.{k}"] = t.detach().clone()
    return out


def same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def rank() -> int:
    return int(os.environ.get("RANK", "0"))


def expect_error(fn: Any) -> str:
    try:
        fn()
    except CheckpointError as e:
        return f"CheckpointError: {e}"
    except Exception as e:  # the wrong kind of error is a failure the test reports
        return f"{type(e).__name__}: {e}"
    return "no error"


def manifest_data(directory: Path) -> Any:
    """The JSON data of a step directory's manifest (inside its seal, for a sealed one)."""
    import json

    data = json.loads((directory / "manifest.json").read_bytes())
    return data["manifest"] if "blake3" in data else data


def write_manifest_bytes(directory: Path, body: bytes) -> None:
    """What a forger who knows the format writes: ``body`` as the manifest, sealed when it is
    of the sealed version, and ``latest`` pointing at it again when it named this directory."""
    from fprep.checkpoint.format import manifest
    from fprep.checkpoint.format.files import digest_of
    from fprep.checkpoint.stores import layout

    sealed = b'"version":1' not in body and b'"version":2' not in body
    data = manifest.seal(body) if sealed else body
    (directory / "manifest.json").write_bytes(data)
    pointer = layout.read_latest(directory.parent) if directory.parent.is_dir() else None
    if pointer is not None and pointer[0] == directory.name:
        layout.write_latest(directory.parent, directory.name, digest_of(data))


def write_manifest_data(directory: Path, data: Any) -> None:
    """``data`` as the manifest (see ``write_manifest_bytes``)."""
    import json

    body = json.dumps(data, sort_keys=True, separators=(",", ":")).encode()
    write_manifest_bytes(directory, body)


def barrier() -> None:
    import torch.distributed as dist

    if dist.is_initialized():
        dist.barrier()


# -- groups --------------------------------------------------------------------------------------
def four_hsdp(root: str) -> dict[str, Any]:
    """4 ranks, hsdp (2 x 2): train 2 steps, save; return the full state at the save."""
    torch.set_num_threads(1)
    state, model, opt, sched, loader = prepared("hsdp", hsdp_shard_size=2)
    Trainer(state, model, opt, sched, loader).run(2)
    fprep.save(Path(root) / "hsdp", state, model, optimizers=(opt,), scheduler=sched, step=2)
    fprep.export_full(Path(root) / "hsdp.safetensors", state, model)
    full = full_state(model, opt)
    return {"full": dump(full) if rank() == 0 else b"", "strategy": state.core.strategy}


def two_first(root: str) -> dict[str, Any]:
    """2 ranks, fsdp: hsdp(4) -> fsdp(2); train N, save (sharded and full), M more; export."""
    torch.set_num_threads(1)
    out: dict[str, Any] = {}
    base = Path(root)
    # hsdp at 4 -> fsdp at 2, another seed: everything must come from the checkpoint
    state, model, opt, sched, _ = prepared("fsdp", seed=99)
    info = fprep.load(base / "hsdp", state, model, optimizers=(opt,), scheduler=sched)
    out["from_hsdp"] = dump(full_state(model, opt))
    out["from_hsdp_info"] = (info.step, info.world_size, info.strategy, info.rng_restored)
    out["from_hsdp_lr"] = sched.get_last_lr()

    state, model, opt, sched, loader = prepared("fsdp")
    trainer = Trainer(state, model, opt, sched, loader)
    trainer.run(N_STEPS)
    rng_before = torch.get_rng_state()
    fprep.save(
        base / "a",
        state,
        model,
        optimizers=(opt,),
        scheduler=sched,
        loader=loader,
        step=N_STEPS,
        extras={"rank_count": 2, "note": "mid-epoch"},
    )
    assert state.state_dict is not None
    full_plan = state.replace(state_dict=dataclasses.replace(state.state_dict, type="full"))
    fprep.save(base / "a_full", full_plan, model, optimizers=(opt,), step=N_STEPS)
    out["save_keeps_rng"] = torch.equal(rng_before, torch.get_rng_state())
    out["at_save"] = dump(full_state(model, opt))
    out["loader_at_save"] = loader.state_dict()
    trainer.run(M_STEPS)
    out["uninterrupted"] = dump(full_state(model)["model"])
    fprep.export_full(base / "export.safetensors", state, model)
    out["files_a"] = sorted(os.listdir(base / "a" / f"step-{N_STEPS:08d}"))
    out["files_a_full"] = sorted(os.listdir(base / "a_full" / f"step-{N_STEPS:08d}"))
    return {k: v for k, v in out.items() if rank() == 0 or not isinstance(v, bytes)}


def _damaged(src: Path, dst: Path, kind: str) -> Path:
    if rank() == 0:
        shutil.rmtree(dst, ignore_errors=True)
        shutil.copytree(src, dst)
        step_dir = next(p for p in dst.iterdir() if p.name.startswith("step-"))
        target = step_dir / "__1_0.distcp"
        data = bytearray(target.read_bytes())
        if kind == "truncated":
            data = data[: len(data) // 2]
        else:  # same size, one byte flipped: only the hash can tell
            data[len(data) // 2] ^= 0xFF
        target.write_bytes(bytes(data))
    barrier()
    return dst


def two_second(root: str) -> dict[str, Any]:
    """2 ranks, fsdp, a fresh process group: resume, 1 -> 2, fsdp -> ddp, damaged files."""
    torch.set_num_threads(1)
    out: dict[str, Any] = {}
    base = Path(root)
    state, model, opt, sched, loader = prepared("fsdp", seed=123)
    info = fprep.load(base / "a", state, model, optimizers=(opt,), scheduler=sched, loader=loader)
    out["resume_info"] = (info.step, info.extras, info.rng_restored, info.notes)
    out["loader_after_load"] = loader.state_dict()
    Trainer(state, model, opt, sched, loader).run(M_STEPS)
    out["resumed"] = dump(full_state(model)["model"])

    # 1 -> 2 (a single-process checkpoint into fsdp)
    state, model, opt, sched, _ = prepared("fsdp", seed=7)
    fprep.load(base / "one", state, model, optimizers=(opt,), scheduler=sched)
    out["from_one"] = dump(full_state(model, opt))

    # fsdp -> ddp at the same world size
    state, model, opt, sched, _ = prepared("ddp", seed=8)
    fprep.load(base / "a", state, model, optimizers=(opt,), scheduler=sched)
    out["ddp_from_fsdp"] = dump(full_state(model, opt))

    # damaged copies: every rank raises, nothing changes
    state, model, opt, sched, _ = prepared("fsdp", seed=9)
    Trainer(state, model, opt, sched, prepared("fsdp")[4]).run(1)
    before = local_state(model, opt)
    lr_before = sched.get_last_lr()
    for kind in ("truncated", "flipped"):
        path = _damaged(base / "a", base / f"damaged_{kind}", kind)
        out[f"error_{kind}"] = expect_error(
            lambda path=path: fprep.load(path, state, model, optimizers=(opt,), scheduler=sched)
        )
    out["unchanged"] = same(before, local_state(model, opt)) and lr_before == sched.get_last_lr()
    # a fresh optimizer stays fresh after a failed load (DCP would have created its state)
    state, model, opt, sched, _ = prepared("fsdp", seed=10)
    out["error_fresh"] = expect_error(
        lambda: fprep.load(base / "damaged_flipped", state, model, optimizers=(opt,))
    )
    out["fresh_still_fresh"] = len(opt.state) == 0
    out["progress"] = progress_text(base)
    return {k: v for k, v in out.items() if rank() == 0 or not isinstance(v, bytes)}


class Terminal(io.StringIO):
    """What a terminal looks like to ``fprep.progress.Progress``."""

    def isatty(self) -> bool:
        return True


def progress_text(base: Path) -> str:
    """What a load and a save draw on this rank's stderr when it is a terminal and every piece
    of work counts as slow."""
    from fprep.checkpoint.format import storage

    state, model, opt, _, _ = prepared("fsdp", seed=11)
    terminal, stderr, after_s = Terminal(), sys.stderr, storage.PROGRESS_AFTER_S
    sys.stderr, storage.PROGRESS_AFTER_S = terminal, 0.0
    try:
        fprep.load(base / "a", state, model, optimizers=(opt,))
        fprep.save(base / "progress", state, model, optimizers=(opt,))
    finally:
        sys.stderr, storage.PROGRESS_AFTER_S = stderr, after_s
    return terminal.getvalue()


def three(root: str) -> dict[str, Any]:
    """3 ranks, fsdp: the 2-rank checkpoints (sharded and full) resharded to 3."""
    torch.set_num_threads(1)
    out: dict[str, Any] = {}
    for name in ("a", "a_full"):
        state, model, opt, _, _ = prepared("fsdp", seed=42)
        info = fprep.load(Path(root) / name, state, model, optimizers=(opt,))
        out[name] = dump(full_state(model, opt))
        out[f"{name}_notes"] = info.notes
        if name == "a":  # two shards arrive at rank 0 per tensor: both receive buffers in use
            fprep.export_full(Path(root) / "three.safetensors", state, model)
    return {k: v for k, v in out.items() if rank() == 0 or not isinstance(v, bytes)}


# -- concurrent savers (tests/test_checkpoint_concurrency.py) -------------------------------------
def wide_model(value: float) -> tuple[Any, nn.Module]:
    """A prepared one-process model of 1 MiB whose every weight is ``value``."""
    model = nn.Sequential(nn.Linear(512, 512, bias=False))
    with torch.no_grad():
        model[0].weight.fill_(value)
    return fprep.prepare(model, fprep.PrepConfig())


def concurrent_saver(root: str, who: int, saves: int, keep_last: int | None) -> dict[str, Any]:
    """Save ``saves`` checkpoints into ``root`` (which another process saves into at the same
    time), retrying a save the root's lock refuses. Returns the published paths and refusals."""
    import time

    torch.set_num_threads(1)
    state, model = wide_model(float(who))
    published: list[str] = []
    refused: list[str] = []
    while len(published) < saves:
        step = 1000 * who + len(published)
        try:
            path = fprep.save(root, state, model, step=step, keep_last=keep_last, extras=step)
        except CheckpointError as e:
            if "in progress" not in str(e):
                raise
            refused.append(str(e))
            time.sleep(0.001)
            continue
        published.append(str(path))
    return {"published": published, "refused": refused}


# -- transactional loads at 2 ranks (tests/test_checkpoint_distributed.py) -----------------------
class RankPicky:
    """A loader-like object whose ``load_state_dict`` fails on rank 1 only (after every check of
    fprep's has passed): the ranks must still agree on the outcome."""

    def state_dict(self) -> dict[str, Any]:
        return {"position": 3}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if rank() == 1:
            raise ValueError("rank 1 does not like this position")


def two_transactional(root: str) -> dict[str, Any]:
    """2 ranks, fsdp: records that do not fit (one rank's RNG state, a hyperparameter) are
    refused on both ranks before anything changes; a failure on one rank while applying is
    raised on both."""
    torch.set_num_threads(1)
    base = Path(root)
    out: dict[str, Any] = {}
    state, model, opt, sched, loader = prepared("fsdp")
    Trainer(state, model, opt, sched, loader).run(1)
    saved = fprep.save(base / "t", state, model, optimizers=(opt,), scheduler=sched, step=1)
    saved_picky = fprep.save(base / "picky", state, model, loader=RankPicky(), step=1)

    def craft(edit: Any) -> None:
        if rank() == 0:
            data = manifest_data(saved)
            edit(data)
            write_manifest_data(saved, data)
        barrier()

    def zero_rank_1_torch_state(m: Any) -> None:  # right size, content torch refuses
        m["ranks"][1]["rng"]["torch"] = "00" * (len(m["ranks"][1]["rng"]["torch"]) // 2)

    def string_lr(m: Any) -> None:
        m["optimizers"][0]["state_dict"]["param_groups"][0]["lr"] = "abc"

    for name, edit in (("rng", zero_rank_1_torch_state), ("lr", string_lr)):
        craft(edit)
        state, model, opt, sched, _ = prepared("fsdp", seed=9)
        before, rng_before = local_state(model, opt), torch.get_rng_state()
        out[f"error_{name}"] = expect_error(
            lambda s=state, m=model, o=opt, c=sched: fprep.load(
                saved, s, m, optimizers=(o,), scheduler=c
            )
        )
        out[f"unchanged_{name}"] = same(before, local_state(model, opt)) and torch.equal(
            rng_before, torch.get_rng_state()
        )
    state, model, *_ = prepared("fsdp", seed=9)
    out["error_apply"] = expect_error(
        lambda: fprep.load(saved_picky, state, model, loader=RankPicky())
    )
    return out


SAVER_SETUP = "state, model = fprep.prepare(nn.Linear(256, 256), fprep.PrepConfig())"


def saver_script(save: str, setup: str = SAVER_SETUP) -> str:
    """A child for ``killed_save_rounds``: after ``setup`` it prints ``ready``, then forever
    fills every parameter with the step number, runs ``save`` (lines using ``root``, ``state``,
    ``model``, ``step``, ``rnd``) and prints the step. ``os.fsync`` sleeps a random moment first,
    spreading a save's phases out so that kills land in every one of them."""
    prologue = """\
import os, random, sys, time
import torch
from torch import nn
import fprep
import fprep.checkpoint.asynchronous.background  # imports DCP: not in the window
import fprep.checkpoint.reading
import fprep.checkpoint.writing

root, start, seed = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
rnd = random.Random(seed)
real_fsync = os.fsync

def slow_fsync(fd):
    time.sleep(rnd.random() * 0.01)
    real_fsync(fd)

os.fsync = slow_fsync
"""
    loop = """\
print("ready", flush=True)
step = start
while True:
    with torch.no_grad():
        for p in model.parameters():
            p.fill_(float(step))
"""
    end = """\
    print(step, flush=True)
    step += 1
"""
    indented = "".join(f"    {line}\n" for line in save.strip("\n").splitlines())
    return prologue + setup.strip("\n") + "\n" + loop + indented + end


def killed_save_rounds(root: Path, script: str, rounds: int, seed: int) -> list[int]:
    """Kill -9 a child saving in a loop (``script``: prints ``ready``, then each step it saved)
    at a random moment, ``rounds`` times; after each kill, the checkpoint ``load`` finds must
    be the newest completed save or the one in flight, complete. Returns the steps seen."""
    rnd = random.Random(seed)
    completed: list[int] = []
    for round_ in range(rounds):
        proc = subprocess.Popen(
            [sys.executable, "-c", script, str(root), str(100 * round_), str(round_)],
            stdout=subprocess.PIPE,
            text=True,
        )
        assert proc.stdout is not None
        assert proc.stdout.readline().strip() == "ready"
        completed.append(int(proc.stdout.readline()))  # saving is under way: kill at random
        time.sleep(rnd.uniform(0.0, 0.3))
        proc.send_signal(signal.SIGKILL)
        rest, _ = proc.communicate(timeout=30)
        completed += [int(line) for line in rest.split()]
        state, model = fprep.prepare(nn.Linear(256, 256), fprep.PrepConfig())
        info = fprep.load(root, state, model)
        # the newest completed save, or the one in flight if it got published
        assert info.step in (completed[-1], completed[-1] + 1)
        assert info.extras == {"step": info.step}
        for p in model.parameters():
            assert torch.equal(p, torch.full_like(p, float(info.step)))
        completed.append(info.step)
    return completed


# -- one failed load, one error on every rank -----------------------------------------------------
def _wait_for(event: Path, limit_s: float = 120.0) -> None:
    """Return once ``event`` exists (another rank made it); a generous bound, never a guess."""
    deadline = time.monotonic() + limit_s
    while not event.exists():
        if time.monotonic() > deadline:
            raise TimeoutError(f"{event} did not appear within {limit_s:g} s")
        time.sleep(0.01)


@contextlib.contextmanager
def _in_rank_order(cls: Any, method: str, name: str, after_rank_0: Any, event: Path) -> Any:
    """Patch ``cls.method`` (whose first argument after ``self`` is a file path or name) for the
    file ``name``: rank 0 runs it first and then calls ``after_rank_0()`` and makes ``event``;
    rank 1 runs it only once ``event`` exists. So the ranks see the file in a fixed order,
    whatever the schedule."""
    original = getattr(cls, method)

    def patched(self: Any, where: Any, *args: Any, **kwargs: Any) -> Any:
        if Path(str(where)).name != name:
            return original(self, where, *args, **kwargs)
        if rank() == 0:
            try:
                return original(self, where, *args, **kwargs)
            finally:
                after_rank_0()
                event.touch()
        _wait_for(event)
        return original(self, where, *args, **kwargs)

    setattr(cls, method, patched)
    try:
        yield
    finally:
        setattr(cls, method, original)


def _flip(path: Path, at: float) -> None:
    """Replace ``path`` by a copy with the byte at fraction ``at`` of its length flipped (a new
    file renamed over it, as a copy tool writes one)."""
    data = bytearray(path.read_bytes())
    data[int(len(data) * at)] ^= 0xFF
    tmp = path.with_name(path.name + ".new")
    tmp.write_bytes(bytes(data))
    os.replace(tmp, path)


def two_same_error(root: str) -> dict[str, Any]:
    """2 ranks, fsdp: loads that fail over one file, each rank's error as text. Faults both
    ranks see alike (a flipped byte in the shard file both read; a missing file) and files
    swapped under the load between the ranks' looks (rank 0 sees the file damaged one way,
    rank 1 another)."""
    from fprep.checkpoint.stores.backend import LocalStep

    torch.set_num_threads(1)
    base = Path(root)
    state, model, opt, sched, loader = prepared("fsdp")
    Trainer(state, model, opt, sched, loader).run(1)
    sharded = fprep.save(base / "sharded", state, model, optimizers=(opt,), step=1)
    assert state.state_dict is not None
    full_plan = state.replace(state_dict=dataclasses.replace(state.state_dict, type="full"))
    full = fprep.save(base / "full", full_plan, model, optimizers=(opt,), step=1)  # one file,
    # __0_0.distcp, that both ranks read

    def copy_of(saved: Any, case: str) -> Path:
        """A copy of the checkpoint ``saved`` (a step directory) for ``case``: its step dir."""
        dst = base / case
        if rank() == 0:
            shutil.copytree(Path(saved).parent, dst)
        barrier()
        return dst / Path(saved).name

    def load(step: Path) -> str:
        return expect_error(lambda: fprep.load(step, state, model, optimizers=(opt,)))

    before = local_state(model, opt)
    out: dict[str, Any] = {}
    step = copy_of(full, "flipped")
    if rank() == 0:
        _flip(step / "__0_0.distcp", 0.5)
    barrier()
    out["flipped"] = load(step)

    step = copy_of(sharded, "missing")
    if rank() == 0:
        (step / "__1_0.distcp").unlink()
    barrier()
    out["missing"] = load(step)

    step = copy_of(full, "swapped")  # rank 0 reads one damaged metadata.json, rank 1 another
    if rank() == 0:
        _flip(step / "metadata.json", 0.25)
    barrier()
    with _in_rank_order(
        LocalStep,
        "read_verified",
        "metadata.json",
        lambda: _flip(step / "metadata.json", 0.75),
        base / "swapped.done",
    ):
        out["swapped"] = load(step)

    step = copy_of(sharded, "removed")  # rank 0 finds the file truncated, rank 1 finds it gone
    if rank() == 0:
        shard = step / "__1_0.distcp"
        shard.write_bytes(shard.read_bytes()[:-8])
    barrier()
    with _in_rank_order(
        LocalStep,
        "check_size",
        "__1_0.distcp",
        lambda: (step / "__1_0.distcp").unlink(),
        base / "removed.done",
    ):
        out["removed"] = load(step)
    out["unchanged"] = same(before, local_state(model, opt))
    return out
