"""experts: expert parallelism applied (each rank keeps its experts and dispatches tokens)."""

from __future__ import annotations

from fprep.errors import ConfigError
from fprep.state import PrepState


def check_expert_parallel_available(state: PrepState) -> None:
    """Refuse a plan with expert parallelism until the apply step exists (before any effect)."""
    if state.expert_parallel is not None:
        raise ConfigError(
            f"PrepConfig.ep={state.config.ep}: fprep plans expert parallelism but does not "
            "apply it yet.",
            subject="ep",
            hint="Use fprep.plan to see the layout; prepare with ep=1.",
        )
