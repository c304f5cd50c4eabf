"""``fprep/checkpoint/guard.py``: an asynchronous save reads optimizer-owned tensors live, and the
optimizer's next step waits until they are read or copied.

* property (hypothesis, real threads): whatever the chunk order, the reader's pace and the
  moment ``protect`` comes, every chunk the writer reads holds the value at the call, though the
  training thread changes every tensor right after ``protect`` returns; ``protect`` copies only
  what was not read, and nothing when the writer was done;
* an in-place change that did not wait is a failure value naming the tensor, never a torn read;
* which keys may be read live (``guardable``): CPU tensors owned by the optimizers passed;
* one step pre-hook per optimizer for its lifetime, whatever the number of saves.
"""

from __future__ import annotations

import threading
import time
from collections import Counter
from types import SimpleNamespace
from typing import Any

import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch import nn
from torch.distributed.checkpoint.metadata import MetadataIndex

from fprep.checkpoint import guard as G
from fprep.checkpoint.staging import Stager


def item(key: str) -> Any:
    return SimpleNamespace(index=MetadataIndex(fqn=key))


def reader(
    g: G.Guard,
    items: list[Any],
    live: dict[str, torch.Tensor],
    pause_s: list[float],
    out: list[tuple[str, torch.Tensor]],
) -> None:
    """What ``SafeWriter`` does per chunk: begin, read (slowly), end."""
    g.expect(Counter(i.index.fqn for i in items))
    for it, pause in zip(items, pause_s, strict=True):
        key = it.index.fqn
        staged = g.begin(it)
        source = live[key] if staged is None else staged
        first = source.clone()
        time.sleep(pause)  # a slow write: the training thread may arrive meanwhile
        out.append((key, first if torch.equal(first, source) else source.clone() * float("nan")))
        if staged is None:
            g.end(key)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    sizes=st.lists(st.integers(1, 64), min_size=1, max_size=6),
    chunks=st.lists(st.integers(1, 3), min_size=6, max_size=6),
    order_seed=st.randoms(use_true_random=False),
    protect_after_s=st.sampled_from([0.0, 0.001, 0.004, 0.02, 0.5]),
    pause_s=st.sampled_from([0.0, 0.001, 0.003]),
)
def test_every_read_holds_the_value_at_the_call(
    sizes: list[int], chunks: list[int], order_seed: Any, protect_after_s: float, pause_s: float
) -> None:
    live = {f"k{i}": torch.arange(n, dtype=torch.float32) + 100 * i for i, n in enumerate(sizes)}
    at_call = {k: v.clone() for k, v in live.items()}
    items = [item(k) for i, k in enumerate(live) for _ in range(chunks[i])]
    order_seed.shuffle(items)
    g = G.Guard(live, Stager(), ())
    out: list[tuple[str, torch.Tensor]] = []
    thread = threading.Thread(target=reader, args=(g, items, live, [pause_s] * len(items), out))
    thread.start()
    time.sleep(protect_after_s)
    g.protect()
    for t in live.values():  # the optimizer step: changes everything at once
        t.add_(1.0)
    thread.join()
    g.close()
    assert len(out) == len(items)
    assert all(torch.equal(value, at_call[key]) for key, value in out)
    assert g.failure() is None
    total = sum(t.numel() * t.element_size() for t in live.values())
    assert 0 <= g.copied_bytes <= total
    if protect_after_s >= 0.5:  # the reader was done long before: nothing to copy
        assert g.copied_bytes == 0


def test_protect_before_the_plan_copies_everything_and_the_reader_reads_the_copies() -> None:
    live = {"a": torch.ones(4), "b": torch.zeros(3)}
    g = G.Guard(live, Stager(), ())
    g.protect()  # the training thread came before the background even planned
    live["a"].add_(5)
    live["b"].add_(5)
    out: list[tuple[str, torch.Tensor]] = []
    reader(g, [item("a"), item("b")], live, [0.0, 0.0], out)
    assert g.copied_bytes == 4 * 4 + 3 * 4
    assert torch.equal(out[0][1], torch.ones(4)) and torch.equal(out[1][1], torch.zeros(3))
    assert g.failure() is None


