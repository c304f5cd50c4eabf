"""``fprep.save(..., wait=False)``: staged in the foreground, published in the background.

* the checkpoint holds the values at the call, though training changes them at once (one
  process here; 2 ranks with fsdp and ddp below), non-tensor state included;
* every tensor is copied before ``save`` returns, into staging buffers allocated once and
  reused by the next saves: no change after the call reaches the checkpoint, whatever makes it
  (each in-place change of issue 18, ``.data``, kernels of another thread overlapping the
  write), and no optimizer step waits for the background;
* a rank killed during a background save is a ``CollectiveError`` on the survivor, naming it;
* at most one save in flight: the next save and ``load`` wait for it; a failure reaches
  ``wait``, or the next save when nobody waited, and the previous checkpoint stays loadable;
* the process's exit waits for a save in flight (and reports its failure);
* a process killed with SIGKILL at random moments of background saves leaves the previous
  checkpoint loadable and the new one absent or complete.
"""

from __future__ import annotations

import copy
import re
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import _async_workers as A
import _checkpoint_workers as W
import pytest
import torch
import torch.distributed as dist
from torch import nn

import fprep
from fprep.checkpoint import SaveHandle
from fprep.checkpoint.asynchronous import staging
from fprep.checkpoint.format import files
from fprep.checkpoint.format.storage import SafeWriter
from fprep.errors import CheckpointError
from fprep.testing.distributed import run_ranks


def trained(steps: int = 3) -> tuple[Any, ...]:
    state, model, opt, sched, loader = W.prepared("none")
    W.Trainer(state, model, opt, sched, loader).run(steps)
    return state, model, opt, sched, loader


def test_the_checkpoint_holds_the_values_at_the_call(tmp_path: Path) -> None:
    state, model, opt, sched, loader = trained()
    want = copy.deepcopy((model.state_dict(), opt.state_dict(), sched.state_dict()))
    extras = {"losses": [0.5, 0.25]}
    rng_at_call = torch.get_rng_state()
    handle = fprep.save(
        tmp_path,
        state,
        model,
        optimizers=(opt,),
        scheduler=sched,
        loader=loader,
        step=3,
        extras=extras,
        wait=False,
    )
    assert isinstance(handle, SaveHandle)
    W.Trainer(state, model, opt, sched, loader).run(2)  # everything changes at once
    extras["losses"].append(0.125)
    assert not torch.equal(model.odd, want[0]["odd"])
    path = handle.wait()
    assert handle.done() and path == tmp_path / "step-00000003"
    s2, m2, o2, sc2, l2 = W.prepared("none", seed=8)
    info = fprep.load(tmp_path, s2, m2, optimizers=(o2,), scheduler=sc2, loader=l2)
    assert info.step == 3 and info.extras == {"losses": [0.5, 0.25]}
    assert all(torch.equal(v, want[0][k]) for k, v in m2.state_dict().items())
    osd = o2.state_dict()
    for i, entry in want[1]["state"].items():
        assert all(torch.equal(osd["state"][i][k], v) for k, v in entry.items())
    assert sc2.state_dict() == want[2]
    assert l2.state_dict() == {"epoch": 0, "batches": 3}
    assert torch.equal(torch.get_rng_state(), rng_at_call)  # restored: the RNG at the call


@pytest.fixture
def held_writer() -> Iterator[threading.Event]:
    """An asynchronous save's write starts only once the returned event is set (tests set it)."""
    with A.held_writer() as gate:
        yield gate


def loads_model(path: Path, want: dict[str, torch.Tensor]) -> bool:
    """The checkpoint at ``path`` loads into a fresh model as exactly ``want``."""
    s2, m2, *_ = W.prepared("none", seed=5)
    fprep.load(path, s2, m2)
    return all(torch.equal(v, want[k]) for k, v in m2.state_dict().items())


def _state_bytes(model: nn.Module, opt: torch.optim.Optimizer) -> int:
    """Bytes of the model's state dict and the optimizer's state tensors."""
    size = sum(v.numel() * v.element_size() for s in opt.state.values() for v in s.values())
    return size + sum(t.numel() * t.element_size() for t in model.state_dict().values())


