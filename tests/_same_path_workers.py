"""Rank functions for tests/test_checkpoint_same_path.py: every checkpoint call with a path per
rank, then with one directory spelled differently on each rank. Module level, so ``run_ranks``
can pickle them; ranks report errors as text and what they saw on disk as lists of names."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path
from typing import Any

import _checkpoint_workers as W
import torch

import fprep


def _listing(directory: Path) -> list[str]:
    return sorted(str(p.relative_to(directory)) for p in directory.rglob("*"))


def _error(call: Any) -> dict[str, Any]:
    try:
        call()
    except Exception as e:
        return {"type": type(e).__name__, "message": str(e), "subject": getattr(e, "subject", "")}
    return {"type": None}


def different_paths(base: str) -> dict[str, Any]:
    """Each rank makes its own directory under ``base`` (as ``tempfile.mkdtemp()`` on every rank
    does) and passes it to every checkpoint call; ``save`` once with the same path first, so
    that ``load`` has something it could read."""
    torch.set_num_threads(1)
    state, model, opt, _, _ = W.prepared("fsdp")
    shared = Path(base) / "shared"
    fprep.save(shared, state, model, optimizers=(opt,), step=1)  # one path: fine
    mine = Path(tempfile.mkdtemp(dir=base, prefix=f"rank{W.rank()}-"))
    before = W.local_state(model, opt)
    out: dict[str, Any] = {"mine": str(mine)}
    out["save"] = _error(lambda: fprep.save(mine, state, model, optimizers=(opt,), step=2))
    out["save_async"] = _error(
        lambda: fprep.save(mine, state, model, optimizers=(opt,), step=3, wait=False).wait()
    )
    out["export_full"] = _error(lambda: fprep.export_full(mine / "m.safetensors", state, model))
    out["save_pretrained"] = _error(
        lambda: fprep.save_pretrained(mine / "hf", state, model, config={"model_type": "x"})
    )
    # rank 1 names a copy of rank 0's checkpoint: a load would silently read rank 0's alone
    copy = shared if W.rank() == 0 else Path(base) / "copy"
    if W.rank() == 1:
        import shutil

        shutil.copytree(shared, copy)
    out["load"] = _error(lambda: fprep.load(copy, state, model, optimizers=(opt,)))
    out["unchanged"] = W.same(before, W.local_state(model, opt))
    W.barrier()  # both ranks are done: what is on disk now is what the calls left
    out["left"] = _listing(mine)
    return out


def one_place_spelled_twice(base: str) -> dict[str, Any]:
    """Rank 0 passes an absolute path, rank 1 a relative one through a symbolic link (with a
    trailing slash): one directory. Everything works, and rank 1 loads what rank 0 saved."""
    torch.set_num_threads(1)
    root = Path(base)
    if W.rank() == 0:
        (root / "real").mkdir()
        os.symlink(root / "real", root / "link")
    W.barrier()
    os.chdir(root)
    path: str | Path = root / "real" / "ckpt" if W.rank() == 0 else "link/ckpt/"
    state, model, opt, sched, loader = W.prepared("fsdp")
    W.Trainer(state, model, opt, sched, loader).run(1)
    saved = W.full_state(model, opt)
    out: dict[str, Any] = {"saved": W.dump(saved) if W.rank() == 0 else None}
    out["published"] = str(fprep.save(path, state, model, optimizers=(opt,), step=1))
    out["async"] = str(fprep.save(path, state, model, optimizers=(opt,), step=2, wait=False).wait())
    where = "real/m.safetensors" if W.rank() == 0 else "link/../real/m.safetensors"
    out["export"] = str(fprep.export_full(where, state, model))
    hf = root / "real" / "hf" if W.rank() == 0 else "file://" + str(root / "link" / "hf")
    out["save_pretrained"] = str(
        fprep.save_pretrained(hf, state, model, config={"model_type": "x"})
    )
    state2, model2, opt2, _, _ = W.prepared("fsdp", seed=W.SEED + 1)
    info = fprep.load(path, state2, model2, optimizers=(opt2,))
    out["step"] = info.step
    loaded = W.full_state(model2, opt2)
    out["loaded"] = W.dump(loaded) if W.rank() == 0 else None
    W.barrier()
    out["files"] = _listing(root / "real")
    return out
