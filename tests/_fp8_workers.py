"""Rank functions for tests/test_fp8_parallel.py (torchao float8, emulated on the CPU), and their
single-process references.

The plan refuses ``precision="fp8"`` on a CPU, so each rank plans fp32 (``precision="no"``)
and a first step puts in the fp8 plan a CUDA rank would get: ``plan_fp8`` and
``plan_tensor_parallel``, the planner's own functions, on the CPU snapshot. The ``fp8`` step
then converts with torchao's emulated float8 matmuls (the float8 casts, scales and
communication are real; only the matmul runs in high precision).

Tensorwise float8 scales the activations per forward call: a data-parallel rank's scale is its
slice's amax. The reference therefore runs the same slices one after the other in one process
(gradient accumulation), which is what data parallelism computes; the weights' scales (and,
under tp, the sharded activations' and gradients') are amaxes all-reduced over the whole tensor.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import _tp_workers as W
import torch
from torch import nn

import fprep
from fprep.apply.steps import Step, handles_of, step
from fprep.config import Fp8Options
from fprep.state import PrepState
from fprep.transitions.fp8 import plan_fp8
from fprep.transitions.tensor_parallel import plan_tensor_parallel

#: fprep's tiny Llama (W.build): every Linear but the output projection runs in float8
FLOAT8 = tuple(
    f"layers.{i}.{name}"
    for i in range(2)
    for name in (
        "attention.wq",
        "attention.wk",
        "attention.wv",
        "attention.wo",
        "feed_forward.w1",
        "feed_forward.w2",
        "feed_forward.w3",
    )
)

#: name -> (PrepConfig fields, Fp8Options fields); "dp2_*" at 4 ranks, the others at 2
RUNS: dict[str, tuple[dict[str, Any], dict[str, Any]]] = {
    "dp2_tp2": ({"strategy": "fsdp", "tp": 2}, {"fsdp_float8_all_gather": False}),
    "dp2_tp2_sp": (
        {"strategy": "fsdp", "tp": 2, "sequence_parallel": True},
        {"fsdp_float8_all_gather": False},
    ),
    "dp2_tp2_rowwise": ({"strategy": "fsdp", "tp": 2}, {"recipe": "rowwise"}),
    "dp2_tp2_gather": ({"strategy": "fsdp", "tp": 2}, {"fsdp_float8_all_gather": True}),
    "tp2": ({"strategy": "auto", "tp": 2}, {}),
    "fsdp2": ({"strategy": "fsdp"}, {"fsdp_float8_all_gather": False}),
    "fsdp2_gather": ({"strategy": "fsdp"}, {"fsdp_float8_all_gather": True}),
}


def cpu_fp8_plan(options: Fp8Options) -> Step:
    """A first step giving this CPU plan the fp8 plan of a CUDA rank (see the module doc)."""

    @step("cpu_fp8_plan")
    def inject(state: PrepState, model: nn.Module) -> tuple[PrepState, nn.Module]:
        core, pg, ignored = state.core, state.process_group, state.ignored
        assert core is not None and pg is not None and ignored is not None
        fp8 = plan_fp8(
            state.tree,
            options,
            ignored_modules=tuple(sorted(ignored.modules)),
            sharded=core.strategy in ("fsdp", "hsdp"),
            device_type="cuda",
        )
        precision = dataclasses.replace(core.precision, fp8=True, fp8_plan=fp8)
        state = state.replace(core=dataclasses.replace(core, precision=precision))
        ext = state.extension
        if ext is not None and ext.tensor_parallel is not None:
            tps = plan_tensor_parallel(state, pg, ignored)
            state = state.replace(extension=dataclasses.replace(ext, tensor_parallel=tps))
        return state, model

    return inject


def _dp_rank(state: PrepState) -> tuple[int, int]:
    pg = state.process_group
    assert pg is not None and state.core is not None
    if not state.core.is_distributed:
        return 0, 1
    dp_rank = 0
    for coord, size in zip(pg.coordinate, pg.mesh_shape, strict=True):
        dp_rank = dp_rank * size + coord
    return dp_rank, pg.replicate_size * pg.shard_size


class _Counter:
    """Counts calls of a torchao function (patched on its module for one forward)."""

    def __init__(self, module: Any, name: str) -> None:
        self.module, self.name, self.calls = module, name, 0
        self.original = getattr(module, name)

    def __enter__(self) -> _Counter:
        def counted(*args: Any, **kwargs: Any) -> Any:
            self.calls += 1
            return self.original(*args, **kwargs)

        setattr(self.module, self.name, counted)
        return self

    def __exit__(self, *exc: object) -> None:
        setattr(self.module, self.name, self.original)


def _scales(model: nn.Module) -> dict[str, Any]:
    """Each float8 weight's precomputed scale (None when not precomputed) and the scale of
    its whole weight (float8 e4m3's largest value over the amax of the full tensor)."""
    out: dict[str, Any] = {}
    for fqn in FLOAT8:
        w = model.get_submodule(fqn).weight
        local = w._local_tensor if hasattr(w, "_local_tensor") else w
        pre = getattr(local, "_precomputed_scale", None)
        full = w.full_tensor() if hasattr(w, "full_tensor") else w
        amax = float(torch.as_tensor(full).detach().abs().max().to(torch.float64))
        expected = torch.finfo(torch.float8_e4m3fn).max / amax
        out[fqn] = (None if pre is None else float(pre), expected, type(local).__name__)
    return out


def options(name: str) -> Fp8Options:
    """Run ``name``'s fp8 options; the tiny Llama's layers are below the size where float8
    pays, so they are converted anyway (``skip_small=False``)."""
    return Fp8Options(**{"skip_small": False, **RUNS[name][1]})


def prepared(
    name: str, seed: int = W.SEED, **more: Any
) -> tuple[PrepState, nn.Module, torch.optim.Optimizer]:
    """fprep's tiny Llama and AdamW prepared as run ``name`` (with the fp8 plan of a CUDA rank);
    ``more``: further PrepConfig fields."""
    fields = RUNS[name][0]
    model = W.build("fprep_llama", seed)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    steps = (cpu_fp8_plan(options(name)), *fprep.default_steps())
    return fprep.prepare(model, fprep.PrepConfig(**fields, **more), opt, steps=steps)


def train(name: str) -> dict[str, Any]:
    state, model, opt = prepared(name)
    fp8 = options(name)
    dp_rank, dp = _dp_rank(state)
    per = W.GLOBAL_BATCH // dp
    mine = slice(dp_rank * per, (dp_rank + 1) * per)
    losses = []
    for x, y in W.batches():
        loss = W.loss_of(W.logits_of(model, x[mine]), y[mine])
        fprep.backward(state, model, loss)
        fprep.optimizer_step(state, opt)
        opt.zero_grad()
        losses.append(loss.item())
    out: dict[str, Any] = {
        "losses": losses,
        "dp_rank": dp_rank,
        "converted": sorted(
            n for n, m in model.named_modules() if type(m).__name__ == "Float8Linear"
        ),
        "refresh": handles_of(state).fp8_scales is not None,
        "scales": _scales(model),
    }
    if state.tensor_parallel is not None:
        out["float8_styles"] = dict(state.tensor_parallel.float8)
        out["summary"] = state.summary()
    if fp8.fsdp_float8_all_gather:  # which cast the next all-gathers use
        from torchao.float8 import fsdp_utils

        x, _ = W.batches()[0]
        with (
            _Counter(fsdp_utils, "hp_tensor_and_scale_to_float8") as precomputed,
            _Counter(fsdp_utils, "hp_tensor_to_float8_dynamic") as dynamic,
        ):
            W.logits_of(model, x[mine])
        out["casts"] = (precomputed.calls, dynamic.calls)
    return out


def runs(names: tuple[str, ...]) -> dict[str, Any]:
    return {n: train(n) for n in names}


def reference(recipe: str, dp: int) -> list[float]:
    """One process, torchao's own conversion of ``FLOAT8`` (emulated), each step's batch as
    ``dp`` slices accumulated; the loss the mean over the slices (what ranks average)."""
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training

    model = W.build("fprep_llama")
    config = dataclasses.replace(Float8LinearConfig.from_recipe_name(recipe), emulate=True)
    convert_to_float8_training(model, module_filter_fn=lambda _m, fqn: fqn in FLOAT8, config=config)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    per = W.GLOBAL_BATCH // dp
    losses = []
    for x, y in W.batches():
        total = 0.0
        for d in range(dp):
            part = slice(d * per, (d + 1) * per)
            loss = W.loss_of(W.logits_of(model, x[part]), y[part]) / dp
            loss.backward()
            total += loss.item()
        opt.step()
        opt.zero_grad()
        losses.append(total)
    return losses