def test_staging_buffers_are_allocated_once(tmp_path: Path, held_writer: threading.Event) -> None:
    state, model, opt, sched, loader = trained()
    handle = fprep.save(tmp_path, state, model, optimizers=(opt,), step=1, wait=False)
    W.Trainer(state, model, opt, sched, loader).run(1)
    held_writer.set()
    handle.wait()
    stager = staging.stager_for(model)
    first = {k: b.data_ptr() for k, b in stager.buffers.items()}
    # one more copy of this rank's model and optimizer state, all of it, every save
    assert stager.nbytes == _state_bytes(model, opt)
    for step in (2, 3):
        handle = fprep.save(tmp_path, state, model, optimizers=(opt,), step=step, wait=False)
        W.Trainer(state, model, opt, sched, loader).run(1)
        handle.wait()
        assert {k: b.data_ptr() for k, b in stager.buffers.items()} == first
    staging.release(model)
    assert staging.stager_for(model).nbytes == 0


# Before issue 18 the parameters and state of the optimizers passed to ``save`` were read live in
# the background, a change by anything but their ``step()`` failed the save (version counters)
# unless ``handle.stage()`` came first, and the step waited for the tensor being written. Now
# every tensor is copied before ``save`` returns: any change afterwards, by any means, is
# simply not in the checkpoint, and no step ever waits for the background.
@pytest.mark.parametrize("mutation", list(A.MUTATIONS))
def test_no_change_after_the_call_reaches_the_checkpoint(
    tmp_path: Path, held_writer: threading.Event, mutation: str
) -> None:
    state, model, opt, *_ = trained()
    fprep.save(tmp_path, state, model, optimizers=(opt,), step=1)
    want = copy.deepcopy((model.state_dict(), opt.state_dict()))
    handle = fprep.save(tmp_path, state, model, optimizers=(opt,), step=2, wait=False)
    with torch.no_grad():
        A.MUTATIONS[mutation](model, opt)  # before the background has read a single byte
    changed = copy.deepcopy((model.state_dict(), opt.state_dict()))
    assert not all(torch.equal(v, want[0][k]) for k, v in changed[0].items()) or any(
        not torch.equal(v, want[1]["state"][i][k])
        for i, entry in changed[1]["state"].items()
        for k, v in entry.items()
    )
    held_writer.set()
    path = handle.wait()
    assert path.name == "step-00000002"
    s2, m2, o2, *_ = W.prepared("none", seed=5)
    fprep.load(tmp_path, s2, m2, optimizers=(o2,))
    assert all(torch.equal(v, want[0][k]) for k, v in m2.state_dict().items())
    for i, entry in want[1]["state"].items():
        assert all(torch.equal(o2.state_dict()["state"][i][k], v) for k, v in entry.items())


def test_an_optimizer_step_never_waits_for_the_background(
    tmp_path: Path, held_writer: threading.Event
) -> None:
    """The writer is held until after the step: a step that waited for it would hang here."""
    state, model, opt, sched, loader = trained()
    want = copy.deepcopy(model.state_dict())
    handle = fprep.save(tmp_path, state, model, optimizers=(opt,), step=1, wait=False)
    W.Trainer(state, model, opt, sched, loader).run(2)
    assert not handle.done()  # still held: the steps ran while nothing was written
    held_writer.set()
    assert loads_model(handle.wait(), want)


def test_overlapping_in_place_kernels_never_reach_a_published_step(tmp_path: Path) -> None:
    """Issue 18's race, at one rank: 4 parameters multiplied in place by another thread for as
    long as each save runs (its write held until the thread's second round), 8 saves: every
    published step loads to exactly the values at its call, and ``latest`` names the last."""

    def fresh() -> tuple[Any, ...]:
        torch.manual_seed(0)
        model = nn.Sequential(*(nn.Linear(256, 256, bias=False) for _ in range(4)))
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        return fprep.prepare(model, fprep.PrepConfig(), opt)

    state, model, opt = fresh()
    model(torch.randn(2, 256)).sum().backward()
    opt.step()
    result = A.overlapping_kernels(tmp_path, fresh, state, model, opt, saves=8)
    assert result["equal"] == [True] * 8
    assert all(r >= 2 for r in result["rounds"])  # the kernels did run during every save
    assert result["latest"] == 107


