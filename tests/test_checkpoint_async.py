"""``fprep.save(..., wait=False)``: staged in the foreground, published in the background.

* the checkpoint holds the values at the call, though training changes them at once (one
  process here; 2 ranks with fsdp and ddp below), non-tensor state included;
* the staging buffers are allocated once and reused by the next saves; what the background
  wrote before the next optimizer step is never copied; a step waits for the tensor being
  written; a change outside the optimizer fails the save by name unless ``handle.stage()``
  came first;
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
from pathlib import Path
from typing import Any

import _async_workers as A
import _checkpoint_workers as W
import pytest
import torch
import torch.distributed as dist
from torch import nn

import fprep
from fprep.checkpoint import SaveHandle, files, staging
from fprep.checkpoint.storage import SafeWriter
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
def held_writer(monkeypatch: pytest.MonkeyPatch) -> threading.Event:
    """An asynchronous save's write starts only once the returned event is set (tests set it)."""
    real = SafeWriter.write_data
    gate = threading.Event()

    def held(self: SafeWriter, *args: Any, **kwargs: Any) -> Any:
        if self.guard is not None:
            gate.wait(timeout=60)
        return real(self, *args, **kwargs)

    monkeypatch.setattr(SafeWriter, "write_data", held)
    return gate


def loads_model(path: Path, want: dict[str, torch.Tensor]) -> bool:
    """The checkpoint at ``path`` loads into a fresh model as exactly ``want``."""
    s2, m2, *_ = W.prepared("none", seed=5)
    fprep.load(path, s2, m2)
    return all(torch.equal(v, want[k]) for k, v in m2.state_dict().items())


def _live_bytes(model: nn.Module, opt: torch.optim.Optimizer) -> tuple[int, int]:
    """(bytes the optimizer owns: parameters and state, bytes of the other model tensors)"""
    owned = {p.data_ptr() for g in opt.param_groups for p in g["params"]}
    size = sum(v.numel() * v.element_size() for s in opt.state.values() for v in s.values())
    other = 0
    for t in model.state_dict().values():
        if t.data_ptr() in owned:
            size += t.numel() * t.element_size()
        else:
            other += t.numel() * t.element_size()
    return size, other


def test_staging_buffers_are_allocated_once(tmp_path: Path, held_writer: threading.Event) -> None:
    state, model, opt, sched, loader = trained()
    handle = fprep.save(tmp_path, state, model, optimizers=(opt,), step=1, wait=False)
    W.Trainer(state, model, opt, sched, loader).run(1)  # the step copies what was not written
    held_writer.set()
    handle.wait()
    stager = staging.stager_for(model)
    first = {k: b.data_ptr() for k, b in stager.buffers.items()}
    owned, other = _live_bytes(model, opt)
    assert stager.nbytes == owned + other  # one more copy of this rank's model and optimizer
    for step in (2, 3):
        handle = fprep.save(tmp_path, state, model, optimizers=(opt,), step=step, wait=False)
        W.Trainer(state, model, opt, sched, loader).run(1)
        handle.wait()
        assert {k: b.data_ptr() for k, b in stager.buffers.items()} == first
    staging.release(model)
    assert staging.stager_for(model).nbytes == 0


def test_what_the_background_wrote_before_the_step_is_never_copied(tmp_path: Path) -> None:
    state, model, opt, sched, loader = trained()
    handle = fprep.save(tmp_path, state, model, optimizers=(opt,), step=1, wait=False)
    path = handle.wait()  # written before the next step
    want = copy.deepcopy(model.state_dict())
    W.Trainer(state, model, opt, sched, loader).run(1)  # nothing left to copy: no hold
    owned, other = _live_bytes(model, opt)
    assert owned > 0 and staging.stager_for(model).nbytes == other  # the buffer only
    assert loads_model(path, want)


def test_the_step_waits_for_the_tensor_being_written(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    state, model, opt, sched, loader = trained()
    want = copy.deepcopy((model.state_dict(), opt.state_dict()))
    real = SafeWriter._read
    reading, gate = threading.Event(), threading.Event()

    def slow_read(self: SafeWriter, planner: Any, item: Any) -> Any:
        out = real(self, planner, item)
        if out[1] is not None and not reading.is_set():  # a live tensor: slow to write
            reading.set()
            gate.wait(timeout=60)
        return out

    monkeypatch.setattr(SafeWriter, "_read", slow_read)
    handle = fprep.save(tmp_path, state, model, optimizers=(opt,), step=1, wait=False)
    assert reading.wait(timeout=60)
    threading.Timer(0.3, gate.set).start()
    start = time.perf_counter()
    W.Trainer(state, model, opt, sched, loader).run(1)
    assert time.perf_counter() - start >= 0.25  # the step waited for that write
    path = handle.wait()
    s2, m2, o2, *_ = W.prepared("none", seed=5)
    fprep.load(path, s2, m2, optimizers=(o2,))
    assert all(torch.equal(v, want[0][k]) for k, v in m2.state_dict().items())
    osd = o2.state_dict()
    for i, entry in want[1]["state"].items():
        assert all(torch.equal(osd["state"][i][k], v) for k, v in entry.items())


def test_a_change_outside_the_optimizer_fails_the_save_by_name(
    tmp_path: Path, held_writer: threading.Event
) -> None:
    state, model, opt, *_ = trained()
    fprep.save(tmp_path, state, model, optimizers=(opt,), step=1)
    handle = fprep.save(tmp_path, state, model, optimizers=(opt,), step=2, wait=False)
    with torch.no_grad():
        model.odd.mul_(2)  # not through opt.step(), and handle.stage() was not called
    held_writer.set()
    with pytest.raises(CheckpointError, match=r"model 'odd' was changed in place") as caught:
        handle.wait()
    assert caught.value.subject == "model/odd" and "handle.stage()" in caught.value.hint
    s2, m2, *_ = W.prepared("none", seed=5)
    assert fprep.load(tmp_path, s2, m2).step == 1  # nothing torn was published


def test_stage_lets_the_loop_change_tensors_any_way(
    tmp_path: Path, held_writer: threading.Event
) -> None:
    state, model, opt, *_ = trained()
    want = copy.deepcopy(model.state_dict())
    handle = fprep.save(tmp_path, state, model, optimizers=(opt,), step=2, wait=False)
    handle.stage()  # copies what the save has not read
    with torch.no_grad():
        model.odd.mul_(2)
    held_writer.set()
    path = handle.wait()
    assert loads_model(path, want)


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
    from fprep.checkpoint.storage import SafeWriter

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

# The same, with the parameters read live (guard.py): the optimizer passed to save changes them
# (SGD, lr=1, gradient p + 1: every parameter becomes -1), so its step waits for what the
# background has not written, and copies it.
KILLED_GUARDED = W.saver_script(
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


@pytest.mark.parametrize("script", [KILLED, KILLED_GUARDED], ids=["copied", "read live"])
def test_killed_background_saves_leave_a_loadable_checkpoint(tmp_path: Path, script: str) -> None:
    guarded = script is KILLED_GUARDED
    assert script.count("opt.step()") + script.count("optimizers=(opt,)") == 2 * guarded
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
            assert r[f"{strategy}_held"] is True, strategy
            assert r[f"{strategy}_step"] == W.N_STEPS
            assert r[f"{strategy}_published"] == f"step-{W.N_STEPS:08d}"


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
