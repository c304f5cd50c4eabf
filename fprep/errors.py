"""One error hierarchy for everything fprep rejects.

Planning returns these as values (``Failure(PrepError)``); ``prepare`` raises them. Every error
names the offending field, parameter, module or rank and says what to do, so a user never has to
read a traceback from deep inside torch to find out what was wrong with their input.
"""

from __future__ import annotations

from typing import TypeVar

T = TypeVar("T")


class PrepError(Exception):
    """Base class: bad input of any kind, found before (or instead of) any effect.

    ``subject`` is the field, FQN or object the error is about; ``hint`` says how to fix it.
    Both are kept apart from the message so tools and tests can read them without parsing text.
    """

    def __init__(self, message: str, *, subject: str = "", hint: str = "") -> None:
        self.message = message
        self.subject = subject
        self.hint = hint
        super().__init__(f"{message} {hint}".strip() if hint else message)

    def __eq__(self, other: object) -> bool:
        # Value semantics, so that two plans that failed the same way compare equal.
        return (
            type(self) is type(other)
            and isinstance(other, PrepError)
            and (self.message, self.subject, self.hint)
            == (other.message, other.subject, other.hint)
        )

    def __hash__(self) -> int:
        return hash((type(self).__name__, self.message, self.subject, self.hint))

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.message!r}, subject={self.subject!r})"

    def __reduce__(self) -> tuple[object, ...]:
        # Keyword-only constructor arguments survive pickling (errors cross process boundaries).
        return (_rebuild, (type(self), self.message, self.subject, self.hint))


def _rebuild(cls: type[PrepError], message: str, subject: str, hint: str) -> PrepError:
    return cls(message, subject=subject, hint=hint)


class ConfigError(PrepError, ValueError):
    """A ``PrepConfig`` field has a value outside what it allows."""


class TopologyError(PrepError, ValueError):
    """World size, rank, node layout, process group or mesh do not fit together."""


class IgnoredStateError(PrepError, ValueError):
    """``ignored_modules`` / ``ignored_params`` name something that cannot be ignored."""


class DeviceError(PrepError, RuntimeError):
    """Parameters sit on devices that cannot be prepared together, or ``device`` disagrees."""


class ModelError(PrepError, ValueError):
    """The model itself cannot be prepared this way (scalar parameters, device maps, ...)."""


class PlanOrderError(PrepError, RuntimeError):
    """A transition ran before one it depends on; a custom pipeline is out of order."""


class PrepareError(PrepError, RuntimeError):
    """Applying a valid plan failed, or the model was already prepared."""


class CheckpointError(PrepError, RuntimeError):
    """A checkpoint cannot be written, or cannot be read safely into this model.

    Raised for missing, truncated, tampered or crafted files, for checkpoints that do not fit
    the model (keys, shapes, dtypes), and for values ``fprep.save`` cannot store as plain data.
    """


class CollectiveError(PrepError, RuntimeError):
    """A collective fprep call could not complete: a rank did not arrive within
    ``PrepConfig.timeout_s`` (it was not called on every rank, or called in another order), or
    a rank was lost (killed, crashed) while the others waited for it. The message names the call
    and the ranks; a lost peer's own torch error is chained as ``__cause__``.
    """


def need(value: T | None, transition: str, needed_by: str) -> T:
    """The sub-state ``value`` or a ``PlanOrderError`` saying which transition must run first."""
    if value is None:
        raise PlanOrderError(
            f"{needed_by} needs {transition} to have run first.",
            subject=transition,
            hint="Compose transitions in the order of fprep.DEFAULT_TRANSITIONS.",
        )
    return value
