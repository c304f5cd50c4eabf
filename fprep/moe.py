"""Mixture-of-experts models in the training loop: the routers' load-balancing loss and each
expert's token counts, under every layout.

``fprep.watch_routers(state, model)`` finds the model's routers and hooks them (forward hooks
that only read what a router returns; the model computes exactly what it computed before). A
router is a module with integer ``num_experts`` and ``top_k`` attributes whose class name ends in
``Router`` and whose output holds its logits first and the chosen experts' indices (an integer
tensor): transformers 5's ``Qwen3MoeTopKRouter``, ``MixtralTopKRouter``, ``GptOssTopKRouter``,
and fprep's ``MoERouter`` (``fprep.testing.models``). For each router call the watch keeps

- its load-balancing loss, ``balance_loss`` of the call (transformers'
  ``load_balancing_loss_func`` for one layer), with its gradient path: ``watch.aux_loss()`` is
  the sum over this rank's routers of their last call's loss, to add to the training loss;
- the tokens each expert received, added up until ``watch.token_counts()`` reads them (one
  tensor per router, optionally summed over the data-parallel ranks).

The auxiliary loss is a statistic of the tokens a router saw together: under data parallelism
each rank's is over its own rows, and under pipeline parallelism over one micro-batch. Summed
over the layers it splits over pipeline stages exactly, so ``fprep.pipeline_step(...,
aux_loss_coef=c)`` adds it everywhere: without pipeline parallelism to the loss before the
backward, with it to each stage's own backward (the stage's output carries the gradient of
``c * its routers' loss / micro-batches``, as Megatron-LM's ``MoEAuxLossAutoScaler`` does).
"""

from __future__ import annotations

import weakref
from typing import Any

import torch
from torch import nn

from fprep.apply.steps import handles_of
from fprep.errors import ConfigError, PrepareError
from fprep.state import PrepState


def balance_loss(logits: torch.Tensor, indices: torch.Tensor, n_experts: int) -> torch.Tensor:
    """The Switch Transformer load-balancing loss of one router call, as transformers'
    ``load_balancing_loss_func`` computes it for one layer: ``n_experts * sum_e f_e * P_e``,
    ``f_e`` the top-k assignments to expert ``e`` per token, ``P_e`` its mean routing
    probability (a softmax over ``logits``). ``top_k`` when every expert takes the same share
    of the tokens; at most ``n_experts``, reached when every token goes to the same experts
    and they hold all the probability. Its gradient reaches the router through ``P`` only (the
    counts are not differentiable)."""
    probs = torch.softmax(logits.reshape(-1, n_experts).float(), dim=-1)
    flat = indices.detach().reshape(-1)
    ones = torch.ones_like(flat, dtype=torch.float32)
    counts = torch.zeros(n_experts, dtype=torch.float32, device=flat.device).index_add(
        0, flat, ones
    )
    return n_experts * torch.sum(counts / probs.shape[0] * probs.mean(dim=0))


def is_router(module: nn.Module) -> bool:
    """Whether ``module`` is a top-k router the watch reads (see the module docstring)."""
    experts, top_k = getattr(module, "num_experts", None), getattr(module, "top_k", None)
    return (
        type(module).__name__.endswith("Router")
        and isinstance(experts, int)
        and isinstance(top_k, int)
    )


def _in_backward() -> bool:
    """Whether autograd is running a backward now: a forward then is activation
    checkpointing's recomputation, which must not count its tokens twice."""
    current = getattr(torch._C, "_current_graph_task_id", None)
    return current is not None and current() != -1


def _infers_metadata(stage: Any) -> bool:
    """Whether ``stage`` (a ``PipelineStage``) runs its forward now only to learn its output's
    shape, as torch does once before the first step (on uninitialized inputs past the first
    stage): that forward's routing is no data and must not count. Torch 2.13 keeps the shapes
    in ``_stage_meta`` and sets its ``outputs`` once learned."""
    meta = getattr(stage, "_stage_meta", None)
    return meta is not None and getattr(meta, "outputs", False) is None


