"""fp8: swap the planned Linear layers (``Fp8Plan.modules``) for float8 ones.

CUDA: torchao's ``convert_to_float8_training`` with the plan's recipe, its module filter set to
exactly the planned FQNs, and float8 all-gather when the plan says so (FSDP2 then all-gathers
the converted weights in float8; the ``shard`` step runs after this one, as torchao requires).
Gaudi: Habana's transformer engine ``Linear`` for the same modules. Which torchao is needed, and
what it must offer, is decided in ``fprep.compat``.

The step runs first after ``connect``, before ``checkpoint``, ``compile_regions`` and
``shard``; ``precision`` later adds bf16 autocast for everything else.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from typing import Any

from torch import nn

from fprep.apply.steps import handles_of, skipped, step, with_handles
from fprep.compat import float8_api, float8_config, float8_tp_styles
from fprep.devices import import_or_fail
from fprep.errors import PrepareError
from fprep.state import Fp8Plan, PrepState, need


def check_fp8_available(state: PrepState) -> None:
    """Before any effect: a ``ConfigError`` when the plan needs a torchao this process lacks."""
    core = state.core
    if core is None or core.precision.fp8_plan is None or not core.precision.fp8_plan.modules:
        return
    if state.device is not None and state.device.device_type == "cuda":
        float8_config(
            float8_api(),
            core.precision.fp8_plan.recipe,
            fsdp_all_gather=core.precision.fp8_plan.fsdp_float8_all_gather,
            emulate=False,
        )
    tps = state.tensor_parallel
    if tps is not None and any(cls.startswith("Float8") for _, cls in tps.float8):
        float8_tp_styles(float8_api("precision='fp8' with tp > 1"))


def convert_fp8(
    model: nn.Module, plan: Fp8Plan, device_type: str, *, emulate: bool = False
) -> nn.Module:
    """Swap ``plan.modules`` for float8 Linear layers (``emulate``: torchao's high-precision
    emulation of the float8 matmuls, for devices without float8 kernels such as the CPU)."""
    wanted = frozenset(plan.modules)
    if not wanted:
        return model
    if device_type == "cuda" or emulate:
        api = float8_api()
        config = float8_config(
            api, plan.recipe, fsdp_all_gather=plan.fsdp_float8_all_gather, emulate=emulate
        )

        def planned(_module: nn.Module, fqn: str) -> bool:
            return fqn in wanted

        converted = api.convert(model, module_filter_fn=planned, config=config)
        return converted if isinstance(converted, nn.Module) else model
    if device_type == "hpu":
        te = import_or_fail(
            "habana_frameworks.torch.hpex.experimental.transformer_engine",
            "precision='fp8' on Gaudi",
        )
        _swap_linears(model, te, wanted, "")
        return model
    raise PrepareError(
        f"precision='fp8' is not available on {device_type}.",
        subject="precision",
        hint="Use precision='bf16' here.",
    )


def _swap_linears(module: nn.Module, te: Any, wanted: frozenset[str], prefix: str) -> None:
    for name, child in list(module.named_children()):
        fqn = f"{prefix}.{name}" if prefix else name
        if fqn in wanted and isinstance(child, nn.Linear):
            fp8 = te.Linear(child.in_features, child.out_features, bias=child.bias is not None)
            fp8.load_state_dict(child.state_dict())
            setattr(module, name, fp8)
        else:
            _swap_linears(child, te, wanted, fqn)


@step("fp8")
def fp8(state: PrepState, model: nn.Module) -> tuple[PrepState, nn.Module]:
    """Swap the planned Linear layers before ``checkpoint``, ``compile_regions`` and ``shard``
    (on the meta device when the model is built there, as torchtitan does): FSDP2 then shards
    the float8 layers' weights, and all-gathers them in float8 when the plan says so.

    On a CPU (which the plan refuses for fp8; reached only by a hand-edited plan, as in the
    tests) torchao emulates the float8 matmuls in high precision."""
    plan = need(state.core, "init_core", "fp8").precision.fp8_plan
    if plan is None or not plan.modules:
        return skipped(state, model)
    device_type = handles_of(state).device.type
    model = convert_fp8(model, plan, device_type, emulate=device_type == "cpu")
    if plan.fsdp_float8_all_gather and device_type != "hpu":
        state = with_handles(state, fp8_scales=_scale_refresher(model))
    return state, model


def _scale_refresher(model: nn.Module) -> Callable[[], None]:
    """torchao's ``precompute_float8_dynamic_scale_for_fsdp`` over ``model`` (held weakly).

    With float8 all-gather, FSDP2 casts each weight shard to float8 before gathering it, with
    one scale for the whole weight: computed by an all-reduce per weight at every all-gather,
    or, once precomputed, by one all-reduce for all of them. A precomputed scale is used until
    the next precompute, so it must follow every change of the weights (``optimizer_step``,
    ``fprep.load``): a stale one would saturate grown weights silently."""
    precompute = float8_api("fp8.fsdp_float8_all_gather").precompute_fsdp_scales
    ref = weakref.ref(model)

    def refresh() -> None:
        live = ref()
        if live is not None:
            precompute(live)

    return refresh


def fp8_modules(model: nn.Module) -> tuple[str, ...]:
    """FQNs of the float8 Linear layers in ``model`` (torchao's ``Float8Linear``)."""
    return tuple(n for n, m in model.named_modules() if type(m).__name__ == "Float8Linear")
