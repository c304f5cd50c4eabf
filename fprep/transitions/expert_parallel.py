"""init_expert_parallel: which experts each rank holds, and with whom it exchanges tokens (pure).

Runs only when ``PrepConfig.ep > 1``, after ``init_extension`` (it reads the mesh record's ep
view, the resolved strategy and the ignored parameters). It finds the experts modules by the
expert-parallel plan: ``PrepConfig.ep_plan``, or the model's own (transformers'
``base_model_ep_plan``: ``layers.*.mlp.experts: ep_dispatch_experts`` and ``grouped_gemm`` on
its ``gate_up_proj`` and ``down_proj``), and for each of them the experts this rank keeps
(``fprep.layout.experts``), the shape FSDP leaves it of each parameter, and its bytes.

It refuses, before any effect: an ep that does not divide a module's expert count (ep not
dividing dp_shard x tp is refused by ``init_process_group``); what expert parallelism is not
composed with yet (pipeline and tensor parallelism, sequence parallelism, strategies other than
``fsdp`` and ``hsdp``, compile, ``sync_module_states``, experts on the meta device and
``weights=``); a plan that names nothing, or a module whose parameters are not fused experts
(``experts x 2I x H`` gate and up projections, ``experts x H x I`` down projection); ignored
experts.
"""

from __future__ import annotations

from typing import Literal

from fprep.config import EP_STYLES, PrepConfig
from fprep.errors import ConfigError, ModelError
from fprep.layout.experts import ExpertLayout, divisors
from fprep.layout.styles import pattern_regex
from fprep.snapshot import ModuleInfo, ModuleTree, dtype_bytes, join_fqn
from fprep.state import (
    ExpertModule,
    ExpertParallelState,
    ExpertParam,
    PrepState,
    need,
)
from fprep.transitions._base import transition

DISPATCH = "ep_dispatch_experts"
GROUPED = "grouped_gemm"
#: The parameters of a fused experts module fprep dispatches, in transformers' layout.
EXPERT_PARAMS = ("gate_up_proj", "down_proj")


def refuse_not_composed(cfg: PrepConfig) -> None:
    """Refuse what expert parallelism is not composed with yet (``init_process_group`` calls
    it first, so that these refusals come before any other transition's about them)."""
    ep = cfg.ep
    not_yet = (
        ("pp", cfg.pp > 1, f"pp={cfg.pp}", "Leave pp at 1"),
        ("tp", cfg.tp > 1, f"tp={cfg.tp}", "Leave tp at 1 (ep borrows data-parallel ranks)"),
        (
            "sequence_parallel",
            cfg.sequence_parallel,
            "sequence_parallel=True",
            "Leave sequence_parallel False",
        ),
    )
    for subject, asked, what, hint in not_yet:
        if asked:
            raise ConfigError(
                f"PrepConfig.ep={ep} with {what}: fprep does not compose expert parallelism "
                f"with {subject.replace('_', ' ')} yet.",
                subject=subject,
                hint=f"{hint}, or set ep=1 (experts are then sharded like every other parameter).",
            )


def _refuse_strategy(state: PrepState) -> None:
    ep = state.config.ep
    core = need(state.core, "init_core", "init_expert_parallel")
    if core.strategy not in ("fsdp", "hsdp"):
        raise ConfigError(
            f"PrepConfig.ep={ep} needs strategy='fsdp' or 'hsdp' (the experts are sharded by "
            f"FSDP over the ranks holding the same experts); the strategy is {core.strategy!r}.",
            subject="strategy",
            hint="Set strategy='fsdp' (or 'hsdp'), or ep=1.",
        )


def _plan_pairs(
    state: PrepState,
) -> tuple[tuple[tuple[str, str], ...], Literal["config", "model"]]:
    cfg, tree = state.config, state.tree
    if cfg.ep_plan_pairs is not None:
        return cfg.ep_plan_pairs, "config"
    if tree.ep_plan:
        return tree.ep_plan, "model"
    raise ConfigError(
        f"PrepConfig.ep={cfg.ep}, but {tree.root.class_name} declares no expert-parallel plan.",
        subject="ep_plan",
        hint='Pass ep_plan={"layers.*.mlp.experts": "ep_dispatch_experts"} naming its experts '
        "modules, or set ep=1.",
    )


def _matches(
    tree: ModuleTree, pairs: tuple[tuple[str, str], ...], field: str
) -> tuple[list[ModuleInfo], set[str]]:
    """The modules the plan dispatches and the parameters it names ``grouped_gemm``."""
    modules: dict[str, ModuleInfo] = {}
    grouped: set[str] = set()
    params = {join_fqn(m.fqn, n) for m in tree.modules for n in m.param_names}
    for pattern, style in pairs:
        if style not in EP_STYLES:
            raise ConfigError(
                f"{field} gives {pattern!r} the style {style!r}, which fprep does not apply.",
                subject=field,
                hint=f"Use {', '.join(map(repr, EP_STYLES))}.",
            )
        rx = pattern_regex(pattern)
        if style == DISPATCH:
            hits = [m.fqn for m in tree.modules[1:] if rx.fullmatch(m.fqn)]
            modules.update((m.fqn, m) for m in tree.modules[1:] if m.fqn in hits)
        else:
            hits = [p for p in params if rx.fullmatch(p)]
            grouped.update(hits)
        if not hits:
            raise ConfigError(
                f"{field} pattern {pattern!r} ({style!r}) matches no "
                f"{'module' if style == DISPATCH else 'parameter'} of {tree.root.class_name}.",
                subject="ep_plan",
                hint="Patterns are FQNs as in model.named_modules(), '*' standing for one "
                "segment (a layer number), e.g. 'layers.*.mlp.experts'.",
            )
    if not modules:
        raise ConfigError(
            f"{field} names no module {DISPATCH!r}: nothing would be dispatched.",
            subject="ep_plan",
            hint=f'Add {{"layers.*.mlp.experts": "{DISPATCH}"}} for the experts modules.',
        )
    return [modules[m.fqn] for m in tree.modules if m.fqn in modules], grouped