def _split(output: Any, name: str) -> tuple[torch.Tensor, torch.Tensor]:
    """A router's ``(logits, indices)``: its first tensor and its integer tensor."""
    parts = output if isinstance(output, tuple | list) else (output,)
    tensors = [p for p in parts if isinstance(p, torch.Tensor)]
    indices = [t for t in tensors if not t.is_floating_point() and not t.is_complex()]
    if not tensors or not indices or not tensors[0].is_floating_point():
        raise PrepareError(
            f"the router {name} ({type(output).__qualname__} out) did not return its logits "
            "first and the chosen experts' indices as an integer tensor.",
            subject=name,
            hint="Return (logits, weights, indices) from the router, as transformers' "
            "Qwen3MoeTopKRouter does.",
        )
    return tensors[0], indices[0]


class _AuxIntoBackward(torch.autograd.Function):
    """Identity on a stage's output whose backward also sends ``scale`` into ``aux``: the
    stage's backward then includes ``scale * aux`` without the loss ever seeing it."""

    @staticmethod
    def forward(ctx: Any, output: torch.Tensor, aux: torch.Tensor, scale: float) -> torch.Tensor:
        ctx.scale = scale
        ctx.aux_shape = aux.shape
        ctx.aux_dtype = aux.dtype
        # a copy, not a view: torch's zero-bubble schedules detach the stage output in place
        return output.clone()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, None]:
        aux_grad = torch.full(ctx.aux_shape, ctx.scale, dtype=ctx.aux_dtype, device=grad.device)
        return grad, aux_grad, None


class RouterWatch:
    """The routers of one prepared model, hooked (``fprep.watch_routers`` makes it)."""

    def __init__(self, state: PrepState, model: nn.Module) -> None:
        self._state = state
        root = getattr(model, "module", model)  # DDP wraps the model
        self.routers: dict[str, nn.Module] = {
            name: m for name, m in root.named_modules() if is_router(m)
        }
        self._counts: dict[str, torch.Tensor] = {}
        self._aux: dict[str, torch.Tensor] = {}
        self._stage_aux: list[torch.Tensor] | None = None
        self._inferring = False
        #: under pp: the weight each stage's aux loss enters its backward with (None: not at all)
        self.stage_scale: float | None = None
        self._handles = [
            router.register_forward_hook(self._recorder(name))
            for name, router in self.routers.items()
        ]
        self._stages = {id(stage.submod): stage for stage in handles_of(state).pipeline_stages}
        for part in handles_of(state).stage_modules:
            self._handles.append(part.register_forward_pre_hook(self._stage_starts))
            self._handles.append(part.register_forward_hook(self._stage_ends))

    def _recorder(self, name: str) -> Any:
        def record(module: nn.Module, args: Any, output: Any) -> None:
            if self._inferring:
                return
            logits, indices = _split(output, name)
            if indices.device.type == "meta":
                return
            n_experts: int = module.num_experts  # type: ignore[assignment]
            aux = balance_loss(logits, indices, n_experts)
            if _in_backward():
                # activation checkpointing's recomputation: the same operations as the forward
                # (it checks that they save as many tensors), but the tokens count once
                return
            flat = indices.detach().reshape(-1)
            counts = self._counts.get(name)
            if counts is None:
                counts = torch.zeros(n_experts, dtype=torch.int64, device=flat.device)
            self._counts[name] = counts.index_add(0, flat, torch.ones_like(flat))
            self._aux[name] = aux
            if self._stage_aux is not None:
                self._stage_aux.append(aux)

        return record

    def _stage_starts(self, module: nn.Module, args: Any) -> None:
        self._stage_aux = []
        self._inferring = _infers_metadata(self._stages.get(id(module)))

    def _stage_ends(self, module: nn.Module, args: Any, output: Any) -> Any:
        collected, self._stage_aux = self._stage_aux, None
        if self._inferring:
            self._inferring = False
            return None
        scale = self.stage_scale
        if not scale or not collected or not isinstance(output, torch.Tensor):
            return None
        if not torch.is_grad_enabled():
            return None
        aux = torch.stack(collected).sum()
        carried: torch.Tensor = _AuxIntoBackward.apply(output, aux, scale)  # type: ignore[no-untyped-call]
        return carried

    def aux_loss(self) -> torch.Tensor:
        """The sum over this rank's routers of their last call's ``balance_loss``, with its
        gradient path (add ``coef * watch.aux_loss()`` to the loss before the backward). Under
        pipeline parallelism: this rank's stages' routers, on the last micro-batch."""
        if not self._aux:
            raise PrepareError(
                "watch.aux_loss() is known after a forward: no router of this model has run "
                "since the watch began.",
                subject="aux_loss",
                hint="Call it after the model's forward (or fprep.pipeline_step).",
            )
        return torch.stack(list(self._aux.values())).sum()

    def token_counts(self, *, reduce: bool = False, reset: bool = True) -> dict[str, torch.Tensor]:
        """Per router (its name in the model), the tokens each expert received since the last
        read: an int64 tensor of ``num_experts`` counts (a token sent to ``top_k`` experts counts
        once for each). ``reduce=True`` sums them over the data-parallel ranks (a collective:
        call it on every rank). ``reset=False`` keeps counting on from here. Under pipeline
        parallelism a rank counts the routers of its own stages."""
        names = sorted(self.routers)
        counts = [self._zeros(name) for name in names]
        if reset:
            self._counts = {}
        if reduce and counts:
            from fprep.ranks import reduce as reduce_over_ranks

            summed = reduce_over_ranks(self._state, torch.stack(counts), "sum")
            counts = list(summed.unbind(0))
        return dict(zip(names, counts, strict=True))

    def _zeros(self, name: str) -> torch.Tensor:
        found = self._counts.get(name)
        if found is not None:
            return found.detach().clone()
        router = self.routers[name]
        param = next(router.parameters(), None)
        device = param.device if param is not None else handles_of(self._state).device
        experts: int = router.num_experts  # type: ignore[assignment]
        return torch.zeros(experts, dtype=torch.int64, device=device)

    def close(self) -> None:
        """Remove the hooks (the model is then exactly as prepare returned it)."""
        for handle in self._handles:
            handle.remove()
        self._handles = []


