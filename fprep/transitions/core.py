"""init_core: the strategy after resolution, the precision policy, offload, and the model checks
that depend on them (already prepared, Hugging Face device maps, 8/4-bit models).

``"auto"`` resolves to ``"none"`` for one process, ``"fast_ddp"`` on Gaudi and ``"ddp"``
elsewhere. Any strategy at world size 1 resolves to ``"none"``, with a note saying so.
"""

from __future__ import annotations

from fprep.errors import ConfigError, DeviceError, ModelError, PrepareError, TopologyError
from fprep.state import (
    CoreState,
    DeviceState,
    Fp8Plan,
    IgnoredState,
    PrecisionPolicy,
    PrepState,
    ResolvedStrategy,
    need,
)
from fprep.transitions._base import transition
from fprep.transitions.device import normalize_device
from fprep.transitions.dtypes import sixteen_bit_note
from fprep.transitions.fp8 import plan_fp8

_FP8_DEVICES = ("cuda", "hpu")


def _resolve(requested: str, world: int, device_type: str) -> tuple[ResolvedStrategy, str]:
    if requested == "auto":
        if world == 1:
            return "none", ""
        return ("fast_ddp" if device_type == "hpu" else "ddp"), ""
    if world == 1 and requested != "none":
        return "none", f"world size is 1: strategy {requested!r} resolved to 'none'."
    return requested, ""  # type: ignore[return-value]


def _resolve_beside_tp(requested: str, tp: int, dp: int) -> tuple[ResolvedStrategy, str]:
    """The data-parallel strategy over the ``dp = world / tp`` ranks beside tensor parallelism:
    FSDP2 (or HSDP) composes with tp; DDP over DTensors does not, and ``none`` with several
    data-parallel ranks would train unsynchronized replicas."""
    if requested in ("ddp", "fast_ddp"):
        raise ConfigError(
            f"strategy={requested!r} does not compose with tp={tp}: DDP cannot replicate "
            "tensor-parallel DTensors.",
            subject="strategy",
            hint="Use strategy='fsdp' (or 'hsdp') for the data-parallel part.",
        )
    if dp == 1:
        note = (
            ""
            if requested in ("auto", "none")
            else (
                f"tp={tp} is the whole world: strategy {requested!r} resolved to 'none' (no "
                "data-parallel ranks)."
            )
        )
        return "none", note
    if requested == "none":
        raise ConfigError(
            f"strategy='none' with tp={tp} leaves {dp} data-parallel replicas that never "
            "synchronize their gradients.",
            subject="strategy",
            hint=f"Use strategy='fsdp' (or 'hsdp'), or tp equal to the world size ({tp * dp}).",
        )
    return ("fsdp" if requested == "auto" else requested), ""  # type: ignore[return-value]


def _fp8_plan(
    state: PrepState, sharded: bool, device: DeviceState, ignored: IgnoredState
) -> Fp8Plan | None:
    if state.config.precision != "fp8":
        return None
    plan = plan_fp8(
        state.tree,
        state.config.fp8,
        ignored_modules=tuple(sorted(ignored.modules)),
        sharded=sharded,
        device_type=device.device_type,
    )
    if not plan.modules:
        _refuse_empty_fp8(plan)
    return plan


def _refuse_empty_fp8(plan: Fp8Plan) -> None:
    """precision='fp8' with no Linear in float8 would train in bf16 while saying fp8."""
    if not plan.kept:
        raise ConfigError(
            "precision='fp8' converts nn.Linear layers, and the model has none: it would "
            "train in bf16.",
            subject="precision",
            hint="Use precision='bf16'.",
        )
    small = [(f, w) for f, w in plan.kept if w.startswith("too small for float8")]
    fqn, why = (small or plan.kept)[0]
    anyway = ", or convert the small layers anyway with fp8={'skip_small': False}"
    raise ConfigError(
        f"precision='fp8' runs none of the model's {len(plan.kept)} Linear layers in float8, "
        f"so it would train in bf16 (e.g. {fqn!r}: {why}).",
        subject="fp8",
        hint=(
            "Use precision='bf16'"
            + (anyway if small else "")
            + "; fprep plan --precision fp8 lists every layer's reason."
        ),
    )


def _precision(state: PrepState, sharded: bool, fp8: Fp8Plan | None) -> PrecisionPolicy:
    """One precision setting, the same numerics under every strategy: the forward runs under
    autocast everywhere, so the ops autocast keeps in float32 (softmax, norms, losses) run in
    float32 also when FSDP2 already holds the parameters in low precision (a model computing
    its loss inside forward, as transformers' BERT, T5 or ViT do, would otherwise compute it in
    bf16 under fsdp only); outputs are float32 everywhere."""
    cfg = state.config
    if cfg.precision == "no":
        return PrecisionPolicy()
    low = "float16" if cfg.precision == "fp16" else "bfloat16"
    if sharded:
        return PrecisionPolicy(
            param_dtype=low,
            reduce_dtype=cfg.reduce_dtype or "float32",
            output_dtype="float32",
            autocast_dtype=low,
            grad_scaling=cfg.precision == "fp16",
            fp8=fp8 is not None,
            fp8_plan=fp8,
        )
    return PrecisionPolicy(
        autocast_dtype=low,
        output_dtype="float32",
        grad_scaling=cfg.precision == "fp16",
        fp8=fp8 is not None,
        fp8_plan=fp8,
    )


