"""init_param_handles: wrap units, the parameters each manages, this rank's shard of each, and how
meta-device parameters are materialized."""

from __future__ import annotations

import dataclasses
import math

import pytest
from _checks import check_plan_order, failure, run_pure, run_until, success, with_rank
from hypothesis import assume, given
from hypothesis import strategies as st
from returns.result import Failure, Success

import fprep
from fprep import ConfigError, ModelError, ModuleInfo, ModuleTree, PrepConfig, PrepState, Topology
from fprep.config import wrap_class_names
from fprep.sharding import shard_shape
from fprep.snapshot import NO_FORWARD_CONTAINERS, is_within, parent_fqn
from fprep.state import IgnoredState, ParamHandleState
from fprep.testing import strategies as fst
from fprep.transitions import init_param_handles

SMALL = fst.module_trees(max_depth=2)
SMALL_WORLDS = fst.topologies(nodes=st.integers(1, 2), local_world_size=st.integers(1, 4))


def handles_of(state: PrepState) -> ParamHandleState:
    result = run_pure(init_param_handles, state)
    if isinstance(result, Failure) and "is tied across units" in str(result.failure()):
        # A correct refusal (checked in test_tied_across_sibling_units_is_refused): the
        # generated wrap policy split a tied parameter's modules over sibling units.
        assert_split_tie(state, result.failure().subject)
        assume(False)
    if isinstance(result, Failure) and "matches no module of the model" in str(result.failure()):
        # A correct refusal (tests/test_misuse_plan.py): a drawn class policy names a class
        # the drawn tree does not have.
        assert isinstance(state.config.wrap, tuple)
        assert not all(
            any(m.is_a(n) for m in state.tree.modules) for n in wrap_class_names(state.config.wrap)
        )
        assume(False)
    handles = success(result).param_handles
    assert handles is not None
    return handles


def assert_split_tie(state: PrepState, name: str) -> None:
    """``name`` is tied, its modules lie in several units, none in their common unit."""
    assert state.ignored is not None and state.core is not None and state.core.is_sharded
    param = state.tree.param(name)
    assert param is not None and param.is_tied
    units = {""} | expected_units(state.tree, state.config, state.ignored)
    owner_units = {nearest_unit((o,), units) for o in param.owners}
    assert len(owner_units) > 1
    assert nearest_unit(param.owners, units) not in owner_units


# -- units and membership -----------------------------------------------------------------------
def expected_units(tree: ModuleTree, cfg: PrepConfig, ignored: IgnoredState) -> set[str]:
    """The wrap policy, written independently of fprep's implementation."""
    candidates = [m for m in tree.modules[1:] if m.fqn not in ignored.modules]
    wrap = cfg.wrap
    if wrap is None:
        return set()
    if isinstance(wrap, tuple):
        names = wrap_class_names(wrap)
        return {m.fqn for m in candidates if any(_is_a(m, n) for n in names)}
    if isinstance(wrap, int):
        return _size_units(tree, ignored, wrap)
    return {m.fqn for m in candidates if wrap(m)}


def _is_a(m: ModuleInfo, name: str) -> bool:
    classes = m.mro or (m.cls,)
    if "." in name:
        return name in classes
    return name in {c.split(".")[-1] for c in classes}


def _size_units(tree: ModuleTree, ignored: IgnoredState, min_params: int) -> set[str]:
    """FSDP's size policy, recursively: wrap a module once what is unwrapped below it reaches
    ``min_params`` (a tied parameter counts once, at the deepest module above all its owners);
    containers without a forward (ModuleList) are never wrapped, their count carries on to
    their parent."""
    owned: dict[str, int] = {}
    for p in tree.params:
        if p.fqn not in ignored.params:
            common = max(
                (m.fqn for m in tree.modules if all(is_within(o, m.fqn) for o in p.owners)),
                key=lambda fqn: fqn.count(".") + bool(fqn),
            )
            owned[common] = owned.get(common, 0) + p.numel
    units: set[str] = set()

    def unwrapped(fqn: str) -> int:
        module = tree.module(fqn)
        assert module is not None
        if fqn in ignored.modules:
            return 0
        total = owned.get(fqn, 0) + sum(unwrapped(c) for c in module.children)
        splits_a_tie = any(
            0 < sum(is_within(o, fqn) for o in p.owners) < len(p.owners)
            for p in tree.params
            if p.fqn not in ignored.params
        )
        if (
            fqn
            and total >= min_params
            and module.cls not in NO_FORWARD_CONTAINERS
            and not splits_a_tie
        ):
            units.add(fqn)
            return 0
        return total

    unwrapped("")
    return units