def _expert_module(
    state: PrepState, info: ModuleInfo, grouped: set[str], field: str
) -> ExpertModule:
    tree, mesh = state.tree, need(state.process_group, "init_process_group", "ep").mesh
    found = {}
    for name in info.param_names:
        param = tree.param(join_fqn(info.fqn, name))
        if param is not None:
            found[name] = param
    shapes = {n: p.shape for n, p in found.items()}
    gate_up, down = shapes.get("gate_up_proj"), shapes.get("down_proj")
    fused = (
        set(shapes) == set(EXPERT_PARAMS)
        and gate_up is not None
        and down is not None
        and len(gate_up) == len(down) == 3
        and gate_up[0] == down[0]
        and gate_up[2] == down[1]
        and gate_up[1] == 2 * down[2]
    )
    if not fused:
        raise ModelError(
            f"{field} dispatches {info.fqn!r} ({info.class_name}), whose parameters "
            f"{shapes} are not fused experts: fprep dispatches modules holding gate_up_proj "
            "(experts x 2I x H) and down_proj (experts x H x I), transformers' layout.",
            subject=info.fqn,
            hint="Name only such experts modules in the expert-parallel plan.",
        )
    assert gate_up is not None
    layout_of = _layout(gate_up[0], mesh.ep, mesh.efsdp, info.fqn)
    params = []
    for name in EXPERT_PARAMS:
        param = found[name]
        params.append(
            ExpertParam(
                fqn=param.fqn,
                shape=param.shape,
                local_shape=layout_of.local_shape(param.shape, mesh.efsdp_rank),
                fsdp_dim=layout_of.fsdp_dim(param.shape),
                itemsize=dtype_bytes(param.dtype),
                grouped_gemm=any(n in grouped for n in param.names),
            )
        )
    return ExpertModule(fqn=info.fqn, cls=info.cls, layout=layout_of, params=tuple(params))


def _layout(num_experts: int, ep: int, efsdp: int, fqn: str) -> ExpertLayout:
    if num_experts % ep:
        raise ConfigError(
            f"PrepConfig.ep={ep} does not divide the {num_experts} experts of {fqn!r}: every "
            "expert-parallel rank holds the same number of whole experts.",
            subject="ep",
            hint=f"Choose ep among the divisors of {num_experts} "
            f"({', '.join(map(str, divisors(num_experts)))}) that also divide the "
            "data-parallel ranks.",
        )
    return ExpertLayout(num_experts=num_experts, ep=ep, efsdp=efsdp)


@transition
def init_expert_parallel(state: PrepState) -> PrepState:
    if state.config.ep == 1:
        return state
    mesh = need(state.process_group, "init_process_group", "init_expert_parallel").mesh
    refuse_not_composed(state.config)
    _refuse_strategy(state)
    if state.config.compile != "none":
        raise ConfigError(
            f"PrepConfig.ep={state.config.ep} with compile={state.config.compile!r}: the "
            "experts' dispatch reads its all-to-all sizes on the host, which fprep has not "
            "compiled and checked yet.",
            subject="compile",
            hint="Leave compile='none' with ep > 1, or set ep=1.",
        )
    if state.config.sync_module_states:
        raise ConfigError(
            f"PrepConfig.ep={state.config.ep} with sync_module_states=True: rank 0 holds only "
            "its own experts, so it cannot send the others theirs.",
            subject="sync_module_states",
            hint="Build the model with the same weights on every rank (the same seed, or "
            "from_pretrained) and leave sync_module_states False.",
        )
    if state.config.weights is not None:
        raise ConfigError(
            f"PrepConfig.ep={state.config.ep} with weights=: fprep does not yet read each "
            "rank's experts from the files.",
            subject="weights",
            hint="Load the model with from_pretrained (real weights) and pass it without "
            "weights=, or set ep=1.",
        )
    pairs, source = _plan_pairs(state)
    field = "PrepConfig.ep_plan" if source == "config" else "the model's ep_plan"
    infos, grouped = _matches(state.tree, pairs, field)
    ignored = need(state.ignored, "init_ignored", "init_expert_parallel").params
    modules = tuple(_expert_module(state, info, grouped, field) for info in infos)
    for module in modules:
        for p in module.params:
            info = state.tree.param(p.fqn)
            if info is not None and info.is_meta:
                raise ConfigError(
                    f"PrepConfig.ep={state.config.ep}: the experts {p.fqn!r} are on the meta "
                    "device; fprep does not yet materialize each rank's experts from a seed.",
                    subject="ep",
                    hint="Build the model with real weights (on the CPU, or from_pretrained) "
                    "and pass it to prepare: each rank then keeps its experts' slices.",
                )
            if p.fqn in ignored:
                raise ConfigError(
                    f"{p.fqn!r} is both ignored and dispatched by expert parallelism.",
                    subject="ignored_params",
                    hint="Leave the experts out of ignored_modules / ignored_params, or set ep=1.",
                )
    return state.replace(
        expert_parallel=ExpertParallelState(mesh=mesh, modules=modules, source=source)
    )
