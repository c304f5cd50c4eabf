"""init_ignored: ignored modules (closed under submodules), parameters (all names), buffers."""

from __future__ import annotations

import pytest
from _checks import failure, replace_modules, run_pure, sharded, success
from hypothesis import assume, given
from hypothesis import strategies as st

from fprep import (
    ConfigError,
    IgnoredStateError,
    ModuleInfo,
    ModuleTree,
    PrepConfig,
    PrepState,
    Topology,
)
from fprep.snapshot import is_within, parent_fqn
from fprep.testing import strategies as fst
from fprep.transitions import init_ignored

TREES = fst.module_trees(allow_tied=True, allow_meta=st.booleans())


def initial(tree: ModuleTree, **cfg: object) -> PrepState:
    return PrepState.initial(tree, PrepConfig(**cfg), Topology())  # type: ignore[arg-type]


@given(fst.prep_states(before="init_ignored"))
def test_pure_and_invariants(state: PrepState) -> None:
    ignored = success(run_pure(init_ignored, state)).ignored
    assert ignored is not None
    tree, cfg = state.tree, state.config
    fqns = {m.fqn for m in tree.modules}

    # Modules: exactly the named ones and everything below them, closed under submodules.
    assert ignored.modules <= fqns
    assert set(cfg.ignored_modules) <= ignored.modules
    assert ignored.modules == {
        m.fqn for m in tree.modules if any(is_within(m.fqn, r) for r in cfg.ignored_modules)
    }
    for m in tree.modules:
        if m.fqn in ignored.modules:
            assert set(m.children) <= ignored.modules
        elif m.fqn:
            assert parent_fqn(m.fqn) not in ignored.modules

    # Parameters: all names of a parameter or none of them (tied parameters are never split).
    names = {n for p in tree.params for n in p.names}
    assert ignored.params <= names
    for p in tree.params:
        inside = {n in ignored.params for n in p.names}
        assert len(inside) == 1, f"tied parameter {p.names} half ignored"
        expected = any(parent_fqn(n) in ignored.modules for n in p.names) or bool(
            set(cfg.ignored_params) & set(p.names)
        )
        assert (p.fqn in ignored.params) == expected
    assert set(cfg.ignored_params) <= ignored.params
    if cfg.ignored_params:
        assert not ignored.modules

    # Buffers: those registered by ignored modules.
    assert ignored.buffers == {b.fqn for b in tree.buffers if parent_fqn(b.fqn) in ignored.modules}

    # The root ignored is allowed, with a note.
    assert bool(ignored.notes) == ("" in ignored.modules)
    if "" in ignored.modules:
        assert ignored.params == names and ignored.modules == fqns


@given(TREES, st.data())
def test_every_name_of_a_tied_parameter(tree: ModuleTree, data: st.DataObject) -> None:
    tied = [p for p in tree.params if p.is_tied]
    assume(tied)
    p = data.draw(st.sampled_from(tied))
    name = data.draw(st.sampled_from(p.names))  # any one of its names ignores all of them
    ignored = success(run_pure(init_ignored, initial(tree, ignored_params=(name,)))).ignored
    assert ignored is not None and set(p.names) <= ignored.params
    # Ignoring one owner module of a tied parameter ignores the parameter everywhere.
    owner = data.draw(st.sampled_from(p.owners))
    ignored = success(run_pure(init_ignored, initial(tree, ignored_modules=(owner,)))).ignored
    assert ignored is not None and set(p.names) <= ignored.params


# -- failures as values -------------------------------------------------------------------------
def _unknown(tree: ModuleTree) -> st.SearchStrategy[str]:
    taken = {m.fqn for m in tree.modules} | {n for p in tree.params for n in p.names}
    taken |= {b.fqn for b in tree.buffers}
    return st.text("abcxyz._0", min_size=1, max_size=8).filter(lambda s: s not in taken)


@given(TREES, st.data())
def test_unknown_module(tree: ModuleTree, data: st.DataObject) -> None:
    good = data.draw(st.lists(st.sampled_from([m.fqn for m in tree.modules]), max_size=2))
    bad = data.draw(_unknown(tree))
    state = initial(tree, ignored_modules=(*good, bad))
    error = failure(run_pure(init_ignored, state), IgnoredStateError, bad)
    assert "not a module" in error.message


@given(TREES, st.data())
def test_parameter_in_ignored_modules(tree: ModuleTree, data: st.DataObject) -> None:
    names = [n for p in tree.params for n in p.names if tree.module(n) is None]
    assume(names)
    name = data.draw(st.sampled_from(names))
    error = failure(
        run_pure(init_ignored, initial(tree, ignored_modules=(name,))), IgnoredStateError, name
    )
    assert "is a parameter" in error.message


@given(TREES, st.data())
def test_module_in_ignored_params(tree: ModuleTree, data: st.DataObject) -> None:
    fqn = data.draw(st.sampled_from([m.fqn for m in tree.modules]))
    assume(tree.param(fqn) is None)
    error = failure(
        run_pure(init_ignored, initial(tree, ignored_params=(fqn,))), IgnoredStateError, fqn
    )
    assert "is a module" in error.message


@given(TREES, st.data())
def test_unknown_parameter(tree: ModuleTree, data: st.DataObject) -> None:
    bad = data.draw(_unknown(tree))
    good = [n for p in tree.params for n in p.names][:2]
    state = initial(tree, ignored_params=(*good, bad))
    error = failure(run_pure(init_ignored, state), IgnoredStateError, bad)
    assert "not a parameter" in error.message


@given(TREES, st.data())
def test_buffer_is_neither_a_module_nor_a_parameter(tree: ModuleTree, data: st.DataObject) -> None:
    assume(tree.buffers)
    buffer = data.draw(st.sampled_from([b.fqn for b in tree.buffers]))
    field = data.draw(st.sampled_from(("ignored_modules", "ignored_params")))
    state = initial(tree, **{field: (buffer,)})
    failure(run_pure(init_ignored, state), IgnoredStateError, buffer)


@given(TREES, st.data())
def test_already_sharded_module(tree: ModuleTree, data: st.DataObject) -> None:
    fqn = data.draw(st.sampled_from([m.fqn for m in tree.modules]))
    module = tree.module(fqn)
    assert module is not None
    tree = replace_modules(tree, {fqn: sharded(module)})
    assert tree.module(fqn).is_sharded  # type: ignore[union-attr]
    error = failure(
        run_pure(init_ignored, initial(tree, ignored_modules=(fqn,))), IgnoredStateError, fqn
    )
    assert "already sharded" in error.message


@given(TREES, st.data())
def test_first_bad_entry_is_named(tree: ModuleTree, data: st.DataObject) -> None:
    entries = data.draw(st.lists(_unknown(tree), min_size=2, max_size=4, unique=True))
    state = initial(tree, ignored_modules=tuple(entries))
    failure(run_pure(init_ignored, state), IgnoredStateError, entries[0])


def test_modules_and_params_both_given_is_refused_by_the_config() -> None:
    # "All of one kind" is checked where the two fields meet: PrepConfig itself.
    with pytest.raises(ConfigError) as info:
        PrepConfig(ignored_modules=("a",), ignored_params=("b.weight",))
    assert info.value.subject == "ignored_params"


def test_no_prerequisites() -> None:
    tree = ModuleTree(modules=(ModuleInfo(fqn="", cls="m.Model"),))
    ignored = success(init_ignored(PrepState.initial(tree, PrepConfig()))).ignored
    assert ignored is not None and not ignored.modules and not ignored.notes