def nearest_unit(owners: tuple[str, ...], units: set[str]) -> str:
    """The deepest unit whose subtree holds every module that registers the parameter."""
    covering = [u for u in units if all(is_within(o, u) for o in owners)]
    return max(covering, key=lambda u: (u.count(".") + 1) if u else 0)


def check_units(state: PrepState, handles: ParamHandleState) -> None:
    tree, cfg, core, ignored = state.tree, state.config, state.core, state.ignored
    assert core is not None and ignored is not None
    fqns = [u.fqn for u in handles.units]
    assert len(set(fqns)) == len(fqns)
    assert fqns[-1] == "", "the root unit comes last"
    order = [m.fqn for m in tree.modules]
    assert fqns == sorted(fqns, key=order.index, reverse=True), "inner units first"
    assert set(fqns) == {""} | expected_units(tree, cfg, ignored)
    for unit in handles.units[:-1]:
        assert not any(is_within(unit.fqn, m) for m in ignored.modules), "unit in ignored module"
    for unit in handles.units:
        keeps_root = unit.fqn == "" and cfg.reshard_after_forward is None and len(fqns) > 1
        # the root stays gathered after forward (FSDP2's default) unless the user set it
        assert unit.reshard_after_forward == (False if keeps_root else core.reshard_after_forward)
        assert unit.cls == (tree.module(unit.fqn) or tree.root).cls
        assert unit.numel == sum(math.prod(s.shape) for s in unit.params)

    # Every managed parameter in exactly one unit, the nearest one holding all its owners.
    units = set(fqns)
    where = {s.fqn: u.fqn for u in handles.units for s in u.params}
    listed = [s.fqn for u in handles.units for s in u.params]
    assert len(listed) == len(set(listed))
    managed = [p for p in tree.params if p.fqn not in ignored.params]
    assert set(listed) == {p.fqn for p in managed}
    for p in managed:
        assert where[p.fqn] == nearest_unit(p.owners, units)

    # Ignored parameters: kept whole, listed once each, in model order.
    kept = [p for p in tree.params if p.fqn in ignored.params]
    assert [s.fqn for s in handles.ignored] == [p.fqn for p in kept]
    for s in handles.ignored:
        assert s.local_shape == s.padded_shape == s.shape

    # Every spec describes its parameter.
    by_fqn = {p.fqn: p for p in tree.params}
    for s in (*handles.specs, *handles.ignored):
        p = by_fqn[s.fqn]
        assert (s.names, s.shape, s.dtype, s.requires_grad) == (
            p.names,
            p.shape,
            p.dtype,
            p.requires_grad,
        )
        if not core.is_sharded:
            assert s.local_shape == s.padded_shape == s.shape


def check_materialize(state: PrepState, handles: ParamHandleState) -> None:
    tree, ignored, cfg = state.tree, state.ignored, state.config
    assert ignored is not None
    meta = {parent_fqn(n) for p in tree.params if p.is_meta for n in p.names}
    meta |= {parent_fqn(b.fqn) for b in tree.buffers if b.is_meta}
    meta -= ignored.modules
    plan = handles.materialize
    assert plan.modules == tuple(m.fqn for m in tree.modules if m.fqn in meta)
    if not meta:
        assert plan.method == "none"
    elif cfg.param_init_fn is not None:
        assert plan.method == "param_init_fn"
    else:
        assert plan.method == "reset_parameters"
        missing = [m for m in plan.modules if not tree.module(m).has_reset_parameters]  # type: ignore[union-attr]
        assert (plan.unavailable is None) == (not missing)


@given(fst.prep_states(before="init_param_handles", inputs=fst.plan_inputs(trees=SMALL)))
def test_pure_and_invariants(state: PrepState) -> None:
    handles = handles_of(state)
    check_units(state, handles)
    check_materialize(state, handles)