def _check_not_prepared(state: PrepState, ignored: IgnoredState) -> None:
    root = state.tree.root
    if state.tree.prepared or root.is_sharded or root.is_replicated:
        raise PrepareError(
            "the model is already prepared (or already wrapped by FSDP/DDP).",
            subject="model",
            hint="Prepare a model once; to change the plan, build the model again (or, for a "
            "sharded model, prepare the full-weight copy fprep.unwrap returns).",
        )
    for m in state.tree.modules[1:]:
        if m.is_sharded and m.fqn not in ignored.modules:
            raise ModelError(
                f"submodule {m.fqn!r} is already sharded by FSDP.",
                subject=m.fqn,
                hint="Prepare the unsharded model: fprep shards every unit itself (FSDP "
                "modules cannot be ignored either).",
            )


def _rank_device(state: PrepState, device: DeviceState) -> str | None:
    """The device this rank must train on, whatever the parameters say: ``PrepConfig.device``,
    else this process's accelerator (``None`` on a CPU-only process)."""
    topo = state.topology
    if state.config.device is not None:
        return normalize_device(state.config.device, topo.local_rank)
    if device.device_type == "cpu" or topo.device_type == "cpu":
        return None
    return normalize_device(topo.device_type, topo.local_rank)


def _check_quantized_placement(state: PrepState, device: DeviceState) -> None:
    """An 8/4-bit model cannot be moved, so it must already sit on this rank's device. The
    compute device follows the parameters, so compare with the rank's own device instead."""
    tree, topo = state.tree, state.topology
    bits = tree.quantization
    own = _rank_device(state, device)
    if bits is None or own is None:
        return
    where = [d for d in device.param_devices if d not in ("cpu", "meta")]
    if tree.hf_device_map is not None:
        # device maps name devices as an index ("0"), a type ("cuda") or both ("cuda:0")
        where += [
            f"{device.device_type}:{d}" if d.isdigit() else normalize_device(d, topo.local_rank)
            for _, d in tree.hf_device_map
            if d not in ("cpu", "disk")
        ]
    other = sorted({d for d in where if d != own})
    if other:
        raise DeviceError(
            f"a model loaded in {bits} sits on {', '.join(other)} but this rank trains on {own}.",
            subject="hf_device_map",
            hint="Load it with device_map={'': <this rank's device index>}.",
        )


def _check_hf_loading(state: PrepState, strategy: str, device: DeviceState) -> None:
    tree = state.tree
    if tree.hf_device_map is None:
        _check_quantized_placement(state, device)
        return
    devices = {d for _, d in tree.hf_device_map}
    if tree.quantization is not None:
        bits = tree.quantization
        if len(devices) > 1 and strategy != "none":
            raise ModelError(
                f"a model loaded in {bits} on several devices ({', '.join(sorted(devices))}) "
                "cannot be trained in a distributed mode.",
                subject="hf_device_map",
                hint="Run one process (naive pipeline parallelism over the device map), or load "
                "the model on one device per process.",
            )
        if "cpu" in devices or "disk" in devices:
            raise ModelError(
                f"a model loaded in {bits} with CPU or disk offload cannot be trained.",
                subject="hf_device_map",
                hint="Load it without offload (enough device memory for every layer).",
            )
        if len(devices) == 1:
            _check_quantized_placement(state, device)
        return
    if len(devices) > 1 and strategy != "none":
        raise ModelError(
            f"a model dispatched with device_map over {len(devices)} devices cannot be "
            "trained in a distributed mode.",
            subject="hf_device_map",
            hint="Run a single process, or load the model without device_map.",
        )


def _check_root_forward(state: PrepState, strategy: str) -> None:
    """FSDP and DDP run the root's forward: a container without one cannot be their root."""
    root = state.tree.root
    if strategy in ("fsdp", "hsdp", "ddp") and not root.can_run_forward:
        raise ModelError(
            f"the model is a {root.class_name}, a container without a forward; strategy "
            f"{strategy!r} wraps the model and runs its forward.",
            subject="model",
            hint="Prepare the module that runs the forward (one that holds this "
            f"{root.class_name}), or prepare each module inside it on its own.",
        )