def test_the_next_save_and_load_wait_for_the_one_in_flight(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    state, model, *_ = trained(1)
    real = SafeWriter.finish
    gate = threading.Event()

    def held_finish(self: SafeWriter, *args: Any, **kwargs: Any) -> None:
        gate.wait(timeout=60)  # the first save stays in flight until the test lets it go
        real(self, *args, **kwargs)

    monkeypatch.setattr(SafeWriter, "finish", held_finish)
    first = fprep.save(tmp_path, state, model, step=1, wait=False)
    assert not first.done()
    threading.Timer(0.3, gate.set).start()  # while the second save is called
    second = fprep.save(tmp_path, state, model, step=2, wait=False)
    assert first.done()  # the second started only after the first was published
    s2, m2, *_ = W.prepared("none", seed=2)
    assert fprep.load(tmp_path, s2, m2).step == 2 and second.done()
    assert first.wait().name == "step-00000001"


def _fail(*args: Any, **kwargs: Any) -> Any:
    raise OSError(28, "injected failure")


@pytest.mark.parametrize(
    "target",
    [(SafeWriter, "finish"), (files, "write_durable")],
    ids=["writing metadata", "writing the manifest"],
)
def test_a_background_failure_is_never_lost(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, target: tuple[Any, str]
) -> None:
    state, model, *_ = trained(1)
    fprep.save(tmp_path, state, model, step=1)
    with monkeypatch.context() as m:
        m.setattr(*target, _fail)
        failed = fprep.save(tmp_path, state, model, step=2, wait=False)
        with pytest.raises(CheckpointError, match="injected failure"):
            failed.wait()  # raised by wait ...
        with pytest.raises(CheckpointError, match="injected failure"):
            failed.wait()  # ... every time it is asked
        unseen = fprep.save(tmp_path, state, model, step=3, wait=False)
        while not unseen.done():  # done() only looks: the failure is still nobody's
            time.sleep(0.01)
    # nobody waited for step 3: the next save raises its failure and saves nothing
    with pytest.raises(CheckpointError, match="injected failure") as caught:
        fprep.save(tmp_path, state, model, step=4)
    assert caught.value.subject is not None and unseen.done()
    s2, m2, *_ = W.prepared("none", seed=3)
    assert fprep.load(tmp_path, s2, m2).step == 1  # the previous checkpoint, intact
    fprep.save(tmp_path, state, model, step=5, wait=False)
    assert fprep.load(tmp_path, s2, m2).step == 5  # load waited; the leftovers are gone
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".tmp-")]


def test_wait_must_be_a_bool(tmp_path: Path) -> None:
    state, model, *_ = W.prepared("none")
    with pytest.raises(CheckpointError, match=r"wait must be True or False; got 0\."):
        fprep.save(tmp_path, state, model, wait=0)  # type: ignore[call-overload]
    assert not list(tmp_path.iterdir())


PLANNED = textwrap.dedent(
    """
    from torch import nn

    def build():  # rows that do not divide by 4: the staged copy is unpadded
        return nn.Sequential(nn.Embedding(101, 64), nn.Linear(64, 64))
    """
)


