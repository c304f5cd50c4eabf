"""Does a saved optimizer record fit the live optimizer? Checked before anything is loaded.

``torch.optim.Optimizer.load_state_dict`` replaces each param group with the saved one and takes
state entries as they come, so a record that does not fit fails late: a hyperparameter of the
wrong type (``lr: "abc"``, ``betas`` of one element) fails at ``step()``, a group without ``lr``
with a ``KeyError`` there, state for a parameter the optimizer does not have inside
``set_optimizer_state_dict`` — after the tensors were copied in. Here the decoded record
(tensors as placeholders) is compared with the live optimizer's state dict first:

* param groups: as many, with as many parameters each;
* hyperparameters: each saved value has the live value's kind (numbers stay numbers, bools
  bools, strings strings, tensors tensors, tuples and lists keep their length; ``None`` may
  stand for an unset flag and anything may replace a live ``None``); one the checkpoint lacks
  (a newer torch's) keeps the live value, which ``missing_hyperparameters`` fills in;
* state: entries for the same parameters, with the same names and kinds of values.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from fprep.errors import CheckpointError

_PLAIN = (bool, int, float, str)


def compatible(live: Any, saved: Any) -> bool:
    """Whether ``saved`` may replace ``live`` (see the module docs)."""
    if isinstance(live, torch.Tensor):
        return isinstance(saved, torch.Tensor)
    if live is None:
        return saved is None or isinstance(saved, _PLAIN)
    if isinstance(live, bool):
        return saved is None or isinstance(saved, bool)
    if isinstance(live, int | float):
        return isinstance(saved, int | float) and not isinstance(saved, bool)
    if isinstance(live, tuple | list):
        return (
            type(saved) is type(live)
            and len(saved) == len(live)
            and all(compatible(a, b) for a, b in zip(live, saved, strict=True))
        )
    if isinstance(live, Mapping):
        return (
            isinstance(saved, Mapping)
            and set(saved) == set(live)
            and all(compatible(live[k], saved[k]) for k in live)
        )
    return type(saved) is type(live)


def _show(value: Any) -> str:
    if isinstance(value, torch.Tensor):
        return "a tensor"
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def _unfit(source: str, index: int, detail: str, subject: str) -> CheckpointError:
    return CheckpointError(
        f"{source} does not fit: optimizer {index}'s {detail}.",
        subject=subject,
        hint="Values keep their kind across a checkpoint (numbers stay numbers, bools bools, "
        "tuples their length); the manifest was modified or belongs to another optimizer. "
        "Nothing was loaded.",
    )


def check_groups(
    saved: list[dict[str, Any]], live: list[dict[str, Any]], index: int, source: str
) -> None:
    """Saved param groups against the live ones, by position."""
    if len(saved) != len(live):
        raise _unfit(
            source,
            index,
            f"param groups: the checkpoint has {len(saved)}, the live optimizer {len(live)}",
            f"optimizers[{index}]",
        )
    for g, (s, lv) in enumerate(zip(saved, live, strict=True)):
        subject = f"optimizers[{index}].param_groups[{g}]"
        if len(s["params"]) != len(lv["params"]):
            raise _unfit(
                source,
                index,
                f"param group {g} holds {len(s['params'])} parameters in the checkpoint, "
                f"{len(lv['params'])} in the live optimizer",
                subject,
            )
        keys = set(s) & set(lv) - {"params"}
        _check_values(s, lv, keys, f"param group {g}", subject, index, source)


def missing_hyperparameters(
    saved: list[dict[str, Any]], live: list[dict[str, Any]]
) -> list[dict[str, Any]]:
    """Per group, the live hyperparameters the checkpoint does not have (kept as they are)."""
    return [{k: v for k, v in lv.items() if k not in s} for s, lv in zip(saved, live, strict=True)]


def check_state(saved: Any, live: Any, index: int, source: str) -> None:
    """Saved per-parameter state against the live optimizer's: same parameters, same names,
    values of the same kinds (tensor shapes and dtypes are compared with the metadata)."""
    subject = f"optimizers[{index}].state"
    if not isinstance(saved, Mapping) or not all(isinstance(v, Mapping) for v in saved.values()):
        raise _unfit(source, index, "state is not a mapping of parameters to entries", subject)
    if set(saved) != set(live):
        extra, lacking = sorted(set(saved) - set(live)), sorted(set(live) - set(saved))
        parts = [f"has entries for {extra}, which the live optimizer has none for"] if extra else []
        parts += [f"has none for {lacking}, which the live optimizer has"] if lacking else []
        raise _unfit(source, index, "state " + " and ".join(parts), subject)
    for fqn in sorted(saved):
        s, lv = saved[fqn], live[fqn]
        if set(s) != set(lv):
            raise _unfit(
                source,
                index,
                f"state of {fqn!r} holds {sorted(s)} in the checkpoint, {sorted(lv)} in the "
                "live optimizer",
                f"{subject}.{fqn}",
            )
        _check_values(s, lv, set(s), f"state of {fqn!r},", f"{subject}.{fqn}", index, source)


def _check_values(
    saved: Mapping[str, Any],
    live: Mapping[str, Any],
    keys: set[str],
    where: str,
    subject: str,
    index: int,
    source: str,
) -> None:
    for key in sorted(keys):
        if not compatible(live[key], saved[key]):
            raise _unfit(
                source,
                index,
                f"{where} {key!r} is {_show(saved[key])} in the checkpoint, where the live "
                f"optimizer has {_show(live[key])}",
                f"{subject}.{key}",
            )