_KEEP: weakref.WeakKeyDictionary[nn.Module, RouterWatch] = weakref.WeakKeyDictionary()


def watch_routers(state: PrepState, model: nn.Module) -> RouterWatch:
    """The ``RouterWatch`` of the model ``prepare`` returned, made on first use (one per model:
    a second call returns the same watch). A ``ConfigError`` when the model has no router."""
    found = existing_watch(model)
    if found is not None:
        return found
    watch = RouterWatch(state, model)
    if not watch.routers and not _routes_elsewhere(state):
        watch.close()
        raise ConfigError(
            f"{type(getattr(model, 'module', model)).__qualname__} has no router this watch "
            "can read: a module whose class name ends in 'Router', with integer num_experts "
            "and top_k, returning its logits first and the chosen experts' indices.",
            subject="model",
            hint="Pass a mixture-of-experts model (transformers' Qwen3-MoE, Mixtral, GPT-OSS, "
            "or fprep.testing.models.MoE).",
        )
    _KEEP[model] = watch
    return watch


def _routes_elsewhere(state: PrepState) -> bool:
    """Under pp: whether another stage holds a router (a module whose class name ends in
    ``Router``), so that a rank whose stages hold none keeps an empty watch instead of refusing
    alone while the other ranks go on."""
    pipeline = state.pipeline
    whole = pipeline.whole if pipeline is not None else None
    return whole is not None and any(m.class_name.endswith("Router") for m in whole.modules)


def existing_watch(model: nn.Module) -> RouterWatch | None:
    """The open watch of ``model``, if ``watch_routers`` made one."""
    found = _KEEP.get(model)
    return found if found is not None and found._handles else None


def check_no_model_aux(model: nn.Module) -> None:
    """Under pipeline parallelism: refuse a transformers model configured to compute its own
    auxiliary loss (``output_router_logits=True``), which a stage would compute and drop."""
    config = getattr(getattr(model, "module", model), "config", None)
    if getattr(config, "output_router_logits", False):
        raise ConfigError(
            "the model's config has output_router_logits=True: under pipeline parallelism each "
            "stage would compute transformers' auxiliary loss over its own layers and drop it "
            "(only the output crosses the stages), training without it.",
            subject="output_router_logits",
            hint="Set config.output_router_logits=False and pass aux_loss_coef= "
            "(config.router_aux_loss_coef) to fprep.pipeline_step: each stage then adds its "
            "routers' loss to its own backward.",
        )