def test_plan_shows_the_staging_memory_when_asked(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from fprep.cli import main

    (tmp_path / "staged_models.py").write_text(PLANNED)
    monkeypatch.chdir(tmp_path)
    argv = ["plan", "staged_models:build", "--world-size", "4", "--precision", "no"]
    assert main(argv) == 0
    assert "async staging" not in capsys.readouterr().out
    assert main([*argv, "--async-checkpoint"]) == 0
    out = capsys.readouterr().out
    # rank 0's shards: 26 embedding rows, 16 + 16 of the linear; the parameters and Adam's two
    # states, all fp32: 3 * 4 * (26 * 64 + 16 * 64 + 16) bytes = 31.69 KiB
    assert re.search(r"host: async staging max +31\.69 KiB\n", out), out


EXITING = textwrap.dedent(
    """
    import sys
    from torch import nn
    import fprep
    from fprep.checkpoint.format.storage import SafeWriter

    root, fail = sys.argv[1], sys.argv[2] == "fail"
    if fail:
        def no_space(*args, **kwargs):
            raise OSError(28, "No space left on device")
        SafeWriter._write = no_space
    state, model = fprep.prepare(nn.Linear(512, 512), fprep.PrepConfig())
    fprep.save(root, state, model, step=7, wait=False)
    print("returned", flush=True)
    """
)


@pytest.mark.parametrize("fail", [False, True], ids=["published", "failure reported"])
def test_exit_waits_for_the_save_in_flight(tmp_path: Path, fail: bool) -> None:
    done = subprocess.run(
        [sys.executable, "-c", EXITING, str(tmp_path), "fail" if fail else "ok"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.stdout == "returned\n"
    if fail:
        assert "fprep: the asynchronous checkpoint save failed: cannot write " in done.stderr
        assert "No space left on device" in done.stderr
        assert not (tmp_path / "latest").exists()
    else:
        assert done.stderr == ""
        assert (tmp_path / "latest").read_text().startswith("step-00000007 blake3:")


KILLED = W.saver_script(
    """
handle = fprep.save(root, state, model, step=step, keep_last=3, extras={"step": step},
                    wait=False)
with torch.no_grad():  # training goes on: none of this may reach the checkpoint
    for p in model.parameters():
        p.fill_(-1.0)
time.sleep(rnd.random() * 0.02)
handle.wait()
"""
)

# The same, with the optimizer passed to save stepping right after the call (SGD, lr=1, gradient
# p + 1: every parameter becomes -1) while the background writes the copies.
KILLED_STEPPING = W.saver_script(
    """
handle = fprep.save(root, state, model, optimizers=(opt,), step=step, keep_last=3,
                    extras={"step": step}, wait=False)
for p in model.parameters():  # training goes on: none of this may reach it
    p.grad = p.detach() + 1.0
opt.step()
time.sleep(rnd.random() * 0.02)
handle.wait()
""",
    setup="""
model = nn.Linear(256, 256)
opt = torch.optim.SGD(model.parameters(), lr=1.0)
state, model, opt = fprep.prepare(model, fprep.PrepConfig(), opt)
""",
)


@pytest.mark.parametrize("script", [KILLED, KILLED_STEPPING], ids=["filled", "stepped"])
def test_killed_background_saves_leave_a_loadable_checkpoint(tmp_path: Path, script: str) -> None:
    stepping = script is KILLED_STEPPING
    assert script.count("opt.step()") + script.count("optimizers=(opt,)") == 2 * stepping
    root = tmp_path / "ckpt"
    W.killed_save_rounds(root, script, rounds=3, seed=2025)
    state, model = fprep.prepare(nn.Linear(256, 256), fprep.PrepConfig())
    fprep.save(root, state, model, step=999, keep_last=3, wait=False).wait()
    names = sorted(p.name for p in root.iterdir())
    # stale temp dirs and files removed (the root's lock file stays, for the next saver)
    assert not [n for n in names if n.startswith(".") and n != ".lock"]
    assert len([n for n in names if n.startswith("step-")]) == 3


needs_gloo = pytest.mark.skipif(
    not (dist.is_available() and dist.is_gloo_available()), reason="needs gloo"
)


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    root = tmp_path_factory.mktemp("two_ranks")
    return run_ranks(A.two_ranks, 2, str(root), timeout_s=240.0)


@pytest.mark.slow
@needs_gloo
def test_two_ranks_fsdp_and_ddp_save_the_values_at_the_call(
    two_ranks: list[dict[str, Any]],
) -> None:
    for r in (r["values"] for r in two_ranks):
        for strategy in ("fsdp", "ddp"):
            assert r[f"{strategy}_changed_after_call"] is True
            assert r[f"{strategy}_equal"] is True, strategy
            assert r[f"{strategy}_lr"] is True and r[f"{strategy}_loader"] is True
            assert r[f"{strategy}_reused"] is True, strategy
            assert r[f"{strategy}_step"] == W.N_STEPS
            assert r[f"{strategy}_published"] == f"step-{W.N_STEPS:08d}"


@pytest.mark.slow
@needs_gloo
def test_two_ranks_no_in_place_change_after_the_call_reaches_the_checkpoint(
    two_ranks: list[dict[str, Any]],
) -> None:
    """Issue 18: each of these was published with the values after the call under fsdp (the
    guard looked at the DTensor's local version counter); a checkpoint overlapping
    ``p.mul_`` kernels failed its own digest and ``latest`` named it."""
    for r in (r["values"] for r in two_ranks):
        for strategy in ("fsdp", "ddp"):
            results = r[f"{strategy}_mutations"]
            assert list(results) == list(A.MUTATIONS)
            for name, outcome in results.items():
                assert outcome == {"changed": True, "equal": True}, (strategy, name)
            overlap = r[f"{strategy}_overlap"]
            assert overlap["equal"] == [True] * 3, strategy
            assert all(n >= 2 for n in overlap["rounds"]), overlap
            assert overlap["latest"] == 102


@pytest.mark.slow
@needs_gloo
@pytest.mark.timeout(120)
@pytest.mark.parametrize("victim", [1, 0])
def test_a_rank_killed_during_a_background_save_is_a_collective_error(
    tmp_path: Path, victim: int
) -> None:
    from _collective_workers import TIMEOUT_S, spawn

    from fprep.collectives import PROBE_S

    results = spawn(A.killed_in_the_background, 2, str(tmp_path), victim)
    assert results[victim] == "exit -9"
    out = results[1 - victim]
    assert isinstance(out, dict) and out["error"] == "CollectiveError", out
    assert out["message"].startswith(
        "fprep.save failed in a collective of its background thread (wait=False): "
        f"ranks [{victim}] did not answer"
    ), out["message"]
    assert "torch said: " in out["message"] and out["cause"] == "RuntimeError"
    assert out["subject"] == "fprep.save"
    assert out["seconds"] < min(TIMEOUT_S, PROBE_S) + 30  # a bound, not a measurement
    if victim == 1:
        assert out["latest"] == "step-00000001"  # the previous checkpoint stays the latest


@pytest.mark.slow
@needs_gloo
def test_a_failure_on_one_rank_reaches_every_ranks_wait(two_ranks: list[dict[str, Any]]) -> None:
    for r in (r["failure"] for r in two_ranks):
        assert r["error"].startswith("CheckpointError: cannot write "), r["error"]
        assert "__1_0.distcp: No space left on device" in r["error"]
        assert r["step_after_failure"] == 1 and r["step_after_retry"] == 3
        assert r["leftovers"] == []


def test_end_training_waits_for_the_save_in_flight(
    tmp_path: Path, held_writer: threading.Event
) -> None:
    state, model, opt, *_ = trained()
    handle = fprep.save(tmp_path, state, model, optimizers=(opt,), step=1, wait=False)
    threading.Timer(0.3, held_writer.set).start()
    fprep.end_training(state)  # no group of fprep's to destroy here, but a save to finish
    assert handle.done() and handle.wait().name == "step-00000001"


def test_a_transformers_model_with_tied_weights_saves_the_values_at_the_call(
    tmp_path: Path, held_writer: threading.Event
) -> None:
    """GPT-2 ties lm_head to wte (two keys, one storage) and brings no reset_parameters."""
    from _weights_workers import gpt2_config
    from transformers import GPT2LMHeadModel

    def build() -> tuple[Any, ...]:
        torch.manual_seed(0)
        model = GPT2LMHeadModel(gpt2_config())
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        return fprep.prepare(model, fprep.PrepConfig(), opt)

    def step(model: nn.Module, opt: torch.optim.Optimizer) -> None:
        ids = torch.arange(12).reshape(2, 6)
        model(input_ids=ids, labels=ids).loss.backward()
        opt.step()
        opt.zero_grad()

    state, model, opt = build()
    step(model, opt)
    want = copy.deepcopy((model.state_dict(), opt.state_dict()))
    handle = fprep.save(tmp_path, state, model, optimizers=(opt,), step=1, wait=False)
    step(model, opt)  # its optimizer.step() copies everything: nothing is written yet
    step(model, opt)
    held_writer.set()
    path = handle.wait()
    s2, m2, o2 = build()
    fprep.load(path, s2, m2, optimizers=(o2,))
    assert m2.lm_head.weight is m2.transformer.wte.weight  # still tied
    assert all(torch.equal(v, want[0][k]) for k, v in m2.state_dict().items())
    for i, entry in want[1]["state"].items():
        assert all(torch.equal(o2.state_dict()["state"][i][k], v) for k, v in entry.items())