@given(
    fst.prep_states(
        before="init_param_handles",
        inputs=fst.plan_inputs(
            wrap=st.one_of(
                st.integers(1, 40),
                st.sampled_from(fst.WRAP_CLASS_CHOICES),
                st.sampled_from(fst.WRAP_PREDICATES),
            )
        ),
    )
)
def test_wrap_policies(state: PrepState) -> None:
    check_units(state, handles_of(state))


@given(fst.prep_states(before="init_param_handles", inputs=fst.plan_inputs(wrap=None)))
def test_no_wrap_policy_is_one_unit(state: PrepState) -> None:
    handles = handles_of(state)
    assert [u.fqn for u in handles.units] == [""]


# -- shards partition every parameter -----------------------------------------------------------
@given(
    fst.plan_inputs(
        trees=SMALL, topos=SMALL_WORLDS, strategy=st.sampled_from(("fsdp", "hsdp", "ddp"))
    )
)
def test_shards_partition_every_parameter(inputs: fst.PlanCase) -> None:
    tree, cfg, topology = inputs
    world = topology.world_size
    plans = {r: success(fprep.plan(tree, cfg, with_rank(topology, r))) for r in range(world)}
    specs = {r: {s.fqn: s for s in p.param_handles.specs} for r, p in plans.items()}  # type: ignore[union-attr]
    groups = {r: p.process_group for r, p in plans.items()}
    sharded = plans[0].core.is_sharded  # type: ignore[union-attr]

    # Every rank plans the same units over the same parameters; only its shards differ.
    for r in range(world):
        assert [u.fqn for u in plans[r].param_handles.units] == [  # type: ignore[union-attr]
            u.fqn
            for u in plans[0].param_handles.units  # type: ignore[union-attr]
        ]
        assert specs[r].keys() == specs[0].keys()

    for fqn, spec in specs[0].items():
        rows, rest = spec.shape[0], spec.shape[1:]
        if not sharded:
            for r in range(world):
                assert specs[r][fqn].local_shape == specs[r][fqn].padded_shape == spec.shape
            continue
        for shard_group in {g.shard_group for g in groups.values()}:  # type: ignore[union-attr]
            size = len(shard_group)
            chunk = -(-rows // size)
            local = [specs[r][fqn].local_shape for r in shard_group]
            padded = {specs[r][fqn].padded_shape for r in shard_group}
            # Every rank allocates the same padded chunk; the padding is less than one row per
            # rank (the chunk is the smallest that fits), and trailing dims are whole.
            assert padded == {(chunk, *rest)}
            assert chunk * size - rows < max(size, 1) and (rows > 0 or chunk == 0)
            assert all(shape[1:] == rest and 0 <= shape[0] <= chunk for shape in local)
            # The local shards are exactly the parameter: elements, and rows when it has any.
            assert sum(math.prod(s) for s in local) == math.prod(spec.shape)
            if all(rest):
                assert sum(s[0] for s in local) == rows
                # torch.chunk order: full chunks first, then at most one partial, then empty.
                assert [s[0] for s in local] == [
                    max(0, min(chunk, rows - chunk * i)) for i in range(size)
                ]
        # Replicas (same shard coordinate in different shard groups) hold the same shard.
        for r in range(world):
            twin = groups[0].shard_group[groups[r].shard_rank]  # type: ignore[union-attr]
            assert specs[r][fqn].local_shape == specs[twin][fqn].local_shape


@given(
    fst.prep_states(
        before="init_param_handles",
        inputs=fst.plan_inputs(trees=SMALL, topos=SMALL_WORLDS, strategy="hsdp"),
    )
)
def test_hsdp_shards_use_the_shard_coordinate(state: PrepState) -> None:
    pg, core = state.process_group, state.core
    assert pg is not None and core is not None
    handles = handles_of(state)
    if not core.is_sharded:  # world 1
        return
    _, shard = pg.coordinate
    assert shard == pg.shard_rank and pg.mesh_shape[1] == pg.shard_size
    for s in handles.specs:
        assert (s.local_shape, s.padded_shape) == shard_shape(s.shape, pg.shard_size, shard)


# -- failures as values -------------------------------------------------------------------------
@given(
    fst.module_trees(max_depth=2, allow_scalar=True),
    fst.topologies(nodes=st.integers(1, 2), local_world_size=st.integers(2, 4)),
    st.data(),
)
def test_scalar_parameters_under_sharding(
    tree: ModuleTree, topology: Topology, data: st.DataObject
) -> None:
    names = [p.fqn for p in tree.params]
    ignored = data.draw(
        st.lists(st.sampled_from(names), max_size=2, unique=True) if names else st.just([])
    )
    strategy = data.draw(st.sampled_from(("fsdp", "hsdp", "ddp", "fast_ddp")))
    cfg = PrepConfig(strategy=strategy, ignored_params=tuple(ignored))  # type: ignore[arg-type]
    state = success(run_until("init_param_handles", PrepState.initial(tree, cfg, topology)))
    assert state.ignored is not None
    scalars = [p.fqn for p in tree.params if not p.shape and p.fqn not in state.ignored.params]
    result = run_pure(init_param_handles, state)
    if scalars and strategy in ("fsdp", "hsdp"):
        error = failure(result, ModelError, scalars[0])
        assert "scalar" in error.message
    else:  # replicated, or ignored: kept whole
        handles = success(result).param_handles
        assert handles is not None
        check_units(state, handles)


@given(
    fst.module_trees(max_depth=2, allow_meta=True, allow_missing_reset=True),
    fst.topologies(),
    st.booleans(),
)
def test_meta_modules_without_reset_parameters(
    tree: ModuleTree, topology: Topology, with_init_fn: bool
) -> None:
    cfg = PrepConfig(param_init_fn=fst.noop_init if with_init_fn else None)
    state = success(run_until("init_param_handles", PrepState.initial(tree, cfg, topology)))
    meta = {parent_fqn(n) for p in tree.params if p.is_meta for n in p.names}
    meta |= {parent_fqn(b.fqn) for b in tree.buffers if b.is_meta}
    cannot = [m.fqn for m in tree.modules if m.fqn in meta and not m.has_reset_parameters]
    result = run_pure(init_param_handles, state)
    if cannot and not with_init_fn:
        # planned (a plan never needs weights), with a note; prepare refuses it
        unavailable = success(result).param_handles.materialize.unavailable  # type: ignore[union-attr]
        assert unavailable is not None and unavailable.subject == cannot[0]
        assert "reset_parameters" in unavailable.message
        with pytest.raises(ModelError, match="reset_parameters"):
            success(result).param_handles.materialize.check()  # type: ignore[union-attr]
    else:
        handles = success(result).param_handles
        assert handles is not None
        check_materialize(state, handles)


@given(fst.module_trees(max_depth=2, allow_meta=True), fst.topologies(), st.booleans())
def test_sync_module_states_with_meta_weights_on_rank_zero(
    tree: ModuleTree, topology: Topology, with_init_fn: bool
) -> None:
    assume(tree.is_meta)
    cfg = PrepConfig(sync_module_states=True, param_init_fn=fst.noop_init if with_init_fn else None)
    state = success(run_until("init_param_handles", PrepState.initial(tree, cfg, topology)))
    result = run_pure(init_param_handles, state)
    if topology.rank == 0 and not with_init_fn:
        error = failure(result, ModelError, "sync_module_states")
        assert "meta" in error.message
    else:  # other ranks may stay on meta; a param_init_fn initializes rank 0
        check_materialize(state, success(result).param_handles)  # type: ignore[arg-type]


def broken_policy(module: ModuleInfo) -> bool:
    raise KeyError(module.fqn)


def refusing_policy(module: ModuleInfo) -> bool:
    raise fprep.ModelError("no wrapping here", subject=module.fqn)


@given(SMALL, fst.topologies(), st.booleans())
def test_wrap_policy_that_raises(tree: ModuleTree, topology: Topology, prep_error: bool) -> None:
    assume(len(tree.modules) > 1)
    policy = refusing_policy if prep_error else broken_policy
    state = success(
        run_until("init_param_handles", PrepState.initial(tree, PrepConfig(wrap=policy), topology))
    )
    first = tree.modules[1].fqn
    if prep_error:  # the policy's own PrepError comes back as it is
        failure(run_pure(init_param_handles, state), ModelError, first)
    else:
        error = failure(run_pure(init_param_handles, state), ConfigError, "wrap")
        assert "KeyError" in error.message and repr(first) in error.message


def every_module(module: ModuleInfo) -> bool:
    return True


@given(fst.prep_states(before="init_param_handles", inputs=fst.plan_inputs(trees=SMALL)))
def test_wrap_policy_selecting_a_container(state: PrepState) -> None:
    # fully_shard refuses modules without a forward (ModuleList): a policy naming one is refused.
    assert state.ignored is not None
    containers = [
        m.fqn
        for m in state.tree.modules[1:]
        if m.cls in NO_FORWARD_CONTAINERS and m.fqn not in state.ignored.modules
    ]
    for wrap in (every_module, ("ModuleList",)):
        cfg = state.config.replace(wrap=wrap)
        bad = state.replace(inputs=dataclasses.replace(state.inputs, config=cfg))
        result = run_pure(init_param_handles, bad)
        if containers:
            error = failure(result, ConfigError, "wrap")
            assert repr(containers[0]) in error.message
        else:
            check_units(bad, handles_of(bad))


@given(fst.prep_states(inputs=fst.plan_inputs(trees=SMALL)))
def test_plan_order(complete: PrepState) -> None:
    check_plan_order("init_param_handles", complete)


def test_size_policy_never_splits_a_tie() -> None:
    """wrap=<size> would make both tied modules units; it wraps their parent instead."""
    from fprep.snapshot import ParamInfo

    leaf = ("torch.nn.modules.linear.Linear", "torch.nn.modules.module.Module")
    tree = ModuleTree(
        modules=(
            ModuleInfo(fqn="", cls="x.Net", children=("p",)),
            ModuleInfo(fqn="p", cls="x.Pair", children=("p.a", "p.b")),
            ModuleInfo(fqn="p.a", cls=leaf[0], mro=leaf, param_names=("w", "u")),
            ModuleInfo(fqn="p.b", cls=leaf[0], mro=leaf, param_names=("w", "v")),
        ),
        params=(
            ParamInfo(names=("p.a.w", "p.b.w"), shape=(4, 4)),
            ParamInfo(names=("p.a.u",), shape=(8,)),
            ParamInfo(names=("p.b.v",), shape=(8,)),
        ),
    )
    state = fprep.plan(tree, PrepConfig(strategy="fsdp", wrap=1), Topology(world_size=2)).unwrap()
    assert state.param_handles is not None
    assert [u.fqn for u in state.param_handles.units] == ["p", ""]


def test_tied_across_sibling_units_is_refused() -> None:
    """FSDP2 would reach the tied weight from neither unit: a ModelError naming it."""
    from fprep.snapshot import ParamInfo

    block = ("x.Block", "torch.nn.modules.module.Module")
    tree = ModuleTree(
        modules=(
            ModuleInfo(fqn="", cls="x.Net", children=("a", "b")),
            ModuleInfo(fqn="a", cls=block[0], mro=block, param_names=("w",)),
            ModuleInfo(fqn="b", cls=block[0], mro=block, param_names=("w",)),
        ),
        params=(ParamInfo(names=("a.w", "b.w"), shape=(4, 4)),),
    )
    cfg = PrepConfig(strategy="fsdp", wrap="Block")
    result = fprep.plan(tree, cfg, fprep.Topology(world_size=2))
    assert isinstance(result, Failure)
    error = result.failure()
    assert isinstance(error, fprep.ModelError) and error.subject == "a.w"
    ok = fprep.plan(tree, cfg.replace(wrap=None), fprep.Topology(world_size=2))
    assert isinstance(ok, Success)


def test_ignored_meta_tensors_are_refused() -> None:
    import torch

    with torch.device("meta"):
        model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 4))
    tree = ModuleTree.of(model)
    for cfg in (PrepConfig(ignored_modules=("1",)), PrepConfig(ignored_params=("1.bias",))):
        error = fprep.plan(tree, cfg, Topology()).failure()
        assert isinstance(error, ModelError) and error.subject.startswith("1.")


def test_container_subclass_without_forward_cannot_be_a_unit() -> None:
    import torch

    class Blocks(torch.nn.ModuleList):
        pass

    model = torch.nn.Sequential(Blocks([torch.nn.Linear(4, 4)]))
    tree = ModuleTree.of(model)
    assert tree.module("0") is not None and not tree.module("0").can_run_forward  # type: ignore[union-attr]
    error = fprep.plan(tree, PrepConfig(wrap=Blocks), Topology()).failure()
    assert isinstance(error, ConfigError) and error.subject == "wrap"
