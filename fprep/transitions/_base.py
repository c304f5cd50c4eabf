"""What a transition is, and the one adapter that makes failures values."""

from __future__ import annotations

import functools
from collections.abc import Callable

from returns.result import Failure, Result, Success

from fprep.errors import PrepError
from fprep.state import PrepState

#: A planning step: pure, total over ``PrepState``; bad input is a ``Failure``, never a raise.
Transition = Callable[[PrepState], Result[PrepState, PrepError]]


def transition(fn: Callable[[PrepState], PrepState]) -> Transition:
    """Turn a function that raises ``PrepError`` into one that returns it as a ``Failure``.

    Writing the body with early ``raise`` keeps each check next to the code it guards; callers
    still only ever see values. Exceptions that are not ``PrepError`` are bugs and propagate.
    """

    @functools.wraps(fn)
    def run(state: PrepState) -> Result[PrepState, PrepError]:
        try:
            return Success(fn(state))
        except PrepError as error:
            return Failure(error)

    return run
