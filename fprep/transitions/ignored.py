"""init_ignored: what fprep leaves alone (not sharded, not replicated, not cast).

Ignored modules are closed under submodules; a parameter is ignored when any module that
registers it is ignored (a tied parameter cannot be half managed). Entries are FQNs, so the kind
of each is checked: a module name in ``ignored_params`` (or the reverse) is a failure.
"""

from __future__ import annotations

from fprep.errors import IgnoredStateError
from fprep.snapshot import ModuleTree, is_within, parent_fqn
from fprep.state import IgnoredState, PrepState
from fprep.transitions._base import transition
from fprep.transitions._names import suggest


def _check_module_names(tree: ModuleTree, names: tuple[str, ...]) -> None:
    for fqn in names:
        module = tree.module(fqn)
        if module is None:
            if tree.param(fqn) is not None:
                raise IgnoredStateError(
                    f"ignored_modules entry {fqn!r} is a parameter, not a module.",
                    subject=fqn,
                    hint="Put parameters in ignored_params (and leave ignored_modules empty).",
                )
            raise IgnoredStateError(
                f"ignored_modules entry {fqn!r} is not a module of the model.",
                subject=fqn,
                hint=suggest(fqn, (m.fqn for m in tree.modules)),
            )
        if module.is_sharded:
            raise IgnoredStateError(
                f"ignored_modules entry {fqn!r} is already sharded by FSDP.",
                subject=fqn,
                hint="Ignore the module before sharding it, or leave it out of ignored_modules.",
            )


def _check_param_names(tree: ModuleTree, names: tuple[str, ...]) -> None:
    for fqn in names:
        if tree.param(fqn) is not None:
            continue
        if tree.module(fqn) is not None:
            raise IgnoredStateError(
                f"ignored_params entry {fqn!r} is a module, not a parameter.",
                subject=fqn,
                hint="Put modules in ignored_modules, or list their parameters "
                f"(e.g. '{fqn}.weight') in ignored_params.",
            )
        raise IgnoredStateError(
            f"ignored_params entry {fqn!r} is not a parameter of the model.",
            subject=fqn,
            hint=suggest(fqn, (n for p in tree.params for n in p.names)),
        )


@transition
def init_ignored(state: PrepState) -> PrepState:
    tree, cfg = state.tree, state.config
    _check_module_names(tree, cfg.ignored_modules)
    _check_param_names(tree, cfg.ignored_params)

    roots = tuple(sorted(set(cfg.ignored_modules)))
    modules = frozenset(
        m.fqn for m in tree.modules if any(is_within(m.fqn, root) for root in roots)
    )
    params: set[str] = set()
    explicit = set(cfg.ignored_params)
    for p in tree.params:
        if any(parent_fqn(n) in modules for n in p.names) or explicit.intersection(p.names):
            params.update(p.names)
    buffers = frozenset(b.fqn for b in tree.buffers if parent_fqn(b.fqn) in modules)
    notes: tuple[str, ...] = ()
    if "" in modules:
        notes = (
            "The root module is ignored: every parameter is left alone, nothing is sharded "
            "or replicated.",
        )
    return state.replace(
        ignored=IgnoredState(
            modules=modules, params=frozenset(params), buffers=buffers, notes=notes
        )
    )