def test_protect_waits_for_the_chunk_being_read() -> None:
    live = {"w": torch.ones(8)}
    g = G.Guard(live, Stager(), ())
    g.expect({"w": 1})
    assert g.begin(item("w")) is None  # reading the live tensor
    threading.Timer(0.2, g.end, args=("w",)).start()
    start = time.perf_counter()
    g.protect()
    assert time.perf_counter() - start >= 0.15  # held until the read ended
    assert g.copied_bytes == 0  # read, so nothing to copy


def test_a_change_that_did_not_wait_is_a_failure_naming_the_tensor() -> None:
    live = {"model/fc.weight": torch.ones(4), "model/fc.bias": torch.ones(2)}
    g = G.Guard(live, Stager(), ())
    g.expect({"model/fc.weight": 1, "model/fc.bias": 1})
    assert g.begin(item("model/fc.weight")) is None
    with torch.no_grad():
        live["model/fc.weight"].mul_(2)  # not an optimizer step: nobody waited
    g.end("model/fc.weight")
    failure = g.failure()
    assert failure is not None and failure.subject == "model/fc.weight"
    assert "model 'fc.weight' was changed in place" in str(failure)
    assert "handle.stage()" in str(failure)
    # a change after the read is none of the save's business
    assert g.begin(item("model/fc.bias")) is None
    g.end("model/fc.bias")
    live["model/fc.bias"].add_(1)
    assert g.failure() is failure


def test_a_change_before_protect_copies_is_a_failure_too() -> None:
    live = {"optimizer/0/state/w/exp_avg": torch.ones(4)}
    g = G.Guard(live, Stager(), ())
    live["optimizer/0/state/w/exp_avg"].add_(1)
    g.protect()
    failure = g.failure()
    assert failure is not None and "optimizer 0 state 'exp_avg' of 'w'" in str(failure)
    assert g.copied_bytes == 0  # a changed tensor is not copied: the save fails anyway


def test_only_host_tensors_owned_by_the_optimizers_are_read_live() -> None:
    model = nn.Sequential(nn.Linear(3, 3), nn.BatchNorm1d(3), nn.Linear(3, 1))
    model[2].weight.requires_grad_(False)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad])
    model(torch.randn(4, 3)).sum().backward()
    opt.step()
    tensors: dict[str, torch.Tensor] = {f"model/{k}": v for k, v in model.state_dict().items()}
    for i, entry in enumerate(opt.state.values()):
        for name, v in entry.items():
            tensors[f"optimizer/0/state/{i}/{name}"] = v
    tensors["model/fresh"] = torch.ones(3)  # made by a state-dict function: nobody owns it
    keys = G.guardable(tensors, (opt,))
    assert keys == {
        "model/0.weight",
        "model/0.bias",
        "model/1.weight",
        "model/1.bias",
        "model/2.bias",
        *(k for k in tensors if k.startswith("optimizer/")),
    }  # not: the frozen weight, BatchNorm's running statistics, unowned tensors
    assert G.guardable(tensors, ()) == set()


def test_one_step_hook_per_optimizer_however_many_saves() -> None:
    p = nn.Parameter(torch.ones(3))
    opt = torch.optim.SGD([p], lr=0.1)
    for _ in range(5):
        g = G.Guard({"model/p": p.detach()}, Stager(), (opt,))
        p.grad = torch.ones(3)
        opt.step()  # protects: the save would now read a copy
        assert g.copied_bytes == 12
        g.close()
    assert len(opt._optimizer_step_pre_hooks) == 1
    opt.step()  # no save in flight: the hook does nothing
    assert torch.allclose(p.detach(), torch.full((3,), 0.4))