def _check_not_compiled(state: PrepState) -> None:
    """Compiling a module the user already compiled nests two compilations (and ignores one
    set of options): refused rather than skipped, so that which options apply is never a
    guess."""
    if state.config.compile == "none":
        return
    for m in state.tree.modules:
        if m.is_compiled:
            how = "torch.compile" if m.compiled is False else ".compile()"
            raise ConfigError(
                f"module {m.fqn or '<root>'!r} is already compiled ({how}), and "
                f"compile={state.config.compile!r} would compile it again.",
                subject="compile",
                hint="Keep your compilation and set compile='none', or pass the model "
                "uncompiled (for torch.compile(model): its ._orig_mod) and let fprep compile it.",
            )


def _no_effect_notes(state: PrepState, strategy: str, sharded: bool) -> tuple[str, ...]:
    """Say which set options this plan does not use, instead of ignoring them silently."""
    cfg = state.config
    notes: list[str] = []
    if cfg.reduce_dtype is not None and (not sharded or cfg.precision == "no"):
        notes.append(
            "reduce_dtype has no effect: it applies to sharded strategies with precision set."
        )
    if cfg.hsdp_shard_size is not None and strategy != "hsdp":
        notes.append(f"hsdp_shard_size has no effect with strategy {strategy!r}.")
    if cfg.compile == "none" and (cfg.compile_backend or cfg.compile_mode):
        notes.append("compile_backend / compile_mode have no effect with compile='none'.")
    if cfg.ddp.comm_hook != "none" and strategy == "none" and cfg.strategy in ("ddp", "auto"):
        notes.append("ddp.comm_hook has no effect: with one process nothing is communicated.")
    return tuple(notes)


@transition
def init_core(state: PrepState) -> PrepState:
    pg = need(state.process_group, "init_process_group", "init_core")
    device = need(state.device, "init_device", "init_core")
    ignored = need(state.ignored, "init_ignored", "init_core")
    cfg = state.config
    _check_not_prepared(state, ignored)

    if cfg.tp > 1:
        strategy, note = _resolve_beside_tp(cfg.strategy, cfg.tp, pg.mesh.dp_size)
    else:
        strategy, note = _resolve(cfg.strategy, pg.world_size, device.device_type)
    notes: tuple[str, ...] = (note,) if note else ()
    _check_hf_loading(state, strategy, device)
    _check_root_forward(state, strategy)
    _check_not_compiled(state)
    sharded = strategy in ("fsdp", "hsdp")

    raf = cfg.effective_reshard_after_forward
    if not isinstance(raf, bool) and sharded:
        if pg.shard_size % raf:
            raise TopologyError(
                f"reshard_after_forward={raf} must divide the shard group size {pg.shard_size}.",
                subject="reshard_after_forward",
                hint="Use True, False, or a factor of the shard group size.",
            )
        if raf in (1, pg.shard_size):
            # Resharding to the whole shard group is True (also when the group is 1 rank).
            resolved = raf == pg.shard_size
            notes += (
                f"reshard_after_forward={raf} equals {resolved} for shard groups of "
                f"{pg.shard_size}.",
            )
            raf = resolved
    if cfg.offload == "cpu" and not sharded and cfg.strategy in ("fsdp", "hsdp"):
        notes += (f"offload='cpu' has no effect: strategy {strategy!r} shards nothing.",)
    elif cfg.offload == "cpu" and not sharded:
        raise ConfigError(
            f"offload='cpu' needs a sharded strategy (fsdp or hsdp); strategy is {strategy!r}.",
            subject="offload",
            hint="Use strategy='fsdp' with offload='cpu', or offload='none'.",
        )
    if cfg.precision == "fp8" and device.device_type not in _FP8_DEVICES:
        raise DeviceError(
            f"precision='fp8' needs a CUDA or Gaudi device; this rank computes on "
            f"{device.compute_device}.",
            subject="precision",
            hint="Use precision='bf16' on this device.",
        )
    if cfg.activation_checkpointing and cfg.wrap is None:
        notes += ("activation checkpointing without a wrap policy checkpoints the whole model.",)
    notes += _no_effect_notes(state, strategy, sharded)
    low = sixteen_bit_note(state.tree, ignored.params, cfg.precision)
    notes += (low,) if low else ()
    fp8 = _fp8_plan(state, sharded, device, ignored)
    if fp8 is not None and cfg.fp8.fsdp_float8_all_gather and not fp8.fsdp_float8_all_gather:
        notes += ("fp8.fsdp_float8_all_gather has no effect: it needs fsdp or hsdp on CUDA.",)
    return state.replace(
        core=CoreState(
            requested_strategy=cfg.strategy,
            strategy=strategy,
            reshard_after_forward=raf if sharded else False,
            precision=_precision(state, sharded, fp8),
            offload=cfg.offload,
            pin_memory=cfg.offload == "cpu" and device.device_type != "cpu",
            notes=notes,
        )
    )
