"""init_runtime: gradient sync, DDP options and comm hook, fast_ddp's fused all-reduce."""

from __future__ import annotations

import dataclasses

from _checks import check_plan_order, failure, run_pure, run_until, success
from hypothesis import given
from hypothesis import strategies as st

from fprep import ConfigError, DDPOptions, ModuleTree, PrepConfig, PrepState, Topology
from fprep.testing import strategies as fst
from fprep.topology import DEVICE_TYPES
from fprep.transitions import init_runtime

SMALL = fst.module_trees(max_depth=2)
TOPOLOGIES = fst.topologies(
    device_type=st.sampled_from(DEVICE_TYPES), backend=st.sampled_from((None, "gloo", "nccl"))
)


@given(fst.prep_states(before="init_runtime", inputs=fst.plan_inputs(topos=TOPOLOGIES)))
def test_pure_and_invariants(state: PrepState) -> None:
    runtime = success(run_pure(init_runtime, state)).runtime
    core, dev, pg, cfg = state.core, state.device, state.process_group, state.config
    assert runtime is not None and core is not None and dev is not None and pg is not None
    assert runtime.sync_gradients is True

    hook = cfg.ddp.comm_hook
    assert hook == "none" or core.strategy == "ddp"
    # torch refuses bf16_compress_hook by name on gloo: the plan records fprep's own hook.
    expected_hook = "bf16_gloo" if hook == "bf16" and dev.backend == "gloo" else hook
    assert runtime.comm_hook == expected_hook

    if core.strategy == "ddp":
        options = dataclasses.asdict(cfg.ddp)
        for key in ("comm_hook", "powersgd_rank", "powersgd_start_iter"):
            del options[key]
        assert dict(runtime.ddp_kwargs) == options
        assert [k for k, _ in runtime.ddp_kwargs] == sorted(options)
    else:
        assert runtime.ddp_kwargs == ()

    if core.strategy == "fast_ddp":
        assert runtime.fast_ddp_dtype == cfg.fast_ddp_dtype
        assert runtime.fast_ddp_scale is not None
        assert abs(runtime.fast_ddp_scale * pg.world_size - 1.0) < 1e-12
    else:
        assert runtime.fast_ddp_dtype is None and runtime.fast_ddp_scale is None


@given(
    SMALL,
    fst.topologies(),
    st.sampled_from(("fp16", "bf16", "powersgd")),
    st.sampled_from(("none", "fast_ddp", "fsdp", "hsdp", "ddp", "auto")),
)
def test_comm_hook_needs_ddp(
    tree: ModuleTree, topology: Topology, hook: str, strategy: str
) -> None:
    cfg = PrepConfig(strategy=strategy, ddp=DDPOptions(comm_hook=hook))  # type: ignore[arg-type]
    state = success(run_until("init_runtime", PrepState.initial(tree, cfg, topology)))
    assert state.core is not None
    result = run_pure(init_runtime, state)
    if state.core.strategy == "ddp":
        success(result)
    elif strategy in ("ddp", "auto"):  # one process resolves to 'none': hook dropped, noted
        runtime = success(result).runtime
        assert runtime is not None and runtime.comm_hook == "none"
        assert any("comm_hook has no effect" in n for n in state.core.notes)
    else:  # fast_ddp, fsdp, hsdp (or 'none' asked for explicitly)
        error = failure(result, ConfigError, "ddp.comm_hook")
        assert repr(state.core.strategy) in error.message


@given(fst.prep_states(inputs=fst.plan_inputs(trees=SMALL)))
def test_plan_order(complete: PrepState) -> None:
    check_plan_order("init_runtime", complete)
